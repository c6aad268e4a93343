"""Device page pools for the KV cache and their update.

Per layer, K and V live in page pools `[num_kv_heads, num_pages, page_size, head_dim]` (latent
attention: one pool, the latent head that is both K and V; `KVCache.v` None there). Page 0 is
the null page: unused page-table entries point at it and padding tokens write into it, and it is
never read for a valid position. Sequences own pages through the host page allocator; the device
side only sees page tables and flat slot indices (`page * page_size + offset`).

Quantized KV (`init_cache(..., dtype="int8" | "fp8")`): a layer's pool is a `QuantizedPages`
(int8 or float8 e4m3 values plus one f32 scale per token per head, `[Hkv, N, ps]`), quantized
symmetrically as the tokens are written: x ~= value * scale with scale = max |x| / (127 | 448).
int8 spaces its 255 levels evenly; e4m3 spends its 8 bits on a 3-bit mantissa at every
magnitude (relative error <= 1/16 everywhere, where int8's grows for the small values of a
head). Model code is the same for all: `write_pages` and `attend` take any.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.runtime.config import ModelConfig


# a quantized KV dtype's name -> (value dtype, largest value)
KV_QUANT = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


@struct.dataclass
class QuantizedPages:
    """One layer's quantized K or V pool: values [Hkv, N, ps, Dh] (int8 or float8_e4m3fn),
    scales [Hkv, N, ps] f32 (x ~= values * scales[..., None]; one scale per token per head)."""

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


def quantize_kv(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """Symmetric over the last axis: x [..., Dh] -> (values [..., Dh] of `dtype` (int8 or
    float8_e4m3fn), f32 scales [...])."""
    top = 127.0 if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else 448.0
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    y = jnp.clip(xf / scale[..., None], -top, top)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scale


@struct.dataclass
class KVCache:
    k: tuple  # per layer [Hkv, N, ps, Dh] array, or QuantizedPages for int8 / fp8 KV
    # per layer like k, or None where the layer's V is its K (latent attention: one cached
    # head serves as both, runtime/device/mla.py); k and v both None for a layer that reads
    # another layer's (ModelConfig.layer_kv_source)
    v: tuple

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None)

    @property
    def page_bytes(self) -> int:
        """One page's bytes across every layer's K and V (and their scales)."""
        return self.nbytes // self.num_pages

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.num_pages * self.page_size)


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    """dtype: the compute dtype (f32 / bf16 pools) or a KV_QUANT name, "int8" / "fp8"
    (QuantizedPages pools)."""
    def zeros(i):  # layer i's pool: its own KV heads and head_dim (Gemma 4's global layers)
        shape = (cfg.layer_kv_heads(i), num_pages, page_size, cfg.layer_head_dim(i))
        if isinstance(dtype, str):
            return QuantizedPages(values=jnp.zeros(shape, KV_QUANT[dtype][0]),
                                  scales=jnp.ones(shape[:-1], jnp.float32))
        return jnp.zeros(shape, dtype)

    own = [cfg.layer_kv_source(i) == i for i in range(cfg.num_layers)]
    return KVCache(
        k=tuple(zeros(i) if own[i] else None for i in range(cfg.num_layers)),
        v=tuple(zeros(i) if own[i] and not cfg.latent_attention else None
                for i in range(cfg.num_layers)),
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
        q, scale = quantize_kv(new, pages.dtype)  # [T, Hkv, Dh] int8 / fp8, [T, Hkv]
        hkv, n, ps, _ = pages.shape
        scales = pages.scales.reshape(hkv, n * ps).at[:, slot_mapping].set(scale.T)
        return QuantizedPages(values=write_pages(pages.values, q, slot_mapping),
                              scales=scales.reshape(hkv, n, ps))
    hkv, n, ps, dh = pages.shape
    flat = pages.reshape(hkv, n * ps, dh)
    flat = flat.at[:, slot_mapping].set(new.transpose(1, 0, 2).astype(pages.dtype))
    return flat.reshape(hkv, n, ps, dh)
