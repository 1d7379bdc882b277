"""The import graph the layout promises (docs/ARCHITECTURE.md): no circles, the engine never imports web code,
the scheduler side never imports MLX, and no module mixes a web framework with MLX.

Read from the source with `ast`, so the test sees lazy (function-level) imports too."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "tessera"
PACKAGES = ("engine", "server", "kernels")  # the checkout's folders; installed as tessera.engine, ... (pyproject.toml)
WEB = ("fastapi", "starlette", "uvicorn", "sse_starlette", "pydantic", "pydantic_settings", "prometheus_client")
MLX_FREE = ("tessera.engine.serving.protocol", "tessera.engine.serving.request", "tessera.engine.serving.scheduler")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join((NAMESPACE, *path.relative_to(ROOT).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


@lru_cache(maxsize=None)
def imports_of(module: str) -> frozenset[str]:
    """Every module `module` imports, anywhere in its body (absolute names; `from x import y` gives x or x.y)."""
    tree = ast.parse(modules()[module].read_text())
    known = modules()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return frozenset(names)


def project_imports(module: str) -> set[str]:
    return {name for name in imports_of(module) if name in modules() and name != module}


def top(name: str) -> str:
    """The package an import name belongs to; for the project's own, its folder (`tessera.engine.x` -> engine)."""
    parts = name.split(".")
    return parts[1] if parts[0] == NAMESPACE and len(parts) > 1 else parts[0]


def reaches(module: str, predicate, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    if module in seen:
        return False
    seen.add(module)
    if any(predicate(name) for name in imports_of(module)):
        return True
    return any(reaches(dep, predicate, seen) for dep in project_imports(module))


def find_cycle(nodes=None, edges=None) -> list[str] | None:
    """A cycle in the import graph as a path, or None (depth-first, colouring). Defaults: the project's."""
    nodes = sorted(modules()) if nodes is None else nodes
    edges = project_imports if edges is None else edges
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(edges(module)):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in nodes:
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_import_graph_has_no_cycles():
    assert find_cycle() is None, " -> ".join(find_cycle() or [])


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: app -> routes -> app (the circle this layout removed) is reported."""
    graph = {"tessera.server.app": {"tessera.server.routes"}, "tessera.server.routes": {"tessera.server.state", "tessera.server.app"}, "tessera.server.state": set()}
    assert find_cycle(sorted(graph), graph.__getitem__) == ["tessera.server.app", "tessera.server.routes", "tessera.server.app"]
    del graph["tessera.server.routes"]
    assert find_cycle(["tessera.server.app", "tessera.server.state"], lambda m: graph.get(m, set())) is None


def test_engine_and_kernels_never_import_web_code_or_the_server():
    for module in modules():
        if top(module) in ("engine", "kernels"):
            bad = {n for n in imports_of(module) if top(n) in WEB or top(n) == "server"}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_kernels_import_nothing_of_the_engine():
    """kernels/ is the layer below the model: MLX and its own modules only (the engine calls down into it)."""
    for module in modules():
        if top(module) == "kernels":
            bad = {n for n in imports_of(module) if top(n) in ("engine", "server")}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_no_module_mixes_a_web_framework_with_mlx():
    for module in modules():
        names = {top(n) for n in imports_of(module)}
        assert not ({"mlx"} & names and set(WEB) & names), f"{module} imports both MLX and web code"


def test_the_scheduler_side_never_reaches_mlx():
    for module in MLX_FREE:
        assert not reaches(module, lambda name: top(name) == "mlx"), f"{module} reaches mlx"



def python_files() -> list[Path]:
    """The project's modules, its tests and the benchmark scripts under docs/."""
    return sorted(modules().values()) + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "docs").rglob("*.py"))


def old_names_in(source: str) -> list[str]:
    """Imports, and module paths in strings (`-m` argv, monkeypatch targets, logger names), that start with a bare
    folder name (`engine` where `tessera.engine` is meant): importable from a checkout's root only, not installed."""
    bare = {name.removeprefix(NAMESPACE + ".") for name in modules()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in re.finditer(r"(?<![\w./-])(?:engine|server|kernels)(?:\.\w+)+", node.value):
                parts = match[0].split(".")
                if any(".".join(parts[:i]) in bare for i in range(2, len(parts) + 1)):
                    found.append(repr(match[0]))
    return found


def test_every_import_uses_the_tessera_namespace():
    """pytest puts the checkout's root on sys.path, so an import of a bare folder name would pass every other test
    and fail once installed. Code written before the move to `tessera.*` is caught here (README.md)."""
    stale = [f"{path.relative_to(ROOT)}: {what}" for path in python_files() for what in old_names_in(path.read_text())]
    assert not stale, "\n".join(stale)


def test_the_old_name_check_finds_old_names():
    # Spelled through format() so that the rename that moved this project under `tessera` leaves it alone.
    source = ("import {e}.model.loader as loader\nfrom {k} import indexer\n"
              "ARGV = ['-m', '{s}.cli']\nTARGET = '{e}.serving.runner.build_runner'\n"
              "FINE = ('tessera.{e}.tools.commands', 'the {e}.', 'served.{e}.start', 'check-{k}.json')\n")
    found = old_names_in(source.format(e="engine", k="kernels", s="server"))
    expected = ["import {e}.model.loader", "from {k} import", "'{s}.cli'", "'{e}.serving.runner.build_runner'"]
    assert sorted(found) == sorted(line.format(e="engine", k="kernels", s="server") for line in expected)
