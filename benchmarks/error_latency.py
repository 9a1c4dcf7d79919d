"""How long a newcomer's mistake takes to be refused: each mistake of ``tests/test_fast_errors.py`` in a new process.

Each mistake is run ``--repeats`` times as ``python -m simulations.run <overrides>`` (or a ``fedsurv.fit`` call in
``python -c``), and the median wall time is set against two references measured in the same run, on the same
machine: the interpreter's start (``python -c pass``) and ``python -c "import pandas"`` (what reading a file needs
anyway), the latter again at the end (a busy machine shows as a drift between the two). Prints one row per mistake: the
median, its ratio to the first pandas reference, the exit status and the start of the one line on stderr.

Usage::

    python -m benchmarks.error_latency [--repeats 3] [--only key-typo,missing-file]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_fast_errors import MISTAKES, command, good_csv, run_command  # noqa: E402


def fit_call(tmp: Path, argument: str, config: str = "{}") -> list[str]:
    """``fedsurv.fit(<argument>, config=<config>)`` in a new interpreter; a refusal prints ``error: ...``, exit 1."""
    code = (f"import sys, fedsurv\ntry:\n    fedsurv.fit({argument}, config={config}, output_dir={str(tmp / 'run')!r})\n"
            "except ValueError as err:\n    sys.exit(f'error: {err}')")
    return [sys.executable, "-c", code]


#: The mistakes through the Python API: a typo in ``config``, a missing file, a frame too small for its sites.
FIT_MISTAKES: dict[str, Callable[[Path], list[str]]] = {
    "fit: key typo": lambda tmp: fit_call(tmp, repr(str(good_csv(tmp / "site.csv"))), "{'train.lrr': 0.01}"),
    "fit: missing file": lambda tmp: fit_call(tmp, repr(str(tmp / "nosuch.csv"))),
    "fit: 30-row frame": lambda tmp: fit_call(tmp, "__import__('pandas').DataFrame({'time': range(1, 31), "
                                                   "'event': [1, 0] * 15, 'age': [40 + i % 7 for i in range(30)]})"),
}


def timed(make: Callable[[Path], list[str]], repeats: int) -> tuple[float, int, str]:
    """Median seconds of ``repeats`` runs of the command ``make(folder)`` builds (a new folder each), its exit status
    and the last line of its stderr."""
    seconds, code, line = [], 0, ""
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            argv = make(Path(folder))
            started = time.perf_counter()
            result = run_command(argv, timeout_s=300.0)
            seconds.append(time.perf_counter() - started)
            code, lines = result.returncode, result.stderr.strip().splitlines()
            line = lines[-1] if lines else ""
    return statistics.median(seconds), code, line


def cli(mistake: Callable[[Path], tuple[list[str], list[str]]]) -> Callable[[Path], list[str]]:
    return lambda folder: command(mistake(folder)[0], folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated mistake names (default: all)")
    args = parser.parse_args(argv)
    cases: dict[str, Callable[[Path], list[str]]] = {
        "reference: python -c pass": lambda folder: [sys.executable, "-c", "pass"],
        "reference: import pandas": lambda folder: [sys.executable, "-c", "import pandas"],
        **{name: cli(mistake) for name, mistake in MISTAKES.items()},
        **FIT_MISTAKES,
        "reference: import pandas, again": lambda folder: [sys.executable, "-c", "import pandas"],
    }
    only = {name for name in args.only.split(",") if name}
    pandas_s = None
    print(f"{'mistake':<28} {'median s':>8} {'x pandas':>8} {'exit':>4}  stderr's last line")
    for name, make in cases.items():
        if only and name not in only and not name.startswith("reference"):
            continue
        median, code, line = timed(make, args.repeats)
        pandas_s = median if name == "reference: import pandas" else pandas_s
        ratio = f"{median / pandas_s:8.1f}" if pandas_s else f"{'':>8}"
        print(f"{name:<28} {median:8.2f} {ratio} {code:>4}  {line[:110]}", flush=True)


if __name__ == "__main__":
    main()
