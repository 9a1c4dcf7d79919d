"""`python -m simulations.papers.report` regenerates docs/results.md and every grid's tables from the saved runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from flwr_app.config import PROJECT_ROOT
from simulations.papers import report

DOCS = PROJECT_ROOT / "docs"


def test_the_committed_report_and_tables_are_what_the_saved_runs_give(tmp_path: Path) -> None:
    """Regenerating from a copy of docs/results changes no table and gives the committed docs/results.md.

    Figures are regenerated too but not compared byte for byte (their pixels depend on the fonts
    installed).
    """
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    text = report.write(results, tmp_path / "results.md")

    assert text == (DOCS / "results.md").read_text(encoding="utf-8"), \
        "docs/results.md is stale: run `python -m simulations.papers.report` and commit it"
    for table in sorted((DOCS / "results").rglob("*.md")) + sorted((DOCS / "results").rglob("*.csv")):
        copy = results / table.relative_to(DOCS / "results")
        assert copy.read_text(encoding="utf-8") == table.read_text(encoding="utf-8"), f"{table} changed"


def test_every_section_names_its_sources_and_keeps_the_papers_numbers_beside_ours() -> None:
    text = (DOCS / "results.md").read_text(encoding="utf-8")
    for title, _ in report.SECTIONS:
        assert f"## {title}" in text
    assert "[0.7701]" in text                      # LS-ADP paper, FLCHAIN no-DP C-index, beside ours
    assert "0.704 ± 0.043" in text                 # FSL-BDP paper, SBA federated BDP test C-index
    assert "0.752" in text                         # BVFLMSP paper, Table 1 and Table 2 figures
    assert "record ε (RDP, all sites)" in text and "paper's ε claim" in text
    for link in ("results/adaptive_dp.md", "results/fsl_bdp_sba.md", "results/bvflmsp.md", "results/membership.md"):
        assert f"({link})" in text and (DOCS / link).exists()
