"""One device's step as programs compiled ahead of use, in two tiers, so no step waits on a
compile it does not need.

A step is two programs (runtime/device/steps.py): the **body** (embed, every layer, the final
norm of the sampling rows; one per token x page x q-length bucket) and the **head** (vocabulary
projection, logits processors, masks, sampling, logprobs; one per slot count and statics, shared
by every bucket). Split this way the head compiles once, not once per bucket.

`compile_mode="background"`: a body whose program is not ready runs **layer by layer** (an
embed program, one program per layer kind (model.layer_kind: Gemma 3 has two), a last-rows
program) and a head not ready runs a **fast head** of 1, S/2 or S rows (as many as the step has
sequences); those small programs compile in a fraction of a second (FAST_OPTIONS on CPU) while
the whole programs compile in the background `Compiler` thread; the first step after that uses
them. `"blocking"`: a step compiles its whole programs first (what every step did before).
Prompt-logprob steps run steps.step whole and wait for it.

Programs are keyed by their argument signature (tree, shapes, dtypes, statics) and shared by
the engines of one model in the process (a table per jitted function, dropped with it).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import jax
import numpy as np

from jaxinfer.runtime.config import COMPILE_MODES
from jaxinfer.runtime.device.kv_cache import KVCache
from jaxinfer.runtime.device.model import deepstack, layer_kind
from jaxinfer.runtime.device.steps import (HEAD_FIELDS, METADATA_FIELDS, body, embed_rows,
                                           given_rows, head,
                                           last_rows, layer_rows, make_step, shared_jit)

log = logging.getLogger(__name__)

# background compile priorities: a decode body a running step needs, any other program it
# needs, then warm-up's list in order
DECODE, NEEDED, WARMUP = 0, 1, 2
QUIET_S = 0.5  # the background thread starts a program this long after the last foreground one


def signature(tree) -> tuple:
    """A pytree's abstract signature: its structure and each leaf's shape and dtype (other
    leaves, e.g. statics, as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    # dtype objects, not their names: str(dtype) cost ~1 ms a decode step on Gemma 3's cache
    return treedef, tuple((x.shape, x.dtype) if hasattr(x, "shape") else x for x in leaves)


def abstract(tree):
    """A pytree of ShapeDtypeStructs standing for `tree` (device arrays keep their sharding), for
    lowering in another thread while the arrays themselves are donated or deleted here."""
    def one(x):
        if not hasattr(x, "shape"):
            return x
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


class _Job:
    """A program to compile once, by whichever thread claims it first."""

    _lock = threading.Lock()

    def __init__(self, fn):
        self.fn, self.future, self.started = fn, Future(), False
        self.priority: int | None = None  # the best priority it is queued at (None: not)
        self.owners: weakref.WeakSet = weakref.WeakSet()  # the engines' tables that want it

    def claim(self) -> bool:
        with self._lock:
            if self.started:
                return False
            self.started = True
            return True

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # noqa: BLE001 - whoever needs the program re-raises it
            self.future.set_exception(exc)


class Compiler:
    """One daemon thread compiling programs in priority order (NEEDED before WARMUP, then in the
    order asked). XLA:CPU compiles on one core, so the other keeps serving; tracing shares the
    interpreter lock with the scheduler for a moment per program."""

    def __init__(self):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition()  # foreground compiles under way: `_busy`
        self._busy = 0
        self._last_foreground = 0.0  # when the last one ended (time.monotonic)
        self._stopping = False
        self.compiled = 0  # programs compiled by the thread
        self.seconds = 0.0  # ... and the seconds it spent on them

    @contextlib.contextmanager
    def foreground(self):
        """Around a compile a step waits for: the thread starts no program meanwhile (the two
        would share the cores, and the step's compile is the one someone waits for)."""
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._last_foreground = time.monotonic()
                self._idle.notify_all()

    def _wait_quiet(self) -> None:
        """Until no foreground compile has run for QUIET_S (a step's compiles come in a row:
        the body's small programs, then its head)."""
        with self._idle:
            while True:
                self._idle.wait_for(lambda: self._busy == 0)
                left = self._last_foreground + QUIET_S - time.monotonic()
                if left <= 0:
                    return
                self._idle.wait(left)

    def stop(self) -> None:
        """At exit: drop what is queued and let the program being compiled finish (an
        interpreter torn down under a running XLA compile aborts the process)."""
        self._stopping = True
        while True:
            try:
                _, _, job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.claim():
                job.future.cancel()
        self._queue.put((-1, -1, None))
        if self._thread is not None:
            self._thread.join()

    def submit(self, job: _Job, priority: int, owner=None) -> bool:
        """Queue `job` for `owner` (an engine's AheadOfTime), or queue it again at a better
        priority (a step now needs what warm-up queued); -> whether it was queued. A job whose
        owners are all gone when its turn comes is skipped (left to be queued again)."""
        if owner is not None:
            job.owners.add(owner)
        if job.started or (job.priority is not None and job.priority <= priority):
            return False
        job.priority = priority
        self._queue.put((priority, next(self._order), job))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="jaxinfer-compile",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.stop)
        return True

    def _work(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: this thread only, nice 19:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # steps run first
        while True:
            _, _, job = self._queue.get()
            if job is None or self._stopping:
                return
            if job.started:  # queued twice (warm-up, then needed)
                continue
            self._wait_quiet()
            if not job.owners:  # every engine that asked for it is gone
                job.priority = None
                continue
            if not job.claim():
                continue
            t0 = time.perf_counter()
            job.run()
            self.compiled += 1
            self.seconds += time.perf_counter() - t0


@functools.cache
def compiler() -> Compiler:
    """The process's background compiler."""
    return Compiler()


@functools.lru_cache(maxsize=32)
def _table(jitted) -> dict:
    """signature -> _Job of one jitted function's ahead-of-time programs (dropped together with
    the function's own entry in shared_jit's cache, give or take)."""
    return {}


class AheadOfTime:
    """The programs of one jitted function, compiled ahead of their use (`jitted.lower(...)
    .compile()`), in this thread or the background compiler's."""

    def __init__(self, jitted, statics: tuple[str, ...], fixed: tuple):
        """`fixed`: the engine's first arguments (params, and the cache for a body), whose
        signature never changes: taken once, not per call."""
        self.jitted, self.statics, self.n_fixed = jitted, statics, len(fixed)
        self.fixed = signature(fixed)
        self.table = _table(jitted)
        self.launched: set = set()  # signatures this engine launched
        self.waiting: list[Future] = []  # programs this engine queued on the background compiler
        self.failed: set = set()  # signatures whose background compile raised

    def job(self, args: tuple, kwargs: dict) -> tuple[tuple, _Job]:
        """(signature, its job) for a call of jitted(*args, **kwargs)."""
        key = (self.fixed, signature((args[self.n_fixed:], kwargs)))
        job = self.table.get(key)
        if job is None:
            spec = abstract((args, kwargs))
            job = self.table[key] = _Job(lambda: self.jitted.lower(*spec[0], **spec[1]).compile())
        return key, job

    def get(self, args: tuple, kwargs: dict, *, background: bool, priority: int = NEEDED):
        """The compiled program for this call; None when `background` and it is still compiling
        (queued at `priority`)."""
        key, job = self.job(args, kwargs)
        if not job.future.done():
            if background:
                if compiler().submit(job, priority, self):
                    self.waiting.append(job.future)
                return None
            if job.claim():  # compile it here, now
                job.run()
        elif background and job.future.exception() is not None:
            if key not in self.failed:  # the layer-by-layer programs serve this shape
                self.failed.add(key)
                log.warning("background compile of %s failed; its steps stay layer by layer: "
                            "%s", getattr(self.jitted, "__name__", "a program"),
                            job.future.exception())
            return None
        program = job.future.result()  # waits for the background thread's compile, if any
        self.launched.add(key)
        return program

    def queue(self, args: tuple, kwargs: dict) -> Future:
        """Compile this call's program in the background (warm-up order)."""
        _, job = self.job(args, kwargs)
        if not job.future.done() and compiler().submit(job, WARMUP, self):
            self.waiting.append(job.future)
        return job.future

    def call(self, args: tuple, kwargs: dict, *, background: bool = False,
             priority: int = NEEDED):
        program = self.get(args, kwargs, background=background, priority=priority)
        if program is None:
            return None
        return program(*args, **{k: v for k, v in kwargs.items() if k not in self.statics})


def head_arrays(arrays: dict) -> dict:
    return {k: arrays[k] for k in HEAD_FIELDS}


def _rows(arrays: dict) -> int:
    """The head rows a step's sequences need: 1, S/2 or S."""
    s, n = arrays["logits_indices"].shape[0], int(np.asarray(arrays["num_seqs"])[0])
    return min(r for r in (1, max(1, s // 2), s) if r >= n)


# XLA options of the layer-by-layer programs and the fast heads on CPU: they compile about 1.5x
# faster and run about 1.5x slower (Gemma 3 270M), and serve only until the whole programs are
# ready
FAST_OPTIONS = (("xla_backend_optimization_level", 0), ("xla_llvm_disable_expensive_passes", True))


@functools.lru_cache(maxsize=64)
def fast_jit(fn, statics: tuple[str, ...], donate: tuple[str, ...], **bound):
    """shared_jit with FAST_OPTIONS on CPU."""
    options = dict(FAST_OPTIONS) if jax.default_backend() == "cpu" else None
    return jax.jit(functools.partial(fn, **bound), static_argnames=statics,
                   donate_argnames=donate, compiler_options=options)


class StepPrograms:
    """An engine's step on one device: `__call__` has make_step's signature and result."""

    def __init__(self, cfg, backend: str, params, cache: KVCache, *, mode: str,
                 vocab_limit: int | None, processed_logprobs: bool):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}, not one of {COMPILE_MODES}")
        self.cfg, self.mode = cfg, mode
        head_bound = dict(vocab_limit=vocab_limit, processed_logprobs=processed_logprobs)
        self.whole = make_step(cfg, backend, None, **head_bound)  # prompt-logprob steps
        self.body = AheadOfTime(shared_jit(body, ("max_q_len",), ("cache",), cfg=cfg,
                                           backend=backend), ("max_q_len",), (params, cache))
        head_statics = ("num_logprobs", "filtered")
        self.head = AheadOfTime(shared_jit(head, head_statics, ("procs",), cfg=cfg, **head_bound),
                                head_statics, (params,))
        self.fast_head = AheadOfTime(fast_jit(head, head_statics + ("rows",), ("procs",),
                                              cfg=cfg, **head_bound),
                                     head_statics + ("rows",), (params,))
        self._embed = fast_jit(embed_rows, (), (), cfg=cfg)
        self._layer = fast_jit(layer_rows, ("i", "max_q_len"), ("k_pages", "v_pages"),
                               cfg=cfg, backend=backend)
        self._last = fast_jit(last_rows, (), (), cfg=cfg)
        self._kinds = tuple(layer_kind(cfg, i) for i in range(cfg.num_layers))
        self.layerwise: set = set()  # body signatures this engine ran layer by layer
        # head signatures (sampling arrays, statics) this engine ran; (signature, rows) of the
        # fast heads
        self.heads: set = set()
        self.layerwise_steps = 0  # steps whose body ran layer by layer
        self.fast_head_steps = 0  # ... whose head ran the fast-compiled program

    @property
    def count(self) -> int:
        """Distinct programs launched: whole steps, heads, bodies, and bodies run layer by layer
        (their small programs compiled for that signature)."""
        return (self.whole.count + len(self.head.launched) + len(self.fast_head.launched)
                + len(self.body.launched) + len(self.layerwise))

    def compiled(self) -> int:
        """Programs compiled in this process for this model's steps, by every engine of it:
        whole bodies and heads, and the small programs (what `count` cannot see: a program
        another engine compiled)."""
        tables = sum(j.future.done() for t in (self.body, self.head, self.fast_head)
                     for j in t.table.values())
        jits = (self.whole.jitted, self._embed, self._layer, self._last)
        return tables + sum(f._cache_size() for f in jits)

    def __call__(self, params, cache, arrays, *, max_q_len: int, num_logprobs: int,
                 filtered: bool, prompt_logprobs: bool = False, prev=None, procs=None):
        if prompt_logprobs:
            return self.whole(params, cache, arrays, max_q_len=max_q_len,
                              num_logprobs=num_logprobs, filtered=filtered,
                              prompt_logprobs=True, prev=prev, procs=procs)
        new = self.compiles(params, cache, arrays, max_q_len=max_q_len,
                            num_logprobs=num_logprobs, filtered=filtered, prev=prev, procs=procs)
        with compiler().foreground() if new else contextlib.nullcontext():
            return self._step(params, cache, arrays, max_q_len, num_logprobs, filtered, prev,
                              procs)

    def _step(self, params, cache, arrays, max_q_len, num_logprobs, filtered, prev, procs):
        background = self.mode == "background"
        args, kwargs = (params, cache, arrays), dict(prev=prev, max_q_len=max_q_len)
        out = self.body.call(args, kwargs, background=background,
                             priority=DECODE if max_q_len == 1 else NEEDED)
        if out is None:
            out = self._by_layer(params, cache, arrays, prev, max_q_len)
        h, cache = out
        args, kwargs = self._head_args(params, h, arrays, procs, num_logprobs, filtered)
        key = signature((args[2:], kwargs))
        out = self.head.call(args, kwargs, background=background)
        if out is None:  # the optimized head is compiling: the fast one meanwhile, of as many
            self.fast_head_steps += 1  # rows as the step has sequences (1, S/2 or S)
            rows = _rows(arrays)
            self.heads.add((key, rows))
            out = self.fast_head.call(args, dict(kwargs, rows=rows))
        else:
            self.heads.add(key)
        packed, new_procs = out
        return packed, cache, procs if args[3] is None else new_procs

    @staticmethod
    def _head_args(params, h, arrays, procs, num_logprobs, filtered):
        """The head's arguments; a step where no row has logits processors passes no state
        (a head program without them: ~40 % less to compile; the state is unchanged)."""
        if procs is not None and not (np.asarray(arrays["proc_slots"]) >= 0).any():
            procs = None
        return (params, h, head_arrays(arrays), procs), dict(num_logprobs=num_logprobs,
                                                             filtered=filtered)

    def compiles(self, params, cache, arrays, *, max_q_len: int, num_logprobs: int,
                 filtered: bool, prompt_logprobs: bool = False, prev=None, procs=None) -> bool:
        """Whether this call would compile a program first (the engine then hands out the
        tokens it holds before launching it). May say yes once for a program the background
        compiler just finished."""
        if prompt_logprobs:
            return not self.whole.launched(params, cache, arrays, max_q_len=max_q_len,
                                           num_logprobs=num_logprobs, filtered=filtered,
                                           prompt_logprobs=True, prev=prev, procs=procs)
        _, body_job = self.body.job((params, cache, arrays), dict(prev=prev, max_q_len=max_q_len))
        if not body_job.future.done() and (
                self.mode == "blocking" or signature(((arrays, prev), max_q_len))
                not in self.layerwise):
            return True
        args, kwargs = self._head_args(None, None, arrays, procs, num_logprobs, filtered)
        key = signature((args[2:], kwargs))
        return key not in self.heads and (key, _rows(arrays)) not in self.heads

    def _by_layer(self, params, cache: KVCache, arrays, prev, max_q_len: int):
        """The body as a chain of small programs (same math, same cache writes)."""
        self.layerwise.add(signature(((arrays, prev), max_q_len)))
        self.layerwise_steps += 1
        md = jax.device_put({k: arrays[k] for k in METADATA_FIELDS if k in arrays})
        x, mask, ple = self._embed(params, arrays, prev)
        given = given_rows(arrays)
        ks, vs = list(cache.k), list(cache.v)
        for i, lp in enumerate(params.layers):
            adapter = None if mask is None else params.lora[i]
            j = self.cfg.layer_kv_source(i)
            x, ks[j], vs[j] = self._layer(lp, x, ks[j], vs[j], md, adapter, mask,
                                          None if ple is None else ple[:, i],
                                          i=self._kinds[i], max_q_len=max_q_len)
            x = deepstack(x, given, i)
        return self._last(params, x, md), KVCache(k=tuple(ks), v=tuple(vs))

    @contextlib.contextmanager
    def waiting(self):
        """Steps in here wait for their whole programs (compile_mode "blocking"): warm-up that
        waits."""
        mode, self.mode = self.mode, "blocking"
        try:
            yield
        finally:
            self.mode = mode

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every program this engine queued on the background compiler is compiled
        (or failed); -> whether all were, within `timeout` seconds."""
        pending = [f for t in (self.body, self.head) for f in t.waiting]
        done, not_done = futures_wait(pending, timeout=timeout)
        for t in (self.body, self.head):
            t.waiting = [f for f in t.waiting if f in not_done]
        return not not_done

    def warmup(self, plans) -> list[Future]:
        """Queue the body and head programs of `plans` ((params, cache, arrays, prev, max_q_len,
        procs) tuples, smallest first) on the background compiler; -> their futures."""
        futures = []
        for params, cache, arrays, prev, q, procs in plans:
            futures.append(self.body.queue((params, cache, arrays), dict(prev=prev, max_q_len=q)))
            x, _, _ = jax.eval_shape(self._embed, params, arrays, prev)  # h has x's dtype
            h = jax.ShapeDtypeStruct((arrays["logits_indices"].shape[0], x.shape[1]), x.dtype)
            futures.append(self.head.queue(*self._head_args(params, h, arrays, procs, 0, False)))
        return futures
