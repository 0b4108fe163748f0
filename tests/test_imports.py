"""Import structure (issue 25): no module import cycles, and top-level packages import
only in the documented direction serving -> jaxinfer -> pallas_kernels.

The graph is read from the source with ``ast`` (nothing is imported), function-local
imports included, since those hide cycles rather than remove them. The tree does not
meet the rule yet: what it breaks today is listed in KNOWN_CYCLES / KNOWN_UPWARD_EDGES,
and the test fails both on anything new and on a listed entry that no longer exists, so
the lists can only shrink (delete an entry when its cycle is broken).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serving", "jaxinfer", "pallas_kernels")        # each may import those after it

# Strongly connected components of the module graph that exist today (sorted members).
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# Imports against the documented direction, as (importer, imported) module pairs.
KNOWN_UPWARD_EDGES: set[tuple[str, str]] = set()


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    anchor = ".".join(parts[:len(parts) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(tuple(sorted(comp)))
    return found


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    rank = {p: i for i, p in enumerate(PACKAGES)}
    return {(a, b) for a, bs in graph.items() for b in bs
            if rank[b.split(".")[0]] < rank[a.split(".")[0]]}


def test_the_graph_sees_function_local_and_relative_imports():
    g = import_graph()
    assert "jaxinfer.engine.engine" in g and "jaxinfer.engine_config" in g["jaxinfer.engine.engine"]
    # a function-local import (cli's serve command) is an edge like any other
    assert "serving.server" in g["serving.cli"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_no_new_import_cycles():
    found = cycles(import_graph())
    new = found - KNOWN_CYCLES
    assert not new, "import cycles (break them; see the module docstring):\n" + \
        "\n".join(" <-> ".join(c) for c in sorted(new))
    gone = KNOWN_CYCLES - found
    assert not gone, f"these cycles are gone: delete them from KNOWN_CYCLES: {sorted(gone)}"


def test_packages_import_in_one_direction():
    found = upward_edges(import_graph())
    new = found - KNOWN_UPWARD_EDGES
    assert not new, "imports against serving -> jaxinfer -> pallas_kernels:\n" + \
        "\n".join(f"{a} -> {b}" for a, b in sorted(new))
    gone = KNOWN_UPWARD_EDGES - found
    assert not gone, f"these edges are gone: delete them from KNOWN_UPWARD_EDGES: {sorted(gone)}"


if __name__ == "__main__":
    for c in sorted(cycles(import_graph())):
        print("cycle:", " <-> ".join(c))
    for e in sorted(upward_edges(import_graph())):
        print("upward:", *e)
