"""Compiled programs shipped beside a checkpoint: `jaxinfer compile` writes them, an engine's
start installs them, so a fresh machine (a new replica, a notebook VM, a Ray actor) starts as
warm as the machine that compiled.

    jaxinfer compile MODEL [engine options] [--out DIR]

DIR (default: beside the checkpoint, `<dir>/compiled/` or `<file>.compiled/`) holds
  xla/            a persistent compilation cache, filled by building the engine under those
                  options, answering a prompt in each token bucket (the small programs a cold
                  start runs first: layer by layer, runtime/device/programs.py) and warm-up
                  (every step program the options imply);
  kernels/        the CPU kernel library the build used (runtime/device/cpu_kernels.py), so
                  a fresh host of the same CPU and compiler does not build it again;
  manifest.json   what the programs are valid for (`host()`: platform, its version, device kind
                  and count, jax / jaxlib versions, and on CPU the instruction-set flags XLA
                  compiled for) and the options they were built under.

At start (runtime/build.py `load`, before anything compiles) `install` reads the manifest of
`compiled_dir` (the option: a dir, or "auto" for the default place beside the checkpoint;
unset: nothing is installed, as compiled programs and the kernel library are native code: use
only those you trust, as with a model's remote code): on a host that matches, the shipped programs the process's compilation cache lacks are linked (or copied) into
it; a host that differs is named in one warning and the engine compiles as usual (XLA:CPU code
built for another CPU's instruction set could crash the process: jax's own cache key does not
cover the CPU's features). Programs of other options or shapes simply compile as usual.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PROGRAMS = "xla"
KERNELS = "kernels"
FORMAT = 1
_SUFFIX = "-cache"  # jax's persistent cache: one "<name>-<key>-cache" file a program


def use_cache(where: str, min_compile_s: float | None) -> None:
    """Point jax's persistent compilation cache at `where` (programs compiled in under
    `min_compile_s` not kept; None: jax's setting), with keys that do not depend on `where`:
    jax puts its GPU autotuning cache's path (a dir inside the cache) into every program's
    compile options, hence its key, so programs written under one path would never load from
    another. That extra cache is off (JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES, if set, wins):
    on GPU programs the cache misses autotune afresh; hits and other platforms lose nothing."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(where))
    if min_compile_s is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        try:
            jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
        except AttributeError:  # a jax without that option (and without the path in keys)
            pass


def cache_dir() -> str | None:
    """This process's compilation cache dir (None: the cache is off)."""
    import jax

    return jax.config.jax_compilation_cache_dir or None


def default_dir(checkpoint: Path) -> Path:
    """Where a checkpoint's compiled programs go: `<dir>/compiled` or `<file>.compiled`."""
    checkpoint = Path(checkpoint)
    return checkpoint / "compiled" if checkpoint.is_dir() else checkpoint.with_name(
        checkpoint.name + ".compiled")


def cpu_flags() -> list[str]:
    """The CPU's feature flags, sorted (cpu_kernels.cpu_flags_line, the line split)."""
    from jaxinfer.runtime.device.cpu_kernels import cpu_flags_line

    line = cpu_flags_line()
    return sorted(set(line.split(":", 1)[1].split())) if ":" in line else [line]


def cpu_tag() -> str:
    """A short name for this CPU's instruction set: the default compilation cache is one
    directory per tag, so hosts of different CPUs sharing a home directory never load each
    other's XLA:CPU code."""
    import hashlib
    import platform

    flags = " ".join([platform.machine(), *cpu_flags()])
    return f"{platform.machine()}-{hashlib.blake2b(flags.encode(), digest_size=5).hexdigest()}"


def host() -> dict:
    """What compiled programs depend on: a program built under one value of any field may not
    load (or run) under another."""
    import jax
    import jaxlib
    from jax.extend.backend import get_backend

    backend = get_backend()
    out = dict(platform=backend.platform, platform_version=backend.platform_version,
               device_kind=jax.devices()[0].device_kind, devices=jax.device_count(),
               processes=jax.process_count(), jax=jax.__version__, jaxlib=jaxlib.__version__)
    if backend.platform == "cpu":
        out["cpu_flags"] = cpu_flags()
    return out


def _link_missing(files, target: Path) -> int:
    """Hard-link (else copy) each of `files` into `target` unless a file of its name is there;
    -> how many were added."""
    target.mkdir(parents=True, exist_ok=True)
    added = 0
    for f in files:
        dest = target / f.name
        if dest.exists():
            continue
        try:
            os.link(f, dest)
        except FileExistsError:  # another process put it there first
            continue
        except OSError:  # another file system, or links not allowed: copied whole, then named
            tmp = target / f".{f.name}.{os.getpid()}"
            shutil.copyfile(f, tmp)
            os.replace(tmp, dest)
        added += 1
    return added


def _options(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _differences(want: dict, have: dict) -> list[str]:
    return sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))


def read_manifest(where: Path) -> dict | None:
    """The manifest of a compiled dir, or None when it has none (or an unreadable one: said)."""
    path = Path(where) / MANIFEST
    if not path.is_file():
        return None
    try:
        got = json.loads(path.read_text())
        if not isinstance(got, dict) or got.get("format") != FORMAT:
            raise ValueError(f"format {got.get('format') if isinstance(got, dict) else got!r}, "
                             f"not {FORMAT}")
        for field in ("host", "options"):
            if not isinstance(got.get(field), dict):
                raise ValueError(f"{field} must be an object, got {got.get(field)!r:.80}")
        return got
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        log.warning("compiled programs in %s not used: %s unreadable (%s)", where, MANIFEST,
                    type(e).__name__ if isinstance(e, RecursionError) else e)
        return None


def install(checkpoint: Path, config) -> int:
    """Link the programs shipped in EngineConfig.compiled_dir ("auto": `default_dir` of
    `checkpoint`; None: none) into this process's compilation cache, when their manifest matches
    this host. -> how many programs were added (0: none asked for or shipped, a host that
    differs, no cache)."""
    if not config.compiled_dir:
        return 0
    auto = config.compiled_dir == "auto"
    where = default_dir(checkpoint) if auto else Path(config.compiled_dir)
    manifest = read_manifest(where)
    if manifest is None:
        if not auto:
            log.warning("compiled_dir %s holds no %s (write one with `jaxinfer compile`)",
                        where, MANIFEST)
        return 0
    target = cache_dir()
    if not target:
        log.warning("compiled programs in %s not used: the compilation cache is off "
                    "(JAXINFER_COMPILATION_CACHE=0)", where)
        return 0
    differ = _differences(manifest.get("host", {}), host())
    if differ:
        log.warning("compiled programs in %s not used: built for another host (%s differ); "
                    "this engine compiles its own", where, ", ".join(differ))
        return 0
    target, source = Path(target), where / PROGRAMS
    if source.resolve() == target.resolve():
        return 0
    added = _link_missing(source.glob(f"*{_SUFFIX}"), target)
    if (where / KERNELS).is_dir():
        from jaxinfer.runtime.device import cpu_kernels

        # named by source, compiler, CPU flags and jaxlib: one another host could not use is
        # never looked up there
        _link_missing((where / KERNELS).glob("*.so"), cpu_kernels.cache_dir())
    other = _differences(manifest.get("options", {}), _options(config))
    log.info("compiled programs: %d installed from %s%s", added, where,
             f" (built with other {', '.join(other)}: programs they change compile as usual)"
             if other else "")
    return added


def start_dir(where: Path, overwrite: bool) -> Path:
    """A fresh compiled dir at `where`, this process's compilation cache in it (every program
    kept, the smallest too) -> its programs dir. Before any engine of this process exists."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        raise ValueError("the compilation cache is set already in this process; "
                         "run `jaxinfer compile` in a process of its own")
    if where.exists():
        if not overwrite:
            raise ValueError(f"{where} exists (pass --overwrite to replace it)")
        shutil.rmtree(where)
    programs = where / PROGRAMS
    programs.mkdir(parents=True)
    use_cache(str(programs), 0.0)
    return programs


def _ship_kernels(where: Path) -> list[str]:
    """The CPU kernel library this process built (runtime/device/cpu_kernels.py), copied into
    `where`/kernels: a fresh host of the same CPU and compiler skips its build (~4 s)."""
    from jaxinfer.runtime.device import cpu_kernels

    if host()["platform"] != "cpu" or not cpu_kernels.available("cpu"):
        return []
    lib = cpu_kernels.library_path()
    (where / KERNELS).mkdir(exist_ok=True)
    shutil.copyfile(lib, where / KERNELS / lib.name)
    return [lib.name]


def write_manifest(where: Path, config, **facts) -> dict:
    """The manifest of the programs in `where` (built under EngineConfig `config`), written last:
    a dir without one is never installed."""
    kernels = _ship_kernels(where)
    files = list((where / PROGRAMS).glob(f"*{_SUFFIX}"))
    manifest = dict(format=FORMAT, host=host(), options=_options(config), programs=len(files),
                    bytes=sum(f.stat().st_size for f in files), kernels=kernels, **facts)
    (where / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
