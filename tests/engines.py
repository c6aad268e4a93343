"""Shared engines: one LLM per (model path, options) for the whole session (conftest's `llm_for`).

    llm = llm_for(tiny_dir, **TINY)                  # built on first use, then the same object
    srv = llm_for(tiny_dir, tag="server", **ENGINE)  # a second engine of the same options

Each build loads the checkpoint, prepares the parameters, allocates a KV cache and compiles (or
loads) its programs; tests that only use an engine share one. `tag` tells apart engines of equal
options that one test drives at once: a server's engine (its loop thread steps it) beside the
reference engine the test steps itself.

A shared engine is left as it was found: no unfinished requests (checked after every test, and
when the engine is handed out), nothing replaced or registered. A test that changes its engine
for good (faults injected into `engine._step`, LoRA adapters registered, the scheduler's
counters asserted from zero, warm-up compile counts, construction itself) builds its own LLM.
"""

from __future__ import annotations

import json
import os

# The session's default tiny engine (conftest's `tiny_llm`): 4 slots, pages of 8, 256 tokens.
TINY = dict(max_slots=4, page_size=8, max_model_len=256)


class SharedEngines:
    def __init__(self):
        self._engines: dict[tuple[str, str | None, str], object] = {}
        self._steps: dict[tuple[str, str | None, str], object] = {}  # each engine's own step

    def __call__(self, model, *, tag: str | None = None, **options):
        """The session's LLM over `model` with `options` (LLM's keyword arguments)."""
        from jaxinfer.runtime.config import ENGINE_OPTIONS

        defaults = {o.name: o.default for o in ENGINE_OPTIONS}  # num_pages=None: not given
        given = {k: v for k, v in options.items() if k not in defaults or v != defaults[k]}
        key = (os.fspath(model), tag, json.dumps(given, sort_keys=True, default=repr))
        llm = self._engines.get(key)
        if llm is None:
            from jaxinfer import LLM

            llm = self._engines[key] = LLM(os.fspath(model), **options)
            self._steps[key] = llm.engine._step
        problem = self.problem(key)
        assert not problem, f"shared engine {key}: its last user left it {problem}"
        return llm

    def problem(self, key) -> str:
        """What the last user left wrong in the engine of `key` ("" if nothing), put right:
        unfinished requests aborted, a replaced step (an injected fault) put back."""
        eng, wrong = self._engines[key].engine, []
        rids = eng.outputs.ids()
        for rid in rids:
            eng.abort(rid)
        if rids:
            wrong.append(f"with {len(rids)} unfinished requests")
        if eng._step is not self._steps[key]:
            eng._step = self._steps[key]
            wrong.append("with its step replaced")
        return " and ".join(wrong)

    def check_untagged(self) -> dict:
        """{key: problem} of the engines tests step themselves (a tagged one may be stepped by
        a running server between tests: it is checked when handed out)."""
        found = {key: self.problem(key) for key in self._engines if key[1] is None}
        return {key: p for key, p in found.items() if p}
