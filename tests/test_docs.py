"""The documentation as a manual: generated pages are current, and every relative link and anchor resolves.

Links are checked in README.md and every page under docs/: each relative target must exist, and each
``#anchor`` must be a heading of the target page under GitHub's slug rules (lowercase; every character
but letters, digits, spaces, ``-`` and ``_`` dropped; spaces to ``-``; a repeated heading gets ``-1``,
``-2``, …). Links inside code (fenced blocks and inline spans) are not links.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from flwr_app.config import PROJECT_ROOT

DOCS = PROJECT_ROOT / "docs"
PAGES = (PROJECT_ROOT / "README.md", *sorted(DOCS.rglob("*.md")))

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a span's brackets stay a link's text)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (its links and HTML reduced to their text first)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor of ``page``: its headings' slugs (repeats numbered as GitHub does) and HTML anchors."""
    text = page.read_text(encoding="utf-8")
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for _, heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file does not exist or whose anchor is not a heading of the target."""
    prose = _prose(page.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(prose) + _REFERENCE.findall(prose):
        if not target or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # an absolute URL (https:, mailto:, …)
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


def test_slug_follows_githubs_rules() -> None:
    assert slug("Accounting (`privacy.accountant`): PLD for the headline, RDP beside it") == \
        "accounting-privacyaccountant-pld-for-the-headline-rdp-beside-it"
    assert slug("NbAFL, LS-ADP and ROW-DP (adaptive-DP Cox-MLP paper)") == \
        "nbafl-ls-adp-and-row-dp-adaptive-dp-cox-mlp-paper"
    assert slug("Record-level DP-SGD (`dp_sgd`)") == "record-level-dp-sgd-dp_sgd"
    assert slug("A site's own privacy budget") == "a-sites-own-privacy-budget"
    assert slug("BVFLMSP §8: does the 95% band widen?") == "bvflmsp-8-does-the-95-band-widen"
    assert slug("The [privacy reference](privacy-reference.md) – in short") == "the-privacy-reference--in-short"


def test_the_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section) [repeat](other.md#a-section-1) [self](#page)\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) [web](https://example.org/x#y)\n"
                    "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nowhere (no heading #nowhere in other.md)"]


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken = {str(page.relative_to(PROJECT_ROOT)): links for page in PAGES if (links := broken_links(page))}
    assert not broken, f"broken links: {broken}"


def test_the_generated_privacy_reference_is_current() -> None:
    """docs/privacy-reference.md is what the mechanisms declare: `python -m flwr_app.config --write` rewrites it."""
    from strategies.mechanisms.reference import REFERENCE_PAGE, reference_page

    committed = (PROJECT_ROOT / REFERENCE_PAGE).read_text(encoding="utf-8")
    assert committed == reference_page(), f"{REFERENCE_PAGE} is stale: run `python -m flwr_app.config --write`"


def test_no_page_is_a_stub_and_no_result_folder_is_named_by_commit() -> None:
    """Every page has content beyond a pointer elsewhere, and a run's commit lives in its meta.json, not its name."""
    stub = re.compile(r"^# .*\((moved|stub|todo)\)", re.IGNORECASE | re.MULTILINE)
    stubs = [str(page.relative_to(PROJECT_ROOT)) for page in PAGES if stub.search(page.read_text(encoding="utf-8"))]
    assert not stubs, f"stub pages: {stubs}"
    by_commit = [str(path.relative_to(PROJECT_ROOT)) for path in (DOCS / "results").rglob("*")
                 if path.is_dir() and re.search(r"_[0-9a-f]{7,40}$", path.name)]
    assert not by_commit, f"result folders named by commit (rename them, the commit goes in meta.json): {by_commit}"
