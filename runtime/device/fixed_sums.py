"""Sums across the tensor-parallel devices in a fixed order (batch-invariant mode, > 2 devices).

A product whose contracted axis is split across the mesh's "model" axis (wo over heads, w_down
over the MLP width, the experts of an MoE layer) leaves each device a partial sum; XLA adds
them with an all-reduce whose algorithm may pick its order by message size, and a step's
message size is its row count, so a row's result could depend on the batch. Two partials add
the same in any order (a + b == b + a); from three on, `ordered_sum` all-gathers the partials
(moving bits, not adding them) and adds them in device order on every device:

    parts = all_gather(partial, "model")          # [tp, ...]
    out = ((parts[0] + parts[1]) + parts[2]) + ...

Products split along their outputs need no sum: the vocabulary head is gathered whole
(`gathered_head`) before any reduction over the vocabulary (softmax, top-k, logprobs).
Traced on the engine's mesh (runtime/device/steps.py `on_mesh`); elsewhere a plain product.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.runtime.device.quantization import einsum


def split_over(n: int) -> int:
    """The "model" axis size of the context mesh when an axis of size n is split across it
    (the sharding rules split only what divides) and its sums need ordering (> 2 devices);
    else 0."""
    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]
    return tp if tp > 2 and n % tp == 0 else 0


def ordered_sum(partial: jax.Array, tp: int) -> jax.Array:
    """Inside a shard_map over "model": the sum of every device's `partial`, in device order."""
    parts = jax.lax.all_gather(partial, "model")  # [tp, ...]
    out = parts[0]
    for i in range(1, tp):
        out = out + parts[i]
    return out


def row_parallel_einsum(spec: str, x: jax.Array, w, invariant: bool) -> jax.Array:
    """einsum(spec, x, w) where w's first axis is contracted and split across the devices
    ("thk,hkd->td": wo over heads; "tf,fd->td": w_down over the MLP width). `invariant` with
    > 2 devices holding float weights: each device's partial product, summed in device
    order; otherwise XLA's partitioned product."""
    tp = split_over(w.shape[0]) if invariant and isinstance(w, jax.Array) else 0
    if not tp:
        return einsum(spec, x, w)
    xs, ws = spec.split("->")[0].split(",")
    x_spec = P(*("model" if c == ws[0] else None for c in xs))

    def local(x, w):
        return ordered_sum(einsum(spec, x, w), tp)

    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(x_spec, P("model")), out_specs=P(), check_vma=False)(x, w)


def gathered_head(product, h: jax.Array, head, invariant: bool) -> jax.Array:
    """product(h, head) -> [N, V] with head [V, D] split by vocabulary: under `invariant` with
    > 2 devices each device's [N, V / tp] columns, all-gathered, so every reduction over V
    that follows runs whole on each device; otherwise as XLA partitions it."""
    tp = split_over(head.shape[0]) if invariant and isinstance(head, jax.Array) else 0
    if not tp:
        return product(h, head)

    def local(h, head):
        return jax.lax.all_gather(product(h, head), "model", axis=1, tiled=True)

    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(P(), P("model")), out_specs=P(), check_vma=False)(h, head)
