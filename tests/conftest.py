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
