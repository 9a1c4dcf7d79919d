"""How distributed_dp's recipe was chosen: its clip norm and learning rate through the apps on validation splits.

``python -m benchmarks.distributed_recipe [--clips 1,5] [--lrs 0.02,0.05] [--data flchain,metabric,gbsg,whas]
[--epsilons 1,10] [--seeds 0] [--out rows.jsonl]``

The saved rows (``docs/results/benchmarks/distributed_recipe.jsonl``, 11 settings) came from three runs: the
defaults; ``--clips 10 --lrs 0.01,0.02`` and ``--clips 5 --lrs 0.01``; ``--clips 20,40 --lrs 0.005,0.01``. Those of the
proportional risk layer (``docs/results/benchmarks/distributed_recipe_proportional.jsonl``, 8 settings) came from
``--clips 5,10,20 --lrs 0.01,0.02`` and ``--clips 5,10 --lrs 0.005``, each with ``--data sba,flchain,metabric,gbsg,whas
--epsilons 1 --seeds 0,1`` (run as two processes per grid, one on SBA and FLCHAIN, one on the rest).

The validation files are those of :mod:`benchmarks.setup_share` (each seed's training records of the default
federation, 80 % ``train`` and 20 % ``test``; the seed's test records are never read). Each (clip norm, learning
rate) runs ``distributed_dp`` at each ε for ``federation.rounds`` = 60 through the ServerApp and ClientApp
(SecAgg+, the private set-up, the recalibration) and is scored by Harrell's C, the IBS and the gap between mean
predicted and Kaplan-Meier survival at the median follow-up on the pooled validation parts. A setting's score is
its mean rank over data sets, ε, seeds and the three figures (the lowest wins). Prints one JSON line per run and
the ranking at the end.
"""

from __future__ import annotations

from benchmarks.setup_share import grid_parser, run_grid


def main(argv: list[str] | None = None) -> None:
    parser = grid_parser(__doc__.splitlines()[0], seeds="0")
    parser.add_argument("--clips", default="1,5")
    parser.add_argument("--lrs", default="0.02,0.05")
    args = parser.parse_args(argv)
    settings = {f"clip {clip:g}, lr {lr:g}": {"strategy.name": "distributed_dp", "privacy.clip_norm": clip,
                                              "train.lr": lr}
                for clip in (float(c) for c in args.clips.split(",")) for lr in (float(r) for r in args.lrs.split(","))}
    run_grid(settings, data=args.data, seeds=args.seeds, epsilons=args.epsilons, out=args.out)


if __name__ == "__main__":
    main()
