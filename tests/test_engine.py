"""The runner's engines: which one runs, the apps Flower's Ray runtime gets, the in-process grid and its workers."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import pytest

from simulations import engine


def _flower_context(partition: int, num_partitions: int, node_id: int = 7):
    """A virtual SuperNode's context as ``flwr.simulation.run_simulation`` makes it: empty run config, node config
    ``partition-id`` and ``num-partitions`` only."""
    from flwr.app import Context, RecordDict

    return Context(run_id=5, node_id=node_id, node_config={"partition-id": partition, "num-partitions": num_partitions},
                   state=RecordDict(), run_config={})


def test_the_ray_apps_give_the_real_apps_the_run_config_and_the_split_sites_their_model_dir(tmp_path, monkeypatch):
    """Flower's public runtime passes no run config: the ServerApp and every site get the fused one, each split site
    its own ``model-dir`` (added to Flower's node config), and a site's state lives on in Flower's context between
    messages; the ClientApp pickles (Ray ships it with every message) and behaves the same after."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from flwr_app import client_app, server_app
    from models.split_run import SITES_DIR

    overrides = {"strategy.name": "split", "data.name": "synthetic_multimodal", "data.synthetic_records": 300,
                 "model.name": "bayesian_multisurv", "baseline.centralized": False, "output.dir": str(tmp_path)}
    fused, cfg, outputs = engine._prepare(overrides, "test")
    configs = engine.site_node_configs(cfg, outputs, 3)
    server, sites = engine.ray_apps(fused, configs)

    seen = []
    probe = ClientApp()

    @probe.query("probe")
    def handle(message, context):
        seen.append((dict(context.run_config), dict(context.node_config)))
        count = context.state.config_records["n"]["n"] + 1 if "n" in context.state else 1
        context.state["n"] = ConfigRecord({"n": count})
        return Message(content=RecordDict({"n": ConfigRecord({"n": count})}), reply_to=message)

    monkeypatch.setattr(client_app, "app", probe)
    for name, value in (("_task_id", 1), ("_run_id", 5), ("_node_id", engine.SUPERLINK_NODE_ID)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)
    context = _flower_context(2, 3)
    for app in (sites, pickle.loads(pickle.dumps(sites))):
        reply = app(Message(content=RecordDict(), dst_node_id=7, message_type="query.probe"), context)
        assert reply.content["n"]["n"] == len(seen)
    assert context.state.config_records["n"]["n"] == 2  # the site's state, in the context Flower keeps
    assert context.run_config == {} and "model-dir" not in context.node_config  # Flower's own context unchanged
    assert seen == [(fused, configs[2])] * 2
    assert configs[2]["model-dir"] == str(tmp_path.resolve() / SITES_DIR / "c")

    ran = []
    monkeypatch.setattr(server_app, "app", lambda grid, context: ran.append((grid, context.run_config, context.run_id)))
    server("grid", _flower_context(0, 1))
    assert ran == [("grid", fused, 5)]


def test_a_horizontal_run_sends_the_ray_sites_no_node_config_of_its_own():
    """Flower's two keys are all a simulated horizontal site needs: nothing is added (nor shipped with a message)."""
    fused, _ = engine.resolve({"federation.num_sites": 4})
    _, sites = engine.ray_apps(fused, [{"partition-id": index, "num-partitions": 4} for index in range(4)])
    assert sites.extra_node_config == {} and sites.run_config == fused


@pytest.mark.slow
def test_a_ray_cluster_serves_the_block_and_leaves_nothing_behind():
    import psutil
    import ray

    with engine.ray_cluster(num_cpus=1) as address:
        assert os.environ["RAY_ADDRESS"] == address
        ray.init(address=address, log_to_driver=False)
        assert ray.cluster_resources()["CPU"] == 1
        ray.shutdown()
        head = next(p for p in psutil.Process().children() if "--block" in p.cmdline())
        session = next(arg.split("=", 1)[1] for arg in head.cmdline() if arg.startswith("--temp-dir="))
        cluster = [head, *head.children(recursive=True)]
    assert "RAY_ADDRESS" not in os.environ
    gone, alive = psutil.wait_procs(cluster, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    assert not Path(session).exists()


class _Nodes:
    """A grid whose connected SuperNodes are fixed."""

    def __init__(self, count):
        self.count = count

    def get_node_ids(self):
        return list(range(1, self.count + 1))


def test_a_simulation_with_fewer_supernodes_than_sites_is_refused_naming_the_option():
    from flwr_app.config import ConfigError
    from flwr_app.server_program import wait_for_sites

    with pytest.raises(ConfigError, match='2 SuperNode.*5 sites.*--federation-config "num-supernodes=5"'):
        wait_for_sites(_Nodes(2), 5, simulated=True, settle_s=0.3, timeout_s=30)
    assert wait_for_sites(_Nodes(5), 5, simulated=True, settle_s=0.3) == 5
    # a deployment waits for late sites instead, then starts with those connected
    assert wait_for_sites(_Nodes(2), 5, simulated=False, settle_s=0.3, timeout_s=1.0) == 2


# ------------------------------------------------------------------ simulation.engine (issue 28, item 2)


def test_auto_runs_small_federations_in_process_and_large_ones_or_any_on_a_running_cluster_on_ray(monkeypatch):
    from strategies.config import INPROCESS_MAX_SITES

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert engine.choose_engine("auto", 5) == engine.INPROCESS
    assert engine.choose_engine("auto", INPROCESS_MAX_SITES) == engine.INPROCESS
    assert engine.choose_engine("auto", INPROCESS_MAX_SITES + 1) == engine.RAY
    assert engine.choose_engine("ray", 5) == engine.RAY
    assert engine.choose_engine("inprocess", 10_000) == engine.INPROCESS
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a sweep's cluster, or the user's
    assert engine.choose_engine("auto", 5) == engine.RAY
    assert engine.choose_engine("inprocess", 5) == engine.INPROCESS


def test_the_summary_records_the_engine_auto_chose(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    summary = engine.run_simulation({"federation.num_sites": 2, "federation.rounds": 1, "baseline.centralized": False,
                                     "output.dir": str(tmp_path)})
    assert summary["engine"] == {"requested": "auto", "ran": "inprocess", "sites": 2, "processes": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["engine"] == summary["engine"]


def test_the_engine_key_is_refused_in_a_deployment_and_a_bad_value_names_the_key():
    from flwr_app.config import ConfigError
    from strategies.config import parse_flat

    deployment = {"data.name": "site_files", "evaluation.server_side": False, "baseline.centralized": False}
    assert parse_flat(deployment).engine == "auto"
    with pytest.raises(ConfigError, match="'simulation.engine' = 'ray'.*deployment.*'auto'"):
        parse_flat({**deployment, "simulation.engine": "ray"})
    with pytest.raises(ConfigError, match="'simulation.engine' = 'spark'; choose one of auto, ray, inprocess"):
        parse_flat({"simulation.engine": "spark"})


def test_run_simulation_dispatches_on_the_key_and_keeps_run_log_and_no_ray(tmp_path, monkeypatch):
    """``simulation.engine = inprocess`` through run_simulation: the in-process engine runs (no Ray start), with the
    run's run.log; observe and node_configs are refused on Ray."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ran = []
    original = engine._run_in_process
    monkeypatch.setattr(engine, "_run_in_process", lambda *args, **kwargs: (ran.append(True), original(*args, **kwargs)))
    monkeypatch.setattr(engine, "_run_on_ray", lambda *args, **kwargs: pytest.fail("Ray was started"))
    summary = engine.run_simulation({"federation.num_sites": 2, "federation.rounds": 1, "baseline.centralized": False,
                                     "simulation.engine": "inprocess", "output.dir": str(tmp_path / "run")})
    assert ran == [True] and summary["rounds"] == 1
    assert (tmp_path / "run" / "run.log").read_text(encoding="utf-8").splitlines()[0].startswith("fedsurv: fedavg")
    with pytest.raises(ValueError, match="observe and node_configs need engine='inprocess'"):
        engine.run_simulation({"federation.num_sites": 2, "output.dir": str(tmp_path / "ray")}, engine="ray",
                              observe=lambda message, reply: None)


def test_the_in_process_grid_delivers_in_one_thread_and_gives_up_on_a_hung_site_only(monkeypatch):
    """The messages run one after another in one thread, batch after batch (a thread per message pays PyTorch's
    per-thread set-up every time); a ClientApp that has not returned within the timeout gets no reply and keeps
    its thread, and the messages after it are delivered in order in a new one, each with its reply; closing the
    grid ends that thread."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    for name, value in (("_task_id", 1), ("_run_id", engine.new_run_id()), ("_node_id", engine.SUPERLINK_NODE_ID)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)  # what a run sets (messages are stamped with them)
    app, release, handled = ClientApp(), threading.Event(), []

    @app.query("probe")
    def probe(message, context):  # noqa: ANN001, ANN202
        handled.append((context.node_id, threading.current_thread()))
        if context.node_id == 2:
            release.wait()  # hangs until the test ends
        return Message(content=RecordDict({"c": ConfigRecord({"node": context.node_id})}), reply_to=message)

    grid = engine.InProcessGrid(app, {}, 4)
    messages = [grid.create_message(RecordDict(), "query.probe", node, "1") for node in (1, 2, 3, 4)]
    try:
        replies = grid.send_and_receive(messages, timeout=2.0)  # node 2 hangs for it; the others take milliseconds
        assert sorted(reply.content["c"]["node"] for reply in replies) == [1, 3, 4]
        again = grid.send_and_receive([grid.create_message(RecordDict(), "query.probe", 1, "2")], timeout=2.0)
        assert [reply.content["c"]["node"] for reply in again] == [1]
        assert [node for node, _ in handled] == [1, 2, 3, 4, 1]
        threads = [thread for _, thread in handled]
        assert threads[0] is threads[1] and threads[2] is threads[3] is threads[4]
        assert threads[1] is not threads[2] and threading.main_thread() not in threads
        grid.close()
        threads[2].join(5)
        assert not threads[2].is_alive() and threads[1].is_alive()  # the hung one runs on
    finally:
        release.set()


# ------------------------------------------------------------------ the in-process engine's worker processes


def test_a_large_federation_runs_in_one_process_per_cpu_and_a_small_one_here_only():
    from simulations.inprocess import PARALLEL_MIN_SITES, site_processes

    assert site_processes(PARALLEL_MIN_SITES - 1, cpus=4) == 1
    assert site_processes(PARALLEL_MIN_SITES, cpus=4) == 4
    assert site_processes(10 * PARALLEL_MIN_SITES, cpus=1) == 1


def test_sites_in_a_worker_process_give_the_same_run_as_one_process(monkeypatch, tmp_path):
    """Half the sites in a worker process: every round's metrics, failures and flags are those of the run in one
    process (site-5, in the worker's share, raises in training: a named failure both times)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    overrides = {"data.name": "sim_cox", "federation.num_sites": 6, "federation.rounds": 2,
                 "baseline.centralized": False, "debug.fail_site": "site-5", "debug.fail_mode": "raise"}
    runs = {}
    for processes in (2, 1):
        monkeypatch.setattr(engine, "site_processes", lambda num_sites, processes=processes: processes)
        summary = engine.run_inprocess({**overrides, "output.dir": str(tmp_path / str(processes))})
        lines = [json.loads(line) for line in (tmp_path / str(processes) / "metrics.jsonl").read_text().splitlines()]
        for line in lines:
            line.pop("elapsed_s")
        runs[processes] = summary, lines
    assert runs[2][0]["engine"]["processes"] == 2 and runs[1][0]["engine"]["processes"] == 1
    assert {(failure["phase"], failure["site"]) for failure in runs[2][1][0]["failures"]} == {("train", "site-5")}
    assert runs[2][1] == runs[1][1]
    assert runs[2][0]["test"] == runs[1][0]["test"]


def test_a_worker_process_that_ends_leaves_its_sites_without_replies_and_the_grid_goes_on(monkeypatch, caplog):
    """Its sites answer until the process is killed; then the others still answer, its own give no reply (named
    failures at the server), and the error says which sites; closing the grid ends the workers."""
    from flwr.app import RecordDict

    from flwr_app import client_app

    for name, value in (("_task_id", 1), ("_run_id", engine.new_run_id()), ("_node_id", engine.SUPERLINK_NODE_ID)):
        monkeypatch.setattr(engine.TaskIdentity, name, value)
    fused, _ = engine.resolve({"data.name": "sim_cox", "federation.num_sites": 4})
    grid = engine.InProcessGrid(client_app.app, fused, 4, processes=2)

    def ask(group: str) -> list[tuple[int, str]]:
        messages = [grid.create_message(RecordDict(), "query.site_name", node, group) for node in grid.get_node_ids()]
        return sorted((reply.metadata.src_node_id, reply.content["site"]["name"])
                      for reply in grid.send_and_receive(messages, timeout=120))

    try:
        assert grid.processes == 2 and sorted(grid.contexts) == [1, 2]
        assert ask("1") == [(1, "site-0"), (2, "site-1"), (3, "site-2"), (4, "site-3")]
        worker = grid._workers[0]
        worker._process.kill()
        worker._process.wait()
        assert ask("2") == [(1, "site-0"), (2, "site-1")]
        assert "the worker process of sites 3-4 gives no more replies" in caplog.text
        assert "(exit code -9)" in caplog.text
        assert ask("3") == [(1, "site-0"), (2, "site-1")]
    finally:
        grid.close()
    assert grid.processes == 1
