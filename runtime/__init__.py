"""jaxinfer runtime. `from runtime import LLM, SamplingParams`.

Imports are lazy so host-only modules (scheduler, page allocator) load without JAX.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "ModelConfig"]


def __getattr__(name):
    if name in ("LLM", "RequestOutput"):
        from runtime import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "EngineConfig", "ModelConfig"):
        from runtime import config

        return getattr(config, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
