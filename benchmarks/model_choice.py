"""What ``model.name = auto`` chooses on a small federation, and how its threshold was measured: through the apps.

``python -m benchmarks.model_choice --part validation|test|default-federations [--data gbsg|metabric]
[--strategies dp_sgd,distributed_dp] [--epsilons 1] [--settings linear,small,default,auto] [--extra key=value;...]
[--dictionary] [--seeds 0,1,2,3,4] [--out rows.jsonl]``

The federation: six centres of :data:`SIZES` training records (990 in all), drawn at each seed from GBSG's bundled
training part (``split = train``); each centre is a natural partition (``federation.partition = centre``).

``--part validation``: each centre's records split 80/20 into ``train`` and ``test`` (the validation part) at the
seed; GBSG's bundled test part is never read. The threshold of :mod:`strategies.model_choice` and every
hyperparameter compared were chosen here. ``--part test``: the centres train on all their records, GBSG's bundled
test part (686 records, which nothing was chosen on) is dealt to them in proportion to their sizes, and the global
model is evaluated on it pooled. ``--part default-federations``: the settings on the validation files of FLCHAIN's
and METABRIC's default federations instead (:func:`default_federations`).

Settings: ``linear`` (``model.hidden=[]``), ``small`` (``[32]``), ``default`` (``[128,64,64,32,32]``), ``auto``
(``model.name=auto``: the rule's choice), each with the strategy's recipe unless ``--extra`` adds keys
(``key=value;key=value``); ``--dictionary`` gives the private set-up public covariate ranges and follow-up
(:func:`dictionary_json`), which it otherwise estimates from noisy histograms, leaving out the covariates whose
range does not stand out of the noise. ``--data metabric`` draws the centres from METABRIC instead. Prints one JSON
line per run (Harrell's C, IBS, the Kaplan-Meier null's IBS, the chosen widths) and per setting the mean and sample
standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from flwr_app import interrupt
from models.data.files import resolve_data_dir
from simulations.engine import run_inprocess
from simulations.results_file import append_jsonl

#: Training records of the six centres.
SIZES = (40, 100, 150, 200, 250, 250)
VALIDATION_STREAM = 31
#: GBSG's follow-up in months (its longest time is 87.4).
FOLLOW_UP = 90.0
SETTINGS = {"linear": {"model.name": "hazard_mlp", "model.hidden": []},
            "small": {"model.name": "hazard_mlp", "model.hidden": [32]},
            "default": {"model.name": "hazard_mlp"},
            "auto": {}}


def federation_csv(seed: int, folder: Path, *, validation: bool, data: str = "gbsg") -> Path:
    """The seed's six centres (:data:`SIZES`) from GBSG's training part; validation: 80/20 within each centre,
    test: GBSG's test part dealt to the centres in proportion to their sizes as ``split = test`` (the server
    evaluates the global model on the pooled test split)."""
    frame = pd.read_csv(resolve_data_dir("") / f"{data}.csv")
    train, test = frame[frame["split"] == "train"], frame[frame["split"] == "test"]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(train))
    bounds = np.cumsum((0,) + SIZES)
    parts = [train.iloc[order[lo:hi]].assign(centre=f"c{index}") for index, (lo, hi) in
             enumerate(zip(bounds, bounds[1:]))]
    sites = pd.concat(parts, ignore_index=True)
    if validation:
        held = np.random.default_rng([seed, VALIDATION_STREAM]).random(len(sites)) < 0.2
        sites = sites.assign(split=np.where(held, "test", "train"))
    else:  # GBSG's test part dealt to the centres in proportion to their sizes
        share = np.repeat([f"c{index}" for index in range(len(SIZES))],
                          np.diff(np.round(np.cumsum((0,) + SIZES) * len(test) / sum(SIZES)).astype(int)))
        sites = pd.concat([sites.assign(split="train"), test.assign(centre=rng.permutation(share))],
                          ignore_index=True)
    path = folder / f"{data}_{'validation' if validation else 'test'}_{seed}.csv"
    sites.to_csv(path, index=False)
    return path


def dictionary_json(folder: Path) -> Path:
    """A data dictionary of public ranges (no privacy cost): each covariate's range over GBSG's training part and
    the study's follow-up (:data:`FOLLOW_UP` months), so that the private set-up spends nothing on finding them."""
    train = pd.read_csv(resolve_data_dir("") / "gbsg.csv").query("split == 'train'")
    covariates = train.drop(columns=["duration", "event", "split"])
    path = folder / "gbsg_dictionary.json"
    path.write_text(json.dumps({"numeric": {column: [float(covariates[column].min()), float(covariates[column].max())]
                                            for column in covariates}, "time": {"max": FOLLOW_UP}}))
    return path


def run_row(path: Path, overrides: dict, *, setting: str, seed: int, out: Path) -> dict:
    """One run through the ServerApp and ClientApp on a federation file, and its figures."""
    summary = run_inprocess({"data.name": "csv", "data.path": str(path), "data.split_col": "split",
                             "data.time_col": "duration", "data.event_col": "event",
                             "federation.partition": "centre", "seed": seed, "baseline.centralized": False,
                             "output.dir": str(out), **overrides})
    choice = summary.get("model_choice", {}).get("chosen", {}).get("model.hidden")
    return {"setting": setting, "strategy": overrides.get("strategy.name", "fedavg"),
            "epsilon": overrides.get("privacy.epsilon"), "seed": seed, "c_index": summary["test"]["c_index"],
            "ibs": summary["test"]["ibs"], "ibs_km_null": summary.get("km_null", {}).get("ibs_km_null"),
            "below_null": summary.get("km_null", {}).get("below_null"), "auto_hidden": choice,
            "auto_reason": summary.get("model_choice", {}).get("reason"),
            "ledger_epsilon": summary["privacy"]["epsilon"]}


def summarise(rows: list[dict]) -> dict[str, dict[str, str]]:
    """Per (strategy, ε, setting): mean ± sample std over seeds of C, IBS and the KM null's IBS."""
    groups = collections.defaultdict(list)
    for row in rows:
        public = " dictionary" if row.get("dictionary") else ""
        groups[f"{row['strategy']} eps={row['epsilon']} {row['setting']}{public}"].append(row)

    def spread(values: list[float]) -> str:
        return f"{np.mean(values):.3f} ± {np.std(values, ddof=1) if len(values) > 1 else 0.0:.3f}"

    return {name: {key: spread([row[key] for row in group]) for key in ("c_index", "ibs", "ibs_km_null")}
                  | {"seeds": str(len(group))}
            for name, group in groups.items()}


def default_federations(args: argparse.Namespace) -> None:
    """``--part default-federations``: the settings on the validation files of FLCHAIN and METABRIC's default
    federations (:func:`benchmarks.setup_share.validation_csv`: 5 i.i.d. sites), at each strategy and ε."""
    from benchmarks.setup_share import run_grid

    settings = {f"{strategy}, {setting}": {"strategy.name": strategy, **SETTINGS[setting], **_extra(args.extra)}
                for strategy in args.strategies.split(",") for setting in args.settings.split(",")}
    run_grid(settings, data="flchain,metabric", seeds=args.seeds, epsilons=args.epsilons, out=args.out)


def _extra(text: str) -> dict:
    pairs = [item.split("=", 1) for item in text.split(";") if item]
    return {key: json.loads(value) if value[:1] in "[0123456789" else value for key, value in pairs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("validation", "test", "default-federations"), required=True)
    parser.add_argument("--data", choices=("gbsg", "metabric"), default="gbsg",
                        help="the bundled set the centres are drawn from (its own split column)")
    parser.add_argument("--strategies", default="dp_sgd,distributed_dp")
    parser.add_argument("--epsilons", default="1")
    parser.add_argument("--settings", default="linear,small,default,auto")
    parser.add_argument("--extra", default="", help="more run-config keys for every run: key=value;key=value")
    parser.add_argument("--dictionary", action="store_true", help="public ranges in data.dictionary "
                        "(dictionary_json)")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.dictionary and args.data != "gbsg":
        parser.error("--dictionary holds GBSG's ranges: use it with --data gbsg")
    if args.part == "default-federations":
        default_federations(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        extra = _extra(args.extra) | ({"data.dictionary": str(dictionary_json(Path(folder)))} if args.dictionary
                                      else {})
        for seed in (int(s) for s in args.seeds.split(",")):
            path = federation_csv(seed, Path(folder), validation=args.part == "validation", data=args.data)
            for strategy in args.strategies.split(","):
                epsilons = [float("inf")] if strategy == "fedavg" else [float(e) for e in args.epsilons.split(",")]
                for epsilon, setting in ((e, s) for e in epsilons for s in args.settings.split(",")):
                    overrides = {"strategy.name": strategy, **SETTINGS[setting], **extra}
                    if strategy != "fedavg":
                        overrides["privacy.epsilon"] = epsilon
                    row = run_row(path, overrides, setting=setting, seed=seed,
                                  out=Path(folder) / f"run_{seed}_{strategy}_{epsilon:g}_{setting}")
                    rows.append({**row, "part": args.part, "data": args.data, "extra": args.extra,
                                 "dictionary": args.dictionary})
                    print(json.dumps(rows[-1]), flush=True)
                    if args.out:
                        append_jsonl(args.out, rows[-1])
    print(json.dumps(summarise(rows), indent=1))


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
