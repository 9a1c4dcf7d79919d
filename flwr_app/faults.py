"""Injected failures and hostile replies for tests of fault tolerance (run-config keys ``debug.*``; simulations only).

A site named by ``debug.fail_site`` misbehaves from round ``debug.fail_round`` on:

* ``debug.fail_mode = "raise"`` or ``"hang"``: on every ``debug.fail_message`` it raises (Flower
  turns that into an error reply) or never answers (the server's ``federation.timeout_s`` passes
  without its reply), as a site whose process crashed or whose link went down would;
* a hostile mode (:data:`HOSTILE_MODES`): it answers, but its reply is tampered with as a buggy or
  hostile site's might be (:func:`tamper`): NaN weights, a transposed weight matrix, an inflated
  record count with poisoned weights, a forged epsilon or a spoofed site name in its training
  replies, or forged test metrics in its evaluation replies. The server must refuse the reply and
  name the site. ``poisoned_update`` is the one the checks cannot see: a well-formed update whose
  weights are all multiplied by ``debug.fail_scale`` (-10); only the bounded mean
  (``federation.update_bound``) or a robust aggregator (``federation.aggregation``) keeps it from the model.

Nothing else about the run changes.
"""

from __future__ import annotations

import threading

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from strategies.config import HOSTILE_MODES, DebugConfig, ExperimentConfig
from strategies.secure_aggregation import MASKED_ARRAY

__all__ = ["HOSTILE_MODES", "InjectedFailure", "inject_failure", "tamper"]

#: Hostile replies (the schema's choices of debug.fail_mode): the message each one tampers with.
_TAMPERED_MESSAGE = {mode: "train" for mode in HOSTILE_MODES} | {"forged_metrics": "evaluate"}


class InjectedFailure(RuntimeError):
    """The failure ``debug.*`` asked for."""


def _misbehaves(debug: DebugConfig, site: str, server_round: int) -> bool:
    """Whether ``site`` is ``debug.fail_site`` and ``server_round`` is ``debug.fail_round`` or later."""
    return bool(debug.fail_site) and site == debug.fail_site and server_round >= debug.fail_round


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
    if debug.fail_mode not in ("raise", "hang") or message != debug.fail_message:
        return
    if not _misbehaves(debug, site, server_round):
        return
    if debug.fail_mode == "hang":
        threading.Event().wait()  # never set: this site never answers
    raise InjectedFailure(f"injected failure (debug.fail_site = {site!r}): {message} in round {server_round} "
                          f"(failing from round {debug.fail_round} on)")


def tamper(cfg: ExperimentConfig, content: RecordDict, *, site: str, server_round: int, message: str) -> RecordDict:
    """``content`` as the hostile site of ``debug.fail_mode`` would send it (unchanged for everyone else).

    ``nan_weights``: every weight of the first layer NaN; ``wrong_shape``: the first weight matrix
    transposed; ``inflated_count``: ``num-examples`` 1e12 and every weight times -10 (a site
    trying to take the model over); ``forged_epsilon``: the reported epsilon 1e-9;
    ``spoofed_name``: the reply names another site; ``forged_metrics``: C-index 0.99 and IBS 0
    in the evaluation reply; ``poisoned_update``: every weight times ``debug.fail_scale``, nothing else changed.
    A secure-aggregation site's masked vector (its training reply) becomes NaN (``nan_weights``), one
    coordinate short (``wrong_shape``) or its masked values times ``debug.fail_scale`` mod M
    (``poisoned_update``: after masking, so the masks no longer cancel and the unmasked sum is garbage
    that the server's sum check must refuse without naming a site).
    """
    mode = cfg.debug.fail_mode
    if _TAMPERED_MESSAGE.get(mode) != message or not _misbehaves(cfg.debug, site, server_round):
        return content
    if MASKED_ARRAY in content.array_records and mode in ("nan_weights", "wrong_shape", "poisoned_update"):
        # a secure-aggregation reply: a non-integer vector, one coordinate short, or (poisoned_update) the masked
        # vector times debug.fail_scale mod M, whose masks then no longer cancel
        masked = content[MASKED_ARRAY][MASKED_ARRAY].numpy()
        if mode == "nan_weights":
            masked = np.full(masked.shape, np.nan)
        elif mode == "wrong_shape":
            masked = masked[:-1].copy()
        elif mode == "poisoned_update":
            scaled = np.round(masked.astype(np.float64) * cfg.debug.fail_scale)
            masked = np.mod(scaled, float(2 ** cfg.privacy.modulus_bits)).astype(np.int64)
        content[MASKED_ARRAY] = ArrayRecord({MASKED_ARRAY: Array(np.ascontiguousarray(masked))})
        return content
    if mode in ("nan_weights", "wrong_shape", "inflated_count", "poisoned_update"):
        arrays = {key: array.numpy() for key, array in content["arrays"].items()}
        first = next(key for key, value in arrays.items() if value.ndim == 2)
        if mode == "nan_weights":
            arrays[first] = np.full_like(arrays[first], np.nan)
        elif mode == "wrong_shape":
            arrays[first] = np.ascontiguousarray(arrays[first].T)
        else:
            factor = cfg.debug.fail_scale if mode == "poisoned_update" else -10.0
            arrays = {key: (value * factor).astype(value.dtype) for key, value in arrays.items()}
            if mode == "inflated_count":
                content["metrics"]["num-examples"] = 1e12
        content["arrays"] = ArrayRecord({key: Array(value) for key, value in arrays.items()})
    elif mode == "forged_epsilon":
        content["metrics"]["epsilon"] = 1e-9
    elif mode == "spoofed_name":
        content["site"] = ConfigRecord({"name": "site-0" if site != "site-0" else "site-1"})
    elif mode == "forged_metrics":
        forged = {"c_index": 0.99, "c_index_td": 0.99, "ibs": 0.0, "inbll": 0.0}
        content["metrics"] = MetricRecord({**dict(content["metrics"]), **forged})
    return content
