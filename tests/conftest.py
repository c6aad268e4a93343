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

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One random-init tiny Llama (2 layers, d 64, vocab 2000, sentencepiece tokenizer) for the
    whole session; tests read it and never write into it."""
    from jaxinfer.tools.make_test_model import make

    return make(tmp_path_factory.mktemp("tiny_llama"), "tiny", seed=0)
