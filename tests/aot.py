"""Ahead-of-time export for CUDA on a machine without a GPU.

jax >= 0.11 lowers a Pallas Triton kernel for the GPU it finds; with none it asks for an
abstract one. `cuda_target()` names an H100 for the export (a no-op where jax has no abstract
devices, or a GPU is present)."""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def cuda_target(device_kind: str = "NVIDIA H100"):
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None or jax.default_backend() == "gpu":
        yield
        return
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=abstract_device(device_kind=device_kind, num_cores=None,
                                        platform="cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        yield
