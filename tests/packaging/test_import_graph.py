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
    assert any(m.startswith("jaxinfer.runtime.host.") for m in graph)
    assert "jaxinfer.runtime.engine" in graph["jaxinfer.runtime.llm"]  # a plain import
    assert "jaxinfer.serve.batch" in graph["jaxinfer.serve.cli"]  # imported by name


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


# The rooms: each may import only the rooms listed for it (and itself). runtime/ is three rooms
# and its two schemas: runtime/config.py and runtime/plan.py (the configs and the step plan every
# room reads), runtime/host/ (the host's work, no JAX), runtime/device/ (what runs on the device,
# JAX), and the engine level above them (runtime/*.py: the engine, the LLM API, the prepare step,
# the proposers). A module's room is its folder: a new module obeys the rules where it is put.
ALLOWED = {
    "pallas_kernels": set(),
    "runtime.schema": set(),
    "runtime.host": {"runtime.schema"},
    "runtime.device": {"runtime.schema", "pallas_kernels"},
    # loaders build parameters of the device code's types; they never reach the engine level
    "checkpoints": {"runtime.schema", "runtime.host", "runtime.device", "pallas_kernels"},
    "runtime.engine": {"runtime.schema", "runtime.host", "runtime.device", "checkpoints",
                       "pallas_kernels"},
    # front ends talk to the engine (its interface, the request door), never to device code
    "serve": {"runtime.schema", "runtime.host", "runtime.engine", "checkpoints"},
    "tools": {"serve", "runtime.schema", "runtime.host", "runtime.device", "runtime.engine",
              "checkpoints", "pallas_kernels"},
}
TOP_FLOOR = {"jaxinfer.serve.cli"}  # the CLI registers the benchmark commands of tools/
SCHEMAS = {"jaxinfer.runtime.config", "jaxinfer.runtime.plan"}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 3:
        return "jaxinfer"
    if parts[1] != "runtime":
        return parts[1]
    if module in SCHEMAS:
        return "runtime.schema"
    if len(parts) > 3 and parts[2] in ("host", "device"):
        return f"runtime.{parts[2]}"
    return "runtime.engine"


def test_every_room_is_read():
    rooms = {room(m) for m in import_graph()}
    assert set(ALLOWED) <= rooms, set(ALLOWED) - rooms
    assert room("jaxinfer.runtime.host.scheduler") == "runtime.host"
    assert room("jaxinfer.runtime.device.model") == "runtime.device"
    assert room("jaxinfer.runtime.engine") == "runtime.engine"
    assert room("jaxinfer.runtime.plan") == "runtime.schema"


def test_dependencies_point_down():
    bad = []
    for mod, deps in import_graph().items():
        r = room(mod)
        if r == "jaxinfer" or mod in TOP_FLOOR:
            continue
        bad += [f"{mod} -> {dep}" for dep in deps if room(dep) not in ALLOWED[r] | {r}]
    assert bad == []


def test_the_rules_catch_a_planted_violation():
    graph = import_graph()
    graph["jaxinfer.runtime.device.moe"] = {"jaxinfer.runtime.engine"}
    graph["jaxinfer.runtime.host.scheduler"] = {"jaxinfer.runtime.device.model"}
    bad = [(m, d) for m, deps in graph.items() if room(m) in ALLOWED
           for d in deps if room(d) not in ALLOWED[room(m)] | {room(m)}]
    assert ("jaxinfer.runtime.device.moe", "jaxinfer.runtime.engine") in bad
    assert ("jaxinfer.runtime.host.scheduler", "jaxinfer.runtime.device.model") in bad


def test_the_host_room_and_the_schemas_never_import_jax():
    """Every module of runtime/host/ and both schemas, imported in a fresh interpreter, leave
    jax (and jaxlib) out of sys.modules."""
    import subprocess
    import sys

    mods = sorted(m for m in import_graph() if room(m) in ("runtime.host", "runtime.schema"))
    assert len(mods) > 8, mods
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_import_jaxinfer_and_the_command_line_help_never_start_jax():
    """`import jaxinfer` is lazy and `jaxinfer --help` (every command registered) and a
    command's own --help answer without importing jax (seconds saved on each)."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "import jaxinfer\n"
            "from jaxinfer.serve.cli import build_parser\n"
            "p = build_parser()\n"
            "for argv in (['--help'], ['serve', '--help'], ['bench', 'startup', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        p.parse_args(argv)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
