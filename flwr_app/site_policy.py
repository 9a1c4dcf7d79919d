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
    privacy-mechanisms='dp_sgd,bdp'              # the strategies the site accepts (default: both)
    privacy-min-noise=0.5                        # the smallest noise multiplier of any release (default 0)
    privacy-rdp-order=18                         # the filter's whole order (default: chosen from the budget
                                                 # when the file is created; fixed for its lifetime)

With its first set-up release the site announces its filter (:func:`announce`: order, RDP spent, limit) and the
server plans the site's noise to fit it (:class:`~strategies.accounting.filter.SiteFilter`); the site's check is the
same either way. The ledger file is JSON Lines: a header (the filter's order, the data file's SHA-256) and one line
per release or refusal, each with the run, round, message, the values that left, their cost and
the filter's ε after it. It is written and synced before the release leaves (a crash can only
over-count) and is read anew at every message, so it survives SuperNode restarts and spans runs:
one file per data set, a lifetime budget. ``python -m flwr_app.site_policy LEDGER`` prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strategies.accounting.filter import FilterExhausted, RenyiFilter, SiteFilter, epsilon_at_order

__all__ = ["CHARGEABLE", "PolicyRefusal", "Request", "SitePolicy", "announce", "enforce", "ledger_table", "read_ledger"]

#: Strategies whose every release a site's filter can charge (a history of Gaussian releases).
CHARGEABLE = ("dp_sgd", "bdp")
KEYS = ("privacy-ledger", "privacy-max-epsilon", "privacy-delta", "privacy-mechanisms", "privacy-min-noise",
        "privacy-rdp-order")
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
            raise ValueError(f"node config privacy-mechanisms = {','.join(mechanisms)!r}: the site's filter can charge "
                             f"only {', '.join(CHARGEABLE)} (every other strategy releases values it cannot account)")
        order = node_config.get("privacy-rdp-order")
        policy = cls(Path(str(node_config["privacy-ledger"])).expanduser(),
                     _number(node_config, "privacy-max-epsilon", above=0.0),
                     _number(node_config, "privacy-delta", 1e-5, above=0.0),
                     mechanisms, _number(node_config, "privacy-min-noise", 0.0, at_least=0.0),
                     None if order is None else _number(node_config, "privacy-rdp-order", at_least=2.0))
        if policy.order is not None and policy.order != int(policy.order):
            raise ValueError(f"node config privacy-rdp-order = {order!r} must be a whole number >= 2")
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[Any]:
    """The ledger file opened for reading and appending, under an exclusive lock (one message at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _append(handle: Any, line: Mapping[str, Any]) -> None:
    handle.write(json.dumps(line) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def _filter(policy: SitePolicy, handle: Any, data_path: Path | None) -> RenyiFilter:
    """The site's filter as its ledger file has it (a new file gets its header: the order and the data's hash)."""
    handle.seek(0)
    lines = read_ledger(policy.ledger, handle.read())
    digest = None if data_path is None else _sha256(data_path)
    if not lines:
        order = RenyiFilter(epsilon=policy.max_epsilon, delta=policy.delta, order=policy.order).order
        lines = [{"kind": "header", "order": order, "data_path": str(data_path), "data_sha256": digest,
                  "unit": "record", "adjacency": "add-remove", "created": _now()}]
        _append(handle, lines[0])
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
    ε the run asks for (refused when above the site's limit).
    """

    strategy: str
    run_id: int
    server_round: int
    message: str
    values: str
    history: History | None
    plan: History = ()
    epsilon: float | None = None


def _data_path(node_config: Mapping[str, Any]) -> Path | None:
    return Path(str(node_config["data-path"])) if "data-path" in node_config else None


def announce(node_config: Mapping[str, Any]) -> SiteFilter | None:
    """The site's filter as it stands (order, RDP spent, limit), which it tells the server at set-up so that the run's
    noise is planned to fit it; ``None`` without a policy. Not a function of any record: the site's own policy and
    the cost of what it released before."""
    policy = SitePolicy.from_node_config(node_config)
    if policy is None:
        return None
    with _locked(policy.ledger) as handle:
        filt = _filter(policy, handle, _data_path(node_config))
    return SiteFilter(filt.order, filt.spent, policy.max_epsilon, policy.delta)


def _refusal(request: Request, policy: SitePolicy, filt: RenyiFilter) -> str:
    """Why ``request`` is refused ("" when it is admitted): mechanism, noise floor, then the filter."""
    if request.strategy not in policy.mechanisms:
        return f"strategy '{request.strategy}' is not one this site accepts (privacy-mechanisms: {', '.join(policy.mechanisms)})"
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
    with _locked(policy.ledger) as handle:
        filt = _filter(policy, handle, _data_path(node_config))
        before = filt.spent
        reason = _refusal(request, policy, filt)
        line = {"kind": "refusal" if reason else "release", "time": _now(), "run": request.run_id,
                "round": request.server_round, "message": request.message, "strategy": request.strategy,
                "values": request.values}
        if reason:
            _append(handle, {**line, "reason": reason, "epsilon": filt.epsilon()})
            raise PolicyRefusal(f"site '{site}' privacy policy refuses {request.message}: {reason}; nothing released "
                                f"(ledger {policy.ledger}: epsilon {filt.epsilon():.3f} of {policy.max_epsilon:g} "
                                f"at delta {policy.delta:g} spent)")
        _append(handle, {**line, "history": [list(entry) for entry in request.history or ()],
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
    parser = argparse.ArgumentParser(description="Print a site's privacy ledger file (python -m flwr_app.site_policy)")
    parser.add_argument("ledger", type=Path)
    args = parser.parse_args(argv)
    try:
        print(ledger_table(read_ledger(args.ledger)))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
