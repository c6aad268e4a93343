"""Device page pools for the KV cache and their update.

Per layer, K and V live in page pools `[num_kv_heads, num_pages, page_size, head_dim]`. Page 0 is
the null page: unused page-table entries point at it and padding tokens write into it, and it is
never read for a valid position. Sequences own pages through the host page allocator; the device
side only sees page tables and flat slot indices (`page * page_size + offset`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from runtime.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [Hkv, N, ps, Dh]
    v: tuple[jax.Array, ...]  # per layer [Hkv, N, ps, Dh]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(
        k=tuple(zeros() for _ in range(cfg.num_layers)),
        v=tuple(zeros() for _ in range(cfg.num_layers)),
    )


def write_pages(
    pages: jax.Array,  # [Hkv, N, ps, Dh]
    new: jax.Array,  # [T, Hkv, Dh]
    slot_mapping: jax.Array,  # [T] int32 flat index page*ps + offset
) -> jax.Array:
    hkv, n, ps, dh = pages.shape
    flat = pages.reshape(hkv, n * ps, dh)
    flat = flat.at[:, slot_mapping].set(new.transpose(1, 0, 2).astype(pages.dtype))
    return flat.reshape(hkv, n, ps, dh)
