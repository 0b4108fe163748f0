"""Import structure (issue 25): no module import cycles, and top-level packages import
only in the documented direction serving -> jaxinfer -> pallas_kernels.

The graph is read from the source with ``ast`` (nothing is imported), function-local
imports included, since those hide cycles rather than remove them. The tree does not
meet the rule yet: what it breaks today is listed in KNOWN_CYCLES / KNOWN_UPWARD_EDGES,
and the test fails both on anything new and on a listed entry that no longer exists, so
the lists can only shrink (delete an entry when its cycle is broken).

Inside jaxinfer/ the modules stand in layers (issue 52: LAYERS): config records <
ops < models and loading < engine < the front (the package, CLI flags, bench). A module
imports only from its own layer and those below, with no exceptions. An op's kernel in
pallas_kernels/ is imported only by the ops layer, where each op's implementation is chosen
in one place (what else imports one today is listed in KNOWN_KERNEL_IMPORTS, which can only
shrink as well).
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

# The layers inside jaxinfer/, bottom first. An entry names a module, or with ".*" a package
# and everything in it; a module's layer is that of its longest entry; every module of
# jaxinfer/ has one (a new module is placed here).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # plain records, validated where they are built (no jax), and leaf helpers that import
    # nothing of jaxinfer/ but these
    ("config", ("jaxinfer.bounds", "jaxinfer.engine_config", "jaxinfer.models.config",
                "jaxinfer.models.gpt_config", "jaxinfer.models.moe_config", "jaxinfer.outputs",
                "jaxinfer.sampling_params", "jaxinfer.errors", "jaxinfer.host_memory",
                "jaxinfer.sharding", "jaxinfer.untrusted_json")),
    # the one module per op that chooses its kernel
    ("ops", ("jaxinfer.matmul", "jaxinfer.reductions", "jaxinfer.attention.dispatch")),
    ("models", ("jaxinfer.models.*", "jaxinfer.loading.*", "jaxinfer.quantization", "jaxinfer.attention.*")),
    ("engine", ("jaxinfer.engine.*",)),
    # what a user or serving/ starts from: the package's names, CLI flags, bench, the references
    ("front", ("jaxinfer", "jaxinfer.engine_args", "jaxinfer.bench.*", "jaxinfer.reference",
               "jaxinfer.quality")),
)

# The ops layer: the one module per op that chooses its implementation (``select`` /
# ``name``): weight matmuls, attention (the layer loop's forms and KV writes included),
# row sums. Everything else reaches a kernel through it.
OPS_LAYER = set(dict(LAYERS)["ops"])
# pallas_kernels modules that are no op's implementation, open to every module: the package
# itself, building the C++ kernels, the layer-indexed kernels' operand form (Stacked), and
# the KV pool's untouched allocation (a choice of content the KV cache makes, not of an op).
NOT_OPS = {"pallas_kernels", "pallas_kernels.cpu_build", "pallas_kernels.layer_stack",
           "pallas_kernels.alloc.cpu"}
# Kernel imports outside the ops layer that exist today, as (importer, kernel module): the
# weight formats and their packing, read straight from the matmul kernels' modules.
KNOWN_KERNEL_IMPORTS: set[tuple[str, str]] = {
    ("jaxinfer.loading.prepared", "pallas_kernels.f32_matmul.cpu"),
    ("jaxinfer.loading.prepared", "pallas_kernels.quantized_matmul.cpu"),
    ("jaxinfer.loading.weight_cache", "pallas_kernels.f32_matmul.cpu"),
    ("jaxinfer.loading.weight_cache", "pallas_kernels.quantized_matmul.xla"),
    ("jaxinfer.quantization", "pallas_kernels.f32_matmul.codes"),
    ("jaxinfer.quantization", "pallas_kernels.f32_matmul.cpu"),
    ("jaxinfer.quantization", "pallas_kernels.quantized_matmul.cpu"),
    ("jaxinfer.quantization", "pallas_kernels.quantized_matmul.xla"),
}


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


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index in ``layers`` of the longest entry naming ``module``; None: no entry does."""
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(layers):
        for e in entries:
            pkg = e.removesuffix(".*")
            if (module == pkg or e.endswith(".*") and module.startswith(pkg + ".")) and \
                    (best is None or len(pkg) > best[1]):
                best = (i, len(pkg))
    return None if best is None else best[0]


def layer_violations(graph: dict[str, set[str]], layers=LAYERS) -> set[tuple[str, str]]:
    """(importer, imported) jaxinfer/ modules where the imported one stands in a higher layer."""
    def rank(m: str) -> int:
        r = layer_of(m, layers)
        return len(layers) if r is None else r
    return {(a, b) for a, bs in graph.items() if a.split(".")[0] == "jaxinfer"
            for b in bs if b.split(".")[0] == "jaxinfer" and rank(b) > rank(a)}


def kernel_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, kernel module) for every import of an op's kernel from outside
    pallas_kernels and the ops layer."""
    return {(a, b) for a, bs in graph.items() for b in bs
            if b.split(".")[0] == "pallas_kernels" and b not in NOT_OPS
            and a.split(".")[0] != "pallas_kernels" and a not in OPS_LAYER}


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


def test_every_jaxinfer_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if m.split(".")[0] == "jaxinfer" and layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_jaxinfer_imports_down_its_layers():
    found = layer_violations(import_graph())
    names = {i: name for i, (name, _) in enumerate(LAYERS)}
    assert not found, "imports against " + " < ".join(names.values()) + " (move the piece down):\n" + \
        "\n".join(f"{a} ({names.get(layer_of(a))}) -> {b} ({names.get(layer_of(b))})" for a, b in sorted(found))


def test_the_layer_rule_can_fail():
    layers = (("low", ("jaxinfer.a", "jaxinfer.b.*")), ("high", ("jaxinfer.b.c", "jaxinfer")))
    mods = ("jaxinfer.a", "jaxinfer.b", "jaxinfer.b.x", "jaxinfer.b.c", "jaxinfer", "jaxinfer.q")
    assert [layer_of(m, layers) for m in mods] == [0, 0, 0, 1, 1, None]
    graph = {"jaxinfer.a": {"jaxinfer.b.x"}, "jaxinfer.b.x": {"jaxinfer.b.c", "pallas_kernels.k"},
             "jaxinfer.b.c": {"jaxinfer.a"}, "jaxinfer": {"jaxinfer.b.c", "jaxinfer.q"}}
    assert layer_violations(graph, layers) == {("jaxinfer.b.x", "jaxinfer.b.c"), ("jaxinfer", "jaxinfer.q")}


def test_only_the_ops_layer_imports_a_kernel():
    found = kernel_imports(import_graph())
    new = found - KNOWN_KERNEL_IMPORTS
    assert not new, "kernels imported outside the ops layer (go through " + \
        ", ".join(sorted(OPS_LAYER)) + "):\n" + "\n".join(f"{a} -> {b}" for a, b in sorted(new))
    gone = KNOWN_KERNEL_IMPORTS - found
    assert not gone, f"these imports are gone: delete them from KNOWN_KERNEL_IMPORTS: {sorted(gone)}"


def test_the_ops_layer_rule_reads_imports_as_kernels_or_not():
    graph = {"jaxinfer.engine.x": {"pallas_kernels.attention.cpu", "pallas_kernels.layer_stack"},
             "jaxinfer.matmul": {"pallas_kernels.f32_matmul.cpu"},
             "pallas_kernels.attention.cpu": {"pallas_kernels.attention.xla"},
             "serving.y": {"pallas_kernels.row_sum.cpu", "jaxinfer.reductions"}}
    assert kernel_imports(graph) == {("jaxinfer.engine.x", "pallas_kernels.attention.cpu"),
                                     ("serving.y", "pallas_kernels.row_sum.cpu")}
    assert OPS_LAYER <= set(import_graph())     # the ops layer's modules exist


if __name__ == "__main__":
    for c in sorted(cycles(import_graph())):
        print("cycle:", " <-> ".join(c))
    for e in sorted(upward_edges(import_graph())):
        print("upward:", *e)
    for e in sorted(layer_violations(import_graph())):
        print("against the layers:", *e)
    for e in sorted(kernel_imports(import_graph())):
        print("kernel outside the ops layer:", *e)
