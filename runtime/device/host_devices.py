"""The host's cores as JAX devices, and tensor parallelism over them by default on CPU.

XLA:CPU runs a small matmul (a decode or mixed step's [T<=256, D] x [D, N] at D ~ 512) on one
core and does not thread it (flags tried: the XNN/YNN/oneDNN fusion types, the
concurrency-optimised scheduler); independent dots of one program can run side by side, which
runtime/device/weight_layout.py uses on one device. Two host devices run side by side too, so a model
split over them (`tensor_parallel=2`, runtime/device/sharding.py) uses both cores: 1.24x output tokens/s steady state on the mixed workload of `jaxinfer bench
throughput` (random Llama, d=512, 8 heads, 8 layers), first run 1.15x. Gemma 3 270M (one KV
head) gains nothing, as its step is the vocabulary projection that XLA already threads, so it
stays on one device.

`request_host_devices()` asks JAX for one CPU device per core; it only works before JAX starts
its backends (the first `jax.devices()`), so `LLM` calls it first. `auto_tensor_parallel`
picks the split for a loaded model. `JAXINFER_HOST_DEVICES=N` sets the count (1: off);
`tensor_parallel=` given explicitly always wins.
"""

from __future__ import annotations

import math
import os

# the smallest hidden size measured to gain from a split: each layer adds two all-reduces of
# [T, D], which a narrower model's matmuls do not pay for
MIN_HIDDEN = 512
MAX_HOST_DEVICES = 8


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def request_host_devices() -> int | None:
    """Ask for one JAX CPU device per core (JAXINFER_HOST_DEVICES overrides) unless JAX's
    backends have started or the CPU device count is set already. Returns the count asked for,
    or None when nothing was changed."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return None
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return None
    if jax.config.jax_num_cpu_devices != -1 and "JAXINFER_HOST_DEVICES" not in os.environ:
        return None  # the caller chose a count
    want = os.environ.get("JAXINFER_HOST_DEVICES")
    try:
        n = int(want) if want else min(host_cores(), MAX_HOST_DEVICES)
    except ValueError:
        raise ValueError(f"JAXINFER_HOST_DEVICES must be a whole number, got {want!r}") from None
    if n < 1:
        raise ValueError(f"JAXINFER_HOST_DEVICES must be >= 1, got {n}")
    jax.config.update("jax_num_cpu_devices", n)
    return n


# weight formats whose sharded forms the tensor-parallel tests cover (int4 groups and kept GGUF
# blocks stay on one device unless asked)
SPLIT_FORMATS = (None, "int8", "fp8")


def auto_tensor_parallel(cfg, ecfg, *, platform: str, devices: int, processes: int = 1) -> int:
    """The tensor-parallel degree to serve `cfg` with when the caller gave none: on a single
    CPU host with several devices, the largest count <= devices that splits both the query and
    the KV heads evenly (heads stay whole on a device), for models of hidden size >= MIN_HIDDEN;
    else 1 (accelerators: one device unless asked; speculative decoding, a Pallas attention
    backend and int4 / GGUF-block weights run on one device, and so do weight-only int8 / fp8
    weights where the CPU kernels load)."""
    if platform != "cpu" or processes != 1 or devices < 2:
        return 1
    if (ecfg.speculative is not None or ecfg.attention_backend not in (None, "xla")
            or ecfg.quantization not in SPLIT_FORMATS):
        return 1
    if ecfg.quantization is not None and ecfg.quant_mode != "w8a8":
        from jaxinfer.runtime.device import cpu_kernels

        if cpu_kernels.available(platform):  # weight-only int8 / fp8 on one device: the CPU
            return 1  # kernels use every core themselves (runtime/device/cpu_matmul.py)
    if cfg.hidden_size < MIN_HIDDEN:
        return 1
    g = math.gcd(cfg.num_heads, cfg.num_kv_heads)
    return max(d for d in range(1, devices + 1) if g % d == 0)
