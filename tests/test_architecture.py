"""The import graph the layout promises (docs/ARCHITECTURE.md): no circles, the engine never imports web code,
the scheduler side never imports MLX, and no module mixes a web framework with MLX.

Read from the source with `ast`, so the test sees lazy (function-level) imports too."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "kernels")
WEB = ("fastapi", "starlette", "uvicorn", "sse_starlette", "pydantic", "pydantic_settings", "prometheus_client")
MLX_FREE = ("engine.serving.protocol", "engine.serving.request", "engine.serving.scheduler")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
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
    return name.split(".")[0]


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
    graph = {"server.app": {"server.routes"}, "server.routes": {"server.state", "server.app"}, "server.state": set()}
    assert find_cycle(sorted(graph), graph.__getitem__) == ["server.app", "server.routes", "server.app"]
    del graph["server.routes"]
    assert find_cycle(["server.app", "server.state"], lambda m: graph.get(m, set())) is None


def test_engine_and_kernels_never_import_web_code_or_the_server():
    for module in modules():
        if top(module) in ("engine", "kernels"):
            bad = {n for n in imports_of(module) if top(n) in WEB or top(n) == "server"}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_no_module_mixes_a_web_framework_with_mlx():
    for module in modules():
        names = {top(n) for n in imports_of(module)}
        assert not ({"mlx"} & names and set(WEB) & names), f"{module} imports both MLX and web code"


def test_the_scheduler_side_never_reaches_mlx():
    for module in MLX_FREE:
        assert not reaches(module, lambda name: top(name) == "mlx"), f"{module} reaches mlx"
