"""A deployed site's own privacy policy: limits in its node config, a Rényi filter, a ledger file it keeps.

A partner site does not trust the server with its budget. Its SuperNode's node config sets its
limits, and before any value derived from its records leaves, the site charges that release to its
own :class:`~strategies.accounting.filter.RenyiFilter`, computed from what the site itself runs (its
noise multipliers, sampling rate and steps), never from the server's plan. A release the filter
cannot admit, a mechanism the site does not accept or whose releases the filter cannot charge,
and a noise multiplier below the site's floor are refused before anything is released (fails
closed); the server files the refusal under the site's name.

Node config keys (``flower-supernode --node-config "..."``)::

    privacy-ledger='/var/fedsurv/ledger.jsonl'   # the site's ledger file (required with a policy)
    privacy-max-epsilon=1.0                      # the lifetime budget of this data set (required)
    privacy-delta=1e-5                           # its delta (default 1e-5)
    privacy-mechanisms='dp_sgd,distributed_dp'   # the strategies the site accepts (default: both)
    privacy-min-noise=0.5                        # the smallest noise multiplier of any release (default 0)
    privacy-rdp-order=18                         # the filter's whole order (default: chosen from the budget
                                                 # when the file is created; fixed for its lifetime)
    privacy-min-honest-sites=3                   # distributed_dp, dp_sgd's secure set-up sum: the honest sites
                                                 # (itself included) whose noise shares the site counts on
                                                 # (default 1: its own alone)

``bdp`` is refused at a site with a policy (:data:`UNCHARGEABLE`). The run's ``privacy.delta`` may not exceed the
policy's δ, and the filter converts at the policy's δ whatever the run says.

With its first set-up release the site announces its filter (:func:`announce`: order, RDP spent, limit) and the
server plans the site's noise to fit it (:class:`~strategies.accounting.filter.SiteFilter`); the site's check is the
same either way. The ledger file is JSON Lines: a header (the filter's order, the data file's SHA-256) and one line
per release or refusal, each with the run, round, message, the values that left, their cost and
the filter's ε after it. It is written and synced before the release leaves (a crash can only
over-count) and is read anew at every message, so it survives SuperNode restarts and spans runs:
one file per data set, a lifetime budget. Its lines are hash-chained and the site keeps its head in its own
directory (:mod:`flwr_app.site_store`): a ledger deleted, cut short or edited is never a fresh budget but stops
every release (:class:`~flwr_app.site_store.LedgerTampered`) until an operator restores it or removes both files.
``python -m flwr_app.site_policy LEDGER [--site-dir DIR] [--verify]`` verifies it and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_app import site_store
from strategies.accounting.filter import FilterExhausted, RenyiFilter, SiteFilter, epsilon_at_order

__all__ = ["CHARGEABLE", "PolicyRefusal", "Request", "SitePolicy", "announce", "enforce", "ledger_table", "read_ledger"]

#: Strategies whose every release a site's filter can charge: releases whose noise is fixed before the site's records
#: are read (a history of Gaussian releases, or a discrete Gaussian share bounded by one).
CHARGEABLE = ("dp_sgd", "distributed_dp")
#: Strategies a site's filter cannot charge, and why (named in the refusal).
UNCHARGEABLE = {"bdp": "its noise scale and its stopping time depend on the site's records (a pilot of gradient "
                       "distances, an estimated budget), so a Rényi filter's theorem does not cover its releases"}
KEYS = ("privacy-ledger", "privacy-max-epsilon", "privacy-delta", "privacy-mechanisms", "privacy-min-noise",
        "privacy-rdp-order", "privacy-min-honest-sites")
History = Sequence[tuple[float, float, int]]


class PolicyRefusal(ValueError):
    """A request the site's policy refuses: nothing was released."""


@dataclass(frozen=True)
class SitePolicy:
    """A site's limits, from its node config (:meth:`from_node_config`)."""

    ledger: Path
    max_epsilon: float
    delta: float = 1e-5
    mechanisms: tuple[str, ...] = CHARGEABLE
    min_noise: float = 0.0
    order: float | None = None
    min_honest_sites: int = 1

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> SitePolicy | None:
        """The policy the node config sets, ``None`` when it sets none; ``ValueError`` naming a bad key."""
        unknown = sorted(key for key in node_config if str(key).startswith("privacy-") and key not in KEYS)
        if unknown:  # a misspelt limit must not leave the site without its policy
            raise ValueError(f"node config {', '.join(unknown)}: not a key of the site's privacy policy (keys: "
                             f"{', '.join(KEYS)})")
        present = [key for key in KEYS if key in node_config]
        if not present:
            return None
        for key in ("privacy-ledger", "privacy-max-epsilon"):
            if key not in node_config:
                raise ValueError(f"node config sets {', '.join(present)} but not '{key}': a site's privacy policy "
                                 "needs both privacy-ledger and privacy-max-epsilon")
        mechanisms = tuple(m.strip() for m in str(node_config.get("privacy-mechanisms", ",".join(CHARGEABLE))).split(",")
                           if m.strip())
        unknown = [m for m in mechanisms if m not in CHARGEABLE]
        if unknown or not mechanisms:
            why = "; ".join(f"{m}: {UNCHARGEABLE[m]}" for m in unknown if m in UNCHARGEABLE)
            raise ValueError(f"node config privacy-mechanisms = {','.join(mechanisms)!r}: the site's filter can charge "
                             f"only {', '.join(CHARGEABLE)} ({why or 'every other strategy releases values it cannot account'})")
        order = node_config.get("privacy-rdp-order")
        policy = cls(Path(str(node_config["privacy-ledger"])).expanduser(),
                     _number(node_config, "privacy-max-epsilon", above=0.0),
                     _number(node_config, "privacy-delta", 1e-5, above=0.0),
                     mechanisms, _number(node_config, "privacy-min-noise", 0.0, at_least=0.0),
                     None if order is None else _number(node_config, "privacy-rdp-order", at_least=2.0),
                     int(_number(node_config, "privacy-min-honest-sites", 1, at_least=1.0)))
        if policy.order is not None and policy.order != int(policy.order):
            raise ValueError(f"node config privacy-rdp-order = {order!r} must be a whole number >= 2")
        if float(node_config.get("privacy-min-honest-sites", 1)) != policy.min_honest_sites:
            raise ValueError(f"node config privacy-min-honest-sites = {node_config['privacy-min-honest-sites']!r} must "
                             "be a whole number >= 1 (1: the site counts on its own noise share alone)")
        if policy.delta >= 1:
            raise ValueError(f"node config privacy-delta = {policy.delta!r} must lie in (0, 1)")
        return policy


def _number(node_config: Mapping[str, Any], key: str, default: float | None = None, *,
            above: float | None = None, at_least: float | None = None) -> float:
    """A finite number from the node config, ``> above`` or ``>= at_least`` (``ValueError`` naming the key)."""
    raw = node_config.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"node config {key} = {raw!r} is not a number") from None
    if not math.isfinite(value) or (above is not None and value <= above) or (at_least is not None and value < at_least):
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise ValueError(f"node config {key} = {raw!r} must be a finite number {bound}")
    return value


# ------------------------------------------------------------------ the ledger file


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_ledger(path: Path, text: str | None = None) -> list[dict[str, Any]]:
    """Every line of a site's ledger file (header first; ``text``: its content, already read), ``ValueError`` naming
    the file and line if one is bad."""
    lines = []
    text = path.read_text(encoding="utf-8") if text is None else text
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {number} is not JSON ({err.msg}): the site's ledger is damaged") from None
    return lines


def _default_head(path: Path) -> Path:
    """The head of ledger ``path`` at a site without ``site-dir``: beside the ledger (:func:`site_store.site_dir`)."""
    return path.expanduser().resolve().parent / f"{path.name}.head"


@contextlib.contextmanager
def _locked(path: Path, head: Path | None = None) -> Iterator[site_store.SiteLedger]:
    """The ledger file under an exclusive lock (one message at a time), verified against its head ``head`` (default:
    beside it) before anything is read or charged: :class:`~flwr_app.site_store.LedgerTampered` when they disagree."""
    with site_store.open_ledger(path.expanduser(), _default_head(path) if head is None else head) as ledger:
        yield ledger


def _filter(policy: SitePolicy, handle: site_store.SiteLedger, data_path: Path | None) -> RenyiFilter:
    """The site's filter as its ledger file has it (a new file gets its header: the order and the data's hash)."""
    lines = handle.records
    digest = None if data_path is None else _sha256(data_path)
    if not lines:
        order = RenyiFilter(epsilon=policy.max_epsilon, delta=policy.delta, order=policy.order).order
        lines = [{"kind": "header", "order": order, "data_path": str(data_path), "data_sha256": digest,
                  "unit": "record", "adjacency": "add-remove", "created": _now()}]
        handle.append(lines[0])
    header = lines[0]
    if header.get("kind") != "header":
        raise ValueError(f"{policy.ledger}: the first line is not the ledger's header")
    if policy.order is not None and float(header["order"]) != policy.order:
        raise ValueError(f"node config privacy-rdp-order = {policy.order:g}, but {policy.ledger} was created with "
                         f"order {header['order']:g}: a filter's order is fixed for its lifetime")
    if digest is not None and header["data_sha256"] not in (digest, None):
        raise ValueError(f"{policy.ledger} holds the budget of another data set ({header['data_path']}, SHA-256 "
                         f"{header['data_sha256'][:12]}…), not of data-path {data_path} ({digest[:12]}…): name one "
                         "ledger file per data set in privacy-ledger")
    spent = sum(float(line.get("rdp", 0.0)) for line in lines if line.get("kind") == "release")
    return RenyiFilter(epsilon=policy.max_epsilon, delta=policy.delta, order=float(header["order"]), spent=spent)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------ enforcement


@dataclass(frozen=True)
class Request:
    """What a message asks the site to release: where, and as accountant history (``None``: not chargeable).

    ``plan`` and ``epsilon``, at the first release of a run: the rest of the run's planned releases, and the
    ε the run asks for (refused when above the site's limit). ``delta``: the run's δ (refused when above the
    policy's). ``details``: further ``(name, value)`` pairs the ledger line records (e.g. a secure sum's honest
    sites, drop-outs and colluding sites).
    """

    strategy: str
    run_id: int
    server_round: int
    message: str
    values: str
    history: History | None
    plan: History = ()
    epsilon: float | None = None
    delta: float | None = None
    details: tuple[tuple[str, Any], ...] = ()


def _data_path(node_config: Mapping[str, Any]) -> Path | None:
    return Path(str(node_config["data-path"])) if "data-path" in node_config else None


def announce(node_config: Mapping[str, Any]) -> SiteFilter | None:
    """The site's filter as it stands (order, RDP spent, limit), which it tells the server at set-up so that the run's
    noise is planned to fit it; ``None`` without a policy. Not a function of any record: the site's own policy and
    the cost of what it released before."""
    policy = SitePolicy.from_node_config(node_config)
    if policy is None:
        return None
    with _locked(policy.ledger, site_store.ledger_head(node_config, policy.ledger)) as handle:
        filt = _filter(policy, handle, _data_path(node_config))
    return SiteFilter(filt.order, filt.spent, policy.max_epsilon, policy.delta, float(policy.min_honest_sites))


def _refusal(request: Request, policy: SitePolicy, filt: RenyiFilter) -> str:
    """Why ``request`` is refused ("" when it is admitted): mechanism, noise floor, then the filter."""
    if request.strategy not in policy.mechanisms:
        why = f": {UNCHARGEABLE[request.strategy]}" if request.strategy in UNCHARGEABLE else ""
        return (f"strategy '{request.strategy}' is not one this site accepts (privacy-mechanisms: "
                f"{', '.join(policy.mechanisms)}){why}")
    if request.delta is not None and request.delta > policy.delta:
        return (f"the run asks for privacy.delta = {request.delta:g}, more than this site's privacy-delta = "
                f"{policy.delta:g}")
    if request.history is None:
        return f"{request.values} cannot be charged to the site's Rényi filter (released without noise)"
    if request.epsilon is not None and request.epsilon > policy.max_epsilon:
        return (f"the run asks for privacy.epsilon = {request.epsilon:g}, more than this site's limit "
                f"privacy-max-epsilon = {policy.max_epsilon:g}")
    low = [sigma for sigma, _, _ in [*request.history, *request.plan] if sigma < policy.min_noise]
    if low:
        return (f"a noise multiplier of {min(low):.4g} is below the site's floor privacy-min-noise = "
                f"{policy.min_noise:g}")
    plan = [*request.history, *request.plan]
    if request.plan and not filt.admits(plan):
        cost = filt.cost(plan)
        return (f"the run's plan would take the site's filter to epsilon "
                f"{epsilon_at_order(filt.spent + cost, filt.order, filt.delta):.3f} > {policy.max_epsilon:g} at "
                f"delta {policy.delta:g}: what is left cannot hold even the set-up")
    try:
        filt.charge(request.history)
    except FilterExhausted as err:
        return str(err)
    return ""


def enforce(node_config: Mapping[str, Any], site: str, request: Request) -> None:
    """Charge ``request`` to the site's filter and log it in its ledger file, or refuse it (:class:`PolicyRefusal`).

    No-op without a policy in ``node_config``. ``request.plan``: the rest of the run's planned releases,
    checked (not charged) with this one before the first release of a run, so that a run the budget cannot
    hold is refused before anything leaves rather than part-way.
    """
    policy = SitePolicy.from_node_config(node_config)
    if policy is None:
        return
    with _locked(policy.ledger, site_store.ledger_head(node_config, policy.ledger)) as handle:
        filt = _filter(policy, handle, _data_path(node_config))
        before = filt.spent
        reason = _refusal(request, policy, filt)
        line = {"kind": "refusal" if reason else "release", "time": _now(), "run": request.run_id,
                "round": request.server_round, "message": request.message, "strategy": request.strategy,
                "values": request.values, **dict(request.details)}
        if reason:
            handle.append({**line, "reason": reason, "epsilon": filt.epsilon()})
            raise PolicyRefusal(f"site '{site}' privacy policy refuses {request.message}: {reason}; nothing released "
                                f"(ledger {policy.ledger}: epsilon {filt.epsilon():.3f} of {policy.max_epsilon:g} "
                                f"at delta {policy.delta:g} spent)")
        handle.append({**line, "history": [list(entry) for entry in request.history or ()],
                         "rdp": filt.spent - before, "order": filt.order, "epsilon": filt.epsilon(),
                         "max_epsilon": policy.max_epsilon, "delta": policy.delta})


# ------------------------------------------------------------------ reading the file


def ledger_table(lines: Iterable[Mapping[str, Any]]) -> str:
    """The ledger file as a table for the site's admin: each release or refusal and the filter's ε after it."""
    rows = ["time | run | round | message | strategy | what | epsilon after", "--- | --- | --- | --- | --- | --- | ---"]
    for line in lines:
        if line.get("kind") == "header":
            rows.insert(0, f"Rényi filter of order {line['order']:g} over {line['data_path']} (SHA-256 "
                           f"{str(line['data_sha256'])[:12]}…), created {line['created']}; epsilon per record, "
                           "add/remove-one adjacency\n")
            continue
        what = line["values"] if line["kind"] == "release" else f"REFUSED: {line['reason']}"
        rows.append(f"{line['time']} | {line['run']} | {line['round']} | {line['message']} | {line['strategy']} | "
                    f"{what} | {line['epsilon']:.4f}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flwr_app.site_policy LEDGER [--site-dir DIR] [--verify]``: verify the ledger against its head
    (changing nothing) and print it as a table; exit code 2 with a one-line error when it is damaged or tampered."""
    parser = argparse.ArgumentParser(description="Verify a site's privacy ledger file against its head and print it "
                                                 "(python -m flwr_app.site_policy)")
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--site-dir", type=Path, help="the site's directory, where the ledger's head is kept "
                                                      "(default: the ledger's directory)")
    parser.add_argument("--verify", action="store_true", help="only verify: print no table")
    args = parser.parse_args(argv)
    head = _default_head(args.ledger) if args.site_dir is None else \
        args.site_dir.expanduser() / f"{args.ledger.name}.head"
    try:
        state = site_store.read_verified(args.ledger.expanduser(), head)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if state.torn or state.ahead:
        left = "a half-written last line" if state.torn else "its last line without its head"
        print(f"{args.ledger}: a crash left {left}; the site repairs it at its next message", file=sys.stderr)
    if args.verify:
        print(f"{args.ledger}: {state.head.lines} lines, chained and matching its head {head}")
    else:
        print(ledger_table(state.records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
