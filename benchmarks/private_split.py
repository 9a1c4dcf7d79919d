"""Private vertical learning with one release per record: its options measured, and the ceiling.

``python -m benchmarks.private_split select [--out grid.jsonl]``
    Chooses ``privacy.clip_norm``, ``split.fit_share`` and the head's ``split.risk_layer``
    (:data:`SELECTION_GRID`) for the ``score`` encoder with Laplace releases on **validation** splits (each seed's training records split 80/20 again; the test
    records are never read): synthetic two modalities and METABRIC, ε = 3 and 10, seeds 0-1.
    A setting's score is its mean validation C over those 8 runs.

``python -m benchmarks.private_split measure --clip C --fit-share F [--out rows.jsonl]``
    Every option at the chosen values, 5 seeds, test split: C (Harrell), the record's ε over every
    site (:func:`strategies.private_split.record_epsilon`), and the reconstruction R² of the raw
    features from the released embeddings (ridge regression, 2-fold cross-fitted over all records;
    the largest over the features, and their mean).

``python -m benchmarks.private_split ceiling``
    What no protocol that releases each record once can beat: each site releases the *true* Cox
    score of its modality (fitted on all records, labels included), clipped and noised once, for
    ε split over the sites as the protocol splits it, with Laplace and with Gaussian noise, at the
    best of clip 0.25, 0.5, 1, 2 (mean C over the seeds).

The runs use the protocol's pieces in one process (:class:`strategies.private_split.PrivateSplitSites`,
:func:`models.release_head.fit_release_head`): the maths of a run without the transport.
"""

from __future__ import annotations

import argparse
import itertools
import json
import warnings

import numpy as np
import pandas as pd
import torch
from sksurv.metrics import concordance_index_censored

from models.data.vertical import load_vertical, split_train_test
from models.multimodal_training import discretised_labels
from models.release_head import fit_release_head, predict_release_head
from models.time_grid import make_time_grid
from simulations.results_file import append_jsonl
from strategies.accounting.private_split import (
    PrivateSplitPlan,
    plan_noise,
    record_epsilon,
)
from strategies.private_split import (
    PrivateSplitSites,
    concatenate,
    martingale_residuals,
)

SETTINGS = {"synthetic 2": ("synthetic_multimodal", ("a", "b")), "synthetic 3": ("synthetic_multimodal", ("a", "b", "c")),
            "metabric": ("metabric", ("genomic", "clinical"))}
#: The (clip norm, fit share, head risk layer) settings of the selection, in the order they were run: a 3 x 3 grid
#: with the per-interval risk layer; the smallest clip having won, the smaller clips 0.25 (two shares) and 0.125 (the
#: best share); then the proportional risk layer at the best share and four clips.
SELECTION_GRID = (*itertools.product((0.5, 1.0, 2.0), (0.05, 0.1, 0.2), ("interval",)), (0.25, 0.05, "interval"),
                  (0.25, 0.1, "interval"), (0.125, 0.05, "interval"),
                  *itertools.product((0.125, 0.25, 0.5, 1.0), (0.05,), ("proportional",)))
#: The options compared: (encoder, release noise, embedding dimensions).
OPTIONS = (("score", "laplace", 1), ("score", "gaussian", 1), ("pca", "gaussian", 2), ("pca", "laplace", 2),
           ("features", "gaussian", 0))


def run(setting: str, epsilon: float, seed: int, *, encoder: str = "score", noise: str = "laplace", dim: int = 1,
        clip: float = 1.0, fit_share: float = 0.1, validation: bool = False, epochs: int = 50,
        risk_layer: str = "interval") -> dict:
    """One private run; returns C, ε and reconstruction R²."""
    name, modalities = SETTINGS[setting]
    table = load_vertical(name).select(modalities)
    train_ids, test_ids = split_train_test(table, test_fraction=0.2, seed=seed)
    if validation:
        train_ids, test_ids = split_train_test(table.subset(train_ids), test_fraction=0.2, seed=seed + 1000)
    train, test = table.subset(train_ids), table.subset(test_ids)
    plan = PrivateSplitPlan(epsilon=epsilon, delta=1e-5, num_sites=len(modalities), encoder=encoder,
                            release_noise=noise, clip_norm=clip, dim=max(dim, 1), fit_share=fit_share)
    noise_plan = plan_noise(plan)
    sites = PrivateSplitSites(plan, noise_plan,
                              {m: (table.modalities[m], table.categorical.get(m, ())) for m in modalities},
                              noise_seed=seed)
    sites.fit(train_ids, dict(zip(map(str, train_ids), martingale_residuals(train.time, train.event))))
    x_train = concatenate(sites.release(train_ids), modalities)
    cuts = make_time_grid(train.time, train.event, num_durations=20, scheme="quantiles")
    time_index, event = discretised_labels(train.time, train.event, cuts)
    head, losses = fit_release_head(torch.tensor(x_train), time_index, event, num_durations=len(cuts),
                                    risk_layer=risk_layer, epochs=epochs, seed=seed)
    x_test = concatenate(sites.release(test_ids), modalities)
    logits = predict_release_head(head, torch.tensor(x_test), passes=20, seed=seed)
    survival = torch.cumprod(torch.sigmoid(-logits), dim=-1).mean(0).numpy()
    c = harrell(test.time, test.event, -survival.sum(axis=1))
    r2 = reconstruction_r2(table, modalities, np.vstack([x_train, x_test]), [*train_ids, *test_ids])
    return {"setting": setting, "epsilon_target": epsilon, "seed": seed, "encoder": encoder, "noise": noise,
            "dim": dim, "clip": clip, "fit_share": fit_share, "risk_layer": risk_layer, "validation": validation,
            "c_index": c,
            "epsilon": record_epsilon(plan, noise_plan), "r2_max": max(r2), "r2_mean": float(np.mean(r2)),
            "loss_first": losses[0], "loss_last": losses[-1]}


def harrell(time: np.ndarray, event: np.ndarray, risk: np.ndarray) -> float:
    """Harrell's C of ``risk`` (higher: earlier event; scikit-survival)."""
    return float(concordance_index_censored(np.asarray(event).astype(bool), time, risk)[0])


def reconstruction_r2(table, modalities, released: np.ndarray, ids) -> list[float]:
    """Cross-fitted R² of each raw feature from the released embeddings (ridge, 2 folds)."""
    from sklearn.linear_model import RidgeCV
    from sklearn.model_selection import cross_val_predict

    scores = []
    for modality in modalities:
        frame = table.modalities[modality].loc[list(ids)]
        for column in frame.columns:
            y = pd.to_numeric(frame[column], errors="coerce").to_numpy(float)
            ok = np.isfinite(y)
            if np.var(y[ok]) == 0:
                continue
            predicted = cross_val_predict(RidgeCV(), released[ok], y[ok], cv=2)
            scores.append(float(1.0 - np.mean((y[ok] - predicted) ** 2) / np.var(y[ok])))
    return scores


def ceiling(setting: str, epsilon: float, seed: int, noise: str, clip: float) -> float:
    """C of the true per-modality Cox scores released once each (Laplace: ε/K per site; Gaussian: RDP)."""
    from lifelines import CoxPHFitter

    from strategies.mechanisms.embedding_dp import calibrate_embedding_noise

    name, modalities = SETTINGS[setting]
    table = load_vertical(name).select(modalities)
    frame = pd.concat([pd.get_dummies(table.modalities[m].astype(float)) for m in modalities], axis=1)
    frame = (frame - frame.mean()) / frame.std()
    fitted = CoxPHFitter(penalizer=1e-4).fit(frame.assign(T=table.time, E=table.event), "T", "E")
    rng = np.random.default_rng(seed)
    score = np.zeros(len(frame))
    sigma = calibrate_embedding_noise(epsilon=epsilon, delta=1e-5, epochs=len(modalities))
    for modality in modalities:
        columns = list(table.modalities[modality].columns)
        s = np.clip(frame[columns].to_numpy() @ fitted.params_[columns].to_numpy(), -clip, clip)
        scale = 2 * clip * len(modalities) / epsilon if noise == "laplace" else sigma * clip
        score += s + (rng.laplace(size=s.size) if noise == "laplace" else rng.normal(size=s.size)) * scale
    _, test_ids = split_train_test(table, test_fraction=0.2, seed=seed)
    test = pd.Index(table.ids).get_indexer(test_ids)
    return harrell(table.time[test], table.event[test], score[test])


def _summary(rows: list[dict], keys: tuple[str, ...]) -> None:
    frame = pd.DataFrame(rows)
    table = frame.groupby(list(keys)).agg(c=("c_index", "mean"), c_std=("c_index", "std"), eps=("epsilon", "max"),
                                          r2_max=("r2_max", "max"), r2_mean=("r2_mean", "mean"), n=("seed", "count"))
    print(table.round(3).to_string())


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message="Optimal order")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("select", "measure", "ceiling"))
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--fit-share", type=float, default=0.1)
    parser.add_argument("--risk-layer", default="interval", choices=("interval", "proportional"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            append_jsonl(args.out, row)

    if args.mode == "select":
        for clip, share, risk_layer in SELECTION_GRID:
            for setting, epsilon, seed in itertools.product(("synthetic 2", "metabric"), (3.0, 10.0), range(2)):
                emit(run(setting, epsilon, seed, clip=clip, fit_share=share, risk_layer=risk_layer, validation=True))
        _summary(rows, ("risk_layer", "clip", "fit_share"))
    elif args.mode == "measure":
        cases = [("synthetic 2", 3.0), ("synthetic 2", 10.0), ("synthetic 3", 10.0), ("metabric", 10.0),
                 ("metabric", 3.0)]
        for (setting, epsilon), (encoder, noise, dim) in itertools.product(cases, OPTIONS):
            for seed in range(args.seeds):
                try:
                    emit(run(setting, epsilon, seed, encoder=encoder, noise=noise, dim=dim, clip=args.clip,
                             fit_share=args.fit_share, risk_layer=args.risk_layer))
                except ValueError as err:  # a budget the option cannot meet: say so
                    print(json.dumps({"setting": setting, "epsilon_target": epsilon, "encoder": encoder,
                                      "noise": noise, "error": str(err)}), flush=True)
                    break
        _summary(rows, ("setting", "epsilon_target", "encoder", "noise"))
    else:
        for setting, epsilon, noise in itertools.product(("synthetic 2", "synthetic 3", "metabric"), (3.0, 10.0),
                                                         ("laplace", "gaussian")):
            best = max((float(np.mean([ceiling(setting, epsilon, seed, noise, clip) for seed in range(args.seeds)])),
                        clip) for clip in (0.25, 0.5, 1.0, 2.0))
            emit({"setting": setting, "epsilon": epsilon, "noise": noise, "ceiling_c": best[0], "clip": best[1]})


if __name__ == "__main__":
    main()
