"""Injected device failures: an engine's jitted step that raises on its n-th call."""

from __future__ import annotations

import jax


class FailingStep:
    """Stands in for an engine's `steps.Launches` (same call and `count`); its `on_call`-th
    call raises (after consuming the donated cache when `delete_cache`), once. `calls`: the
    calls so far; `real`: the wrapped step, to put back."""

    def __init__(self, real, on_call: int, delete_cache: bool = False):
        self.real, self.on_call, self.delete_cache, self.calls = real, on_call, delete_cache, []

    @property
    def count(self) -> int:
        return self.real.count

    def __call__(self, params, cache, *a, **kw):
        self.calls.append(1)
        if len(self.calls) == self.on_call:
            if self.delete_cache:
                for x in jax.tree.leaves(cache):
                    x.delete()
            raise RuntimeError("injected device failure")
        return self.real(params, cache, *a, **kw)


def fail_once(engine, on_call: int, delete_cache: bool = False) -> FailingStep:
    engine._step = FailingStep(engine._step, on_call, delete_cache)
    return engine._step
