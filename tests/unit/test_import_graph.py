"""The package's module-level imports form no cycle (imports inside functions, made to
break one, do not count as a way out: they are listed here as cycles too, by reading
every import), so each module can be read, and loaded, after the ones it names."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name and t != "tokenmill"}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# package -> packages it must never import (docs/ARCHITECTURE.md, "Who may import whom")
FORBIDDEN = {
    "tokenmill.engine": ("tokenmill.model", "tokenmill.worker", "tokenmill.kernels", "tokenmill.quant",
                         "tokenmill.distributed", "tokenmill.speculative"),  # fmt: skip
    "tokenmill.model": ("tokenmill.engine", "tokenmill.worker", "tokenmill.distributed", "tokenmill.speculative"),
    "tokenmill.kernels": ("tokenmill.model", "tokenmill.engine", "tokenmill.worker", "tokenmill.speculative"),
    "tokenmill.worker": ("tokenmill.speculative",),  # the proposers plug into the runner, never the reverse
}


def test_imports_point_down():
    wrong = [f"{m} -> {d}" for m, deps in import_graph().items() for pkg, banned in FORBIDDEN.items()
             if m.startswith(pkg + ".") or m == pkg for d in deps if d.startswith(banned)]  # fmt: skip
    assert not wrong, wrong
