"""A grid of runs in worker processes (``simulations.results_file.append_runs``) stops cleanly on Ctrl-C."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

GRID = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from flwr_app import interrupt
    from simulations.results_file import append_runs

    def run(job):
        with open(sys.argv[1] + ".started", "a") as handle:  # which runs started (and in which process)
            handle.write(f"{job} {os.getpid()}\\n")
        time.sleep(float(sys.argv[2]))
        return {"job": job}

    def main():
        append_runs(Path(sys.argv[1]), ["job"], list(range(40)), run, workers=2, describe=str)

    if __name__ == "__main__":  # the spawned workers import this file
        sys.exit(interrupt.run_stoppable(main))
""")


def _start_grid(tmp_path: Path, seconds_per_run: float) -> tuple[subprocess.Popen, Path]:
    """The grid above in its own process group, once its workers run (two rows written, or two runs started)."""
    out, script = tmp_path / "rows.csv", tmp_path / "grid.py"
    script.write_text(GRID)
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen([sys.executable, str(script), str(out), str(seconds_per_run)], cwd=root,
                               env={**os.environ, "PYTHONPATH": str(root)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = tmp_path / "rows.csv.started"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ((out.exists() and len(out.read_text().splitlines()) >= 3)
                                               or (started.exists() and len(started.read_text().splitlines()) >= 2)):
        time.sleep(0.1)
    return process, out


def test_ctrl_c_to_the_process_group_stops_a_grid_after_its_runs_under_way_writing_their_rows(tmp_path: Path) -> None:
    process, out = _start_grid(tmp_path, 0.5)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the parent and its workers
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, stderr
    rows = out.read_text().splitlines()
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        f"stopped: SIGINT: the grid stopped after its runs under way; {out} holds {len(rows) - 1} rows (the same "
        "command runs the rest); what was written up to then is kept")
    assert rows[0] == "job" and rows[1:] == [str(job) for job in range(len(rows) - 1)]  # in order, none torn
    assert 2 <= len(rows) - 1 < 40  # the grid stopped well before its end
    started = (tmp_path / "rows.csv.started").read_text().splitlines()
    assert len(started) == len(rows) - 1, started  # no run started after the stop, and every run started has its row


def test_a_second_ctrl_c_kills_the_runs_under_way_at_once(tmp_path: Path) -> None:
    process, out = _start_grid(tmp_path, 60.0)  # runs far longer than the test waits
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=20)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        "stopped: SIGINT received twice: stopped at once; what was written up to then is kept")
    assert out.read_text().splitlines() == ["job"]  # the runs under way were cut: no row
    workers = {int(line.split()[1]) for line in (tmp_path / "rows.csv.started").read_text().splitlines()}
    time.sleep(0.5)
    for pid in workers:  # no worker left running its 60 s
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        assert Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"worker {pid} still runs"
