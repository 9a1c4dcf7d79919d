"""How the DP recipes' ``model.risk_layer`` was chosen: interval vs proportional through the apps on validation splits.

``python -m benchmarks.risk_layer [--strategies dp_sgd,distributed_dp] [--data flchain,metabric,gbsg,whas,sba]
[--epsilons 1,10] [--seeds 0,1] [--out rows.jsonl]``

The validation files are those of :mod:`benchmarks.setup_share` (each seed's training records of the default
federation, 80 % ``train`` and 20 % ``test``; the seed's test records are never read): FLCHAIN, METABRIC, GBSG and
WHAS at 5 i.i.d. sites, SBA over its 4 census regions. Each strategy runs with each risk layer of the hazard model
(:class:`models.survival.HazardMLP`) at each ε through the ServerApp and ClientApp, the other keys at the strategy's
recipe, and is scored by Harrell's C, the IBS and the calibration gap at the median follow-up on the pooled
validation parts. Per strategy, a layer's score is its mean rank over data sets, ε, seeds and the three figures
(the lowest wins). Prints one JSON line per run (``c_index_td`` beside Harrell's C) and each strategy's ranking.
The saved rows (``docs/results/benchmarks/risk_layer.jsonl``) are three runs: ``--strategies dp_sgd``,
``--strategies distributed_dp`` and ``--strategies bdp``.
"""

from __future__ import annotations

import sys

from benchmarks.setup_share import grid_parser, run_grid
from flwr_app import interrupt
from models.survival import RISK_LAYERS


def main(argv: list[str] | None = None) -> None:
    parser = grid_parser(__doc__.splitlines()[0], seeds="0,1")
    parser.set_defaults(data="flchain,metabric,gbsg,whas,sba")
    parser.add_argument("--strategies", default="dp_sgd,distributed_dp")
    args = parser.parse_args(argv)
    for strategy in args.strategies.split(","):
        settings = {f"{strategy}, {layer}": {"strategy.name": strategy, "model.risk_layer": layer}
                    for layer in RISK_LAYERS}
        run_grid(settings, data=args.data, seeds=args.seeds, epsilons=args.epsilons, out=args.out)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
