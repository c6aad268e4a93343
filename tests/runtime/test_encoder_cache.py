"""The encoder cache (runtime/host/encoder_cache.py): least recently used entries go first,
bounded in bytes; an entry larger than the whole budget is not kept."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.runtime.host.encoder_cache import EncoderCache


def _e(n: int) -> np.ndarray:
    return np.zeros(n // 4, np.float32)  # n bytes


def test_lru_by_bytes_hits_misses_and_evictions():
    c = EncoderCache(max_bytes=100)
    c.put(b"a", _e(40))
    c.put(b"b", _e(40))
    assert c.get(b"a") is not None  # a is now the most recent
    c.put(b"c", _e(40))  # 120 > 100: b (least recent) goes
    assert b"b" not in c and b"a" in c and b"c" in c and c.bytes == 80
    assert c.get(b"b") is None
    c.put(b"huge", _e(104))  # larger than the budget: not kept, nothing evicted for it
    assert b"huge" not in c and len(c) == 2
    assert c.stats == {"hits": 1, "misses": 1, "evictions": 1}
    c.put(b"a", _e(40))  # already held: unchanged
    assert c.bytes == 80
    with pytest.raises(ValueError, match="max_bytes"):
        EncoderCache(-1)


def test_a_zero_budget_keeps_nothing():
    c = EncoderCache(0)
    c.put(b"a", _e(4))
    assert len(c) == 0 and c.bytes == 0
