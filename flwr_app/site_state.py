"""A site's privacy state (its accountant across rounds): the site's own, sealed when the server carries it.

A site's mechanism keeps state across rounds (steps taken, the accountant, a calibrated noise scale). That
state decides what the site charges and how much noise it adds, so the site never takes it from the server:

* between messages it lives in the node state (held by the site's SuperNode);
* a deployed site also writes it, after every round and before the reply leaves, to its own directory
  (``<site dir>/privacy-states/<run id>.json``, :mod:`flwr_app.site_store`), and reloads it from there when
  its node state is empty (a restarted SuperNode);
* the copy in its reply (which the server checkpoints, to hand back to a resumed run or a restarted site) is
  **sealed**: site, run, round and state under an HMAC-SHA256 tag with a key derived from the site's secret
  (a simulated site's: the public :data:`SIMULATION_KEY`).
  A state handed back is used only when its tag verifies for this site; a deployed site that holds its own
  copy of that run uses its own instead. Anything else is refused (:class:`StateRefused`).

The rounds the server says it charged after the site's last state (``catch_up``: the site runs its mechanism
that many times, releasing nothing, so that its accountant counts them, as the server's ledger does) are
bounded by the rounds between that state (its own copy's, else the sealed one's) and the current round.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_app import site_store

__all__ = ["Sealed", "StateRefused", "load_own", "restore", "save_own", "seal", "state_key", "unseal"]

#: The subdirectory of a deployed site's directory that holds its privacy states, one file per run.
STATES = "privacy-states"


class StateRefused(ValueError):
    """A privacy state handed back to the site that it did not issue (or not for this site): nothing was trained."""


@dataclass(frozen=True)
class Sealed:
    """A state as the site sealed it: whose, which run, after which round."""

    site: str
    run: int
    round: int
    state: dict[str, Any]


#: The key that seals a simulated site's states: public, since a simulation's operator runs the server and every site
#: (its seal protects nothing from them); it gives a simulation, on one machine or a Ray cluster, a deployment's code
#: path without a file in anyone's home directory.
SIMULATION_KEY = b"fedsurv simulation: the operator runs every site"


def state_key(node_config: Mapping[str, Any], deployed: bool) -> bytes:
    """The key that seals this site's states: derived from its own secret (deployed), else :data:`SIMULATION_KEY`."""
    return site_store.derived_key(site_store.site_dir(node_config), "privacy-state") if deployed else SIMULATION_KEY


def _payload(site: str, run: int, server_round: int, state: Mapping[str, Any]) -> bytes:
    return json.dumps({"site": site, "run": run, "round": server_round, "state": state},
                      sort_keys=True, separators=(",", ":")).encode()


def seal(state: Mapping[str, Any], *, key: bytes, site: str, run: int, server_round: int) -> str:
    """``state`` sealed for the server to carry: a JSON object with the site, run, round, state and tag."""
    tag = site_store.sign(key, _payload(site, run, server_round, state))
    return json.dumps({"site": site, "run": run, "round": server_round, "state": dict(state), "tag": tag})


def unseal(text: str, *, key: bytes, site: str) -> Sealed:
    """The sealed state in ``text`` if its tag verifies for ``site`` under ``key``; :class:`StateRefused` otherwise."""
    try:
        body = json.loads(text)
        sealed = Sealed(str(body["site"]), int(body["run"]), int(body["round"]), dict(body["state"]))
        valid = site_store.verify(key, _payload(sealed.site, sealed.run, sealed.round, sealed.state), body.get("tag"))
    except (TypeError, ValueError, KeyError, AttributeError):
        valid = False
    if not valid or sealed.site != site:
        raise StateRefused(f"site '{site}': the privacy state the server handed back was not sealed by this site "
                           "(its authenticator does not verify): refused, nothing trained; the site uses only its "
                           "own state or one it sealed")
    return sealed


def _own_path(node_config: Mapping[str, Any], run: int) -> Path:
    return site_store.site_dir(node_config) / STATES / f"{int(run)}.json"


def save_own(node_config: Mapping[str, Any], sealed_text: str, run: int) -> None:
    """Keep a deployed site's sealed state of ``run`` in its own directory (atomically, synced)."""
    path = _own_path(node_config, run)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(sealed_text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_own(node_config: Mapping[str, Any], run: int, *, key: bytes, site: str) -> Sealed | None:
    """A deployed site's own sealed state of ``run`` (``None`` when it has none; :class:`StateRefused` when the file
    does not verify: the site's own copy was altered)."""
    path = _own_path(node_config, run)
    return unseal(path.read_text(encoding="utf-8"), key=key, site=site) if path.exists() else None


def restore(node_config: Mapping[str, Any], *, deployed: bool, site: str, run: int, server_round: int,
            handed_back: str | None, catch_up: int, max_rounds: int) -> tuple[dict[str, Any] | None, int]:
    """The site's privacy state for a round of ``run`` when its node state holds none, and the rounds to catch up.

    ``handed_back``: a sealed state the server sent back (a resumed run, a restarted site), ``catch_up``: the rounds
    the server says it charged the site after its last state (a round it asked for and got no reply to). A deployed
    site's own copy of this run (or of the run the sealed state names) wins over the handed-back state; else the
    handed-back state, which must verify; else none. ``catch_up`` is bounded by the rounds after that state and before
    ``server_round`` (and by the run's ``max_rounds``): the server can make a site count a round it may have run, never
    one it has a state for.
    """
    key = state_key(node_config, deployed)
    sealed = None if handed_back is None else unseal(handed_back, key=key, site=site)
    base = sealed
    if deployed:
        for candidate in dict.fromkeys([run] + ([sealed.run] if sealed else [])):
            if (own := load_own(node_config, candidate, key=key, site=site)) is not None:
                base = own
                break
    after = 0 if base is None else base.round
    rounds = max(0, min(int(catch_up), server_round - 1 - after, int(max_rounds)))
    return (None if base is None else base.state), rounds
