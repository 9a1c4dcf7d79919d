"""A site's per-message path stays light: in a deployment every message may start a new ``flwr-clientapp`` process
(Flower's default isolation), which imports the ClientApp and whatever its message needs. Neither the ClientApp
module nor a deployed site's training message imports scipy.stats, dp_accounting or matplotlib unless the message
needs them; pandas comes with the first message of a process, which reads the site's file."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from flwr_app import client_app
from flwr_app.site_errors import CARRIED_SETUP
from models.data.datasets import load_flchain
from simulations.engine import resolve, run_inprocess

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("scipy.stats", "dp_accounting", "matplotlib", "pandas")
#: Prints which of ``HEAVY`` a new process holds after importing the ClientApp and handling the pickled message.
REPLAY = """
import json, pickle, sys
import flwr_app.client_app
heavy = {heavy!r}
at_import = sorted(name for name in heavy if name in sys.modules)
message, context = pickle.loads(open(sys.argv[1], "rb").read())
reply = flwr_app.client_app.app(message, context)
print(json.dumps([at_import, sorted(name for name in heavy if name in sys.modules),
                  reply.error.reason if reply.has_error() else None]))
"""


def _imported(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_the_client_app_imports_no_heavy_module():
    code = f"import flwr_app.client_app; import sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    assert _imported("-c", code) == "[]"


def _site_files(tmp_path: Path) -> list[dict[str, str]]:
    """Three deployed sites of 300 FLCHAIN records each, every one with its own file and directory."""
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    parts = np.array_split(np.random.default_rng(0).permutation(len(frame))[:900], 3)
    configs = []
    for index, part in enumerate(parts):
        path = tmp_path / f"site-{index}.csv"
        frame.iloc[part].reset_index(drop=True).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{'abc'[index]}",
                        "site-dir": str(tmp_path / f"site-{index}")})
    return configs


#: The set-up's messages to a site before round 1: exact sums (fedavg), or the private set-up's two passes (dp_sgd).
SETUP_QUERIES = {"fedavg": ["query.site_summary", "query.site_time_histogram"],
                 "dp_sgd": ["query.setup_ranges", "query.setup_moments"]}


@pytest.mark.parametrize(("strategy", "needed"), [
    ("fedavg", []),
    # its first round: the site calibrates σ and reports its ε with the run's accountant (PLD: dp_accounting, which
    # imports scipy.stats)
    ("dp_sgd", ["dp_accounting", "scipy.stats"]),
])
def test_a_deployed_sites_train_message_in_a_new_process_imports_only_what_it_needs(strategy, needed, tmp_path):
    configs = _site_files(tmp_path)
    overrides = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death",
                 "strategy.name": strategy, "privacy.epsilon": 1.0 if strategy == "dp_sgd" else float("inf"),
                 "federation.num_sites": 3, "federation.rounds": 1, "train.local_epochs": 1,
                 "evaluation.server_side": False, "baseline.centralized": False, "output.dir": str(tmp_path / "run")}
    sent: list[Message] = []
    run_inprocess(overrides, node_configs=configs,
                  observe=lambda message, reply: sent.append(message) if message.metadata.dst_node_id == 1 else None)
    train = next(index for index, message in enumerate(sent) if message.metadata.message_type == "train")
    # The set-up is two sequential messages; what it agreed travels with the site's first message of round 1 only.
    assert [message.metadata.message_type for message in sent[:train]] == SETUP_QUERIES[strategy]
    assert CARRIED_SETUP in sent[train].content and not any(CARRIED_SETUP in m.content for m in sent[train + 1:])
    # Site 1's node state before its training message: its earlier messages (the set-up) handled again, in order.
    context = Context(run_id=sent[train].metadata.run_id, node_id=1, node_config=configs[0], state=RecordDict(),
                      run_config=resolve(overrides)[0])
    for message in sent[:train]:
        reply = client_app.app(message, context)
        assert not reply.has_error(), reply.error.reason
    path = tmp_path / "train.pkl"
    path.write_bytes(pickle.dumps((sent[train], context)))
    at_import, after, error = json.loads(_imported("-c", REPLAY.format(heavy=HEAVY), str(path)))
    assert error is None
    assert at_import == [] and after == sorted(["pandas", *needed])  # pandas: the site reads its file
