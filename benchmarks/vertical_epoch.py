"""Benchmark: one epoch of vertical split learning vs one centralised epoch of the same network.

Three timings of the same network, data, batches and seeds (BVFLMSP architecture on METABRIC by
default: 512-dimensional embeddings, a 4-block Bayesian head, batch 128, one torch thread):

* ``centralised``: :func:`models.multimodal_training.train_multisurv` on the pooled modalities;
* ``split_inprocess``: the split protocol with the sites as objects in this process
  (:class:`strategies.split.LocalSites`): the protocol's own compute overhead (each site
  recomputes its forward pass to back-propagate the returned gradient);
* ``split_flower``: the same run through Flower's simulation engine (Ray), one message per site
  per round trip, each site restoring its encoder and optimiser from ``context.state``; its
  epoch time is the mean over epochs 2.. of the per-epoch wall times the run logs (epoch 1 also
  pays Ray's and the processes' start-up, reported apart).

It also counts round trips per batch (the protocol fuses batch ``t``'s gradient with batch
``t+1``'s embeddings, so it is ``(batches + 1) / batches``) and checks that the in-process split
run ends with the centralised run's weights. Prints one JSON object.

Usage::

    python benchmarks/vertical_epoch.py [--epochs 3] [--data metabric] [--flower/--no-flower] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr_app import vertical_task  # noqa: E402
from models.multimodal import build_multisurv  # noqa: E402
from models.multimodal_training import MultimodalData, fit_transforms, modality_inputs, train_multisurv  # noqa: E402
from simulations.engine import resolve, run_simulation  # noqa: E402
from simulations.hydra_config import parse_value  # noqa: E402
from strategies.split import LocalSites, SplitSite, run_split_training  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", default="metabric")
    parser.add_argument("--flower", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("overrides", nargs="*", help="run-config key=value (e.g. split.embedding_dim=128)")
    args = parser.parse_args(argv)
    overrides = {"strategy.name": "split", "data.name": args.data, "model.name": "bayesian_multisurv",
                 "model.num_durations": 30, "federation.rounds": args.epochs, "train.num_threads": 1,
                 "baseline.centralized": False,
                 **{key: parse_value(text) for key, text in (item.split("=", 1) for item in args.overrides)}}
    _, cfg = resolve(overrides)
    torch.set_num_threads(cfg.train.num_threads)
    table = vertical_task.load_table(cfg)
    label_info = vertical_task.labels(cfg, table)

    # centralised: the pooled modalities
    transforms = fit_transforms(table, label_info.train_ids)
    inputs, present = modality_inputs(table, label_info.train_ids, transforms)
    model = build_multisurv({name: t.input_shape for name, t in transforms.items()}, seed=cfg.seed,
                            dim=cfg.split.embedding_dim, num_durations=len(label_info.cuts),
                            encoder_layers=cfg.split.encoder_layers, head_layers=cfg.split.head_layers,
                            dropout=cfg.split.dropout, risk_layer=cfg.split.risk_layer)
    central_epochs: list[float] = []
    mark = [time.perf_counter()]

    def central_epoch(epoch: int, loss: float) -> None:
        central_epochs.append(time.perf_counter() - mark[0])
        mark[0] = time.perf_counter()

    train_multisurv(model, MultimodalData(inputs, present, label_info.time_index, label_info.event),
                    epochs=cfg.federation.rounds, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
                    weight_decay=cfg.train.weight_decay, seed=cfg.seed,
                    similarity_weight=cfg.split.similarity_weight, on_epoch=central_epoch)

    # split, the sites as objects in this process (the protocol's compute alone: no messages)
    sites = [vertical_task.simulated_site(cfg, index) for index in range(len(table.modalities))]
    transport = LocalSites({site.modality: SplitSite(vertical_task.site_config(cfg, site.modality, label_info, 0.0),
                                                     site.features, site.categorical,
                                                     noise_base_seed=site.noise_base_seed, source=site.source)
                            for site in sites})
    server = vertical_task.server(cfg, tuple(table.modalities), label_info)
    split_epochs: list[float] = []
    mark[0] = time.perf_counter()

    def split_epoch(epoch: int, info: dict) -> None:
        split_epochs.append(time.perf_counter() - mark[0])
        mark[0] = time.perf_counter()

    history = run_split_training(server, transport, epochs=cfg.federation.rounds,
                                 batch_size=cfg.train.batch_size, on_epoch=split_epoch)
    deviation = max(float((value - model.fusion_head.state_dict()[key]).abs().max())
                    for key, value in server.fusion_head.state_dict().items())

    result = {
        "data": cfg.data.name, "modalities": list(table.modalities), "train_records": len(label_info.train_ids),
        "embedding_dim": cfg.split.embedding_dim, "batch_size": cfg.train.batch_size, "epochs": cfg.federation.rounds,
        "centralised_epoch_s": statistics.median(central_epochs),
        "split_inprocess_epoch_s": statistics.median(split_epochs),
        "batches": history.batches, "round_trips": history.round_trips,
        "round_trips_per_batch": history.round_trips / history.batches,
        "split_vs_centralised_max_weight_difference": deviation,
    }
    result["ratio_split_inprocess_over_centralised"] = result["split_inprocess_epoch_s"] / result["centralised_epoch_s"]
    if args.flower:
        with tempfile.TemporaryDirectory() as out:
            summary = run_simulation({**overrides, "output.dir": out}, engine="ray")  # Flower's engine, timed
            lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        elapsed = [line["elapsed_s"] for line in lines]
        per_epoch = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
        result["split_flower_epoch_s"] = statistics.mean(per_epoch) if per_epoch else elapsed[0]
        result["split_flower_first_epoch_s"] = elapsed[0]
        result["split_flower_round_trips_per_batch"] = summary["round_trips_per_batch"]
        result["ratio_split_flower_over_centralised"] = result["split_flower_epoch_s"] / result["centralised_epoch_s"]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
