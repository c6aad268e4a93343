"""Copies of whole KV pages between the device pools and the host tier's arrays (the tier's
index: runtime/host/kv_host_tier.py; who copies what and when: runtime/engine.py).

A page's content is, for every leaf of the KVCache (per layer K and V, and their scales with
int8 / fp8 KV), the leaf's [Hkv, 1, ps, ...] slice at that page; `gather_pages` takes n pages'
slices of every leaf at once, `scatter_pages` writes them back (the cache donated). Page lists
are padded to a power of two with the null page (padding writes only the null page, which no
valid position reads), so a few programs serve every count.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxinfer.runtime.device.kv_cache import KVCache


def padded(pages) -> np.ndarray:
    """int32 pages padded with the null page 0 to the next power of two (at least 1)."""
    n = max(1, len(pages))
    out = np.zeros(1 << (n - 1).bit_length(), np.int32)
    out[:len(pages)] = pages
    return out


@jax.jit
def gather_pages(cache: KVCache, pages: jax.Array) -> list[jax.Array]:
    """Every leaf's slices at pages [n]: a list of [Hkv, n, ps, ...] arrays, leaf order."""
    return [leaf[:, pages] for leaf in jax.tree.leaves(cache)]


@functools.partial(jax.jit, donate_argnums=0)
def scatter_pages(cache: KVCache, pages: jax.Array, blocks: list[jax.Array]) -> KVCache:
    """The cache with pages [n] of every leaf set to blocks (gather_pages' layout)."""
    leaves, tree = jax.tree.flatten(cache)
    return jax.tree.unflatten(tree, [a.at[:, pages].set(b) for a, b in zip(leaves, blocks)])


class HostPages:
    """The host tier's page contents: per cache leaf a host array [Hkv, slots, ps, ...] of the
    leaf's dtype. Offloads
    arrive asynchronously: `send` starts the device-to-host copy of gathered pages and queues
    it; `land` writes queued copies into their slots, in order (a slot written twice keeps the
    later page), without waiting unless a restore needs one."""

    def __init__(self, cache: KVCache, slots: int):
        self.slots, self.page_bytes = slots, cache.page_bytes
        self.arrays = [np.zeros((a.shape[0], slots, *a.shape[2:]), a.dtype)
                       for a in jax.tree.leaves(cache)]
        self._queued: list[tuple[list[jax.Array], list[int]]] = []
        self.restore_s: list[float] = []  # per restore: host time (read + copy launched) / pages

    def send(self, blocks: list[jax.Array], slots: list[int]) -> None:
        for b in blocks:
            b.copy_to_host_async()
        self._queued.append((blocks, slots))

    def land(self, needed=()) -> None:
        """Write queued copies into their slots, oldest first: every one up to the last that
        writes a slot in `needed` (waiting for it), then more while their copies are done."""
        needed = set(needed)
        last = max((i for i, (_, slots) in enumerate(self._queued) if needed & set(slots)),
                   default=-1)
        n = 0
        for i, (blocks, slots) in enumerate(self._queued):
            if i > last and not all(b.is_ready() for b in blocks):
                break
            for host, b in zip(self.arrays, blocks):
                host[:, slots] = np.asarray(b)[:, :len(slots)]
            n += 1
        del self._queued[:n]

    def read(self, slots: list[int]) -> list[np.ndarray]:
        """Copies of the slots' pages, every leaf: [Hkv, n, ps, ...]."""
        return [host[:, slots] for host in self.arrays]

    @staticmethod
    def pad(blocks: list[np.ndarray], n: int) -> list[np.ndarray]:
        """blocks padded along the page axis to n (the padded page list's length)."""
        return [np.pad(b, [(0, 0), (0, n - b.shape[1])] + [(0, 0)] * (b.ndim - 2))
                for b in blocks]

    def stats(self, tier) -> dict:
        """The tier's counters (its index `tier`: runtime/host/kv_host_tier.py)."""
        r = sorted(self.restore_s)
        return {"kv_host_slots": self.slots, "kv_host_bytes_used": tier.num_used * self.page_bytes,
                "kv_host_pages_offloaded": tier.stats["offloaded"],
                "kv_host_pages_restored": tier.stats["restored"],
                "kv_host_pages_evicted": tier.stats["evicted"],
                "kv_host_restore_s_per_page_p50": r[len(r) // 2] if r else None}
