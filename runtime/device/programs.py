"""A step as programs compiled ahead of use, in tiers, so no step waits on a compile it does
not need (on one device, or a mesh of this process's devices: each program sharded as its
arrays are).

A step is two programs (runtime/device/steps.py): the **body** (embed, every layer, the final
norm of the sampling rows; one per token x page x q-length bucket) and the **head** (vocabulary
projection, logits processors, masks, sampling, logprobs; one per slot count and statics, shared
by every bucket). Split this way the head compiles once, not once per bucket.

`compile_mode="background"`: a body whose program is not ready runs **layer by layer** (an
embed program, one program per layer kind (model.layer_kind: Gemma 3 has two), a last-rows
program) and a head not ready runs a **fast head** of 1, S/2 or S rows (as many as the step has
sequences); those small programs compile in a fraction of a second (FAST_LEVELS on CPU) while
the whole programs compile in the background `Compiler` thread; the first step after that uses
them. A step whose body is not ready but whose programs for a larger token bucket are (a whole
body of up to PAD_WHOLE x its rows, else layer programs) runs on its rows padded to that bucket
(`pad_tokens`), compiling nothing first: the tail of a batch, as requests finish, keeps the
programs of its full width. On CPU, where the background compile shares the cores with the
steps, a stand-in that runs about as fast as its whole program (level-1 layers, a larger
bucket's ready whole body, the fast head) has that program queued only after PATIENCE_S of
use. `"blocking"`: a step compiles its whole programs first (what every step did before).
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
                                           last_rows, layer_rows, make_step, shared_jit,
                                           on_mesh)
from jaxinfer.runtime.plan import PLAN_FIELDS

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


class Frozen:
    """A hashable value whose hash is computed once: a program table's key holds the engine's
    fixed arguments' signature and shardings (~400 leaves for Gemma 3), which a plain tuple
    re-hashes at every lookup (~2500 sharding hashes, ~1.2 ms a decode step)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Frozen) and self._hash == other._hash
                                 and self.value == other.value)


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
    landed = 0  # jobs finished in this process (counted after their future is set)

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
        with self._lock:  # two threads may finish at once (a foreground and a background one)
            _Job.landed += 1


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
            item = self._queue.get()
            if item[2] is not None and not self._stopping:
                self._wait_quiet()  # then the best job queued by now (put back, taken again)
                self._queue.put(item)
                item = self._queue.get()
            job = item[2]
            if job is None or self._stopping:
                return
            if job.started:  # queued twice (warm-up, then needed)
                continue
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
        # with their shardings: the engines sharing a model's programs may sit on other meshes
        self.fixed = Frozen((signature(fixed), tuple(x.sharding for x in jax.tree.leaves(fixed)
                                                     if isinstance(x, jax.Array))))
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

    def ready(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call's program is compiled (asks nothing to compile it)."""
        job = self.table.get((self.fixed, signature((args[self.n_fixed:], kwargs))))
        return job is not None and job.future.done() and job.future.exception() is None

    def get(self, args: tuple, kwargs: dict, *, background: bool, priority: int | None = NEEDED):
        """The compiled program for this call; None when `background` and it is not compiled
        (queued at `priority`; None: not queued)."""
        key, job = self.job(args, kwargs)
        if not job.future.done():
            if background:
                if priority is not None and compiler().submit(job, priority, self):
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
             priority: int | None = NEEDED):
        program = self.get(args, kwargs, background=background, priority=priority)
        if program is None:
            return None
        return program(*args, **{k: v for k, v in kwargs.items() if k not in self.statics})


def head_arrays(arrays: dict) -> dict:
    return {k: arrays[k] for k in HEAD_FIELDS}


# a step whose whole body is compiling may run a ready one of up to this many times its rows
PAD_WHOLE = 4
_T_FIELDS = tuple(f for f in PLAN_FIELDS if f.shape.split(",")[0] == "T")  # token rows first


def pad_tokens(arrays: dict, t: int) -> dict:
    """A step's arrays with its token rows padded to `t` (padding rows: each field's pad value;
    they write the null page and feed no logits row)."""
    out = dict(arrays)
    for f in _T_FIELDS:
        if f.name in arrays:
            a = np.asarray(arrays[f.name])
            out[f.name] = np.concatenate(
                [a, np.full((t - a.shape[0],) + a.shape[1:], f.pad, a.dtype)])
    return out


# XLA:CPU's backend optimization level of the layer-by-layer programs (with expensive LLVM
# passes off), by the step's token rows: level 0 compiles ~1.3x faster than 1 and runs 1.5x
# (Gemma 3 270M) to 2.5x (the mixed preset's d 512 layers) slower; level 1 runs as fast as the
# default (2) and compiles ~1.2x faster. A step of few rows (one request's first token) is a
# compile to hurry; one of many rows (a batch) runs long enough to repay level 1. The fast
# head takes its rows' level (at level 0 the mixed preset's 32-row head, a 32k vocabulary and
# sampling, ran the stand-in steps 8-10 % slower: two pairs of runs); the embed and last-rows
# programs (a gather, a norm) take level 0.
FAST_LEVELS = ((16, 0), (None, 1))  # (rows up to, level); None: any


# CPU: seconds a step shape whose stand-in runs as fast (level-1 layers, the fast head) is in use
# before its whole program compiles in the background (those compiles share the cores with the
# steps: ~6 s of a 14 s batch job on 2 cores for the mixed preset, where the stand-ins run as
# fast as the whole programs; Gemma 3 270M's whole ones are 0-6 % faster). Elsewhere the host
# compiles while the accelerator runs: at once.
PATIENCE_S = {"cpu": 20.0}


def fast_level(rows: int) -> int:
    return next(lvl for most, lvl in FAST_LEVELS if most is None or rows <= most)


@functools.lru_cache(maxsize=64)
def fast_jit(fn, statics: tuple[str, ...], donate: tuple[str, ...], level: int = 0, mesh=None,
             **bound):
    """shared_jit compiled at XLA:CPU optimization `level` on CPU (elsewhere: the defaults)."""
    options = None
    if jax.default_backend() == "cpu":
        options = {"xla_backend_optimization_level": level,
                   "xla_llvm_disable_expensive_passes": True}
    return jax.jit(functools.partial(on_mesh(fn, mesh), **bound), static_argnames=statics,
                   donate_argnames=donate, compiler_options=options)


class StepPrograms:
    """An engine's step on one device or one process's mesh: `__call__` has make_step's
    signature and result."""

    def __init__(self, cfg, backend: str, params, cache: KVCache, *, mode: str,
                 vocab_limit: int | None, processed_logprobs: bool,
                 token_buckets: tuple[int, ...] = (), mesh=None):
        """`token_buckets`: the T buckets steps come in; a step may run padded to a larger one
        whose programs are ready. `mesh` (an AbstractMesh): the one params and cache lie on,
        every program traced on it (expert-parallel layers and the Pallas kernels' shard_map
        find its "model" axis there)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}, not one of {COMPILE_MODES}")
        self.cfg, self.mode, self.token_buckets = cfg, mode, tuple(sorted(token_buckets))
        head_bound = dict(vocab_limit=vocab_limit, processed_logprobs=processed_logprobs)
        self.whole = make_step(cfg, backend, None, **head_bound, mesh=mesh)  # prompt logprobs
        self.body = AheadOfTime(shared_jit(body, ("max_q_len",), ("cache",), cfg=cfg,
                                           backend=backend, mesh=mesh), ("max_q_len",),
                                (params, cache))
        head_statics = ("num_logprobs", "filtered")
        self.head = AheadOfTime(shared_jit(head, head_statics, ("procs",), cfg=cfg, mesh=mesh,
                                           **head_bound), head_statics, (params,))
        self.fast_heads = {lvl: AheadOfTime(fast_jit(head, head_statics + ("rows",), ("procs",),
                                                     level=lvl, cfg=cfg, mesh=mesh, **head_bound),
                                            head_statics + ("rows",), (params,))
                           for _, lvl in FAST_LEVELS}  # by level, as the layers
        self._embed = fast_jit(embed_rows, (), (), cfg=cfg, mesh=mesh)
        self._layers = {lvl: fast_jit(layer_rows, ("i", "max_q_len"), ("k_pages", "v_pages"),
                                      level=lvl, cfg=cfg, backend=backend, mesh=mesh)
                        for _, lvl in FAST_LEVELS}
        self._last = fast_jit(last_rows, (), (), cfg=cfg, mesh=mesh)
        self._kinds = tuple(layer_kind(cfg, i) for i in range(cfg.num_layers))
        self.layerwise: set = set()  # body signatures this engine ran layer by layer
        # head signatures (sampling arrays, statics) this engine ran; (signature, rows) of the
        # fast heads
        self.heads: set = set()
        self.layerwise_steps = 0  # steps whose body ran layer by layer
        self.padded_steps = 0  # steps that ran padded to a larger token bucket's programs
        self.fast_head_steps = 0  # ... whose head ran the fast-compiled program
        self.patience = PATIENCE_S.get(jax.default_backend(), 0.0)
        self.first_use: dict = {}  # step shape -> when it first ran (time.monotonic)
        self._chosen: tuple = (None, None)  # _stand_in's last (key, choice)

    @property
    def count(self) -> int:
        """Distinct programs launched: whole steps, heads, bodies, and bodies run layer by layer
        (their small programs compiled for that signature)."""
        return (self.whole.count + len(self.head.launched)
                + sum(len(t.launched) for t in self.fast_heads.values())
                + len(self.body.launched) + len(self.layerwise))

    def compiled(self) -> int:
        """Programs compiled in this process for this model's steps, by every engine of it:
        whole bodies and heads, and the small programs (what `count` cannot see: a program
        another engine compiled)."""
        tables = sum(j.future.done() for t in (self.body, self.head, *self.fast_heads.values())
                     for j in t.table.values())
        jits = (self.whole.jitted, self._embed, self._last, *self._layers.values())
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
        out = self.body.call(args, kwargs, background=background, priority=None)
        if out is None:
            tier, padded, q = self._stand_in(arrays, prev, max_q_len)
            self.body.get(args, kwargs, background=True,  # queued now, or not yet (_due)
                          priority=self._body_priority(arrays, prev, max_q_len, tier, padded))
            if padded is not arrays:
                self.padded_steps += 1
            if tier == "whole":
                out = self.body.call((params, cache, padded), dict(prev=prev, max_q_len=q),
                                     background=True)
            else:
                out = self._by_layer(params, cache, padded, prev, q)
        h, cache = out
        args, kwargs = self._head_args(params, h, arrays, procs, num_logprobs, filtered)
        key = signature((args[2:], kwargs))
        # the fast head runs about as fast as the optimized one (a product and sampling ops):
        # its whole program waits for _due too
        due = self._due(("head", arrays["logits_indices"].shape[0], num_logprobs, filtered,
                         args[3] is None))
        out = self.head.call(args, kwargs, background=background, priority=NEEDED if due else None)
        if out is None:  # the optimized head is compiling: the fast one meanwhile, of as many
            self.fast_head_steps += 1  # rows as the step has sequences (1, S/2 or S)
            rows = self._fast_rows(key, arrays)
            self.heads.add((key, rows))
            out = self.fast_heads[fast_level(rows)].call(args, dict(kwargs, rows=rows))
        else:
            self.heads.add(key)
        packed, new_procs = out
        return packed, cache, procs if args[3] is None else new_procs

    def _due(self, shape: tuple) -> bool:
        """Whether the whole program of a step `shape` whose stand-in runs as fast may be queued
        now: at once where the host compiles beside an accelerator; on CPU once the shape has
        been in use for `patience` seconds (a short job's cores are not shared with compiles
        that would not pay back before it ends)."""
        if not self.patience:
            return True
        first = self.first_use.setdefault(shape, time.monotonic())
        return time.monotonic() - first >= self.patience

    def _body_priority(self, arrays, prev, max_q_len: int, tier: str,
                       stand_in: dict) -> int | None:
        """The background priority of this step's whole body; None: not queued yet. A stand-in
        about as fast (a ready whole body of a larger bucket, level-1 layers, padded or not)
        waits _due; one of level-0 layers is slower: queued at once."""
        T = arrays["token_ids"].shape[0]
        if (tier == "whole" or fast_level(stand_in["token_ids"].shape[0]) > 0) and not self._due(
                ("body", T, arrays["page_indices"].shape[-1], max_q_len, prev is None)):
            return None
        return DECODE if max_q_len == 1 else NEEDED

    def _stand_in(self, arrays, prev, max_q_len: int) -> tuple[str, dict, int]:
        """How a step whose whole body is not ready runs: ("whole" | "layers", its arrays,
        padded to a larger token bucket where that bucket's programs are ready, and the q-length
        bound: a prefill's bound grows with its bucket, and a larger bound is as valid). In
        order: a whole body of at most PAD_WHOLE times the rows, this shape's layer programs,
        any larger shape's, else this shape's layer programs (compiled now)."""
        tier, t, q, _ = self._choice(arrays, prev, max_q_len)
        return tier, arrays if t == arrays["token_ids"].shape[0] else pad_tokens(arrays, t), q

    def _choice(self, arrays, prev, max_q_len: int) -> tuple[str, int, int, bool]:
        """_stand_in's choice: (tier, token rows, q-length bound, whether its layer programs
        compile first); made once a shape (the engine asks compiles() first), until a program
        lands or layer programs are added."""
        key = (signature(((arrays, prev), max_q_len)), len(self.layerwise), _Job.landed)
        if self._chosen[0] != key:
            self._chosen = key, self._choose(arrays, prev, max_q_len, key[0])
        return self._chosen[1]

    def _choose(self, arrays, prev, max_q_len: int, sig) -> tuple[str, int, int, bool]:
        T = arrays["token_ids"].shape[0]
        first = ("layers", T, max_q_len, False) if sig in self.layerwise else None
        new = ("layers", T, max_q_len, True)
        if "mm_embeds" in arrays:  # image rows: no padding
            return first or new
        later = None
        for t in (b for b in self.token_buckets if b > T):
            padded = pad_tokens(arrays, t)
            for q in dict.fromkeys((max_q_len, t if max_q_len > 1 else 1)):
                if t <= PAD_WHOLE * T and self.body.ready((None, None, padded),
                                                          dict(prev=prev, max_q_len=q)):
                    return "whole", t, q, False
                if later is None and signature(((padded, prev), q)) in self.layerwise:
                    later = ("layers", t, q, False)
        return first or later or new

    def _fast_rows(self, key, arrays: dict) -> int:
        """The fast head's rows for a step: the fewest of 1, S/2, S that hold its sequences,
        of those already compiled if any (the last requests of a batch keep its head)."""
        s, n = arrays["logits_indices"].shape[0], int(np.asarray(arrays["num_seqs"])[0])
        fits = [r for r in sorted({1, max(1, s // 2), s}) if r >= n]
        return next((r for r in fits if (key, r) in self.heads), fits[0])

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
        if not body_job.future.done():
            if self.mode == "blocking":
                return True
            if self._choice(arrays, prev, max_q_len)[3]:
                return True
        args, kwargs = self._head_args(None, None, arrays, procs, num_logprobs, filtered)
        key = signature((args[2:], kwargs))
        return key not in self.heads and (key, self._fast_rows(key, arrays)) not in self.heads

    def _by_layer(self, params, cache: KVCache, arrays, prev, max_q_len: int):
        """The body as a chain of small programs (same math, same cache writes)."""
        self.layerwise.add(signature(((arrays, prev), max_q_len)))
        self.layerwise_steps += 1
        md = jax.device_put({k: arrays[k] for k in METADATA_FIELDS if k in arrays})
        x, mask, ple = self._embed(params, arrays, prev)
        given = given_rows(arrays)
        ks, vs = list(cache.k), list(cache.v)
        layer = self._layers[fast_level(arrays["token_ids"].shape[0])]
        for i, lp in enumerate(params.layers):
            adapter = None if mask is None else params.lora[i]
            j = self.cfg.layer_kv_source(i)
            x, ks[j], vs[j] = layer(lp, x, ks[j], vs[j], md, adapter, mask,
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
