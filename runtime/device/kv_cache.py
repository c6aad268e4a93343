"""Device page pools for the KV cache and their update.

Per layer, K and V live in page pools `[num_kv_heads, num_pages, page_size, head_dim]`. Page 0 is
the null page: unused page-table entries point at it and padding tokens write into it, and it is
never read for a valid position. Sequences own pages through the host page allocator; the device
side only sees page tables and flat slot indices (`page * page_size + offset`).

int8 KV (`init_cache(..., dtype="int8")`): a layer's pool is a `QuantizedPages` (int8 values plus
one f32 scale per token per head, `[Hkv, N, ps]`), quantized symmetrically as the tokens are
written. Model code is the same for both: `write_pages` and `attend` take either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.runtime.config import ModelConfig


@struct.dataclass
class QuantizedPages:
    """One layer's int8 K or V pool: values [Hkv, N, ps, Dh] int8, scales [Hkv, N, ps] f32
    (x ~= values * scales[..., None]; one scale per token per head)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scales[..., None]).astype(dtype)


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: x [..., Dh] -> (int8 [..., Dh], f32 scales [...])."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xf / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


@struct.dataclass
class KVCache:
    k: tuple  # per layer [Hkv, N, ps, Dh] array, or QuantizedPages for int8 KV
    v: tuple  # per layer [Hkv, N, ps, Dh] array, or QuantizedPages for int8 KV

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.num_pages * self.page_size)


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    """dtype: the compute dtype (f32 / bf16 pools) or "int8" (QuantizedPages pools)."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    if isinstance(dtype, str) and dtype == "int8":
        def zeros():
            return QuantizedPages(values=jnp.zeros(shape, jnp.int8),
                                  scales=jnp.ones(shape[:-1], jnp.float32))
    else:
        zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(
        k=tuple(zeros() for _ in range(cfg.num_layers)),
        v=tuple(zeros() for _ in range(cfg.num_layers)),
    )


def write_pages(
    pages,  # [Hkv, N, ps, Dh] array or QuantizedPages
    new: jax.Array,  # [T, Hkv, Dh]
    slot_mapping: jax.Array,  # [T] int32 flat index page*ps + offset
):
    if slot_mapping.shape[0] == 1:
        # XLA:CPU turns a one-row scatter into a dynamic-update-slice that copies the whole
        # page pool; a second row aimed at the null page (slot 0) keeps the in-place scatter
        new = jnp.concatenate([new, new])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros_like(slot_mapping)])
    if isinstance(pages, QuantizedPages):
        q, scale = quantize_kv(new)  # [T, Hkv, Dh] int8, [T, Hkv]
        hkv, n, ps, _ = pages.shape
        scales = pages.scales.reshape(hkv, n * ps).at[:, slot_mapping].set(scale.T)
        return QuantizedPages(values=write_pages(pages.values, q, slot_mapping),
                              scales=scales.reshape(hkv, n, ps))
    hkv, n, ps, dh = pages.shape
    flat = pages.reshape(hkv, n * ps, dh)
    flat = flat.at[:, slot_mapping].set(new.transpose(1, 0, 2).astype(pages.dtype))
    return flat.reshape(hkv, n, ps, dh)
