"""The engine's interface (runtime/host/interface.py): the real engine implements it, and the
front ends under serve/ use nothing else of an engine (read with `ast`, nothing imported)."""

import ast
import pathlib

from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.host.interface import EngineInterface, members, missing_members

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_engine_implements_the_interface(tiny_llm):
    assert missing_members(Engine) == []
    assert missing_members(tiny_llm.engine) == []
    assert isinstance(tiny_llm.engine, EngineInterface)
    s = tiny_llm.engine.stats()
    assert {"running", "waiting", "max_slots", "pages_total", "pages_free", "compile_count",
            "faults", "consecutive_faults", "ttft_target_s", "itl_target_s"} <= set(s)
    assert s["max_slots"] == 4 and s["pages_free"] == s["pages_total"] > 0


def _engine_uses(tree) -> list[tuple[int, str]]:
    """(line, member) of every `<...>.engine.<member>` and of every getattr / hasattr on an
    engine in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name)):
            base = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
            if base == "engine":
                out.append((node.lineno, node.attr))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and "engine" in ast.unparse(node.args[0])):
            out.append((node.lineno, f"{node.func.id}(...)"))
    return out


def test_serve_uses_only_the_interface():
    allowed = set(members())
    bad = [f"{p.relative_to(ROOT)}:{line}: engine.{name}"
           for p in sorted((ROOT / "serve").rglob("*.py"))
           for line, name in _engine_uses(ast.parse(p.read_text())) if name not in allowed]
    assert bad == []


def test_the_check_finds_a_planted_reach_into_the_engine():
    planted = ast.parse("def f(loop):\n    loop.engine.scheduler.slo\n"
                        "    getattr(loop.engine, 'faults', 0)\n    loop.engine.step()\n")
    assert sorted(_engine_uses(planted)) == [(2, "scheduler"), (3, "getattr(...)"), (4, "step")]
    assert "scheduler" not in members() and "step" in members()
