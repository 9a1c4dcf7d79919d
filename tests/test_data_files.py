"""The data sets shipped with the package, and the one function that finds a data set's file."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flwr_app.config import PROJECT_ROOT
from models.data import BUNDLED_DIR, DataValidationError, data_file, load_table, resolve_data_dir
from models.data.files import DATA_DIR_ENV, DATA_FILES


def _readme_table() -> dict[str, tuple[int, int]]:
    """``file -> (rows, columns)`` from the table of the bundled folder's README."""
    rows = {}
    for line in (BUNDLED_DIR / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([^`]+)` \| (\d+) \| (\d+) \|", line)
        if match:
            rows[match[1]] = (int(match[2]), int(match[3]))
    return rows


def test_every_bundled_file_is_in_the_readme_with_its_rows_and_columns() -> None:
    table = _readme_table()
    assert sorted(table) == sorted(path.name for path in BUNDLED_DIR.iterdir() if path.name != "README.md")
    for name, (rows, columns) in table.items():
        frame = pd.read_csv(BUNDLED_DIR / name, low_memory=False)  # pandas infers gzip from ".gz"
        assert frame.shape == (rows, columns), name


def test_each_named_data_set_resolves_to_its_bundled_file_by_default(monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert resolve_data_dir() == BUNDLED_DIR
    assert {name: data_file(name).name for name in DATA_FILES} == {
        "metabric": "metabric.csv", "gbsg": "gbsg.csv", "whas": "whas.csv", "sba": "sba_national_subset.csv.gz",
    }
    assert all(data_file(name).parent == BUNDLED_DIR for name in DATA_FILES)


def test_data_dir_beats_the_environment_variable_which_beats_the_bundled_copy(monkeypatch, tmp_path) -> None:
    from_env, from_config = tmp_path / "env", tmp_path / "config"
    for folder in (from_env, from_config):
        folder.mkdir()
        shutil.copy(BUNDLED_DIR / "whas.csv", folder / "whas.csv")
    monkeypatch.setenv(DATA_DIR_ENV, str(from_env))
    assert data_file("whas") == from_env / "whas.csv"
    assert data_file("whas", str(from_config)) == from_config / "whas.csv"
    monkeypatch.chdir(tmp_path)
    assert data_file("whas", "config") == from_config / "whas.csv"  # relative to the working directory


def test_a_gzip_file_loads_like_the_plain_one_and_the_plain_one_wins(tmp_path) -> None:
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    shutil.copy(BUNDLED_DIR / "gbsg.csv", plain / "gbsg.csv")
    (packed / "gbsg.csv.gz").write_bytes(gzip.compress((BUNDLED_DIR / "gbsg.csv").read_bytes()))
    a, b = load_table("gbsg", data_dir=str(plain)), load_table("gbsg", data_dir=str(packed))
    pd.testing.assert_frame_equal(a.features, b.features)
    np.testing.assert_array_equal(a.time, b.time)
    np.testing.assert_array_equal(a.event, b.event)
    assert b.source == str(packed / "gbsg.csv.gz")

    shutil.copy(packed / "gbsg.csv.gz", plain / "gbsg.csv.gz")
    assert data_file("gbsg", str(plain)) == plain / "gbsg.csv"


def test_a_missing_file_names_the_path_and_who_chose_the_folder(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(DataValidationError, match=re.escape(f"{tmp_path / 'metabric.csv'}: file not found, "
                                                            "nor its .gz (folder set by data.dir)")):
        load_table("metabric", data_dir=str(tmp_path))
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(DataValidationError, match=re.escape(f"(folder set by ${DATA_DIR_ENV})")):
        load_table("sba")
    with pytest.raises(DataValidationError, match="no bundled file for data set 'flchain'"):
        data_file("flchain")


#: What a user's checkout does not have: the team's sibling folder and its design notes.
_PRIVATE = ("../" + "shared", "/shared/" + "data", "/shared/" + "papers", "DESIGN" + ".md", "DESIGN" + " §")
_SKIPPED_DIRS = {".git", ".venv", "outputs", "multirun", ".pytest_cache", "__pycache__", "build", "dist",
                 ".flwr_home"}
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".cfg", ".txt", ".sh", ".ini"}


def test_no_project_file_reads_or_names_the_sibling_shared_folder() -> None:
    hits = []
    for path in sorted(PROJECT_ROOT.rglob("*")):
        parts = set(path.relative_to(PROJECT_ROOT).parts)
        if parts & _SKIPPED_DIRS or any(part.endswith(".egg-info") for part in parts) or not path.is_file():
            continue
        if path.suffix not in _TEXT_SUFFIXES and path.name not in {"Makefile", "run", "Dockerfile"}:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(PROJECT_ROOT)}:{number}: {word}" for word in _PRIVATE if word in line]
    assert not hits, "\n".join(hits)


def test_a_flower_app_bundle_without_the_csvs_reads_the_installed_packages_copy(tmp_path) -> None:
    """``flwr run`` loads the apps from the FAB it built, which carries Python and text files only: a named data set
    is then read from the installed package (on ``sys.path`` after the bundle), not refused as missing."""
    bundle = tmp_path / "fab"
    shutil.copytree(PROJECT_ROOT / "models", bundle / "models",
                    ignore=lambda folder, names: [name for name in names if name.endswith((".csv", ".gz", ".pyc"))])
    assert not list((bundle / "models" / "data" / "bundled").glob("*.csv*"))
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import models.data as data; "
              "assert data.__file__.startswith(sys.argv[1]), data.__file__; "
              "print(data.BUNDLED_DIR, len(data.load_table('metabric').time))")
    result = subprocess.run([sys.executable, "-c", script, str(bundle)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120, env={k: v for k, v in os.environ.items() if k != DATA_DIR_ENV})
    assert result.returncode == 0, result.stderr[-2000:]
    folder, rows = result.stdout.split()
    assert Path(folder) == BUNDLED_DIR and int(rows) == len(load_table("metabric").time)
