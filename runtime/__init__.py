"""jaxinfer runtime. `from runtime import LLM, SamplingParams`.

Imports are lazy so host-only modules (scheduler, page allocator) load without JAX.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestError", "EngineConfig", "ModelConfig"]


def __getattr__(name):
    if name == "LLM":
        from runtime import llm

        return llm.LLM
    if name in ("SamplingParams", "RequestOutput", "RequestError"):
        from runtime import requests

        return getattr(requests, name)
    if name in ("EngineConfig", "ModelConfig"):
        from runtime import config

        return getattr(config, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
