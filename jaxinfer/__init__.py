"""jaxinfer: LLM inference on JAX/XLA. `from jaxinfer import LLM, SamplingParams`.

The subpackages live in the repository's top-level folders and are installed under this name:
jaxinfer.runtime (engine, scheduler, model), jaxinfer.pallas_kernels, jaxinfer.checkpoints,
jaxinfer.serve (CLI, gRPC, HTTP, JSONL batch) and jaxinfer.tools (benchmarks, test models).

Names resolve lazily, so `import jaxinfer` does not import JAX.
"""

import os as _os

# A source checkout that was never installed (an accelerator host with its own jax, no package
# index): the subpackages are the folders beside this one, so `python -m jaxinfer.tools.X` runs
# from the repository root. Installed, they sit inside this package and this adds nothing.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (_os.path.isfile(_os.path.join(_ROOT, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_ROOT, "pallas_kernels", "ragged_paged_attention.py"))
        and _ROOT not in __path__):
    __path__.append(_ROOT)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestDelta",
           "RequestError", "LoRARequest", "BeamSearchParams", "EngineConfig", "ModelConfig"]

_HOMES = {
    "LLM": "jaxinfer.runtime.llm",
    "SamplingParams": "jaxinfer.runtime.host.requests",
    "RequestOutput": "jaxinfer.runtime.host.outputs",
    "CompletionOutput": "jaxinfer.runtime.host.outputs",
    "RequestDelta": "jaxinfer.runtime.host.outputs",
    "BeamSearchParams": "jaxinfer.runtime.beam_search",
    "RequestError": "jaxinfer.runtime.host.errors",
    "LoRARequest": "jaxinfer.runtime.host.requests",
    "EngineConfig": "jaxinfer.runtime.config",
    "ModelConfig": "jaxinfer.runtime.config",
}


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


def __dir__():
    return sorted(list(globals()) + __all__)
