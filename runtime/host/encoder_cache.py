"""The encoder cache: an image's encoder output, computed once, kept by its content digest.
No JAX (entries are numpy arrays on the host).

Bounded in bytes; least recently used entries go first. An image asked for again (a second
turn, the same picture in another request, a recompute after preemption) is a hit: the
encoder does not run for it again.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class EncoderCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.stats = dict(hits=0, misses=0, evictions=0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> np.ndarray | None:
        out = self._entries.get(key)
        if out is None:
            self.stats["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        return out

    def put(self, key: bytes, value: np.ndarray) -> None:
        """Keep `value` (an entry larger than the whole budget is not kept)."""
        if key in self._entries or value.nbytes > self.max_bytes:
            return
        self._entries[key] = value
        self.bytes += value.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.stats["evictions"] += 1
