"""The product uses Flower, PyTorch, Opacus and Ray through their public names only, and changes nothing in them.

An AST scan of every module of the product packages (not the tests, not the benchmarks) refuses

* a private name (``_x``, not ``__x__``) of ``flwr``, ``torch``, ``opacus`` or ``ray``: imported
  (``from flwr.simulation.run_simulation import _run_simulation``, ``import torch._dynamo``), in a
  dotted module path (``from torch.optim._functional import adam``), or reached as an attribute of a
  name imported from them (``vce_api._register_node_info_stores``, ``torch._dynamo``,
  ``getattr(torch, "_C")``), and
* an assignment into them: to an attribute of a module or object imported from them
  (``vce_api.add_messages_to_queue = ...``, ``del torch.x``, ``setattr(vce_api, ...)``).

One assignment is allowed: ``TaskIdentity.task_id``/``run_id``/``node_id`` of
``flwr.supercore.task_identity``, the identity that Flower's runtimes (``run_serverapp``,
``run_clientapp``, ``run_simulation``) set through those properties' setters for the messages a
process creates, and that the in-process engine, a runtime of its own, sets for the same reason.

One module, ``flwr_app/flower_entry.py``, and no other imports the undocumented Flower entry points
that the warm ClientApp executor needs (Flower's Runtime API client and ``run_clientapp``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("fedsurv", "flwr_app", "models", "strategies", "simulations")
PACKAGES = ("flwr", "torch", "opacus", "ray")
ALLOWED_ASSIGNMENTS = {f"flwr.supercore.task_identity.TaskIdentity.{key}" for key in ("task_id", "run_id", "node_id")}
#: The one module allowed the undocumented Flower entry points of the warm ClientApp executor (Flower's Runtime API
#: client and its ``run_clientapp``); it names the Flower versions it was tested with (``tests/test_executor.py``).
FLOWER_ENTRY_MODULE = "flwr_app/flower_entry.py"
FLOWER_ENTRY_POINTS = ("flwr.supernode", "flwr.supercore.runtime", "flwr.supercore.superexec",
                       "flwr.supercore.interceptors", "flwr.supercore.retry", "flwr.supercore.tls", "flwr.proto")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(dotted: str) -> bool:
    return dotted.split(".", 1)[0] in PACKAGES


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted path of every name bound by an import from the packages (anywhere in the module)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _ours(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The dotted path of ``a.b.c`` when ``a`` is a name imported from the packages, else None."""
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(attributes)])
    return None


def _import_findings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [f"import {alias.name}" for alias in node.names
                if _ours(alias.name) and any(map(_private, alias.name.split(".")))]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level and _ours(node.module):
        return [f"from {node.module} import {alias.name}" for alias in node.names
                if any(map(_private, [*node.module.split("."), alias.name]))]
    return []


def _target_findings(node: ast.AST, bound: dict[str, str]) -> list[str]:
    """Assignments (and deletions) of attributes of imported names, and setattr/delattr on them."""
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    findings = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Attribute) and (dotted := _dotted(target, bound)) and \
                dotted not in ALLOWED_ASSIGNMENTS:
            findings.append(f"assignment to {dotted}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
            and node.args and (dotted := _dotted(node.args[0], bound)):
        findings.append(f"{node.func.id}({dotted}, ...)")
    return findings


def violations(source: str) -> list[str]:
    """What the module ``source`` does that this file's docstring refuses, one line each."""
    tree = ast.parse(source)
    bound = _bindings(tree)
    findings = []
    for node in ast.walk(tree):
        lines = _import_findings(node) + _target_findings(node, bound)
        if isinstance(node, ast.Attribute) and (dotted := _dotted(node, bound)) and \
                any(map(_private, dotted.split("."))):
            lines.append(dotted)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and (dotted := _dotted(node.args[0], bound)) and \
                isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value)):
            lines.append(f"{node.func.id}({dotted}, {node.args[1].value!r})")
        findings.extend(f"line {node.lineno}: {line}" for line in lines)
    return sorted(set(findings), key=lambda line: (int(line.split(":")[0].split()[1]), line))


def test_no_product_module_uses_a_private_name_of_flower_torch_or_opacus_or_assigns_into_them():
    files = sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))
    assert len(files) > 50  # the scan sees the product
    sources = {path: path.read_text(encoding="utf-8") for path in files}
    found = {str(path.relative_to(ROOT)): lines for path, source in sources.items()
             if any(package in source for package in PACKAGES) and (lines := violations(source))}
    assert found == {}


def test_only_the_flower_entry_module_imports_the_executors_undocumented_flower_entry_points():
    files = sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))
    found = {}
    for path in files:
        bound = _bindings(ast.parse(path.read_text(encoding="utf-8"))).values()
        if uses := sorted(name for name in bound if name.startswith(FLOWER_ENTRY_POINTS)):
            found[str(path.relative_to(ROOT))] = uses
    assert set(found) == {FLOWER_ENTRY_MODULE}, found


def test_the_scan_finds_private_names_and_assignments_into_the_packages():
    bad = """
from flwr.simulation.run_simulation import _run_simulation
from flwr.server.superlink.fleet.vce import vce_api
from torch.optim._functional import adam
import torch._dynamo
import torch.optim.adam as adam_module
import opacus
from flwr.supercore.task_identity import TaskIdentity

adam_module._single_tensor_adam(1)
vce_api.add_messages_to_queue = print
original = vce_api._register_node_info_stores
setattr(vce_api, "x", 1)
torch.backends.flag = True
opacus.privacy_engine.x += 1
del torch.x
compiled = getattr(opacus, "_private")
TaskIdentity._task_id = 1
"""
    assert {line.split(": ", 1)[1] for line in violations(bad)} == {
        "from flwr.simulation.run_simulation import _run_simulation",
        "from torch.optim._functional import adam",
        "import torch._dynamo",
        "torch.optim.adam._single_tensor_adam",
        "assignment to flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue",
        "flwr.server.superlink.fleet.vce.vce_api._register_node_info_stores",
        "setattr(flwr.server.superlink.fleet.vce.vce_api, ...)",
        "assignment to torch.backends.flag",
        "assignment to opacus.privacy_engine.x",
        "assignment to torch.x",
        "getattr(opacus, '_private')",
        "assignment to flwr.supercore.task_identity.TaskIdentity._task_id",
        "flwr.supercore.task_identity.TaskIdentity._task_id",
    }


def test_the_scan_passes_public_use_and_the_runtime_identity():
    good = """
import torch
import flwr.simulation
from flwr.app import Context
from flwr.supercore.task_identity import TaskIdentity
from models import _helpers

TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 2, 3
version = torch.__version__
flwr.simulation.run_simulation
context = Context(1, 2, {}, None, {})
context.run_config = {}
_helpers._x = 1
"""
    assert violations(good) == []
