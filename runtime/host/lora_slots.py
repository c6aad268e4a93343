"""Which LoRA adapter sits in which of the L device slots: the scheduler's host-side table. No JAX.

A running sequence holds a reference on its adapter's slot. A slot whose adapter no running
sequence uses stays loaded (least recently released first out), so an adapter that comes back
is not copied to the device again. Admission asks for a slot: the adapter's own if loaded, else
a never-used slot, else the least recently released one; none when every slot is referenced
(the request waits). Each newly given slot is recorded as a load (slot, adapter key) that the
engine performs before the step that first uses it.

LoraGate is the scheduler's admission gate over that table (runtime/host/admission.py): the
queue's head takes its adapter's slot when admitted, and gives it back with its pages.
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot: dict[str, int] = {}  # adapter key -> slot (1..L) it is loaded in
        self._refs: dict[str, int] = {}  # adapter key -> running sequences using it
        self._idle: OrderedDict[str, None] = OrderedDict()  # loaded, unreferenced; oldest first
        self._free = list(range(num_slots, 0, -1))  # never used (pop: lowest first)
        self._loads: list[tuple[int, str]] = []

    def acquire(self, key: str) -> int | None:
        """The slot for `key` with one more reference, or None if every slot is referenced."""
        slot = self._slot.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                old, _ = self._idle.popitem(last=False)
                slot = self._slot.pop(old)
            else:
                return None
            self._slot[key] = slot
            self._loads.append((slot, key))
        self._idle.pop(key, None)
        self._refs[key] = self._refs.get(key, 0) + 1
        return slot

    def release(self, key: str) -> None:
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]
            self._idle[key] = None

    def in_use(self, key: str) -> bool:
        return key in self._refs

    def evict(self, key: str) -> None:
        """Forget an unreferenced adapter (unloaded): its slot is free again."""
        if key in self._refs:
            raise ValueError(f"adapter {key!r} is in use by running requests")
        self._idle.pop(key, None)
        self._loads = [(s, k) for s, k in self._loads if k != key]
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def take_loads(self) -> list[tuple[int, str]]:
        """The (slot, adapter key) loads recorded since the last call, oldest first."""
        out, self._loads = self._loads, []
        return out

    def loaded(self) -> dict[str, int]:
        return dict(self._slot)

    def refs(self) -> dict[str, int]:
        return dict(self._refs)


class LoraGate:
    """Admission gate: a request with an adapter runs only while it holds its adapter's slot
    (`seq.lora_slot`, 0: the base model); `slots`: the table. Loads recorded since the last
    plan: `take_loads()` (the plan's lora_loads)."""

    def __init__(self, num_slots: int):
        self.slots = LoraSlots(num_slots)

    def acquire(self, seq) -> bool:
        if seq.req.lora is None:
            return True
        got = self.slots.acquire(seq.req.lora)
        if got is None:
            return False
        seq.lora_slot = got
        return True

    def release(self, seq) -> None:
        if seq.lora_slot:
            self.slots.release(seq.req.lora)
            seq.lora_slot = 0

    def take_loads(self) -> list[tuple[int, str]]:
        return self.slots.take_loads()

    def evict(self, key: str) -> None:
        self.slots.evict(key)

    def check(self, running) -> None:
        """Every running sequence with an adapter holds its loaded slot, one reference each."""
        held: dict[str, int] = {}
        loaded = self.slots.loaded()
        for s in running:
            assert bool(s.lora_slot) == (s.req.lora is not None)
            if s.lora_slot:
                assert loaded[s.req.lora] == s.lora_slot
                held[s.req.lora] = held.get(s.req.lora, 0) + 1
        assert held == self.slots.refs()
