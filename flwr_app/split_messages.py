"""Flower message encoding of the split-learning protocol (:mod:`strategies.split`).

Message types (``<category>.<action>``, routed by the ClientApp):

``query.split_hello``    the site answers with its modality and the record IDs it holds
``train.split_setup``    the label holder's :class:`~strategies.split.SiteConfig`; the site builds its encoder
``train.split_step``     one round trip: gradient of batch ``t−1`` and IDs of batch ``t`` -> embeddings of ``t``
``query.split_predict``  prediction passes for a list of IDs -> embeddings (passes, b, dim)
``query.split_save``     the run's token, after prediction; a site whose node config sets ``model-dir``
                         writes its encoder, configuration and preprocessing there, on its own disk
                         (:meth:`strategies.split.SplitSite.save`), and replies with its modality; a
                         site without one saves nothing and replies with nothing. No other value
                         leaves the site (the release manifest's ``split.site.modality`` covers the reply)

Strategy ``private_split`` (:mod:`strategies.private_split`) answers the same hello, then:

``train.private_split_setup``    the public plan, the run's public data dictionary, the training IDs
                                 and (``score``) their residuals; the site runs its private set-up
                                 and fits its encoder -> its width and the set-up's notes
``query.private_split_release``  a list of IDs -> each record's one release (b, dim), from the cache
                                 when it was released before

Arrays travel in an ``ArrayRecord`` (numpy, lossless), IDs and steps in a ``ConfigRecord``, the
site's privacy report in a ``MetricRecord``.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from models.data.dictionary import DataDictionary
from strategies.accounting.private_split import PrivateSplitPlan
from strategies.split import PredictRequest, SiteConfig, SiteReply, SiteRequest

HELLO = "query.split_hello"
SETUP = "train.split_setup"
STEP = "train.split_step"
PREDICT = "query.split_predict"
SAVE = "query.split_save"
PRIVATE_SETUP = "train.private_split_setup"
PRIVATE_RELEASE = "query.private_split_release"

_REQUEST, _ARRAYS, _PRIVACY, _SITE = "split.request", "split.arrays", "split.privacy", "split.site"


def encode_hello_reply(modality: str, ids: list[str]) -> RecordDict:
    return RecordDict({_SITE: ConfigRecord({"modality": modality, "ids": ids})})


def decode_hello_reply(content: RecordDict) -> tuple[str, list[str]]:
    site = content.config_records[_SITE]
    return str(site["modality"]), [str(i) for i in site["ids"]]


def encode_setup(config: SiteConfig) -> RecordDict:
    return RecordDict({_REQUEST: ConfigRecord({"config": config.to_json()})})


def decode_setup(content: RecordDict) -> SiteConfig:
    return SiteConfig.from_json(str(content.config_records[_REQUEST]["config"]))


def encode_request(request: SiteRequest) -> RecordDict:
    config = ConfigRecord({
        "backward_ids": request.backward_ids or [], "has_backward": request.backward_ids is not None,
        "backward_step": request.backward_step,
        "forward_ids": request.forward_ids or [], "has_forward": request.forward_ids is not None,
        "forward_step": request.forward_step,
    })
    content = RecordDict({_REQUEST: config})
    if request.gradient is not None:
        content[_ARRAYS] = ArrayRecord({"gradient": Array(np.ascontiguousarray(request.gradient, dtype=np.float32))})
    return content


def decode_request(content: RecordDict) -> SiteRequest:
    config = content.config_records[_REQUEST]
    gradient = content.array_records[_ARRAYS]["gradient"].numpy() if _ARRAYS in content.array_records else None
    return SiteRequest(
        backward_ids=[str(i) for i in config["backward_ids"]] if config["has_backward"] else None,
        backward_step=int(config["backward_step"]), gradient=gradient,
        forward_ids=[str(i) for i in config["forward_ids"]] if config["has_forward"] else None,
        forward_step=int(config["forward_step"]),
    )


def encode_predict(request: PredictRequest) -> RecordDict:
    return RecordDict({_REQUEST: ConfigRecord({"ids": request.ids, "passes": request.passes,
                                               "first_step": request.first_step, "clean": request.clean})})


def decode_predict(content: RecordDict) -> PredictRequest:
    config = content.config_records[_REQUEST]
    return PredictRequest(ids=[str(i) for i in config["ids"]], passes=int(config["passes"]),
                          first_step=int(config["first_step"]), clean=bool(config["clean"]))


def encode_reply(modality: str, reply: SiteReply) -> RecordDict:
    return RecordDict({
        _ARRAYS: ArrayRecord({"embeddings": Array(np.ascontiguousarray(reply.embeddings, dtype=np.float32)),
                              "present": Array(np.ascontiguousarray(reply.present, dtype=bool))}),
        _PRIVACY: MetricRecord({key: float(value) for key, value in reply.privacy.items()}),
        _SITE: ConfigRecord({"modality": modality}),
    })


def decode_reply(content: RecordDict) -> tuple[str, SiteReply]:
    arrays = content.array_records[_ARRAYS]
    privacy = {key: float(value) for key, value in content.metric_records[_PRIVACY].items()}
    reply = SiteReply(arrays["embeddings"].numpy(), arrays["present"].numpy(), privacy)
    return str(content.config_records[_SITE]["modality"]), reply


def encode_save(run_token: str) -> RecordDict:
    return RecordDict({_REQUEST: ConfigRecord({"run_token": run_token})})


def decode_save(content: RecordDict) -> str:
    """The run's token of a save request (letters, digits, ``-`` and ``_``: it is written into the site's files)."""
    token = content.config_records[_REQUEST]["run_token"]
    if not isinstance(token, str) or not token or not all(c.isascii() and (c.isalnum() or c in "-_") for c in token):
        raise ValueError(f"the save request's run token {token!r} is not a word of letters, digits, '-' and '_'")
    return token


def encode_save_reply(modality: str | None) -> RecordDict:
    """A site's answer to a save request: its modality once it saved its part, nothing when it saved nothing."""
    return RecordDict() if modality is None else RecordDict({_SITE: ConfigRecord({"modality": modality})})


def decode_save_reply(content: RecordDict) -> str | None:
    """The modality a site saved its part of (``None``: it saved nothing); a reply carrying anything else is refused."""
    if not len(content):
        return None
    if (set(content) != {_SITE} or _SITE not in content.config_records
            or set(content.config_records[_SITE]) != {"modality"}):
        raise ValueError(f"a save reply carries the site's modality only, not {sorted(content)}")
    modality = content.config_records[_SITE]["modality"]
    if not isinstance(modality, str):
        raise ValueError(f"the save reply's modality {modality!r} is not a name")
    return modality


# --------------------------------------------------------------------------- private_split

_PRIVATE = "private_split"


def encode_private_setup(plan: PrivateSplitPlan, modality: str, train_ids: list[str], residuals: np.ndarray | None,
                         dictionary: DataDictionary | None = None) -> RecordDict:
    content = RecordDict({f"{_PRIVATE}.request": ConfigRecord({
        "plan": json.dumps(dataclasses.asdict(plan)), "modality": modality, "train_ids": train_ids,
        "dictionary": "" if dictionary is None else json.dumps(dictionary.to_dict())})})
    if residuals is not None:
        content[f"{_PRIVATE}.arrays"] = ArrayRecord({"residuals": Array(np.ascontiguousarray(residuals,
                                                                                              dtype=np.float64))})
    return content


def decode_private_setup(content: RecordDict,
                         ) -> tuple[PrivateSplitPlan, str, list[str], np.ndarray | None, DataDictionary | None]:
    """The plan, modality, training IDs, residuals and public data dictionary (checked) of a set-up request."""
    request = content.config_records[f"{_PRIVATE}.request"]
    plan = PrivateSplitPlan(**json.loads(str(request["plan"])))
    arrays = content.array_records.get(f"{_PRIVATE}.arrays")
    residuals = arrays["residuals"].numpy() if arrays is not None else None
    text = str(request["dictionary"])
    dictionary = DataDictionary.from_mapping(json.loads(text), source="the label holder's data dictionary") if text \
        else None
    return plan, str(request["modality"]), [str(i) for i in request["train_ids"]], residuals, dictionary


def encode_private_setup_reply(modality: str, dim: int, notes: tuple[str, ...] = ()) -> RecordDict:
    return RecordDict({f"{_PRIVATE}.site": ConfigRecord({"modality": modality, "dim": int(dim),
                                                          "notes": json.dumps(list(notes))})})


def decode_private_setup_reply(content: RecordDict) -> tuple[str, int, tuple[str, ...]]:
    """The site's modality, embedding width and set-up notes (one sentence each)."""
    site = content.config_records[f"{_PRIVATE}.site"]
    notes = json.loads(str(site["notes"]))
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        raise ValueError("the set-up notes must be a list of sentences")
    return str(site["modality"]), int(site["dim"]), tuple(notes)


def encode_private_release(ids: list[str]) -> RecordDict:
    return RecordDict({f"{_PRIVATE}.request": ConfigRecord({"ids": ids})})


def decode_private_release(content: RecordDict) -> list[str]:
    return [str(i) for i in content.config_records[f"{_PRIVATE}.request"]["ids"]]


def encode_private_release_reply(modality: str, embeddings: np.ndarray, present: np.ndarray,
                                 privacy: dict[str, float]) -> RecordDict:
    return RecordDict({
        f"{_PRIVATE}.arrays": ArrayRecord({
            "embeddings": Array(np.ascontiguousarray(embeddings, dtype=np.float64)),
            "present": Array(np.ascontiguousarray(present, dtype=bool))}),
        f"{_PRIVATE}.privacy": MetricRecord({key: float(value) for key, value in privacy.items()}),
        f"{_PRIVATE}.site": ConfigRecord({"modality": modality}),
    })


def decode_private_release_reply(content: RecordDict) -> tuple[str, np.ndarray, np.ndarray, dict[str, float]]:
    arrays = content.array_records[f"{_PRIVATE}.arrays"]
    privacy = {key: float(value) for key, value in content.metric_records[f"{_PRIVATE}.privacy"].items()}
    return (str(content.config_records[f"{_PRIVATE}.site"]["modality"]), arrays["embeddings"].numpy(),
            arrays["present"].numpy(), privacy)
