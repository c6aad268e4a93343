"""EngineLoop: one device-owning thread around the (single-threaded) Engine, shared by transports.

    loop = EngineLoop(llm.engine, max_queue=64)
    h = loop.submit(prompt_ids, SamplingParams(...), n=1)
    async for deltas in h:           # or `for deltas in h:` from a plain thread
        for d in deltas: ...         # RequestDelta: index, text, token_ids, logprobs, finished, output
    h.cancel()                       # abort at the next step: slot and pages freed

Every engine call happens on the loop thread. Callers only touch thread-safe queues: `submit`
checks the request at the request door (runtime.host.requests) on the caller's thread, so bad input
and a full queue fail at once without waiting for a device step, then hands the request to the
loop thread, which adds it to the engine before the next step. After each step the deltas of one
handle are delivered as ONE batch (a list with one RequestDelta per sample that advanced, its
`index` set to the sample's), so a handle with n samples sees them in lock-step. The loop uses
the engine only through runtime/host/interface.py.

Queue accounting is per sequence: a handle of n samples counts n, `submit_many` (several prompts
of one request) is admitted or refused as a whole, and the depth (not yet admitted + waiting in
the engine) is refreshed after every submit, cancel and step. `max_queue` bounds sequences.

Failure model: a request can fail, the engine cannot. An engine step that raises fails the
requests that held slots (their handles end with EngineFault; slots and pages are freed) and the
loop goes on. Only when steps keep failing (MAX_CONSECUTIVE_FAULTS in a row) or the loop's own
bookkeeping breaks does the loop go down: every in-flight handle gets EngineFault, the loop turns
unhealthy (health NOT_SERVING) and later submits raise EngineFault at once. No consumer is ever
left waiting: every handle ends with either its final updates or an exception.

Transport-agnostic: no gRPC or HTTP here. Listeners (`on_finish`, `on_fault`) let a metrics or
health layer observe without the loop knowing about them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxinfer.runtime.host.errors import EngineAsleep, QueueFull, RequestError
from jaxinfer.runtime.host.interface import EngineInterface
from jaxinfer.runtime.host.outputs import RequestDelta, RequestOutput
from jaxinfer.runtime.host.requests import (SamplingParams, check_request, sample_params,
                                            truncate_prompt)

log = logging.getLogger(__name__)

__all__ = ["EngineLoop", "Handle", "EngineFault", "ShuttingDown", "QueueFull"]

# Outcome names used in stats()["requests"] (and the Prometheus requests counter).
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected", "invalid")
MAX_CONSECUTIVE_FAULTS = 3  # failed engine steps in a row before the loop declares itself down


class EngineFault(RuntimeError):
    """The engine failed this request (a step raised), or the loop is down."""


class ShuttingDown(RuntimeError):
    """The loop is draining or stopped and admits no new requests."""


_END = object()


class Handle:
    """One submission (n samples). Iterate it (async or sync) for per-step lists of
    RequestDelta; iteration ends after every sample finished, or raises EngineFault /
    ShuttingDown / ValueError."""

    def __init__(self, owner: EngineLoop, hid: str, n: int, aloop: asyncio.AbstractEventLoop | None,
                 request_id: str | None = None):
        self.id, self.n, self._owner = hid, n, owner
        self.request_id = request_id or hid
        self._aloop = aloop
        self._aq: asyncio.Queue | None = asyncio.Queue() if aloop is not None else None
        self._sq: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False
        self.finish_reasons: list[str | None] = [None] * n

    # called on the loop thread
    def _put(self, item) -> None:
        if self._aloop is not None:
            try:
                self._aloop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass
        else:
            self._sq.put(item)

    def cancel(self) -> None:
        """Abort every unfinished sample at the next step (idempotent, any thread)."""
        self._owner.cancel(self.id)

    def _unwrap(self, item):
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def __aiter__(self):
        if self._aq is None:
            raise TypeError("this handle was submitted outside an event loop: iterate it with `for`")
        return self

    async def __anext__(self) -> list[RequestDelta]:
        if self._done:
            raise StopAsyncIteration
        item = await self._aq.get()
        try:
            return self._unwrap(item)
        except StopIteration:
            raise StopAsyncIteration from None

    def __iter__(self):
        if self._aq is not None:
            raise TypeError("this handle belongs to an event loop: iterate it with `async for`")
        return self

    def __next__(self) -> list[RequestDelta]:
        if self._done:
            raise StopIteration
        return self._unwrap(self._sq.get())


@dataclass
class _Pending:
    handle: Handle
    prompt_ids: list[int]
    params: list[SamplingParams]
    live: dict[str, int] = field(default_factory=dict)  # engine rid -> sample index
    lora: str | None = None  # the LoRA adapter's name (None: the base model)
    images: list = field(default_factory=list)  # [(digest, pixels)]: runtime/host/image_prompt.py


class EngineLoop:
    def __init__(self, engine: EngineInterface, *, max_queue: int | None = None,
                 idle_wait_s: float = 0.05,
                 model_name: str = ""):
        self.engine = engine
        self.max_queue = max_queue
        self.model_name = model_name
        self._idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._inbox: deque[_Pending] = deque()  # guarded by _cv
        self._inbox_seqs = 0  # guarded by _cv: sequences (samples) in _inbox
        self._waiting = 0  # guarded by _cv: sequences waiting in the engine (refreshed each turn)
        self._cancels: set[str] = set()  # guarded by _cv
        self._calls: deque[tuple[Callable, Future]] = deque()  # guarded by _cv: call()
        self._swaps: list[tuple[object, Future]] = []  # loop thread: updates not serving yet
        self._handles: dict[str, _Pending] = {}  # loop thread only
        self._in_flight = 0  # guarded by _cv: handles submitted and not yet ended
        self._closing = False
        self._drain = True
        self._stopped = threading.Event()
        self._fault: BaseException | None = None
        self._ids = itertools.count()
        self._outcomes: Counter[str] = Counter({k: 0 for k in OUTCOMES})  # guarded by _cv
        self._tokens = 0
        self._steps = 0
        self.on_finish: list[Callable[[RequestOutput, str], None]] = []  # (output, outcome)
        self.on_fault: list[Callable[[BaseException], None]] = []
        self.limits = engine.limits  # runtime.host.requests.Limits of the served model
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) ---------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._fault is None and not self._stopped.is_set() and self._thread.is_alive()

    def count(self, outcome: str, n: int = 1) -> None:
        """Record an outcome decided outside the loop (e.g. a transport-level invalid request)."""
        with self._cv:
            self._outcomes[outcome] += n

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | Sequence[SamplingParams],
               request_id: str | None = None, *, n: int = 1, lora: str | None = None) -> Handle:
        """Queue `n` samples of one prompt (each an independent engine request; `params` is one
        SamplingParams, seeded per sample by `sample_params`, or one per sample). Raises at
        once: RequestError (a ValueError naming the field), QueueFull, ShuttingDown,
        EngineFault. From inside a running event loop the handle is async-iterable, otherwise
        sync-iterable."""
        return self.submit_many([(prompt_ids, params, n)], [request_id], lora=lora)[0]

    def submit_many(self, items: Sequence[tuple],
                    request_ids: Sequence[str | None] | None = None, *,
                    lora: str | None = None) -> list[Handle]:
        """Queue several prompts (prompt_ids, params, n[, images]) as one request, all on the
        LoRA adapter `lora` (None: the base model): every one is admitted, or none (the first
        bad one raises, naming its field; a queue that cannot take all of their sequences raises
        QueueFull). `images` [(digest, pixels)]: a prompt's images, its ids expanded already
        (runtime/host/image_prompt.py)."""
        pending, image_lists = [], []
        try:
            self.engine.check_lora(lora)
            for prompt_ids, params, n, *images in items:
                image_lists.append(images[0] if images else [])
                plist = (list(params) if isinstance(params, (list, tuple))
                         else sample_params(params, n))
                if len(plist) != n or n < 1:
                    raise RequestError("n", f"{len(plist)} sampling params for n={n}")
                prompt_ids = truncate_prompt([int(t) for t in prompt_ids], plist[0])
                for p in plist:
                    check_request(prompt_ids, p, self.limits)
                    if image_lists[-1]:
                        self.engine.check_images(image_lists[-1], p)
                pending.append((prompt_ids, plist))
        except ValueError:
            self.count("invalid")
            raise
        try:
            aloop = asyncio.get_running_loop()
        except RuntimeError:
            aloop = None
        total = sum(len(pl) for _, pl in pending)
        rids = list(request_ids or [None] * len(pending))
        with self._cv:
            if self._fault is not None or not self._thread.is_alive():
                raise EngineFault(f"engine is down: {self._fault!r}")
            if self._closing or self._stopped.is_set():
                raise ShuttingDown("server is shutting down")
            if self.engine.sleep_level:
                self._outcomes["rejected"] += 1
                raise EngineAsleep(f"the engine is asleep (level {self.engine.sleep_level}): "
                                   "POST /wake_up first")
            depth = self._inbox_seqs + self._waiting
            try:  # latency targets: a request predicted to miss its TTFT budget is refused now
                for prompt_ids, plist in pending:
                    self.engine.check_admission(len(prompt_ids), plist[0].priority)
            except QueueFull:
                self._outcomes["rejected"] += 1
                raise
            if self.max_queue is not None and depth + total > self.max_queue:
                self._outcomes["rejected"] += 1
                if total > self.max_queue:
                    raise QueueFull(f"request of {total} sequences (prompts x samples) exceeds "
                                    f"the queue limit of {self.max_queue}")
                raise QueueFull(f"queue is full ({depth} sequences waiting, max_queue "
                                f"{self.max_queue})")
            handles = []
            for (prompt_ids, plist), rid, images in zip(pending, rids, image_lists):
                h = Handle(self, f"h{next(self._ids)}", len(plist), aloop, rid)
                self._inbox.append(_Pending(h, prompt_ids, plist, lora=lora, images=images))
                handles.append(h)
            self._inbox_seqs += total
            self._in_flight += len(handles)
            self._cv.notify()
        return handles

    def load_lora(self, name: str, path: str):
        """Register a PEFT adapter (read and checked on the caller's thread while the engine
        serves on): -> runtime.adapters.Adapter. ValueError names the problem."""
        return self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> Future:
        """Unload an adapter between two steps: the Future holds None, or UnknownAdapter /
        AdapterInUse (ValueErrors) while a request still uses it."""
        return self.call(lambda: self.engine.remove_lora(name))

    def lora_adapters(self) -> dict[str, str] | None:
        """{name: path} of the loaded adapters (None: the engine serves none); any thread."""
        return self.engine.lora_adapters()

    def update_weights(self, weights, version=None, policy: str = "drain") -> Future:
        """Engine.update_weights between two steps (the checkpoint is read and the new version
        built on the loop thread: serving pauses meanwhile); the Future holds the new version
        once it serves (after the drain), or the error (WeightError names the tensor)."""
        done: Future = Future()

        def start():
            version_ = self.engine.update_weights(weights, version=version, policy=policy)
            self._swaps.append((version_, done))

        started = self.call(start)
        started.add_done_callback(lambda f: f.exception() and done.set_exception(f.exception()))
        return done

    def _settle_swaps(self) -> None:
        """Resolve update_weights Futures whose version serves now (loop thread)."""
        if self._swaps and not self.engine.weights_pending:
            swaps, self._swaps = self._swaps, []
            for version, fut in swaps:
                fut.set_result(version)

    def sleep(self, level: int = 1) -> Future:
        """Engine.sleep between two steps: refused (RuntimeError) while requests are
        unfinished; new requests are refused (EngineAsleep) until wake_up."""
        return self.call(lambda: self.engine.sleep(level))

    def wake_up(self) -> Future:
        return self.call(self.engine.wake_up)

    @property
    def sleep_level(self) -> int:
        """The engine's (0: awake); any thread."""
        return self.engine.sleep_level

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the loop thread between two steps; its result or exception in the
        Future."""
        fut: Future = Future()
        with self._cv:
            if self._stopped.is_set() or not self._thread.is_alive():
                raise ShuttingDown("the engine loop has stopped")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def embed(self, prompts: Sequence[Sequence[int]], pooling: str | None = None,
              normalize: bool = True) -> Future:
        """Embed token-id prompts on the loop thread between two steps (the engine's `embed`;
        generation waits meanwhile): the Future holds an f32 array [n, D], or the RequestError
        naming a bad field. Raises ShuttingDown when the loop has stopped."""
        return self.call(lambda: self.engine.embed(prompts, pooling=pooling, normalize=normalize))

    def cancel(self, handle_id: str) -> None:
        with self._cv:
            self._cancels.add(handle_id)
            self._cv.notify()

    def stats(self) -> dict:
        e = self.engine.stats()
        with self._cv:
            outcomes = dict(self._outcomes)
            depth = self._inbox_seqs + self._waiting
            in_flight = self._in_flight
        total, free = e["pages_total"], e["pages_free"]
        return {
            "queue_depth": depth, "running": e["running"],
            "max_slots": e["max_slots"], "pages_total": total, "pages_free": free,
            "pages_used": total - free, "tokens_generated": self._tokens, "requests": outcomes,
            "healthy": self.healthy, "in_flight": in_flight, "steps": self._steps,
            "compile_count": e["compile_count"], "vocab_size": self.limits.vocab_size,
            "max_model_len": self.limits.max_model_len, "model": self.model_name,
            "engine_faults": e["faults"], "spec_proposed": e["spec_proposed"],
            "spec_accepted": e["spec_accepted"],
            # the host KV tier's; a vision model's encoder and encoder cache
            **{k: v for k, v in e.items() if k.startswith(("kv_host_", "encoder_", "images_"))},
        }

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting. drain=True: let in-flight requests finish (up to `timeout` s, then
        cancel the rest); drain=False: cancel them now. Returns when the loop thread exited."""
        with self._cv:
            self._closing, self._drain = True, drain
            self._cv.notify()
        if drain and timeout is not None:
            deadline = time.monotonic() + timeout
            while self._in_flight and time.monotonic() < deadline and self._thread.is_alive():
                time.sleep(0.01)
            with self._cv:
                self._drain = False
                self._cv.notify()
        self._thread.join()

    # ---- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                cancels, stop = self._take_commands()
                for hid in cancels:
                    self._cancel_now(hid)
                self._refresh_depth()
                self._settle_swaps()
                if stop:
                    break
                if self.engine.has_work:
                    self._step()
                    self._refresh_depth()
                    self._settle_swaps()
                    faults = self.engine.stats()["consecutive_faults"]
                    if faults >= MAX_CONSECUTIVE_FAULTS:
                        raise EngineFault(f"{faults} engine steps failed in a row")
        except BaseException as e:  # noqa: BLE001 - any engine failure fails all clients
            log.exception("engine loop fault")
            self._fail_all(e)
        finally:
            self._stopped.set()

    def _take_commands(self):
        with self._cv:
            while (not self._inbox and not self._cancels and not self._closing
                   and not self._calls and not self.engine.has_work):
                self._cv.wait(self._idle_wait_s)
            # Admission is host-only bookkeeping; doing it under the lock keeps the queue depth
            # seen by submit() exact (inbox + engine waiting queue, never a gap between them).
            while self._inbox:
                p = self._inbox.popleft()
                self._inbox_seqs -= len(p.params)
                self._admit(p)
            self._waiting = self.engine.num_waiting
            cancels = set(self._cancels)
            self._cancels.clear()
            calls, self._calls = list(self._calls), deque()
            stop = False
            if self._closing:
                if not self._drain:
                    cancels |= set(self._handles)
                stop = not self._handles and not cancels
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)
        return cancels, stop

    def _refresh_depth(self) -> None:
        with self._cv:
            self._waiting = self.engine.num_waiting

    def _admit(self, p: _Pending) -> None:
        self._handles[p.handle.id] = p
        try:
            for i, sp in enumerate(p.params):
                rid = self.engine.add_request(p.prompt_ids, sp, f"{p.handle.id}/{i}", lora=p.lora,
                                              refuse_late=False,
                                              **({"images": p.images} if p.images else {}))
                p.live[rid] = i
        except Exception as e:  # checked at submit already; a last guard fails this handle only
            for rid in list(p.live):
                self.engine.abort(rid)
            p.live.clear()
            self._end(p, e if isinstance(e, ValueError) else EngineFault(repr(e)),
                      outcome="invalid" if isinstance(e, ValueError) else "error", locked=True)

    def _cancel_now(self, hid: str) -> None:
        p = self._handles.get(hid)
        if p is None:
            return
        updates = []
        for rid, i in list(p.live.items()):
            out = self.engine.abort(rid)
            p.handle.finish_reasons[i] = "abort"
            updates.append(RequestDelta(rid, finished=True, finish_reason="abort", output=out,
                                        index=i))
            if out is not None:
                self._notify_finish(out, "cancelled")
        p.live.clear()
        if updates:
            p.handle._put(updates)
        self._end(p, _END)

    def _step(self) -> None:
        deltas = self.engine.step()
        self._steps += 1
        by_handle: dict[str, list[RequestDelta]] = {}
        failed: dict[str, str] = {}  # handle id -> why
        for d in deltas:
            hid = d.request_id.rsplit("/", 1)[0]
            p = self._handles.get(hid)
            if p is None or d.request_id not in p.live:
                continue
            self._tokens += len(d.token_ids)
            d.index = p.live[d.request_id]
            if d.finish_reason == "error":  # the engine failed this sample: the handle fails
                del p.live[d.request_id]
                failed[hid] = d.error or "engine step failed"
                continue
            if d.finished:
                p.handle.finish_reasons[d.index] = d.finish_reason
                del p.live[d.request_id]
                self._notify_finish(d.output, d.finish_reason or "stop")
            by_handle.setdefault(hid, []).append(d)
        for hid, ups in by_handle.items():
            p = self._handles[hid]
            p.handle._put(sorted(ups, key=lambda u: u.index))
            if not p.live and hid not in failed:
                self._end(p, _END)
        for hid, why in failed.items():
            self._fail(self._handles[hid], why)

    def _fail(self, p: _Pending, why: str) -> None:
        """The engine failed one of this handle's samples: end the handle with EngineFault and
        free what its other samples hold."""
        for rid in list(p.live):
            self.engine.abort(rid)
        p.live.clear()
        self._end(p, EngineFault(why), outcome="error")

    def _end(self, p: _Pending, final, outcome: str | None = None, locked: bool = False) -> None:
        if self._handles.pop(p.handle.id, None) is None:
            return
        p.handle._put(final)
        if locked:
            self._count_end(outcome)
        else:
            with self._cv:
                self._count_end(outcome)

    def _count_end(self, outcome: str | None) -> None:
        self._in_flight -= 1
        if outcome is not None:
            self._outcomes[outcome] += 1

    def _notify_finish(self, out: RequestOutput, outcome: str) -> None:
        if outcome == "abort":
            outcome = "cancelled"
        with self._cv:
            self._outcomes[outcome] += 1
        for fn in self.on_finish:
            try:
                fn(out, outcome)
            except Exception:  # a listener bug must not take the engine down
                log.exception("on_finish listener failed")

    def _fail_all(self, exc: BaseException) -> None:
        self._fault = exc
        err = EngineFault(f"engine fault: {exc!r}")
        with self._cv:
            pending = list(self._handles.values()) + list(self._inbox)
            self._inbox.clear()
            self._inbox_seqs = 0
            self._handles.clear()
            for p in pending:
                self._outcomes["error"] += len(p.live) if p.live else p.handle.n
            self._in_flight = 0
        for p in pending:
            p.handle._put(err)
        swaps, self._swaps = self._swaps, []
        for _, fut in swaps:
            fut.set_exception(err)
        for fn in self.on_fault:
            try:
                fn(exc)
            except Exception:
                log.exception("on_fault listener failed")
