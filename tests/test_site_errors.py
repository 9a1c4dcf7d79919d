"""A deployed site's error replies (flwr_app.site_errors): the server that picks bad column roles learns the site's
name, a class of failure and the key, never a count, a row, a value, a column name or a path of the site's file; the
detail is in the site's own log. A site with a privacy policy reads its file only with the column roles of its own
node config. Through the real ServerApp and ClientApp in process, and the ClientApp (with its mods) called directly."""

import re

import numpy as np
import pandas as pd
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.config import parse_config_args
from flwr.supercore.task_identity import TaskIdentity

from flwr_app import client_app, deployment, site_errors, task
from flwr_app.config import parse_run_config
from flwr_app.site_errors import SiteError, check_column_roles, public_text
from models.data.datasets import load_flchain
from models.data.validate import MISSING_COLUMN, NOT_TIME, DataValidationError
from simulations.engine import resolve, run_inprocess
from strategies.replies import error_message

SITES = ("site-a", "site-b", "site-c")  # no digit in a site's name: a reply may then hold no digit at all
RUN = {"data.name": "site_files", "data.time_col": "futime", "data.event_col": "death", "strategy.name": "fedavg",
       "federation.num_sites": 3, "federation.min_sites": 2, "federation.rounds": 1, "evaluation.server_side": False,
       "baseline.centralized": False}

#: Server-chosen column roles that FLCHAIN's columns fail, and the public phrase of each.
BAD_ROLES = {
    "time: a column with missing values": ({"data.time_col": "creatinine"},
                                           "the column given as data.time_col is not a valid time column"),
    "time: a text column": ({"data.time_col": "sex"}, "the column given as data.time_col is not a valid time column"),
    "time: a negative-valued column": ({"data.time_col": "offset"},
                                       "the column given as data.time_col is not a valid time column"),
    "time: an absent column": ({"data.time_col": "followup"}, "the column given as data.time_col is not in the site's "
                                                              "file"),
    "event: a multi-valued column": ({"data.event_col": "flc.grp"},
                                     "the column given as data.event_col is not a valid event column"),
    "event: a text column": ({"data.event_col": "mgus"}, "the column given as data.event_col is not a valid event "
                                                         "column"),
    "event: the time column": ({"data.time_col": "death", "data.event_col": "futime"},
                               "the column given as data.event_col is not a valid event column"),
    "categorical: a column of many levels": ({"data.categorical_cols": "kappa"},
                                             "a feature column looks like a record identifier"),
    "categorical: an outcome column": ({"data.categorical_cols": "futime"},
                                       "the column given as data.categorical_cols is not a feature column"),
    "split: a text column": ({"data.split_col": "sex"},
                             "the column given as data.split_col is not a valid train/test split column"),
    "id: an absent column": ({"data.id_col": "patient"}, "the column given as data.id_col is not in the site's file"),
    "features: an absent column": ({"data.feature_cols": "age,kappa,albumin"},
                                   "the column given as data.feature_cols is not in the site's file"),
    "drop: an outcome column": ({"data.drop_cols": "death"},
                                "the column given as data.drop_cols also has another role"),
}


def _frame():
    """FLCHAIN with its outcome, and ``offset`` (age - 70: a measurement with negative values)."""
    table = load_flchain()
    frame = table.features.assign(futime=table.time, death=table.event)
    return frame.assign(offset=frame["age"] - 70)


def _sites(tmp_path, rows=400):
    """Three site files of ``rows`` FLCHAIN records each, and their node configs (each site its own directory)."""
    frame = _frame()
    configs = []
    for name, part in zip(SITES, np.array_split(np.random.default_rng(0).permutation(len(frame))[:3 * rows], 3),
                          strict=True):
        path = tmp_path / f"{name}.csv"
        frame.iloc[part].reset_index(drop=True).to_csv(path, index=False)
        configs.append({"data-path": str(path), "site-name": name, "site-dir": str(tmp_path / f"{name}-dir")})
    return configs


def _assert_tells_nothing_of_the_file(reply: str, config: dict) -> None:
    """``reply`` (a whole error reason) holds no digit but the site's name's, no column name, category level or path
    of the site's file."""
    text = reply.replace(f"'{config['site-name']}'", "")
    assert not re.search(r"\d", text), reply
    frame = _frame()
    words = {*map(str, frame.columns)} | {str(level) for column in ("sex", "mgus", "flc.grp")
                                           for level in frame[column].dropna().unique()}
    named = [word for word in words if re.search(rf"(?<![\w.]){re.escape(word)}(?![\w.])", text)]
    assert not named, (named, reply)
    assert config["data-path"] not in reply and config["site-dir"] not in reply and ".csv" not in reply


def _detail(overrides: dict, config: dict) -> str:
    """What the site's check of its file says in full (what its log must hold)."""
    fused, _ = resolve({**RUN, **overrides})
    with pytest.raises(DataValidationError) as raised:
        task.load_site_table(parse_run_config(fused), config["data-path"])
    return str(raised.value)


@pytest.mark.parametrize("case", list(BAD_ROLES))
def test_bad_column_roles_reach_the_server_as_a_class_and_a_key_and_the_detail_stays_in_the_sites_log(case, tmp_path):
    overrides, phrase = BAD_ROLES[case]
    configs = _sites(tmp_path)
    replies = []
    observe = lambda message, reply: replies.append((message.metadata.dst_node_id, reply))  # noqa: E731
    with pytest.raises(RuntimeError, match="only 0 of 3 sites can take part") as raised:
        run_inprocess({**RUN, **overrides, "output.dir": str(tmp_path / "out")}, node_configs=configs, observe=observe)
    assert len(replies) == 3 and all(reply.has_error() for _, reply in replies)
    for node, reply in replies:
        config = configs[node - 1]
        said = error_message(reply.error.reason)
        assert said.startswith(f"site '{config['site-name']}': {phrase}"), said
        assert said.endswith("(the site's log has the detail)")
        _assert_tells_nothing_of_the_file(reply.error.reason, config)
        assert f"node {node}: {said}" in str(raised.value)  # the server files it under the site's name
        detail = _detail(overrides, config)
        log = (tmp_path / f"{config['site-name']}-dir" / site_errors.LOG_FILE).read_text()
        assert detail in log and "Traceback" in log and said in log
    if case == "time: a column with missing values":  # what the server no longer learns: the count and the rows
        count = int(pd.read_csv(configs[0]["data-path"])["creatinine"].isna().sum())
        assert count > 9 and f"{count} missing (NaN) values (rows " in _detail(overrides, configs[0])


def _policy_node(tmp_path, config: dict, **roles) -> dict:
    return {**config, "privacy-ledger": str(tmp_path / f"{config['site-name']}-ledger.jsonl"),
            "privacy-max-epsilon": 10.0, **roles}


def _ask(node_config: dict, overrides: dict, message_type: str = deployment.RANGES, node: int = 3) -> str:
    """The error text of ``message_type`` at a deployed site through the ClientApp and its mods ("" if it answered)."""
    fused, _ = resolve({**RUN, "strategy.name": "dp_sgd", "privacy.epsilon": 5.0, **overrides})
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, node
    context = Context(run_id=7, node_id=node, node_config=node_config, state=RecordDict(), run_config=fused)
    message = Message(content=deployment._payload({"dictionary": None}), dst_node_id=node, message_type=message_type)
    try:
        client_app.app(message, context)
    except site_errors.SiteFailure as err:
        return str(err)
    return ""


def test_at_a_policy_site_any_server_chosen_roles_give_byte_identical_replies(tmp_path):
    config = _sites(tmp_path)[1]
    node = _policy_node(tmp_path, config, **{"data-time-col": "futime", "data-event-col": "death"})
    times = [_ask(node, {"data.time_col": column}) for column in ("creatinine", "sex", "followup")]
    events = [_ask(node, {"data.event_col": column}) for column in ("flc.grp", "mgus")]
    others = [_ask(node, keys) for keys in ({"data.categorical_cols": "kappa"}, {"data.id_col": "age"},
                                            {"data.time_col": "age", "data.event_col": "sex"},
                                            {"data.event_values": "0"})]  # censored records read as deaths
    assert len(set(times + events + others)) == 1, (times, events, others)
    assert times[0] == ("site 'site-b': the run config's column roles (data.*) differ from this site's node config "
                        "(data-*); the site reads its file only with its own column roles (the site's log has the "
                        "detail)")
    # the same choices at a site without a policy (nor roles of its own) fail on the file, each with its class
    assert len({_ask(config, {"data.time_col": column}) for column in ("creatinine", "followup")}) == 2
    assert not (tmp_path / "site-b-ledger.jsonl").exists()  # refused before anything was charged or read
    assert _ask(node, {}) == ""  # its own roles: it answers


def test_a_policy_site_refuses_before_reading_its_file_and_needs_its_roles_in_its_node_config(tmp_path):
    config = _sites(tmp_path)[0]
    absent = {**config, "data-path": str(tmp_path / "not-there.csv")}
    refused = _ask(_policy_node(tmp_path, absent, **{"data-time-col": "futime", "data-event-col": "death"}),
                   {"data.time_col": "age"})
    assert "the run config's column roles (data.*) differ" in refused  # not "cannot be read": never opened
    undeclared = _ask(_policy_node(tmp_path, config), {})
    assert "\n" not in undeclared and "its node config lacks data-time-col and data-event-col" in undeclared
    time_only = _policy_node(tmp_path, config, **{"data-time-col": "futime"})
    assert "its node config lacks data-event-col (" in _ask(time_only, {})


def test_node_config_roles_as_flower_parses_them_match_the_run_config():
    node_config = {"site-name": "site-a", "data-path": "/x.csv", "privacy-ledger": "/x.jsonl",
                   "privacy-max-epsilon": 1.0,
                   **parse_config_args(["data-time-col='futime' data-event-col='death' data-id-col='' "
                                        "data-categorical-cols='flc.grp, sex' data-drop-cols='kappa,lambda' "
                                        "data-event-values='1'"])}
    fused, _ = resolve({**RUN, "data.categorical_cols": "sex,flc.grp", "data.drop_cols": "lambda,kappa",
                        "data.event_values": " 1"})
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=fused)
    check_column_roles(parse_run_config(fused), context)  # the same roles, in another order: admitted
    fused, _ = resolve({**RUN, "data.categorical_cols": "sex", "data.event_values": "1"})
    with pytest.raises(SiteError, match=r"data.categorical_cols = frozenset\(\{'sex'\}\)") as raised:
        check_column_roles(parse_run_config(fused), Context(run_id=1, node_id=1, node_config=node_config,
                                                            state=RecordDict(), run_config=fused))
    assert "column roles (data.*) differ" in public_text(raised.value, "site-a")


def test_the_server_files_a_policy_sites_refusal_under_its_name_and_trains_with_the_others(tmp_path):
    configs = _sites(tmp_path)
    configs[2] = _policy_node(tmp_path, configs[2], **{"data-time-col": "age", "data-event-col": "death"})
    summary = run_inprocess({**RUN, "strategy.name": "dp_sgd", "privacy.epsilon": 5.0,
                             "output.dir": str(tmp_path / "out")}, node_configs=configs)
    assert summary["left_out"] == {"node 3": "site 'site-c': the run config's column roles (data.*) differ from this "
                                             "site's node config (data-*); the site reads its file only with its own "
                                             "column roles (the site's log has the detail)"}
    assert set(summary["sites"]) == {"site-a", "site-b"}
    log = (tmp_path / "site-c-dir" / site_errors.LOG_FILE).read_text()
    assert "data.time_col = 'futime', node config data-time-col = 'age'" in log


def test_protocol_markers_and_refusals_still_reach_the_server(tmp_path):
    config = _sites(tmp_path)[0]
    no_setup = _ask(config, {}, message_type="train.default")
    assert no_setup.startswith(deployment.NO_SETUP) and "site 'site-a'" in no_setup
    refusal = _ask(_policy_node(tmp_path, config, **{"data-time-col": "futime", "data-event-col": "death"}),
                   {}, message_type=deployment.SUMMARY)  # exact statistics: the policy cannot charge them
    assert refusal == ("site 'site-a': the site's privacy policy refused the request; nothing released (the site's log "
                       "has the detail)")
    delta = _ask(config, {"privacy.delta": 0.01})
    assert delta.startswith("site 'site-a': privacy.delta is more than 1/n") and not re.search(r"\d\d", delta)


def test_a_simulated_site_keeps_its_detailed_errors(tmp_path):
    path = tmp_path / "all.csv"
    _frame().iloc[:400].to_csv(path, index=False)
    fused, _ = resolve({"data.name": "csv", "data.path": str(path), "data.time_col": "creatinine",
                        "data.event_col": "death", "federation.num_sites": 2})
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config=fused)
    message = Message(content=RecordDict(), dst_node_id=1, message_type="query.site_name")
    with pytest.raises(DataValidationError, match=r"missing \(NaN\) values \(rows "):
        client_app.app(message, context)


@pytest.mark.parametrize(("public", "said"), [
    ([(NOT_TIME, "data.time_col")], "the column given as data.time_col is not a valid time column"),
    ([(MISSING_COLUMN, "creatinine")], "the site's file is not valid for this run"),  # not a key: never said
    ([("101 rows", "data.time_col")], "the site's file is not valid for this run"),  # not a class: never said
    ([(MISSING_COLUMN, "data.time_col"), (MISSING_COLUMN, "data.event_col")],
     "the columns given as data.time_col and data.event_col are not in the site's file"),
])
def test_the_public_text_comes_from_the_closed_vocabulary_only(public, said):
    err = DataValidationError("/data/site.csv: column 'creatinine': 101 missing (NaN) values (rows 14, 18)",
                              public=public)
    assert public_text(err, "site-a") == f"site 'site-a': {said} (the site's log has the detail)"
    assert public_text(KeyError("creatinine 101"), "site-a") == ("site 'site-a': the site could not handle the "
                                                                 "message (the site's log has the detail)")
