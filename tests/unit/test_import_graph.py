"""The package's module-level imports form no cycle (imports inside functions, made to
break one, do not count as a way out: they are listed here as cycles too, by reading
every import), so each module can be read, and loaded, after the ones it names."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # read once: every test here asks for it
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


# The package's folders and top-level modules in layers, lowest first (docs/ARCHITECTURE.md, "Who may
# import whom"): a module imports its own folder and the layers below its own, nothing level with it
# or above. A new folder or top-level module must be placed here before it can be imported.
LAYERS = [
    ["errors", "host"],  # host: the process's lifetime and the machine's energy readings
    ["configuration", "hub"],  # configuration: options, flags and memory sizes; hub: a model named by its Hub id
    ["structured", "quant", "lora"],
    ["sampling_params", "pooling_params", "kernels"],
    ["beam_search", "engine", "model"],  # engine: no torch; model: no requests
    ["worker"],
    ["speculative", "distributed", "evaluate", "quantize"],  # the proposers plug into the runner, never the reverse
    ["factory"],
    ["llm", "core_process"],
    ["plan", "loadgen", "server"],  # server: the HTTP app, whoever hosts its engines
    ["tune"],  # starts servers (tokenmill serve) and drives them with loadgen
    ["replicas"],  # Ray Serve replicas: engines hosted there, and the app as a Serve application
    ["entrypoints"],  # the command line and tokenmill serve's choice among the ways to host engines
    ["__main__", "tokenmill"],
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """``tokenmill.engine.core.engine_core`` -> ``engine``; ``tokenmill.llm`` -> ``llm``; ``tokenmill`` -> ``tokenmill``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def arrows_against_layers(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, deps in graph.items():
        here = unit_of(module)
        for dep in deps:
            there = unit_of(dep)
            if there != here and LAYER[there] >= LAYER[here]:
                wrong.append(f"{module} -> {dep} ({here} is in layer {LAYER[here]}, {there} in layer {LAYER[there]})")
    return sorted(wrong)


def test_every_folder_has_a_layer():
    units = {unit_of(m) for m in import_graph()}
    assert not units - LAYER.keys(), f"place these in LAYERS: {sorted(units - LAYER.keys())}"


def test_imports_point_down_the_layers():
    wrong = arrows_against_layers(import_graph())
    assert not wrong, "\n".join(wrong)


def test_the_layer_rule_finds_an_upward_and_a_sideways_arrow():
    graph = {
        "tokenmill.engine.core.engine_core": {"tokenmill.model.llama", "tokenmill.configuration.config"},
        "tokenmill.model.llama": set(),
        "tokenmill.configuration.config": set(),
        "tokenmill.quant.packed": {"tokenmill.kernels.cpu"},
        "tokenmill.kernels.cpu": set(),
    }
    assert arrows_against_layers(graph) == [
        "tokenmill.engine.core.engine_core -> tokenmill.model.llama (engine is in layer 4, model in layer 4)",
        "tokenmill.quant.packed -> tokenmill.kernels.cpu (quant is in layer 2, kernels in layer 3)",
    ]


# Inside engine/: the core process's side (core/) and the API process's side (api/) meet only
# through the pipe (pipe/) and the records both read (the folder's own modules: model_input,
# outputs, stats, sequences); the in-process hosts (engine.py, async_engine.py) join the two.
SIDES = {"tokenmill.engine.core": "core", "tokenmill.engine.api": "api", "tokenmill.engine.pipe": "pipe"}
SIDE_MAY_IMPORT = {"core": {"core", "pipe"}, "api": {"api", "pipe"}, "pipe": {"pipe"}}


def side_of(module: str) -> str | None:
    return next((side for prefix, side in SIDES.items() if module == prefix or module.startswith(prefix + ".")), None)


def arrows_across_sides(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, deps in graph.items():
        here = side_of(module)
        for dep in deps:
            there = side_of(dep)
            if here is not None and there is not None and there not in SIDE_MAY_IMPORT[here]:
                wrong.append(f"{module} -> {dep} (the {here} side imports the {there} side)")
    return sorted(wrong)


def test_the_engine_sides_meet_only_through_the_pipe():
    wrong = arrows_across_sides(import_graph())
    assert not wrong, "\n".join(wrong)
    assert {side_of(m) for m in import_graph()} >= {"core", "api", "pipe"}


def test_the_side_rule_finds_a_crossing():
    graph = {
        "tokenmill.engine.api.core_client": {"tokenmill.engine.core.request", "tokenmill.engine.pipe.wire"},
        "tokenmill.engine.pipe.wire": {"tokenmill.engine.outputs"},
        "tokenmill.engine.core.core_loop": {"tokenmill.engine.pipe.channel"},
    }
    assert arrows_across_sides(graph) == [
        "tokenmill.engine.api.core_client -> tokenmill.engine.core.request (the api side imports the core side)"
    ]


def test_the_root_holds_the_public_api_and_the_entries_only():
    """At most eight modules at the package's root (besides ``__init__`` and ``__main__``): the
    rest lives in folders that say their role, and no module grows past 600 lines."""
    root = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(root) <= 8, root
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
