"""The privacy reference (``docs/privacy-reference.md``), generated from each registered mechanism's declarations.

:func:`reference_page` reads only what the mechanisms themselves declare (the objects that also write every
run's ``ledger.jsonl`` and ``manifest.json``), so the page cannot drift from what runs: the unit protected and the
neighbouring relations offered (:attr:`~strategies.mechanisms.base.Mechanism.unit`,
:attr:`~strategies.mechanisms.base.Mechanism.adjacencies`), the accountants offered, whose count bounds δ, who
adds the noise, the figures a site declares with each update and those the server recomputes, what the ledger's
figures assume, and the release manifest (every value a site sends, covered by ε or not). Each mechanism is shown
at its defaults with ``privacy.epsilon = 1``, then the options that change what its sites send.
``python -m flwr_app.config --write`` writes the page; a test checks that the committed page is current.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strategies.config import ConfigError, ExperimentConfig, defaults, parse_flat
from strategies.mechanisms.base import DELTA_POPULATIONS, HorizontalMechanism, Mechanism, SecureSumMechanism, SiteSetUp
from strategies.mechanisms.manifest import noise_source
from strategies.mechanisms.registry import MECHANISMS

__all__ = ["REFERENCE_PAGE", "reference_page"]

#: Where the page goes, relative to the project root.
REFERENCE_PAGE = "docs/privacy-reference.md"

#: Options that change what a mechanism's sites send, shown under each mechanism they apply to.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("a Cox model (model.name = cox_mlp or cox_time)", {"model.name": "cox_mlp"}),
    ("privacy.allocation = exact", {"privacy.allocation": "exact"}),
    ("split.clean_inference = true", {"split.clean_inference": True}),
    ("privacy.setup_sum = secure", {"privacy.setup_sum": "secure"}),
)


def mechanism_config(mechanism: Mechanism, **overrides: Any) -> ExperimentConfig:
    """``mechanism`` at its defaults (``privacy.epsilon = 1``; a vertical one on METABRIC), with ``overrides``.

    Raises ``ConfigError`` when an override does not apply to the mechanism (its own checks refuse it).
    """
    flat: dict[str, Any] = {**defaults(), "strategy.name": mechanism.name}
    if mechanism.vertical:
        flat |= {"data.name": "metabric", "model.name": "bayesian_multisurv"}
    flat["privacy.epsilon"] = 1.0 if mechanism.private or mechanism.vertical else float("inf")
    cfg = parse_flat({**flat, **overrides})
    mechanism.check_keys(cfg)
    mechanism.check(cfg)
    return cfg


def noise_added_by(mechanism: Mechanism) -> str:
    """Who draws the mechanism's noise, from what it declares (its kind and ``server_side``)."""
    if not mechanism.private:
        return "nobody: no noise, no guarantee"
    if getattr(mechanism, "server_side", False):
        return "the server, to the mean of the clipped updates it receives in the clear (its own generator)"
    if isinstance(mechanism, SecureSumMechanism):
        return ("each site, a discrete Gaussian share on its integer vector before masking; the server sees only the "
                "sum")
    if mechanism.vertical:
        return "each site, to every embedding it sends"
    return "each site, to its own release before it leaves"


def checked_figures(mechanism: Mechanism, cfg: ExperimentConfig) -> list[str]:
    """The rows that say which figures a site declares with each update and which the server recomputes."""
    if not isinstance(mechanism, HorizontalMechanism):
        return ["| figures a site declares with each reply | none (the label holder plans every release) |"]
    declared = mechanism.report_keys(cfg)
    count = 1000.0  # any agreed count: which figures the server recomputes does not depend on it
    recomputed = mechanism.expected_report(cfg, setup=SiteSetUp(count=count, min_count=count), previous=[])
    return [f"| figures a site declares with each update | {', '.join(f'`{k}`' for k in declared) or 'none'} |",
            "| of which the server recomputes from public inputs (a reply that differs is refused) | "
            + (", ".join(f"`{k}`" for k in recomputed) or "none") + " |"]


def declarations(mechanism: Mechanism, cfg: ExperimentConfig) -> list[str]:
    """The table of one mechanism's declarations."""
    population = getattr(mechanism, "delta_population", "records" if mechanism.vertical else "")
    setup = getattr(mechanism, "private_setup", False)
    rows = ["| declaration | value |", "| --- | --- |",
            f"| unit protected | {mechanism.unit} |",
            "| neighbouring relation (`privacy.adjacency`; `auto` is the first) | "
            + (", ".join(mechanism.adjacencies) if mechanism.private else "none") + " |",
            "| accountant (`privacy.accountant`; `auto` is the first) | "
            + (", ".join(mechanism.accountants) if mechanism.private else "none") + " |",
            f"| δ is refused above 1/n, n = | {DELTA_POPULATIONS.get(population, 'no δ (no guarantee)')} |",
            f"| noise added by | {noise_added_by(mechanism)} |"]
    if isinstance(mechanism, HorizontalMechanism):
        rows.append(f"| set-up statistics | {'released with DP (`privacy.setup_share`)' if setup else 'exact'} |")
    return rows + checked_figures(mechanism, cfg)


def variant_lines(mechanism: Mechanism, releases: Mapping[str, bool]) -> list[str]:
    """What each applicable option of :data:`VARIANTS` changes in the manifest (value and whether it is covered)."""
    lines = []
    for label, overrides in VARIANTS:
        try:
            variant = mechanism.manifest(mechanism_config(mechanism, **overrides))
        except ConfigError:
            continue  # the option does not apply to this mechanism
        changed = [f"{release.value} ({'covered' if release.covered else 'not covered'})"
                   for release in variant.releases if releases.get(release.value) != release.covered]
        if changed:
            lines += [f"With {label}: {'; '.join(changed)}.", ""]
    return lines


def mechanism_section(name: str, mechanism: Mechanism) -> list[str]:
    """One mechanism's section: declarations, the ledger's assumptions, the release manifest, its variants."""
    cfg = mechanism_config(mechanism)
    manifest = mechanism.manifest(cfg)
    parts = [f"## `{name}`", "", *declarations(mechanism, cfg), "", "What the ledger's figures assume:", ""]
    parts += [f"- {sentence}" for sentence in mechanism.assumptions(cfg)]
    parts += ["", "What a site sends:", "", manifest.as_markdown(), ""]
    return parts + variant_lines(mechanism, {release.value: release.covered for release in manifest.releases})


def summary_table() -> list[str]:
    """One row per mechanism: unit, neighbouring relations, accountants, who adds the noise."""
    rows = ["| strategy | unit | neighbouring relation | accountant | noise added by |",
            "| --- | --- | --- | --- | --- |"]
    for name, mechanism in MECHANISMS.items():
        accountants = ", ".join(mechanism.accountants) if mechanism.private else "none"
        who = noise_added_by(mechanism).split(",")[0].split(":")[0]
        relations = ", ".join(mechanism.adjacencies) if mechanism.private else "none"
        rows.append(f"| [`{name}`](#{name}) | {mechanism.unit} | {relations} | {accountants} | {who} |")
    return rows


def reference_page() -> str:
    """``docs/privacy-reference.md``: every registered mechanism's declarations and release manifest."""
    parts = ["# Privacy reference: what each mechanism declares", "",
             "Generated by `python -m flwr_app.config --write` from each registered mechanism's own declarations "
             "(`strategies/mechanisms/`: the objects that write every run's `ledger.jsonl` and `manifest.json`); do "
             "not edit by hand. The concepts (units, neighbouring relations, accountants, the threat model) are in "
             "[privacy.md](privacy.md). Each mechanism is shown at its defaults with `privacy.epsilon = 1`; each run "
             "writes the manifest of its own configuration to `manifest.json`. In a manifest, *covered* means the "
             "value is a function of the mechanism's noisy output or of public inputs only; every other value a site "
             "sends is listed as not covered, with the reason.", "",
             f"Noise a site draws, in every horizontal mechanism: in a {noise_source(True)}; in a "
             f"{noise_source(False)}.",
             "", *summary_table(), ""]
    for name, mechanism in MECHANISMS.items():
        parts += mechanism_section(name, mechanism)
    return "\n".join(parts).rstrip() + "\n"
