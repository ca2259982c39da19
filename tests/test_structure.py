"""Small units and no import cycle, checked over every module of serval/ (docs/architecture.md, "Ten
conventions", 3): a module of at most 400 lines, a function of at most 60, and no cycle among serval's modules,
function-level imports included (only `if TYPE_CHECKING:` imports are left out: they never run). The layers'
direction is tests/test_layering.py's."""

from __future__ import annotations

import ast

from tests.imports import import_graph, modules

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_no_module_is_over_400_lines():
    long = {}
    for name, path in modules().items():
        num_lines = len(path.read_text(encoding="utf-8").splitlines())
        if num_lines > MAX_MODULE_LINES:
            long[name] = num_lines
    assert long == {}


def test_no_function_is_over_60_lines():
    long = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1  # the def line to the last, docstring included
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{name}:{node.lineno} {node.name}"] = num_lines
    assert long == {}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start, successors in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(successors)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            successor = next(edges, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_longer_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_import_graph_sees_function_level_imports():
    # serval/__init__.py imports the offline LLM inside a function (`__getattr__`): that edge must be seen.
    assert "serval.entrypoints.llm" in import_graph()["serval"]
