"""What runs on the device (JAX): the pure model forward, attention backends, the paged KV
cache, quantized weights, sampling, the jitted steps, and how parameters are laid out and
sharded. It reads the schemas (runtime/config.py, runtime/plan.py) and nothing else of the
runtime."""
