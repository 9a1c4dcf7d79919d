"""Plots a reader can use: each call draws its own figure (never pyplot's current axes) and returns it,
the axes are labelled with the run's time unit, sites come in natural order, and a sweep draws a
privacy-utility figure only where ε varies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

import fedsurv
from models.data import FederatedDataset, SiteData, SurvivalArrays
from models.plots import (
    natural_key,
    plot_calibration,
    plot_curves,
    plot_survival_bands,
    plot_survival_vs_km,
    time_label,
)
from models.predict import load_run
from models.survival import build_survival_model
from simulations import engine, sweep
from simulations.plots import plot_privacy_utility, privacy_utility_figure
from tests.test_sweep import _job, _summary

matplotlib.use("Agg")

CUTS = np.linspace(0.0, 10.0, 6)


@pytest.fixture(autouse=True)
def _close_pyplot_figures():
    yield
    plt.close("all")


def _curves(rows: int = 3) -> pd.DataFrame:
    values = np.cumprod(np.full((rows, CUTS.size), 0.9), axis=1)
    return pd.DataFrame(values, columns=pd.Index(CUTS, name="time"))


def _calibration() -> pd.DataFrame:
    return pd.DataFrame({"group": [1, 2], "n": [10, 10], "predicted": [0.3, 0.7], "km": [0.35, 0.65],
                         "km_lower": [0.2, 0.5], "km_upper": [0.5, 0.8]})


def _federation(names: list[str], rng: np.random.Generator) -> FederatedDataset:
    def part(n: int) -> SurvivalArrays:
        return SurvivalArrays(rng.normal(size=(n, 2)), rng.uniform(0.5, 10.0, n), (rng.random(n) < 0.6))

    return FederatedDataset(tuple(SiteData(name, part(20), part(int(rng.integers(5, 40)))) for name in names),
                            preprocessor=None, source="test")  # type: ignore[arg-type]


def test_two_calls_in_a_row_draw_two_figures_and_leave_the_current_axes_alone() -> None:
    mine = plt.figure().gca()
    km = fedsurv.kaplan_meier(pd.DataFrame({"t": [1.0, 2, 3, 4], "e": [1, 0, 1, 1]}), time_col="t", event_col="e")
    for draw in (lambda: plot_curves(_curves()), lambda: plot_calibration(_calibration(), horizon=5.0),
                 lambda: fedsurv.plot_kaplan_meier(km)):
        first, second = draw(), draw()
        assert first.figure is not second.figure and first is not mine and second is not mine
    assert not mine.get_lines() and not mine.collections
    given = Figure().subplots()
    assert plot_curves(_curves(), ax=given) is given


def test_the_runs_figures_are_new_each_call_and_stay_open_nowhere(tmp_path: Path) -> None:
    open_before = plt.get_fignums()
    mean = np.cumprod(np.full((4, CUTS.size), 0.9), axis=1)
    first = plot_survival_bands(CUTS, mean, mean - 0.05, mean + 0.05, tmp_path / "a.png")
    second = plot_survival_bands(CUTS, mean, mean - 0.05, mean + 0.05, tmp_path / "b.png")
    assert isinstance(first, Figure) and first is not second
    assert (tmp_path / "a.png").stat().st_size > 0 and plt.get_fignums() == open_before


def test_axes_carry_the_time_unit() -> None:
    assert time_label() == "time" and time_label("days") == "time (days)" and time_label("") == "time"
    ax = plot_curves(_curves(), time_unit="days")
    assert ax.get_xlabel() == "time (days)" and ax.get_ylabel() == "survival probability"
    assert plot_curves(_curves()).get_xlabel() == "time"
    ax = plot_calibration(_calibration(), horizon=365.0, time_unit="days")
    assert ax.get_xlabel().endswith("at t = 365 days") and ax.get_ylabel().endswith("at t = 365 days")
    km = fedsurv.kaplan_meier(pd.DataFrame({"futime": [1.0, 2, 3], "e": [1, 1, 0]}), time_col="futime",
                              event_col="e")
    assert fedsurv.plot_kaplan_meier(km, time_unit="months").get_xlabel() == "futime (months)"
    mean = np.cumprod(np.full((3, CUTS.size), 0.9), axis=1)
    fig = plot_survival_bands(CUTS, mean, mean, mean, time_unit="weeks")
    assert all(a.get_xlabel() == "time (weeks)" and a.get_ylabel() for a in fig.axes if a.get_visible())


def test_site_panels_and_legends_come_in_natural_order() -> None:
    rng = np.random.default_rng(0)
    names = [f"site-{k}" for k in rng.permutation(11)]
    model = build_survival_model("hazard_mlp", in_features=2, cuts=CUTS)
    fig = plot_survival_vs_km(model, _federation(names, rng), time_unit="days")
    titles = [a.get_title().split(" (")[0] for a in fig.axes if a.get_visible()]
    assert titles == ["pooled test"] + [f"site-{k}" for k in range(11)]
    assert all(a.get_xlabel() == "time (days)" for a in fig.axes if a.get_visible())
    frame = pd.DataFrame({"t": rng.uniform(1, 9, 110), "e": rng.integers(0, 2, 110),
                          "site": [f"site-{k % 11}" for k in range(110)]})
    km = fedsurv.kaplan_meier(frame, time_col="t", event_col="e", group_col="site")
    legend = [text.get_text() for text in fedsurv.plot_kaplan_meier(km).get_legend().get_texts()]
    assert legend == [f"site-{k}" for k in range(11)]
    assert sorted(["b10", "b9", "a"], key=natural_key) == ["a", "b9", "b10"]


def _lr_sweep(root: Path, *, epsilons: tuple[float, ...]) -> None:
    """dp_sgd over two learning rates at the given target ε (one seed each)."""
    num = 0
    for lr in ("0.01", "0.003"):
        for eps in epsilons:
            _job(root, num, "ok", eps, _summary("dp_sgd", 0, 0.7 + 0.01 * num, 0.15, eps * 0.99),
                 overrides=[f"train.lr={lr}", "strategy=dp_sgd", f"privacy.epsilon={eps}"])
            num += 1


def test_a_sweep_at_one_epsilon_writes_no_privacy_utility_figure(tmp_path: Path) -> None:
    _lr_sweep(tmp_path / "one", epsilons=(1.0,))
    sweep.write_report(tmp_path / "one", quiet=True)
    assert not (tmp_path / "one" / sweep.FIGURE).exists()
    by_setting = tmp_path / "one" / sweep.BY_SETTING_FIGURE
    assert by_setting.stat().st_size > 0
    summary = sweep.summarize(sweep.gather(tmp_path / "one"))
    assert plot_privacy_utility(summary, tmp_path / "pu.png") == [] and not (tmp_path / "pu.png").exists()
    _lr_sweep(tmp_path / "two", epsilons=(1.0, 4.0))
    sweep.write_report(tmp_path / "two", quiet=True)
    # one privacy-utility figure per learning rate, each with points at both ε
    assert (tmp_path / "two" / sweep.FIGURE).exists() and (tmp_path / "two" / "privacy_utility_1.png").exists()
    assert not (tmp_path / "two" / sweep.BY_SETTING_FIGURE).exists()


def test_sweep_figures_have_labelled_axes_and_refuse_to_be_empty(tmp_path: Path) -> None:
    _lr_sweep(tmp_path / "s", epsilons=(1.0, 4.0))
    summary = sweep.summarize(sweep.gather(tmp_path / "s"))
    setting = summary[summary["variant"] == "train.lr=0.003"]
    fig = privacy_utility_figure(setting)
    assert all(a.get_xlabel() and a.get_ylabel() and a.lines for a in fig.axes)
    with pytest.raises(ValueError, match="no values"):
        privacy_utility_figure(setting, ["test_no_such_metric"])


def test_the_centralised_reference_reads_not_private_with_the_reason_below(tmp_path: Path) -> None:
    root = tmp_path / "s"
    for num, eps in enumerate((1.0, 4.0)):
        summary = _summary("dp_sgd", 0, 0.74, 0.15, eps * 0.99)
        summary["centralized"] = {"test": {"c_index": 0.70, "ibs": 0.16},
                                  "privacy": {"mechanism": "dp_sgd", "epsilon": eps * 0.998}}
        _job(root, num, "ok", eps, summary)
    text = sweep.format_summary(sweep.summarize(sweep.gather(root)))
    rows = [line for line in text.splitlines() if "centralized_dp_sgd [" in line]
    assert len(rows) == 2 and all("not private" in row and "0.998" not in row for row in rows)
    assert "can score below the federated model" in text and "early stopping" in text


@pytest.fixture(scope="module")
def days_run(tmp_path_factory) -> tuple[Path, list[Figure]]:
    """A short run (2 sites, 1 round, in process) with ``data.time_unit = days``; every figure it saves."""
    tmp = tmp_path_factory.mktemp("days")
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"age": rng.normal(60, 10, 300), "days": rng.integers(30, 2000, 300),
                          "died": (rng.random(300) < 0.5).astype(int)})
    frame.to_csv(tmp / "table.csv", index=False)
    saved: list[Figure] = []
    original = Figure.savefig

    def spy(self: Figure, fname, *args, **kwargs):
        saved.append(self)
        return original(self, fname, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(Figure, "savefig", spy)
    try:
        engine.run_inprocess({"data.name": "csv", "data.path": str(tmp / "table.csv"), "data.time_col": "days",
                              "data.event_col": "died", "data.time_unit": "days", "federation.num_sites": 2,
                              "federation.rounds": 1, "baseline.centralized": False, "output.dir": str(tmp / "run")})
    finally:
        patch.undo()
    return tmp / "run", saved


def test_every_png_of_a_run_has_labelled_axes_in_its_time_unit(days_run) -> None:
    directory, saved = days_run
    assert sorted(p.name for p in directory.glob("*.png")) == ["survival_vs_km.png"] and len(saved) == 1
    for fig in saved:
        visible = [a for a in fig.axes if a.get_visible()]
        assert visible and all(a.get_xlabel() == "time (days)" and a.get_ylabel() for a in visible)


def test_a_saved_runs_plots_use_its_time_unit(days_run, tmp_path: Path) -> None:
    directory, _ = days_run
    run = load_run(directory)
    records = pd.read_csv(directory.parent / "table.csv")
    assert run.time_unit == "days"
    first, second = run.plot_survival(records.head(3)), run.plot_survival(records.head(3))
    assert first.figure is not second.figure and first.get_xlabel() == "time (days)"
    assert run.plot_calibration(records, groups=3).get_xlabel().endswith("days")
    older = shutil.copytree(directory, tmp_path / "older")
    config = json.loads((older / "config.json").read_text())
    config["resolved"]["data"].pop("time_unit")  # a run saved before the key: no unit
    (older / "config.json").write_text(json.dumps(config))
    assert load_run(older).time_unit == "time" and load_run(older).plot_survival(records.head(2)).get_xlabel() == "time"
