"""A Ray cluster the user already has (issue 28, item 3): ``RAY_ADDRESS`` connects a simulation to it.

The slow test starts a cluster of two Ray nodes on this machine (a head and a worker, one CPU each,
``ray start --block`` in process groups of their own), runs a 20-site simulation on it with
``RAY_ADDRESS`` set, checks from the cluster's actor table that the sites' actors ran on both nodes,
and compares the run with the same configuration on a one-node Ray instance. The nodes are stopped
by signalling their process groups, not by ``ray stop``, which would stop every Ray process of the
user on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from simulations import engine

#: 20 sites, one round, no centralised baseline: the shortest run whose sites' messages spread over two nodes.
RUN = {"federation.num_sites": 20, "federation.rounds": 1, "baseline.centralized": False,
       "simulation.engine": "ray", "seed": 3}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray_start(*args: str, temp_dir: Path, log: Path) -> subprocess.Popen:
    """``ray start --block`` with ``args`` in a process group of its own (so that it can be stopped alone)."""
    command = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--num-cpus=1",
               "--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={temp_dir}",
               f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}",
               f"--runtime-env-agent-port={_free_port()}", *args]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(node: subprocess.Popen) -> None:
    """Stop a node started by :func:`_ray_start`: SIGTERM to its group (``--block`` then stops its processes)."""
    if node.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def _processes_of(root: Path) -> list:
    """Live processes whose command line names a path under ``root`` (the cluster's temporary directory)."""
    import ray  # noqa: F401  (Ray bundles psutil)
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if process.info["status"] != psutil.STATUS_ZOMBIE and \
                    any(str(root) in arg for arg in process.info["cmdline"] or []):
                found.append(process)
    return found


@contextlib.contextmanager
def two_node_cluster() -> Iterator[str]:
    """A head and a worker node on this machine, one CPU each; yields the head's address. Always stopped."""
    import psutil

    root = Path(tempfile.mkdtemp(prefix="fsray-"))  # short: Ray's socket paths live under it
    port = _free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(_ray_start("--head", f"--port={port}", "--include-dashboard=false",
                                f"--ray-client-server-port={_free_port()}", temp_dir=root / "head",
                                log=root / "head.log"))
        deadline = time.monotonic() + 120
        while True:
            assert nodes[0].poll() is None, (root / "head.log").read_text(errors="replace")[-2000:]
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            assert time.monotonic() < deadline, "the head did not start"
            time.sleep(0.2)
        nodes.append(_ray_start(f"--address={address}", temp_dir=root / "worker", log=root / "worker.log"))
        import ray

        ray.init(address=address, log_to_driver=False)
        try:
            while len([node for node in ray.nodes() if node["Alive"]]) < 2:
                assert nodes[1].poll() is None, (root / "worker.log").read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, "the worker did not join"
                time.sleep(0.2)
        finally:
            ray.shutdown()
        yield address
    finally:
        for node in reversed(nodes):
            _stop(node)
        left = _processes_of(root)
        for process in left:  # none expected; never leave one behind
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, [" ".join(p.info["cmdline"])[:120] for p in left]


def _client_actor_nodes(address: str) -> tuple[set[str], set[str]]:
    """The nodes of the cluster, and those on which the sites' actors (Flower's ``ClientAppActor``) ran.

    The actor table of the cluster's GCS keeps the actors of finished jobs with the node each ran on.
    """
    import ray
    from ray._private.state import state

    ray.init(address=address, log_to_driver=False)
    try:
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        actors = [actor for actor in state.actor_table(None).values()
                  if "ClientAppActor" in actor.get("ActorClassName", "")]
        return nodes, {actor["Address"]["NodeID"] for actor in actors}
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_simulation_on_a_two_node_cluster_runs_sites_on_both_and_equals_the_one_node_run(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    one_node = engine.run_simulation({**RUN, "output.dir": str(tmp_path / "one")})  # Ray started for the run
    with two_node_cluster() as address:
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert engine.choose_engine("auto", 5) == engine.RAY  # a running cluster: auto uses it
        two_nodes = engine.run_simulation({**RUN, "output.dir": str(tmp_path / "two")})
        monkeypatch.delenv("RAY_ADDRESS")
        nodes, used = _client_actor_nodes(address)
    assert len(nodes) == 2 and used == nodes, (nodes, used)
    # Each site's round is seeded, the server aggregates the replies in site order: which node ran a site changes
    # nothing, to the bit.
    for part in ("test", "sites", "sites_mean", "calibration", "privacy"):
        assert two_nodes[part] == one_node[part], part
    print(f"two-node test: {time.monotonic() - started:.1f} s", file=sys.stderr)
