"""A grid of runs in worker processes (``simulations.results_file.append_runs``) stops cleanly on Ctrl-C."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

GRID = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flwr_app import interrupt
    from simulations.results_file import append_runs

    def run(job):
        with open(sys.argv[1] + ".started", "a") as handle:  # which runs started, and so how many
            handle.write(f"{job}\\n")
        time.sleep(0.5)
        return {"job": job}

    def main():
        append_runs(Path(sys.argv[1]), ["job"], list(range(40)), run, workers=2, describe=str)

    if __name__ == "__main__":  # the spawned workers import this file
        sys.exit(interrupt.run_stoppable(main))
""")


def test_ctrl_c_to_the_process_group_stops_a_grid_after_its_runs_under_way_keeping_its_rows(tmp_path: Path) -> None:
    out, script = tmp_path / "rows.csv", tmp_path / "grid.py"
    script.write_text(GRID)
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen([sys.executable, str(script), str(out)], cwd=root,
                               env={**os.environ, "PYTHONPATH": str(root)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.1)  # the header and two rows: the workers are running
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the parent and its workers
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and stderr.splitlines()[-1].startswith("stopped: SIGINT")
    rows = out.read_text().splitlines()
    assert rows[0] == "job" and rows[1:] == [str(job) for job in range(len(rows) - 1)]  # in order, none torn
    assert 2 <= len(rows) - 1 < 40  # the grid stopped well before its end
    started = (tmp_path / "rows.csv.started").read_text().split()
    assert len(started) <= len(rows) - 1 + 2, started  # no run started after the stop: only the 2 under way
