"""The import graph of the installed package, read with `ast` (nothing is imported): no cycles,
and dependencies point down only — interfaces (serve, tools) over the core (runtime, checkpoints)
over the kernels."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "pallas_kernels", "checkpoints", "serve", "tools")


def _modules() -> dict[str, pathlib.Path]:
    mods = {"jaxinfer": ROOT / "jaxinfer" / "__init__.py"}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = ["jaxinfer", *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the jaxinfer modules it imports anywhere in its body (lazy imports count)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` names a module when pkg.mod is one.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                           else node.module for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                    and node.value in mods:
                targets = [node.value]  # importlib.import_module("jaxinfer....") by name
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_folder_is_read():
    graph = import_graph()
    for folder in FOLDERS:
        assert any(m.startswith(f"jaxinfer.{folder}.") for m in graph), folder
    assert "jaxinfer.runtime.engine" in graph["jaxinfer.runtime.llm"]  # a plain import
    assert "jaxinfer.serve.batch" in graph["jaxinfer.serve.cli"]  # imported by name


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


# Each folder may import only the folders listed for it (and itself). The CLI is the top floor:
# it alone in serve/ registers the benchmark commands of tools/.
ALLOWED = {
    "pallas_kernels": set(),
    "runtime": {"pallas_kernels", "checkpoints"},
    "checkpoints": {"runtime", "pallas_kernels"},
    "serve": {"runtime", "checkpoints", "pallas_kernels"},
    "tools": {"serve", "runtime", "checkpoints", "pallas_kernels"},
}
TOP_FLOOR = {"jaxinfer.serve.cli"}
# Device code (what runs inside the jitted steps) reaches neither the host core above it nor
# load-time code.
DEVICE = {f"jaxinfer.runtime.{m}" for m in
          ("model", "attention", "kv_cache", "sampling", "steps", "quantization", "plan")}
HOST_CORE = {f"jaxinfer.runtime.{m}" for m in
             ("llm", "engine", "scheduler", "speculative", "requests", "batch", "page_allocator")}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "jaxinfer"


def test_dependencies_point_down():
    bad = []
    for mod, deps in import_graph().items():
        layer = _layer(mod)
        if layer == "jaxinfer" or mod in TOP_FLOOR:
            continue
        for dep in deps:
            if _layer(dep) not in ALLOWED[layer] | {layer}:
                bad.append(f"{mod} -> {dep}")
            if mod in DEVICE and (dep in HOST_CORE or _layer(dep) == "checkpoints"):
                bad.append(f"{mod} -> {dep}")
    assert bad == []


def test_runtime_imports_neither_serve_nor_tools():
    bad = [f"{m} -> {d}" for m, deps in import_graph().items() if _layer(m) == "runtime"
           for d in deps if _layer(d) in ("serve", "tools")]
    assert bad == []
