"""The built wheel: one import name (`jaxinfer`), its subpackages and data inside it, and the
public API importable from outside the repository by an interpreter that has only the wheel
(plus the dependencies, reached through a path entry)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # built from a copy: the checkout gains no build/ or egg-info
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".jax_cache", ".pytest_cache", ".hypothesis", "build", "*.egg-info",
        "__pycache__", "tests", "notebooks"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("jaxinfer-*.whl")
    return whl


def test_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"jaxinfer"}
    for sub in ("runtime/engine.py", "serve/cli.py", "checkpoints/loader.py", "tools/soak.py",
                "pallas_kernels/ragged_paged_attention.py", "serve/proto/jaxinfer.proto",
                "serve/proto/jaxinfer_pb2.py",
                "runtime/device/cpu_matmul.cc"):  # compiled on the host at first use
        assert f"jaxinfer/{sub}" in names, sub
    assert not any(n.startswith("jaxinfer/tests/") or n.startswith("tests/") for n in names)


def test_installed_wheel_imports_from_outside_the_repository(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                        "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # The dependencies come from this interpreter's site-packages as a plain path entry: its
    # .pth files (this checkout's editable install among them) are not processed there.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = ("import jaxinfer, jaxinfer.runtime.engine, jaxinfer.serve.cli; "
            "from jaxinfer import LLM, SamplingParams; "
            "import importlib.util as u; "
            "print(jaxinfer.__file__); print(LLM.__module__, SamplingParams(max_tokens=3).max_tokens); "
            "print([m for m in ('runtime', 'serve', 'checkpoints', 'tools', 'pallas_kernels') "
            "if u.find_spec(m)])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    file, api, stray = r.stdout.splitlines()
    assert Path(file).is_relative_to(site)
    assert api == "jaxinfer.runtime.llm 3"
    assert stray == "[]"  # no generic top-level names
    r = subprocess.run([str(env_dir / "bin" / "jaxinfer"), "--help"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and "generate" in r.stdout, r.stderr[-3000:]
