"""distributed_dp at three partner sites that each hold a privacy policy, over a loopback deployment.

Three SuperNodes (TLS, SuperNode authentication, 127.0.0.1) each read a third of FLCHAIN and set a policy
(``privacy-max-epsilon``, ``privacy-min-honest-sites``, their column roles); one ``distributed_dp`` run; prints,
as JSON, what each site's own ledger charged for every release (the honest sites h its policy counts on, the
shares it counted, D, t and the parties the server reported, the RDP cost and the filter's ε after it), each
ledger verified against its head::

    python -m benchmarks.policy_sites --rounds 2 --epsilon 1 --max-epsilon 10 --honest-sites 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.loopback import SITES, loopback


def _ledger(path: Path) -> list[dict]:
    from flwr_app.site_policy import read_ledger

    keys = ("message", "kind", "honest_sites", "counted_shares", "max_dropouts", "colluding_sites",
            "parties_reported", "rdp", "epsilon")
    return [{key: line.get(key) for key in keys} for line in read_ledger(path) if line.get("kind") != "header"]


def main(argv: list[str] | None = None) -> int:
    from flwr_app import site_store
    from models.data.datasets import _sksurv_flchain

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--max-epsilon", type=float, default=10.0)
    parser.add_argument("--honest-sites", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder, loopback(Path(folder)) as deployment:
        flchain = _sksurv_flchain().drop(columns=["chapter"]).dropna()
        for index, site in enumerate(SITES):
            path = deployment.root / f"{site}.csv"
            flchain.iloc[index::len(SITES)].to_csv(path, index=False)
            deployment.start_supernode(site, (
                f"data-path='{path}' site-name='{site}' site-dir='{deployment.root / site}' "
                f"privacy-ledger='{deployment.root / site / 'ledger.jsonl'}' privacy-max-epsilon={args.max_epsilon} "
                f"privacy-min-honest-sites={args.honest_sites} data-time-col='futime' data-event-col='death'"))
        started = time.monotonic()
        out = deployment.root / "run"
        deployment.flwr_run(
            f"data.name='site_files' data.time_col='futime' data.event_col='death' strategy.name='distributed_dp' "
            f"privacy.epsilon={args.epsilon} federation.num_sites=3 federation.min_sites=3 "
            f"federation.rounds={args.rounds} evaluation.server_side=false baseline.centralized=false "
            f"output.dir='{out}'")
        summary = json.loads((out / "summary.json").read_text())
        report = {"run_s": round(time.monotonic() - started, 1), "headline": summary["privacy"],
                  "sites_kept_local": summary.get("sites_kept_local"), "left_out": summary.get("left_out", {}),
                  "ledgers": {}}
        for site in SITES:
            ledger = deployment.root / site / "ledger.jsonl"
            head = site_store.ledger_head({"site-dir": str(deployment.root / site)}, ledger)
            state = site_store.read_verified(ledger, head)  # LedgerTampered if the chain or the head disagree
            report["ledgers"][site] = {"lines": state.head.lines, "chain_verified": True, "releases": _ledger(ledger)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
