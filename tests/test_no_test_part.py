"""``data.test_fraction = 0`` end to end through Flower (the ServerApp and ClientApp over the in-process grid): no
site holds out a test part, the sites train on every record, and the run reports no test figure and says why.

The runs are small (1,600 GBSG records in a CSV file, 2 sites, 2 rounds; a deployment of 2 site files, 1 round);
the records of the file that no run saw score the saved model.
"""

import json

import numpy as np
import pandas as pd
import pytest

import fedsurv
from flwr_app import deployment
from flwr_app.config import ConfigError
from models.data.files import data_file
from simulations.engine import resolve, run_inprocess
from strategies.horizontal import NO_TEST_PART, WEIGHT_KEY

NO_TEST = {"data.name": "csv", "data.time_col": "duration", "data.drop_cols": "split", "data.test_fraction": 0,
           "federation.num_sites": 2, "federation.rounds": 2, "seed": 0}


@pytest.fixture(scope="module")
def gbsg():
    """GBSG's records, shuffled: the first 1,600 to train on, the others to score."""
    return pd.read_csv(data_file("gbsg")).sample(frac=1.0, random_state=0).reset_index(drop=True)


def _observed(sent):
    """An ``observe`` that keeps each message's type and, for a training reply, its site's record count."""
    def observe(message, reply):
        kind = message.metadata.message_type
        count = (reply.content.metric_records["metrics"][WEIGHT_KEY]
                 if kind == "train" and not reply.has_error() else None)
        sent.append((kind, count))
    return observe


def test_a_run_without_a_test_part_trains_on_every_record_and_reports_no_test_figure(gbsg, tmp_path):
    path = tmp_path / "train.csv"
    gbsg.iloc[:1600].to_csv(path, index=False)
    sent = []
    summary = run_inprocess({**NO_TEST, "data.path": str(path), "output.dir": str(tmp_path / "run"),
                             "evaluation.server_side": True, "baseline.centralized": True},
                            observe=_observed(sent))
    counts = [count for kind, count in sent if kind == "train"]
    print("training record counts per site and round:", counts)
    assert len(counts) == 4 and sum(counts[:2]) == sum(counts[2:]) == 1600  # every record, each round
    assert "evaluate" not in {kind for kind, _ in sent}  # no site has test metrics to send
    assert summary["test"] == {} and summary["test_source"] == NO_TEST_PART
    assert summary["sites"] == {} and summary["sites_mean"] == {} and summary["centralized"]["test"] == {}
    assert not {"calibration", "km_null", "diverged"} & set(summary)
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "summary.json").read_text())["test"] == {}
    assert (run_dir / "model.pt").stat().st_size > 0 and not (run_dir / "survival_vs_km.png").exists()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["global_test"] for line in lines] == [{}, {}]
    log = (run_dir / "run.log").read_text()
    assert log.count("data.test_fraction = 0") == 1 and "final test" not in log and "nan" not in log.lower()
    scores = fedsurv.load_run(run_dir).score(gbsg.iloc[1600:])  # records that no site held
    print("score on the other records:", {key: round(value, 4) for key, value in scores.items()})
    assert 0.6 < scores["c_index"] < 0.8 and scores["ibs"] < scores["ibs_km_null"]


def test_a_deployed_site_accepts_no_test_part_within_its_max_test_share(gbsg, tmp_path):
    configs = []
    for index, rows in enumerate(np.array_split(np.arange(1200), 2)):
        site = tmp_path / f"site-{index}.csv"
        gbsg.drop(columns="split").iloc[rows].to_csv(site, index=False)
        configs.append({"data-path": str(site), "site-name": f"site-{index}", "max-test-share": 0.1})
    sent = []
    summary = run_inprocess({"data.name": "site_files", "data.time_col": "duration", "data.test_fraction": 0,
                             "federation.num_sites": 2, "federation.rounds": 1, "evaluation.server_side": False,
                             "baseline.centralized": False, "output.dir": str(tmp_path / "run")},
                            node_configs=configs, observe=_observed(sent))
    assert sorted(count for kind, count in sent if kind == "train") == [600, 600]
    assert summary["test"] == {} and summary["test_source"] == NO_TEST_PART and "left_out" not in summary
    assert deployment.max_test_share(configs[0]) == 0.1


def test_zero_is_accepted_where_a_test_part_is_optional_and_refused_in_one_line_where_it_is_not(tmp_path):
    assert resolve({"data.name": "gbsg", "data.test_fraction": 0})[1].data.test_fraction == 0
    for value in (-0.1, 1):
        with pytest.raises(ConfigError, match=r"^run config: 'data.test_fraction' must be in \[0, 1\), got "):
            resolve({"data.name": "gbsg", "data.test_fraction": value})
    with pytest.raises(ConfigError, match=r"^run config: data.test_fraction = 0 needs a horizontal strategy; 'split' "
                                          r"[^\n]*set data.test_fraction in \(0, 1\)$"):
        run_inprocess({"data.name": "metabric", "strategy.name": "split", "data.test_fraction": 0,
                       "output.dir": str(tmp_path / "split")})
