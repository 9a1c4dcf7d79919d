"""A deployed site owns its train/test split: each record's side is a keyed hash of its identity under the site's
own key (the run seed moves nothing, a new record moves no other, a larger fraction only adds), the site caps
the share it holds out, and a site with a privacy policy keeps its test metrics at the site."""

import json

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from flwr_app import deployment, site_store
from models.data.datasets import ColumnRoles, load_flchain, load_table
from models.data.federated import keyed_shares, raw_rows, record_identities, split_site_table
from models.data.validate import DataValidationError
from simulations.engine import resolve, run_inprocess
from strategies.replies import check_evaluation

RUN = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": "dp_sgd",
       "privacy.epsilon": 0.5, "federation.num_sites": 3, "federation.min_sites": 2, "federation.rounds": 1,
       "evaluation.server_side": False, "baseline.centralized": False}


def _frame(rows=600, seed=0):
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    return frame.iloc[np.random.default_rng(seed).permutation(len(frame))[:rows]].reset_index(drop=True)


def _held_out(tmp_path, frame, *, site_dir, name="site.csv", seed=0, fraction=0.2, **run):
    """The test part (positions) of ``frame`` written as a site's file, split by the deployed site's own code."""
    path = tmp_path / name
    frame.to_csv(path, index=False)
    fused, cfg = resolve({**RUN, "seed": seed, "data.test_fraction": fraction, **run})
    node = {"data-path": str(path), "site-name": "site-a", "site-dir": str(site_dir), "max-test-share": 0.5}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=fused)
    table, train, test = deployment._site_table(cfg, context, notes=False)
    assert len(table) == len(frame) and sorted([*train, *test]) == list(range(len(frame)))
    return set(test.tolist())


def test_the_run_seed_moves_no_record_and_another_site_key_splits_otherwise(tmp_path):
    frame = _frame()
    held = [_held_out(tmp_path, frame, site_dir=tmp_path / "site", seed=seed) for seed in range(5)]
    assert all(part == held[0] for part in held)  # the seeded split held out 67 % of this file over 5 seeds
    assert 0.14 < len(held[0]) / len(frame) < 0.26
    other = _held_out(tmp_path, frame, site_dir=tmp_path / "another-site")
    assert other != held[0] and len(other & held[0]) < 0.5 * len(held[0])  # independent keys: ~20 % overlap


def test_adding_one_record_moves_no_other_record(tmp_path):
    frame = _frame(601)
    before = _held_out(tmp_path, frame.drop(index=300), site_dir=tmp_path / "site", name="before.csv")
    after = _held_out(tmp_path, frame, site_dir=tmp_path / "site", name="after.csv")
    # position p of the file without record 300 is position p (p < 300) or p + 1 of the file with it
    assert {p if p < 300 else p + 1 for p in before} == after - {300}


def test_a_larger_fraction_only_adds_records_to_the_test_part(tmp_path):
    frame = _frame()
    parts = [_held_out(tmp_path, frame, site_dir=tmp_path / "site", fraction=fraction)
             for fraction in (0.05, 0.1, 0.15, 0.2)]
    assert all(smaller <= larger for smaller, larger in zip(parts, parts[1:]))
    assert set().union(*parts) == parts[-1]  # held out over any fractions: no more than at the largest
    assert len(parts[0]) < len(parts[-1])


def test_the_id_column_is_the_identity_and_identical_rows_fall_on_the_same_side(tmp_path):
    frame = _frame().assign(patient=[f"p{i:04d}" for i in range(600)])
    held = _held_out(tmp_path, frame, site_dir=tmp_path / "site", **{"data.id_col": "patient"})
    changed = frame.assign(age=frame["age"] + 1)  # every row's content changes; no record's ID does
    assert _held_out(tmp_path, changed, site_dir=tmp_path / "site", name="changed.csv",
                     **{"data.id_col": "patient"}) == held
    by_content = _held_out(tmp_path, changed, site_dir=tmp_path / "site", name="content.csv",
                           **{"data.drop_cols": "patient"})
    assert by_content != held
    copies = frame.drop(columns="patient").iloc[[7] * 40 + list(range(100, 400))].reset_index(drop=True)
    split = _held_out(tmp_path, copies, site_dir=tmp_path / "site", name="copies.csv")
    assert len({position in split for position in range(40)}) == 1  # 40 copies of one row: one side


def test_the_training_part_must_have_an_event(tmp_path):
    frame = _frame().assign(death=0, patient=[f"p{i:04d}" for i in range(600)])
    key = site_store.derived_key(tmp_path, "split")
    identities = record_identities(frame, id_col="patient")
    shares = keyed_shares(identities, key)
    chosen = int(np.flatnonzero((shares >= 0.1) & (shares < 0.2))[0])
    frame.loc[chosen, "death"] = 1  # the file's one event: held out at 0.2, trained on at 0.1
    path = tmp_path / "site.csv"
    frame.to_csv(path, index=False)
    table = load_table("csv", path=str(path), time_col="futime", event_col="death", roles=ColumnRoles(id_col="patient"))
    assert record_identities(raw_rows(path), id_col="patient") == identities
    with pytest.raises(DataValidationError, match="no events in the training part of site 'site-a'"):
        split_site_table(table, identities, name="site-a", key=key, test_fraction=0.2)
    train, _ = split_site_table(table, identities, name="site-a", key=key, test_fraction=0.1)
    assert chosen in train


def _context(node, **run):
    fused, _ = resolve({**RUN, **run})
    return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=fused)


def test_a_test_fraction_above_the_sites_max_test_share_is_refused_before_the_file_is_read(tmp_path):
    node = {"data-path": str(tmp_path / "no-such-file.csv"), "site-name": "site-a", "site-dir": str(tmp_path)}
    for cap, fraction in ((None, 0.3), (0.1, 0.15)):
        context = _context({**node, **({} if cap is None else {"max-test-share": cap})},
                           **{"data.test_fraction": fraction})
        cfg = deployment.parse_run_config(context.run_config)
        with pytest.raises(ValueError) as refused:
            deployment._site_table(cfg, context)
        text = str(refused.value)
        assert "\n" not in text and "data.test_fraction" in text and "max-test-share" in text
        assert f"run with data.test_fraction <= {cap or 0.2:g}" in text
    context = _context({**node, "max-test-share": 0.3}, **{"data.test_fraction": 0.3})
    with pytest.raises(DataValidationError, match="file not found"):  # within the cap: the site reads its file
        deployment._site_table(deployment.parse_run_config(context.run_config), context)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, "a fifth", True, float("nan")])
def test_a_bad_max_test_share_is_refused_in_one_line_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^node config max-test-share = .* must be a number in \(0, 1\)[^\n]*$"):
        deployment.max_test_share({"max-test-share": value})


def _federation(tmp_path):
    frame = _frame(3000)
    configs = []
    for index, rows in enumerate(np.array_split(np.arange(3000), 3)):
        path = tmp_path / f"site-{index + 1}.csv"
        frame.iloc[rows].to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": f"site-{index + 1}",
                        "site-dir": str(tmp_path / f"site-{index + 1}")})
    configs[0].update({"privacy-ledger": str(tmp_path / "site-1" / "ledger.jsonl"), "privacy-max-epsilon": 1.0,
                       "data-time-col": "futime", "data-event-col": "death"})
    return configs


def test_a_policy_site_keeps_its_test_metrics_and_the_run_finishes_without_them(tmp_path, capsys):
    replies = {}

    def observe(message, reply):
        if message.metadata.message_type == "evaluate" and not reply.has_error():
            replies[str(reply.content["site"]["name"])] = reply

    summary = run_inprocess({**RUN, "privacy.epsilon": 0.5, "output.dir": str(tmp_path / "out")},
                            node_configs=_federation(tmp_path), observe=observe)
    kept = replies["site-1"]
    assert len(kept.content["metrics"]) == 0 and kept.content["site"]["kept_local"] is True
    assert all(len(replies[site].content["metrics"]) > 0 for site in ("site-2", "site-3"))
    assert summary["sites_kept_local"] == ["site-1"] and set(summary["sites"]) == {"site-2", "site-3"}
    assert "left_out" not in summary
    (line,) = [json.loads(text) for text in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert line["failures"] == [] and line["sites_kept_local"] == ["site-1"]
    assert set(line["sites"]) == {"site-2", "site-3"}
    (own,) = [json.loads(text) for text in (tmp_path / "site-1" / "evaluation.jsonl").read_text().splitlines()]
    assert (own["round"], own["site"]) == (1, "site-1") and 0.0 <= own["metrics"]["c_index"] <= 1.0
    assert own["test_records"] < 0.3 * 1000
    out = capsys.readouterr().out
    assert "site 'site-1' round 1: test metrics kept at the site" in out
    assert "[test metrics kept at the site: site-1]" in out


def test_the_server_leaves_out_a_site_that_refuses_the_runs_test_fraction_and_trains_with_the_others(tmp_path):
    configs = _federation(tmp_path)
    configs[2]["max-test-share"] = 0.1
    summary = run_inprocess({**RUN, "data.test_fraction": 0.15, "output.dir": str(tmp_path / "out")},
                            node_configs=configs)
    (reason,) = summary["left_out"].values()
    assert reason.startswith("site 'site-3'") and "\n" not in reason
    assert set(summary["sites"]) == {"site-2"} and summary["sites_kept_local"] == ["site-1"]


def test_a_reply_marked_kept_local_must_carry_no_metric():
    assert check_evaluation({}, kept_local=True) == ""
    assert "kept its test metrics local but carries 1 metric(s): c_index" in check_evaluation(
        {"c_index": 0.7}, kept_local=True)
    assert check_evaluation({"c_index": 0.7}) == ""
