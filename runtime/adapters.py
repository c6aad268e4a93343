"""The engine's LoRA adapters by name: where each was read from, and its weights on the host.

An adapter is registered under a name (`add`), read and checked once (checkpoints/peft.py), and
known to the scheduler by a key unique to that registration (name#n), so an adapter unloaded and
loaded again under the same name never shares prefix-cache pages or a device slot with its
earlier weights. Up to `max_cpu` adapters keep their padded weights in host memory, least
recently used first out; an evicted one is read again from its path when a slot needs it.
Thread-safe: a server registers adapters from its request threads while the engine's thread
reads them.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.lora import LoraLayer, padded_weights

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    key: str
    rank: int
    targets: tuple[str, ...]


class Adapters:
    def __init__(self, cfg: ModelConfig, max_rank: int, max_cpu: int | None = None):
        self.cfg, self.max_rank, self.max_cpu = cfg, max_rank, max_cpu
        self._by_name: dict[str, Adapter] = {}
        self._by_key: dict[str, Adapter] = {}
        self._host: OrderedDict[str, tuple[LoraLayer, ...]] = OrderedDict()  # key -> weights
        self._gen = itertools.count(1)
        self._lock = threading.RLock()

    def _read(self, path: str) -> tuple:
        from jaxinfer.checkpoints.peft import load_peft_adapter

        ad = load_peft_adapter(path, self.cfg, self.max_rank)
        return ad, padded_weights(self.cfg, self.max_rank, ad.tensors)

    def add(self, name: str, path: str) -> Adapter:
        """Register `name` (read from `path` now: a bad adapter fails here, naming the
        problem). The same name and path again is a no-op; another path needs remove() first."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"LoRA adapter name must be a non-empty string of at most "
                             f"{MAX_NAME_CHARS} characters, got {name!r}")
        path = str(path)

        def same(old):
            if old.path == path:
                return old
            raise ValueError(f"LoRA adapter {name!r} is already loaded from {old.path}; "
                             "unload it first")

        with self._lock:
            if name in self._by_name:
                return same(self._by_name[name])
        ad, weights = self._read(path)  # outside the lock: the engine's reads go on meanwhile
        with self._lock:
            if name in self._by_name:  # registered meanwhile
                return same(self._by_name[name])
            a = Adapter(name=name, path=path, key=f"{name}#{next(self._gen)}", rank=ad.rank,
                        targets=ad.targets)
            self._by_name[name], self._by_key[a.key] = a, a
            self._keep(a.key, weights)
            return a

    def replace(self, name: str, path: str) -> tuple[Adapter, Adapter]:
        """Re-register `name` from `path` (read and checked first: a bad adapter leaves the
        old one registered) under a fresh key; -> (old, new)."""
        path = str(path)
        ad, weights = self._read(path)
        with self._lock:
            old = self.remove(name)
            new = Adapter(name=name, path=path, key=f"{name}#{next(self._gen)}", rank=ad.rank,
                          targets=ad.targets)
            self._by_name[name], self._by_key[new.key] = new, new
            self._keep(new.key, weights)
            return old, new

    def remove(self, name: str) -> Adapter:
        with self._lock:
            a = self._by_name.pop(name)
            del self._by_key[a.key]
            self._host.pop(a.key, None)
            return a

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._by_name.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def weights(self, key: str) -> tuple[LoraLayer, ...]:
        """Host weights of the adapter registered as `key` (read again if evicted)."""
        with self._lock:
            w = self._host.get(key)
            if w is None:
                w = self._read(self._by_key[key].path)[1]
                self._keep(key, w)
            self._host.move_to_end(key)
            return w

    def _keep(self, key: str, weights) -> None:
        self._host[key] = weights
        while self.max_cpu is not None and len(self._host) > self.max_cpu:
            self._host.popitem(last=False)
