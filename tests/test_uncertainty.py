"""Tests of simulations.papers.uncertainty_bands: band widths and spreads from stochastic passes, band comparisons, masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.multimodal import survival_band
from simulations.papers.uncertainty_bands import (
    band_widths,
    compare_bands,
    grid_columns,
    mask_modality,
    mean_band_width,
    noise_to_signal,
    pass_spread,
    summarise_band,
    survival_passes,
    time_columns,
)


def _logit(hazard: float) -> float:
    return math.log(hazard / (1.0 - hazard))


def _two_passes() -> np.ndarray:
    """One record, two times; pass 1 has hazards 1/2, pass 2 hazards 1/4: S = (1/2, 1/4) and (3/4, 9/16)."""
    return np.array([[[_logit(0.5), _logit(0.5)]], [[_logit(0.25), _logit(0.25)]]])


def test_survival_passes_is_the_product_of_one_minus_hazards() -> None:
    curves = survival_passes(_two_passes())
    np.testing.assert_allclose(curves[:, 0], [[0.5, 0.25], [0.75, 0.5625]], rtol=1e-12)
    np.testing.assert_allclose(survival_passes(torch.tensor(_two_passes())), curves, rtol=0, atol=0)
    with pytest.raises(ValueError):
        survival_passes(np.zeros((3, 4)))


def test_band_width_of_two_passes_is_level_times_their_distance() -> None:
    # Linear interpolation between the two values x1 < x2: q_p = x1 + p (x2 - x1), so
    # q_0.975 - q_0.025 = 0.95 (x2 - x1).
    widths = band_widths(_two_passes(), level=0.95)
    np.testing.assert_allclose(widths, [[0.95 * 0.25, 0.95 * 0.3125]], rtol=1e-12)
    np.testing.assert_allclose(pass_spread(_two_passes()), [[0.25 / math.sqrt(2), 0.3125 / math.sqrt(2)]], rtol=1e-12)
    assert mean_band_width(_two_passes()).tolist() == pytest.approx([0.95 * (0.25 + 0.3125) / 2])
    assert mean_band_width(_two_passes(), columns=[1]).tolist() == pytest.approx([0.95 * 0.3125])


def test_band_width_of_five_passes_at_level_one_half_is_the_interquartile_range() -> None:
    # With m = 5 the 0.25 and 0.75 quantiles sit exactly on the 2nd and 4th smallest values.
    hazards = np.array([0.1, 0.3, 0.2, 0.5, 0.4])
    logits = np.log(hazards / (1 - hazards)).reshape(5, 1, 1)
    survival = np.sort(1 - hazards)
    assert band_widths(logits, level=0.5)[0, 0] == pytest.approx(survival[3] - survival[1])
    assert pass_spread(logits)[0, 0] == pytest.approx(np.std(1 - hazards, ddof=1))
    assert pass_spread(logits[:1])[0, 0] == 0.0
    with pytest.raises(ValueError):
        band_widths(logits, level=1.0)


def test_band_is_the_one_of_survival_band() -> None:
    logits = torch.randn(60, 4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, lower, upper = survival_band(logits, level=0.9)
    np.testing.assert_allclose(band_widths(logits, level=0.9), (upper - lower).numpy(), rtol=1e-10, atol=1e-12)


def test_noise_to_signal_hand_computation() -> None:
    # Passes (0, 1) and (2, 3) for two records: within sd 1/sqrt(2) each; pass means 0.5 and 2.5 have sd sqrt(2).
    logits = np.array([[[0.0], [2.0]], [[1.0], [3.0]]])
    assert noise_to_signal(logits) == pytest.approx(0.5)
    # A second time whose logits are 3x - 1 of the first (the same ratio there) leaves it unchanged.
    shifted = np.concatenate([logits, 3.0 * logits - 1.0], axis=2)
    assert noise_to_signal(shifted) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        noise_to_signal(logits[:1])


def test_summary_averages_widths_over_records_and_chosen_times() -> None:
    logits = np.random.default_rng(1).normal(size=(40, 5, 6))
    widths = band_widths(logits)
    summary = summarise_band(logits, columns=[2, 3, 4])
    assert summary.mean_width == pytest.approx(widths[:, 2:5].mean())
    np.testing.assert_allclose(summary.width_by_record, widths[:, 2:5].mean(axis=1))
    np.testing.assert_allclose(summary.width_by_time, widths.mean(axis=0))
    np.testing.assert_allclose(summary.spread_by_time, pass_spread(logits).mean(axis=0))
    with pytest.raises(ValueError):
        summarise_band(logits, columns=[6])


def test_grid_and_time_columns() -> None:
    cuts = np.array([0.0, 1.0, 2.5, 4.0])
    assert grid_columns(cuts, 1.0, 3.0).tolist() == [1, 2]
    assert time_columns(cuts, [0.0, 0.99, 1.0, 3.0, 10.0]).tolist() == [0, 0, 1, 2, 3]
    with pytest.raises(ValueError):
        grid_columns(cuts, 4.5, 5.0)
    with pytest.raises(ValueError):
        time_columns(cuts, [-1.0])


def test_compare_bands_hand_computation() -> None:
    # Record 0: reference passes equal (width 0), alternative the two-pass example (widths 0.2375, 0.296875).
    # Record 1: both are the two-pass example (no change).
    example = _two_passes()[:, 0]
    reference = np.stack([np.stack([np.full(2, _logit(0.5)), example[0]]), np.stack([np.full(2, _logit(0.5)), example[1]])])
    alternative = np.stack([np.stack([example[0], example[0]]), np.stack([example[1], example[1]])])
    record_width = 0.95 * (0.25 + 0.3125) / 2
    comparison = compare_bands(reference, alternative)
    assert comparison.reference_width == pytest.approx(record_width / 2)
    assert comparison.alternative_width == pytest.approx(record_width)
    assert comparison.difference == pytest.approx(record_width / 2)
    assert comparison.ratio == pytest.approx(2.0)
    assert comparison.share_wider == 0.5
    np.testing.assert_allclose(comparison.difference_by_record, [record_width, 0.0], atol=1e-12)
    same = np.zeros((3, 2, 2))
    assert math.isnan(compare_bands(same, same).ratio) and compare_bands(same, alternative[:2]).ratio == math.inf
    with pytest.raises(ValueError):
        compare_bands(reference, alternative[:, :1])


def test_mask_modality_copies_the_mask_with_one_column_off() -> None:
    present = torch.tensor([[True, True, False], [True, True, True]])
    masked = mask_modality(present, ("a", "b", "c"), "b")
    assert masked.tolist() == [[True, False, False], [True, False, True]]
    assert present[:, 1].all()
    as_array = mask_modality(present.numpy(), ("a", "b", "c"), "a")
    assert isinstance(as_array, np.ndarray) and as_array.tolist() == [[False, True, False], [False, True, True]]
    with pytest.raises(ValueError):
        mask_modality(present, ("a", "b", "c"), "d")
    with pytest.raises(ValueError):
        mask_modality(present, ("a", "b"), "a")


def test_simulation_writes_consistent_tables_and_figures(tmp_path) -> None:
    import pandas as pd

    from simulations.papers.uncertainty import ALL, main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny layers: a second thread only adds synchronisation (10x slower on a busy machine)
    try:
        main(["--data", "synthetic_multimodal", "--out", str(tmp_path), "--n", "160", "--dim", "16", "--epochs", "1",
              "--batch-size", "64", "--passes", "8", "--num-durations", "6", "--seeds", "3,4"])
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "synthetic_multimodal"
    runs = pd.read_csv(out / "runs.csv", keep_default_na=False, na_values=[""])
    assert len(runs) == 2 * (1 + 2 * 3)  # per seed: the full model, then masked and trained without for a, b, c
    for seed, rows in runs.groupby("seed"):
        full = rows[rows["setup"] == ALL].iloc[0]
        others = rows[rows["setup"] != ALL]
        np.testing.assert_allclose(others["difference"], others["mean_width"] - full["mean_width"], rtol=1e-9)
        np.testing.assert_allclose(others["ratio"], others["mean_width"] / full["mean_width"], rtol=1e-9)
        assert ((others["share_wider"] >= 0) & (others["share_wider"] <= 1)).all()
    assert (runs["noise_to_signal"] > 0).all()
    summary = pd.read_csv(out / "summary.csv", keep_default_na=False, na_values=[""])
    masked_b = summary[(summary["setup"] == "masked at prediction") & (summary["modality"] == "b")].iloc[0]
    values = runs[(runs["setup"] == "masked at prediction") & (runs["modality"] == "b")]["mean_width"]
    assert masked_b["mean_width_mean"] == pytest.approx(values.mean())
    assert masked_b["mean_width_std"] == pytest.approx(values.std(ddof=1))
    assert masked_b["seeds_wider"] == int((runs.loc[values.index, "difference"] > 0).sum())
    figures = ["width_by_time.png", *(f"{kind}_without_{name}.png" for kind in ("curves", "violins") for name in "abc")]
    for name in figures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
