"""How the DP-SGD recipe of ``dp_sgd`` and ``bdp`` was chosen: a grid on validation splits of unreported data sets.

``python -m benchmarks.dp_recipe [--out grid.jsonl]``

For each of METABRIC, GBSG and WHAS (public data sets that no DP result of the project reports), 5
i.i.d. sites, seed 0: every site's training part is split 80/20 into a fitting part and a
validation part (the test parts are never read). Federated DP-SGD (every site runs
:func:`~strategies.mechanisms.dp_sgd_training.train_epochs_dp` from the global model, the server
takes the record-weighted mean; the maths of the apps, without Flower, with the exact time grid and
record counts instead of the private set-up) runs 20 rounds at ε = 1 and ε = 10 for every
combination of

* expected batch size 128, 512; Adam learning rate 0.003, 0.01 (second grid: 0.01, 0.03);
* clip norm 1, 5 (second grid: 5, 20); local epochs 1, 3 (second grid: 3, 6),

and is scored by Harrell's C and the IBS on the pooled validation parts. A setting's score is its
mean rank (as a fraction of the settings compared) over the three data sets, both ε and both
metrics; the lowest wins. Selection uses public data only, so it spends no privacy of any site.

The grid is cheap (about 3 s a setting on one core) and prints one JSON line per setting and the
ranking at the end.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
from collections.abc import Iterable

import numpy as np
import torch

from models.data.federated import SurvivalArrays, build_federated_dataset
from models.metrics import evaluate_survival
from models.survival import build_survival_model
from models.time_grid import make_time_grid
from simulations.results_file import append_jsonl
from strategies.mechanisms.dp_sgd import calibrated_noise_multiplier
from strategies.mechanisms.schedules import poisson_schedule

DATA_SETS = ("metabric", "gbsg", "whas")
EPSILONS = (1.0, 10.0)
GRIDS = (
    dict(batch=(128, 512), lr=(0.003, 0.01), clip=(1.0, 5.0), epochs=(1, 3)),
    dict(batch=(128, 512), lr=(0.01, 0.03), clip=(5.0, 20.0), epochs=(3, 6)),
)


def validation_federation(name: str, *, sites: int = 5, seed: int = 0
                          ) -> tuple[list[SurvivalArrays], SurvivalArrays, SurvivalArrays]:
    """Each site's fitting part, the pooled validation parts and the pooled fitting parts (no test record)."""
    dataset = build_federated_dataset(name=name, seed=seed, num_sites=sites, test_fraction=0.2)
    rng = np.random.default_rng(1000 + seed)
    fits, validation = [], []
    for site in dataset.sites:
        order = rng.permutation(len(site.train))
        cut = int(0.8 * len(order))
        fits.append(site.train.subset(np.sort(order[:cut])))
        validation.append(site.train.subset(np.sort(order[cut:])))
    return fits, SurvivalArrays.concat(validation), SurvivalArrays.concat(fits)


def federated_dp_sgd(sites: list[SurvivalArrays], validation: SurvivalArrays, pooled: SurvivalArrays, *,
                     epsilon: float, batch: int, lr: float, clip: float, epochs: int, rounds: int = 20,
                     seed: int = 0) -> dict[str, float]:
    """FedAvg of per-site DP-SGD (σ calibrated per site for all its steps), scored on ``validation``."""
    from strategies.mechanisms.dp_sgd_training import train_epochs_dp

    cuts = make_time_grid(pooled.time, pooled.event, num_durations=20)
    model = build_survival_model("hazard_mlp", in_features=pooled.x.shape[1], cuts=cuts, seed=seed)
    weights = np.array([len(site) for site in sites], dtype=float) / sum(len(site) for site in sites)
    start = {key: value.clone() for key, value in model.net.state_dict().items()}
    sigmas = []
    for server_round in range(rounds):
        updates = []
        for index, site in enumerate(sites):
            model.net.load_state_dict(start)
            rate, steps = poisson_schedule(len(site), batch_size=batch, epochs=epochs)
            sigma = calibrated_noise_multiplier(epsilon=epsilon, delta=1e-5, sample_rate=rate, steps=steps * rounds,
                                                accountant="rdp")
            train_epochs_dp(model, site.x, site.time, site.event, epochs=epochs, batch_size=batch, lr=lr,
                            weight_decay=1e-4, seed=seed * 100_000 + server_round * 100 + index,
                            noise_multiplier=sigma, clip_norm=clip)
            updates.append({key: value.clone() for key, value in model.net.state_dict().items()})
            sigmas.append(sigma)
        start = {key: sum(w * update[key] for w, update in zip(weights, updates)) for key in start}
    model.net.load_state_dict(start)
    times, surv = model.predict_survival(validation.x)
    scores = evaluate_survival(times, surv, time=validation.time, event=validation.event, concordance_td=False)
    return {"c_index": float(scores["c_index"]), "ibs": float(scores["ibs"]), "sigma_max": float(max(sigmas))}


def ranking(rows: Iterable[dict]) -> list[tuple[tuple, float, int]]:
    """Settings by mean rank fraction over (data set, ε) groups and both metrics (lowest first)."""
    rows = list(rows)
    setting = lambda row: (row["batch"], row["lr"], row["clip"], row["epochs"])  # noqa: E731
    ranks: dict[tuple, list[float]] = collections.defaultdict(list)
    for group in {(row["data"], row["epsilon"]) for row in rows}:
        members = [row for row in rows if (row["data"], row["epsilon"]) == group]
        for metric, sign in (("c_index", -1.0), ("ibs", 1.0)):
            for rank, row in enumerate(sorted(members, key=lambda row: sign * row[metric])):
                ranks[setting(row)].append(rank / len(members))
    return sorted(((key, float(np.mean(values)), len(values)) for key, values in ranks.items()),
                  key=lambda item: item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="also append the rows to this JSON-lines file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in DATA_SETS:
        sites, validation, pooled = validation_federation(name)
        for grid in GRIDS:
            for epsilon, (batch, lr, clip, epochs) in itertools.product(
                    EPSILONS, itertools.product(grid["batch"], grid["lr"], grid["clip"], grid["epochs"])):
                row = dict(data=name, epsilon=epsilon, batch=batch, lr=lr, clip=clip, epochs=epochs,
                           **federated_dp_sgd(sites, validation, pooled, epsilon=epsilon, batch=batch, lr=lr,
                                              clip=clip, epochs=epochs))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    append_jsonl(args.out, row)
    print("setting (batch, lr, clip, local epochs) -> mean rank fraction (lower is better), groups")
    for key, score, count in ranking(rows)[:10]:
        print(f"{key}: {score:.3f} ({count})")


if __name__ == "__main__":
    main()
