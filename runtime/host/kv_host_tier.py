"""The host-memory tier of the prefix cache, its index: prefix hash -> host slot. No JAX.

Pages the device's prefix cache evicts (runtime/host/page_allocator.py: a cached page handed to a
new owner) are copied to a host slot under the same chained prefix hash; a request whose next
full pages miss on the device but hit here gets fresh device pages that are filled from the host
before its step (the scheduler plans both moves: `StepPlan.kv_offloads` [(device page, host
slot)] and `kv_restores` [(device page, host slot)]; the engine copies, runtime/engine.py).

The tier holds `slots` pages (its byte bound over one page's bytes) and evicts least recently
used first; a hit or a repeated offload makes an entry most recent. A slot whose entry was
evicted is unreachable (its hash is gone) until it is written again, so no sequence reads a
recycled slot's old contents. The hash already namespaces what changes K/V for the same tokens
(adapter, KV dtype), as on the device.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class HostTier:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {slots}")
        self.slots = int(slots)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._free: deque[int] = deque(range(self.slots))
        self.stats = dict(offloaded=0, restored=0, evicted=0)

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Slots of the longest prefix of `hashes` held here; each hit becomes most recent."""
        out = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            self._slot_of.move_to_end(h)
            out.append(slot)
        return out

    def put(self, page_hash: bytes) -> int | None:
        """A slot to copy the page of `page_hash` into (evicting the least recently used entry
        when full), or None when it is here already (it becomes most recent; no copy)."""
        if page_hash in self._slot_of:
            self._slot_of.move_to_end(page_hash)
            return None
        if self._free:
            slot = self._free.popleft()
        else:
            _, slot = self._slot_of.popitem(last=False)
            self.stats["evicted"] += 1
        self._slot_of[page_hash] = slot
        self.stats["offloaded"] += 1
        return slot

    def free_slots(self) -> list[int]:
        """Slots no hash names (never written, or their entry evicted): nothing reads them."""
        used = set(self._slot_of.values())
        return [s for s in range(self.slots) if s not in used]

    def reset(self) -> int:
        """Forget every entry; returns how many there were."""
        n = len(self._slot_of)
        self._slot_of.clear()
        self._free = deque(range(self.slots))
        return n

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values())
        assert len(set(slots)) == len(slots), "a host slot named by two hashes"
        assert sorted(slots + list(self._free)) == list(range(self.slots)), "host slot leaked"
