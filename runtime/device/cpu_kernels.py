"""The CPU kernels' library (runtime/device/cpu_matmul.cc, cpu_attention.cc): compiled on first
use, loaded and registered with XLA's FFI. Kept apart from the weight type (cpu_matmul.py) so that the
platform defaults in quantization.py can ask whether the kernels run without an import cycle.

Build: compiled with the host's C++ compiler (`$CXX`, else g++ / c++ / clang++) for this CPU's
instruction set (`-O3 -march=native`: AVX-512 where the host has it, the compiler's own
vectorisation of the portable path elsewhere, ARM included), into `$JAXINFER_CACHE/kernels/`
keyed by the source, the compiler, the CPU's feature flags and jaxlib's version. A compile on
the host that runs it, rather than a wheel: hosts of one machine kind differ in instruction
sets, and `pip install` needs no compiler. Without a compiler (or with
`JAXINFER_CPU_KERNELS=0`) the engine runs XLA's path and says so once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger("jaxinfer")

TARGET = "jaxinfer_qmatmul"
ATTENTION_TARGET = "jaxinfer_paged_attention"
_SOURCES = tuple(Path(__file__).with_name(f) for f in ("cpu_matmul.cc", "cpu_attention.cc"))
_HEADERS = (Path(__file__).with_name("cpu_threads.h"),)


# ------------------------------------------------------------------------- build and load


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


def cpu_flags_line() -> str:
    """The CPU's feature-flags line (Linux /proc/cpuinfo), else the machine and processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def cache_dir() -> Path:
    """Where built kernel libraries are kept (one file per source, compiler, CPU, jaxlib)."""
    base = os.environ.get("JAXINFER_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "jaxinfer") / "kernels"


_build_lock = threading.Lock()


def prebuild() -> None:
    """Compile the library in a background thread (a fresh host: ~4 s), while a checkpoint
    loads; `load()` then finds it built, or waits for the compile under way."""
    if os.environ.get("JAXINFER_CPU_KERNELS", "1") != "0":
        threading.Thread(target=library_path, name="jaxinfer-cpu-kernels", daemon=True).start()


def library_path() -> Path | None:
    """The compiled kernel library for this host, compiled now if it is not there yet; None
    without a compiler (or if it fails: the error is logged)."""
    with _build_lock:
        return _library_path()


@functools.cache
def _library_path() -> Path | None:
    cxx = _compiler()
    if cxx is None:
        _warn_once("no C++ compiler found (set $CXX or install g++)")
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    import jaxlib

    key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in (
        *(f.read_bytes() for f in _SOURCES + _HEADERS), version, cpu_flags_line(), jaxlib.__version__))).hexdigest()[:20]
    out = cache_dir() / f"cpu_matmul-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    base = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-w",
            "-isystem", jax.ffi.include_dir(), *map(str, _SOURCES), "-o", tmp]
    for arch in (["-march=native"], ["-mcpu=native"], []):
        r = subprocess.run(base[:1] + arch + base[1:], capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, out)  # atomic: a concurrent build writes the same file
            return out
    os.unlink(tmp)
    _warn_once(f"compiling {', '.join(f.name for f in _SOURCES)} failed:\n{r.stderr[-2000:]}")
    return None


_warned: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        log.warning("jaxinfer: CPU quantized-matmul kernels unavailable (%s); quantized weights "
                    "run on XLA's slower path. Set JAXINFER_CPU_KERNELS=0 to silence this.", why)


@functools.cache
def load() -> str | None:
    """Register the kernels with XLA; the instruction set they were built for ("avx512",
    "portable"), or None when they are switched off or cannot be built."""
    if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0":
        return None
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferQMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET,
                                    jax.ffi.pycapsule(lib.JaxinferPagedAttention), platform="cpu")
        lib.jaxinfer_cpu_matmul_isa.restype = ctypes.c_char_p
        return lib.jaxinfer_cpu_matmul_isa().decode()
    except (OSError, AttributeError) as e:
        _warn_once(f"loading {path} failed: {e}")
        return None


def available(platform: str | None = None) -> bool:
    """Whether this process multiplies quantized weights with the kernels (CPU only)."""
    return (platform or jax.default_backend()) == "cpu" and load() is not None
