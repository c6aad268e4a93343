"""The engine: typed configs, the request door, the host scheduler (no JAX), the jitted steps and
the pure model. The public names are re-exported by `jaxinfer`."""
