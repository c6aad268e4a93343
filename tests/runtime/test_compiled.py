"""Programs compiled ahead (`jaxinfer compile`, runtime/compiled.py): a fresh process with an
empty compilation cache and the shipped programs compiles nothing for its first answer (nor
builds the CPU kernels), and answers as one without; a manifest written on another host (its CPU flags, jax version) or an
unreadable one is refused with a warning naming why, and the engine compiles its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ("--max-slots", "2", "--max-model-len", "64")

# a fresh process: the first answer's tokens and its persistent-cache misses (programs compiled)
CHILD = r"""
import json, logging, sys
misses = []
class Count(logging.Handler):
    def emit(self, r):
        if "PERSISTENT COMPILATION CACHE MISS" in r.getMessage():
            misses.append(r.getMessage())
logging.getLogger("jax._src.compiler").addHandler(Count(logging.DEBUG))
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
from jaxinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], max_slots=2, max_model_len=64, compiled_dir=sys.argv[2])
out = llm.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0))[0]
print(json.dumps(dict(tokens=out.token_ids, misses=len(misses))))
"""


def _env(cache: Path, models: Path | None = None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXINFER_COMPILATION_CACHE=str(cache))
    if models is not None:  # a fresh host's model and kernel cache
        env["JAXINFER_CACHE"] = str(models)
    env.pop("JAXINFER_TEST_COMPILATION_CACHE", None)
    return env


def _first_answer(model: Path, shipped: Path, cache: Path,
                  models: Path | None = None) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(shipped)], cwd=ROOT,
                         env=_env(cache, models), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_shipped_programs_start_a_fresh_process_without_compiling(tiny_dir, tmp_path):
    shipped = tmp_path / "compiled"
    out = subprocess.run([sys.executable, "-m", "jaxinfer.serve.cli", "compile", "--model",
                          str(tiny_dir), "--out", str(shipped), *OPTIONS], cwd=ROOT,
                         env=_env(tmp_path / "compile_cache"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["programs"] == len(list((shipped / "xla").glob("*-cache"))) > 0
    assert manifest["options"]["max_slots"] == 2 and manifest["host"]["cpu_flags"]
    assert manifest["kernels"] or shutil.which(os.environ.get("CXX", "g++")) is None
    assert not (tmp_path / "compile_cache").exists()  # everything went to --out

    warm, _ = _first_answer(tiny_dir, shipped, tmp_path / "cache_a", tmp_path / "models_a")
    assert warm["misses"] == 0, warm  # every program came from the shipped set
    for name in manifest["kernels"]:  # the CPU kernels too: linked, not built again
        assert (tmp_path / "models_a" / "kernels" / name).stat().st_nlink > 1

    # another host's programs (its CPU): refused by name, compiled here, the same answer
    other = tmp_path / "other"
    shutil.copytree(shipped, other)
    manifest["host"]["cpu_flags"] = ["sse2"]
    (other / "manifest.json").write_text(json.dumps(manifest))
    cold, log = _first_answer(tiny_dir, other, tmp_path / "cache_b")
    assert "cpu_flags" in log and "not used" in log
    assert cold["misses"] > 0 and cold["tokens"] == warm["tokens"]


def _manifest(where: Path, **host) -> None:
    from jaxinfer.runtime.compiled import FORMAT, MANIFEST, PROGRAMS, host as this_host

    (where / PROGRAMS).mkdir(parents=True)
    (where / PROGRAMS / "jit_x-0123-cache").write_bytes(b"program")
    (where / MANIFEST).write_text(json.dumps(dict(format=FORMAT, host=this_host() | host,
                                                  options={})))


@pytest.mark.parametrize("host, installed", [({}, 1), ({"jax": "0.0.1"}, 0),
                                             ({"devices": 99}, 0)])
def test_install_links_programs_only_for_a_host_like_this_one(tmp_path, monkeypatch, caplog,
                                                              host, installed):
    from jaxinfer.runtime import compiled
    from jaxinfer.runtime.config import EngineConfig

    _manifest(tmp_path / "shipped", **host)
    cache = tmp_path / "cache"
    monkeypatch.setattr(compiled, "cache_dir", lambda: str(cache))
    config = EngineConfig(compiled_dir=str(tmp_path / "shipped"))
    assert compiled.install(tmp_path, config) == installed
    assert (cache / "jit_x-0123-cache").exists() == bool(installed)
    if not installed:
        assert f"{next(iter(host))} differ" in caplog.text
    assert compiled.install(tmp_path, config) == 0  # nothing new the second time


def test_install_says_why_it_uses_nothing(tmp_path, monkeypatch, caplog):
    from jaxinfer.runtime import compiled
    from jaxinfer.runtime.config import EngineConfig

    monkeypatch.setattr(compiled, "cache_dir", lambda: str(tmp_path / "cache"))
    # off unless asked for (native code), even with programs beside the checkpoint
    (tmp_path / "model").mkdir()
    _manifest(tmp_path / "model" / "compiled")
    assert compiled.install(tmp_path / "model", EngineConfig()) == 0 and not caplog.text
    assert compiled.install(tmp_path / "model", EngineConfig(compiled_dir="auto")) == 1
    # "auto" with nothing beside the checkpoint: silent
    assert compiled.install(tmp_path, EngineConfig(compiled_dir="auto")) == 0
    assert not caplog.text
    # a compiled_dir without a manifest, a manifest that is not JSON, one of another format
    empty = tmp_path / "empty"
    empty.mkdir()
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(empty))) == 0
    assert "holds no manifest.json" in caplog.text
    (empty / "manifest.json").write_text("{not json")
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(empty))) == 0
    assert "unreadable" in caplog.text
    (empty / "manifest.json").write_text(json.dumps({"format": 99}))
    caplog.clear()
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(empty))) == 0
    assert "format 99" in caplog.text
    (empty / "manifest.json").write_text(json.dumps({"format": compiled.FORMAT, "host": [1],
                                                     "options": {}}))
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(empty))) == 0
    assert "host must be an object" in caplog.text
    (empty / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # nested too deep
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(empty))) == 0
    assert "RecursionError" in caplog.text
    # the compilation cache off
    _manifest(tmp_path / "shipped")
    monkeypatch.setattr(compiled, "cache_dir", lambda: None)
    assert compiled.install(tmp_path, EngineConfig(compiled_dir=str(tmp_path / "shipped"))) == 0
    assert "compilation cache is off" in caplog.text


def test_default_place_is_beside_the_checkpoint(tmp_path):
    from jaxinfer.runtime.compiled import default_dir

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"")
    assert default_dir(tmp_path / "ckpt") == tmp_path / "ckpt" / "compiled"
    assert default_dir(tmp_path / "m.gguf") == tmp_path / "m.gguf.compiled"
