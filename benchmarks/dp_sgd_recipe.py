"""How dp_sgd's clip norm and learning rate were chosen: through the apps on validation splits of five data sets.

``python -m benchmarks.dp_sgd_recipe [--clips 1,2,5] [--lrs 0.01,0.03] [--data flchain,metabric,gbsg,whas,sba]
[--epsilons 1,10] [--seeds 0] [--out rows.jsonl]``

The validation files are those of :mod:`benchmarks.setup_share` (each seed's training records of the default
federation, 80 % ``train`` and 20 % ``test``; the seed's test records are never read): FLCHAIN, METABRIC, GBSG
and WHAS at 5 i.i.d. sites, SBA over its 4 census regions. Each (clip norm, learning rate) runs ``dp_sgd`` at
each ε through the ServerApp and ClientApp (the private set-up, DP-SGD with the PLD-calibrated noise, the
recalibration; the other keys at their defaults) and is scored by Harrell's C, the IBS and the gap between mean
predicted and Kaplan-Meier survival at the median follow-up on the pooled validation parts. A setting's score
is its mean rank over data sets, ε, seeds and the three figures (the lowest wins). Prints one JSON line per run
and the ranking at the end.

Before it, the recipe came from :mod:`benchmarks.dp_recipe` (METABRIC, GBSG and WHAS only, outside the apps,
with the exact set-up), which chose clip 5 and lr 0.01.
"""

from __future__ import annotations

import sys

from benchmarks.setup_share import grid_parser, run_grid
from flwr_app import interrupt


def main(argv: list[str] | None = None) -> None:
    parser = grid_parser(__doc__.splitlines()[0], seeds="0")
    parser.set_defaults(data="flchain,metabric,gbsg,whas,sba")
    parser.add_argument("--clips", default="1,2,5")
    parser.add_argument("--lrs", default="0.01,0.03")
    args = parser.parse_args(argv)
    settings = {f"clip {clip:g}, lr {lr:g}": {"strategy.name": "dp_sgd", "privacy.clip_norm": clip, "train.lr": lr}
                for clip in (float(c) for c in args.clips.split(",")) for lr in (float(r) for r in args.lrs.split(","))}
    run_grid(settings, data=args.data, seeds=args.seeds, epsilons=args.epsilons, out=args.out)


if __name__ == "__main__":
    sys.exit(interrupt.run_stoppable(main))
