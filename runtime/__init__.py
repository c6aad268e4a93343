"""The engine, in rooms: runtime/host/ (no JAX), runtime/device/ (JAX), the two schemas they
share (config.py, plan.py), and the engine level over them (llm.py, build.py, engine.py,
proposers.py, adapters.py). The public names are re-exported by `jaxinfer`."""
