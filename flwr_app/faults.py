"""Injected failures for tests of fault tolerance (run-config keys ``debug.*``; simulations only).

A site named by ``debug.fail_site`` fails on every ``debug.fail_message`` from round
``debug.fail_round`` on, as a site whose process crashed or whose link went down would: it
raises (Flower turns that into an error reply) or never answers (the server's
``federation.timeout_s`` passes without its reply). Nothing else about the run changes.
"""

from __future__ import annotations

import threading

from flwr_app.config import ExperimentConfig


class InjectedFailure(RuntimeError):
    """The failure ``debug.*`` asked for."""


def inject_failure(cfg: ExperimentConfig, *, site: str, server_round: int, message: str) -> None:
    """Raise (or block for ever) if ``cfg.debug`` says that ``site`` fails on ``message`` in ``server_round``.

    Parameters
    ----------
    cfg
        The run's configuration; ``cfg.debug.fail_site = ""`` (the default) never fails.
    site
        The site's name (horizontal: ``site-<i>``; split: its modality).
    server_round
        The round (split: the epoch) the message belongs to.
    message
        ``"train"``, ``"evaluate"`` or ``"breslow"``.
    """
    debug = cfg.debug
    if site != debug.fail_site or message != debug.fail_message or server_round < debug.fail_round:
        return
    if debug.fail_mode == "hang":
        threading.Event().wait()  # never set: this site never answers
    raise InjectedFailure(f"injected failure (debug.fail_site = {site!r}): {message} in round {server_round} "
                          f"(failing from round {debug.fail_round} on)")
