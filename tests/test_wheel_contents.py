"""The wheel holds the product and none of the paper reproductions (``simulations/papers``).

The wheel's packages and exclusions are read from ``pyproject.toml``'s hatch section. One test checks that
every project module a product module imports (at the top or lazily inside a function, or names as a
string for ``import_module``/``-m``) is itself a product module: never ``simulations.papers``,
``benchmarks`` or ``tests``. The other builds the wheel with the project's own build backend and checks
that it holds every product module and no reproduction.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from flwr_app.config import PROJECT_ROOT

PAPERS = "simulations/papers"
# The checkout's own packages (benchmarks and tests included): imports of anything else are third-party.
FIRST_PARTY = {path.name for path in PROJECT_ROOT.iterdir() if (path / "__init__.py").is_file()}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:\w+)?")


def wheel_config() -> dict:
    with (PROJECT_ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)["tool"]["hatch"]["build"]["targets"]["wheel"]


def product_sources() -> list[Path]:
    """Every Python file under the wheel's packages, less the reproductions (paths relative to the root)."""
    files = []
    for package in wheel_config()["packages"]:
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            relative = path.relative_to(PROJECT_ROOT)
            if "__pycache__" not in relative.parts and not relative.is_relative_to(PAPERS):
                files.append(relative)
    return files


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_checkout_module(name: str) -> bool:
    path = PROJECT_ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` for every checkout module the code imports or names as a dotted string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            # `from package import name`: name is a submodule when the checkout has it as one
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if is_checkout_module(f"{node.module}.{alias.name}")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            name = node.value.split(":")[0]
            while name and not is_checkout_module(name):
                name = name.rpartition(".")[0]
            if name:
                found.append((node.lineno, name))
    return [(line, name) for line, name in found if name.split(".")[0] in FIRST_PARTY]


def test_the_product_imports_only_the_product():
    sources = product_sources()
    assert Path("simulations/run.py") in sources and Path("fedsurv/api.py") in sources
    product = {module_name(path) for path in sources}
    outside = [f"{path}:{line} {name}" for path in sources
               for line, name in project_imports(ast.parse((PROJECT_ROOT / path).read_text(encoding="utf-8")))
               if name not in product]
    assert not outside, f"product modules that import what the wheel leaves out (simulations.papers, ...): {outside}"


def build_wheel(out: Path) -> Path:
    """The wheel ``pip wheel .`` builds with the project's backend (hatchling; offline when it is installed)."""
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(PROJECT_ROOT), "--no-deps", "--quiet",
                             "--wheel-dir", str(out), *isolation], capture_output=True, text=True, timeout=300)
    if result.returncode and not isolation and "hatchling" in result.stderr and "No matching distribution" in (
            result.stderr):
        pytest.skip("the build backend (hatchling) can neither be imported nor downloaded here")
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("fedsurv-*.whl")
    return wheel


def test_built_wheel_holds_the_product_and_no_reproduction(tmp_path):
    assert PAPERS in wheel_config()["exclude"]
    names = set(zipfile.ZipFile(build_wheel(tmp_path)).namelist())
    assert not [name for name in names if name.startswith(PAPERS)], "the wheel ships the paper reproductions"
    missing = [path.as_posix() for path in product_sources() if path.as_posix() not in names]
    assert not missing, f"product modules left out of the wheel: {missing}"
    assert "models/data/bundled/metabric.csv" in names
    conf = sorted(str(path.relative_to("conf")) for path in Path("conf").rglob("*.yaml"))
    assert [name for name in conf if f"simulations/conf/{name}" not in names] == [], "Hydra's conf/ is not in the wheel"


def test_an_installed_package_takes_the_run_config_defaults_from_the_schema(tmp_path):
    """Without pyproject.toml beside the package (a wheel installed in site-packages) the defaults are the same."""
    from flwr_app.config import project_run_config

    assert project_run_config(tmp_path) == project_run_config()
