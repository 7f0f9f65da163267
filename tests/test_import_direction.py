"""Imports flow one way (docs/architecture.md), checked statically over every module, function-local imports too.

    edge_client     -> shared
    partition_tools -> shared, edge_client      (verify and the planner run the phone's own runtime)
    cloud_server    -> shared, partition_tools  (the cloud half's format and model live in partition_tools)
    rig             -> any of them

``shared`` imports none of them, and neither ``shared`` nor ``edge_client`` imports torch or transformers (the
phone has neither). None of the five imports ``bench``, ``tests`` or ``scripts`` (only the five are installed).
The one exception: the edge demo's bundle builder (``edge_client.demo.ensure_bundle``) imports partition_tools to
build its bundle (and the demo starts cloud_server as a subprocess, not an import).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "edge_client", "partition_tools", "cloud_server", "rig")
ALLOWED = {
    "shared": frozenset(),
    "edge_client": frozenset({"shared"}),
    "partition_tools": frozenset({"shared", "edge_client"}),
    "cloud_server": frozenset({"shared", "partition_tools"}),
    "rig": frozenset(PACKAGES),
}
NOT_INSTALLED = frozenset({"bench", "tests", "scripts"})  # outside pyproject's packages.find: never a package's import
NO_TORCH = {"shared", "edge_client"}
TORCH = frozenset({"torch", "transformers"})
# (importing module, enclosing function, imported package): the only edges allowed against the direction
EXCEPTIONS = frozenset({("edge_client.demo", "ensure_bundle", "partition_tools")})


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, "cloud_server.model"
    function: str | None  # innermost enclosing function, None at module level
    target: str  # top-level package imported, "partition_tools"
    line: int


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, package: str):
        self.module, self.package = module, package  # package: what a level-1 relative import is relative to
        self.functions: list[str] = []
        self.found: list[Import] = []

    def _add(self, name: str, node: ast.AST) -> None:
        fn = self.functions[-1] if self.functions else None
        self.found.append(Import(self.module, fn, name.split(".")[0], node.lineno))

    def _function(self, node) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # relative: within the importing package (it cannot climb above the top level)
            base = self.package.split(".")[: max(1, len(self.package.split(".")) - node.level + 1)]
            self._add(".".join(base), node)
        else:
            self._add(node.module, node)

    def visit_Call(self, node: ast.Call) -> None:  # importlib.import_module("pkg.mod") with a literal name
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source`` (the text of ``module``), at module level or inside functions."""
    c = _Collector(module, module if is_package else module.rpartition(".")[0] or module)
    c.visit(ast.parse(source))
    return c.found


def violations(found: list[Import]) -> list[str]:
    """The imports against the allowed direction (or of torch where the phone runs), one line each."""
    bad = []
    for imp in found:
        src = imp.module.split(".")[0]
        if src not in ALLOWED or imp.target == src:
            continue
        if imp.target in NOT_INSTALLED:
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} (not installed: only the packages are)")
        elif imp.target in PACKAGES and imp.target not in ALLOWED[src] \
                and (imp.module, imp.function, imp.target) not in EXCEPTIONS:
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} (allowed: {sorted(ALLOWED[src])})")
        elif src in NO_TORCH and imp.target in TORCH:
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} (the phone has no torch)")
    return bad


def all_modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def test_every_module_imports_along_the_allowed_direction():
    modules = all_modules()
    assert {"cloud_server.model", "partition_tools.cloud_half", "edge_client.front", "shared.protocol"} \
        <= {m for m, _ in modules}
    found = [imp for m, path in modules for imp in imports_of(m, path.read_text(), path.name == "__init__.py")]
    assert violations(found) == []


@pytest.mark.parametrize(("module", "source", "bad"), [
    ("partition_tools.split", "def write():\n    from cloud_server.model import CloudModel\n", 1),  # local import
    ("partition_tools.split", "import cloud_server.model as m\n", 1),
    ("shared.codecs", "import edge_client\n", 1),
    ("edge_client.front", "def f():\n    import torch\n", 1),
    ("edge_client.client", "import importlib\nimportlib.import_module('cloud_server.app')\n", 1),
    ("edge_client.demo", "from partition_tools.split import split\n", 1),  # the exception is the builder only
    ("edge_client.demo", "def ensure_bundle():\n    from partition_tools.split import split\n", 0),
    ("cloud_server.model", "from partition_tools.cloud_half import CloudModel\nimport torch\n", 0),
    ("cloud_server.engine.llm_engine", "from ..model import CloudModel\nfrom . import scheduler\n", 0),
    ("rig.profiles", "import cloud_server, edge_client, partition_tools, shared\n", 0),
    ("rig.runner", "def f():\n    from bench.results_io import emit\n", 1),  # bench/ is not installed
    ("cloud_server.app", "import tests.model_support\n", 1),
])
def test_the_check_catches_edges_against_the_direction(module, source, bad):
    found = imports_of(module, source)
    assert found, "nothing collected"
    assert len(violations(found)) == bad, violations(found)
