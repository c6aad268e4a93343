"""Host scheduler: waiting queue, slots, page allocation, chunked prefill, preemption. No JAX.

One model covers prefill, chunking, decode and recompute after preemption (vLLM v1 style): every
sequence has `num_computed` tokens whose K/V are in the cache, catching up to its `num_tokens` =
prompt + outputs. Each step, `schedule()` gives sequences new tokens to compute under a token
budget; the step that makes a sequence's computed tokens reach all its tokens samples its next
token, which `update()` appends.

Policy (tests pin every point):
  * Row order of a plan: running sequences whose prompt is computed (decodes) in admission order,
    then running sequences still prefilling (chunk continuation) in admission order, then
    sequences admitted this step, in queue order.
  * Budget: `token_budget` tokens per step, decodes included (the admission policy may cut it:
    runtime/host/admission.py). A chunk is min(uncomputed tokens, budget left). Decodes go
    first, so a long prompt never stalls them.
  * Admission: from the head of the waiting queue (in the policy's order: first come first
    served by default) while a slot is free, budget is left, the policy admits the head, its
    gates give it what it needs (an adapter's slot: runtime/host/lora_slots.py) and the pages
    for its first chunk can be allocated. If the head does not fit, nobody behind it is admitted
    this step (no overtaking). Nothing is admitted in a step that preempted.
  * Pages are allocated only for the tokens computed this step (a sequence grows page by page).
  * Preemption: when a running sequence cannot get the pages it needs, the youngest running
    sequence (latest arrival_time, ties: later add_request) is preempted, possibly the asker
    itself; repeat until the pages are found or the asker is preempted. A victim loses its pages
    and slot, goes back to the FRONT of the waiting queue with num_computed = 0 and keeps its
    outputs: when readmitted it recomputes prompt + outputs as its prefill and the final chunk
    samples the next new token (never a token it already has).
  * Finished sequences (EOS / stop token: "stop"; max_tokens: "length"; `finish()`; `abort()`)
    free their slot and pages at once, so the next `schedule()` can admit the next request.
  * Pages of a sequence are returned tail first (reverse order) to the allocator, so with prefix
    caching the head (most shareable) pages are the most recently used and stay cached longest.
  * Slots: lowest free slot first.

Prefix caching (`enable_prefix_caching=True`; see runtime/host/page_allocator.py for page states):
  * At admission (first or after preemption) a sequence looks up the longest run of cached FULL
    pages matching its tokens (prompt, plus outputs when recomputing), limited to the pages that
    end before its last token: k = (num_tokens - 1) // page_size pages at most, so at least the
    last token is always computed and its logits sampled. It shares those k pages (ref + 1) and
    starts with num_computed = k * page_size; only the rest is prefilled.
  * Shared pages are never written: a sequence writes only at positions >= num_computed, which
    lie in pages allocated to it alone after the shared ones.
  * A page is registered under its chained prefix hash as soon as all its tokens are computed
    (in `update`, during prefill chunks and decode alike), so later admissions can share it even
    while its writer is still running. If the hash is already registered (two sequences computed
    the same page concurrently) the second page stays private and is simply freed later.
  * A queue head whose first uncached full page is being computed by a running sequence (same
    hash, not registered yet: the n samples of one prompt, admitted together) is not admitted
    until that page is registered; then it shares it (no overtaking meanwhile).
  * Admission counts cached-but-unheld pages as available (they are evicted LRU first when truly
    free pages run out), minus the cached pages the sequence itself is about to take back.
  * A request that wants prompt logprobs takes no cached pages: its prefill computes the logits
    of every prompt token (`plan.prompt_targets`); its own pages are registered as usual.
  * Stats: `prefix_cache_stats()`; per request `cached_tokens_of(rid)` = prompt tokens served from
    the cache at its first admission.
  * With a host tier (`host_tier`, runtime/host/kv_host_tier.py): each cached page the allocator
    evicts is offloaded under its hash (the plan's `kv_offloads`: copied before the page's new
    owner writes it), and an admission continues its device prefix with the pages the tier
    holds: they get fresh pages, registered at once, filled from the host before the step
    (`kv_restores`), and count as cached tokens (`host_cached_tokens` apart in the stats).

Speculative decoding (`num_spec_tokens=K > 0`):
  * Before `schedule()`, `decode_candidates()` lists the sequences in pure decode (computed up to
    their last token, no logprobs wanted) with how many proposals each can use: min(K,
    max_tokens - outputs - 1), so a step never emits past max_tokens. `set_drafts()` hands the
    proposals in; a sequence with d proposals then wants 1 + d tokens (`_num_new_tokens`). No
    sequence takes proposals while one that wants prompt logprobs may prefill (those steps score
    every prompt row; verify steps do not).
  * Proposals are trimmed to the token budget; when the pages for 1 + d tokens cannot be found the
    proposals are dropped first (no preemption on their account), then the usual policy applies.
  * `update(plan, tokens [S, K+1], num_accepted [S])`: a row with d proposals of which a were
    accepted advances num_computed by 1 + a (its last token + the accepted proposals; the K/V of
    rejected ones stays behind the new length and is overwritten later) and appends
    tokens[:a + 1], cut at the first stop token or at max_tokens (later tokens are discarded).
    Pages beyond the new length are freed at once (tail first). Pages are registered in the
    prefix cache only up to num_computed, so a page filled by rejected tokens never is.

Asynchronous scheduling (one plan ahead; the engine's default without speculation):
  * `schedule()` may be called once more while the latest plan's step still runs (its results
    not yet given to `update()`); at most two plans are outstanding, and `update()` takes them
    oldest first. A plan's tokens count as computed from the moment it is planned (num_computed
    advances in `schedule()`); a row that samples leaves one *pending* token per sequence, whose
    id only the device knows until `update()`.
  * A decode row whose input is a pending token reads it on the device from the previous
    step's sampled tokens: `plan.feed_rows[t]` = that sequence's row in the previous plan
    (-1: the id is in token_ids).
  * A sequence whose pending token will be its max_tokens-th is not planned again (it finishes
    with "length" in `update()`). One that samples a stop token is planned once more before the
    host sees it; `update()` drops that row's result (the sequence is finished by then), as it
    drops rows of sequences finished, aborted or preempted after their plan was made.
  * A preempted sequence loses its pending token; after readmission it recomputes and samples
    it again (same seed and position, so the same token).
  * Pages are registered in the prefix cache in `update()`, only up to tokens computed by steps
    whose results have come back and whose ids are known.
  * Speculative proposals need every token known: `set_drafts()` refuses them for a sequence
    with a pending token.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.runtime.config import SloConfig
from jaxinfer.runtime.host.admission import FirstComeFirstServed
from jaxinfer.runtime.host.errors import QueueFull
from jaxinfer.runtime.host.image_prompt import chunk_end, span_hash_extras
from jaxinfer.runtime.host.lora_slots import LoraGate, LoraSlots
from jaxinfer.runtime.host.kv_host_tier import HostTier
from jaxinfer.runtime.host.page_allocator import PageAllocator, page_hashes
from jaxinfer.runtime.host.plan_rows import PlanRows
from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.host.slo import StepTimes
from jaxinfer.runtime.plan import GROUPS, StepPlan, bucket, padding_arrays, pow_buckets


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()  # the model's EOS ids (ignored when params.ignore_eos)
    arrival_time: float = field(default_factory=time.monotonic)
    lora: str | None = None  # LoRA adapter key (one per loaded adapter version); None: base
    procs: object = None  # runtime.host.processors.ProcessorSpec: its logits processors; None: none
    images: tuple = ()  # runtime.host.image_prompt.ImageSpan per image in the prompt, in order
    rope_positions: object = None  # int32 [prompt, 3] multimodal RoPE positions (None: 1-D)
    rope_delta: int = 0  # ... and what generated tokens add to their position


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | given to finish()
    num_proposed: int = 0  # speculative proposals verified this step
    num_accepted: int = 0  # of which accepted


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class _Seq:
    req: Request
    order: int  # add_request counter: FCFS tie-break and seed derivation
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache or being computed by a planned step
    pending: int = 0  # tokens sampled by planned steps whose ids the host has not seen yet
    sample_row: int = 0  # the row of the latest plan that samples this sequence's next token
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    lora_slot: int = 0  # the adapter's device slot while running (0: base model)
    hashes: list[bytes] = field(default_factory=list)  # prefix hashes of full pages, lazily grown
    num_registered: int = 0  # leading pages already hashed in the allocator (shared or registered)
    cached_tokens: int | None = None  # tokens taken from the prefix cache at first admission
    prefilled: bool = False  # computed tokens have reached all tokens once since (re)admission
    draft: list[int] = field(default_factory=list)  # speculative proposals for the next step
    admissions: int = 0  # times it took a slot: its device state is loaded on a new count
    status: str = WAITING
    finish_reason: str | None = None

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows: prompt + outputs seen so far."""
        return len(self.req.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known + self.pending

    def token(self, i: int) -> int:
        n = len(self.req.prompt_ids)
        return self.req.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def age_key(self) -> tuple[float, int]:
        return (self.req.arrival_time, self.order)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Continuous-batching scheduler over `max_slots` slots and a pool of `num_pages` KV pages
    (page 0 null) of `page_size` tokens. Loop: add_request()* -> schedule() -> device step ->
    update(plan, sampled) -> repeat. Buckets (static shapes): T from `token_buckets` (default
    powers of two 8..>=token_budget), S = max_slots, P from `page_buckets` (default powers of two
    below pages_per_seq, then pages_per_seq), max_q_len from `q_buckets` capped at T.
    `enable_prefix_caching` is off by default here (host tests pin exact free-list orders);
    EngineConfig turns it on. `cache_salt` namespaces the prefix hashes (LoRA, KV dtype...).
    `mask_words` (W): int32 words of a plan's token bitmask rows; the scheduler flags the rows
    that sample under a structured-output constraint, the engine fills their masks.
    `max_loras` adapter slots (0: base model only) gate admission. `admission`: the policy
    (runtime/host/admission.py; default first come first served), which reads the measured
    `step_times` / `decode_times` (`record_step_time`) and `clock`."""

    def __init__(
        self,
        *,
        max_slots: int,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        token_budget: int,
        max_queue: int | None = None,
        token_buckets: Sequence[int] | None = None,
        q_buckets: Sequence[int] | None = None,
        page_buckets: Sequence[int] | None = None,
        enable_prefix_caching: bool = False,
        cache_salt: bytes = b"",
        num_spec_tokens: int = 0,
        mask_words: int = 1,
        max_loras: int = 0,
        admission: FirstComeFirstServed | None = None,
        step_times: StepTimes | None = None,
        host_tier: HostTier | None = None,
        decode_times: StepTimes | None = None,
        clock=time.monotonic,
    ):
        for name, v in (("max_slots", max_slots), ("page_size", page_size),
                        ("max_model_len", max_model_len), ("token_budget", token_budget)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.max_slots = max_slots
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.max_queue = max_queue
        self.pages_per_seq = _cdiv(max_model_len, page_size)
        self.allocator = PageAllocator(num_pages)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.host_tier = host_tier if self.enable_prefix_caching else None
        if self.host_tier is not None:
            self.allocator.evicted = []
        self._restores: list[tuple[int, int]] = []  # (device page, host slot) of the next plan
        self.cache_salt = bytes(cache_salt)  # namespace of the prefix hashes (adapter, KV dtype...)
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        self.num_spec_tokens = num_spec_tokens
        self.mask_words = mask_words
        self.admission = admission or FirstComeFirstServed()
        self._lora = LoraGate(max_loras) if max_loras else None
        self._gates = (self._lora,) if self._lora else ()  # acquired in order, released all
        self._rows = PlanRows(page_size=page_size, num_spec_tokens=num_spec_tokens,
                              lora_gate=self._lora)
        self.step_times = step_times or StepTimes()  # every step's time by its token rows
        # ... and decode-only steps' by live sequence count (the ITL budget's admission cap)
        self.decode_times = decode_times or StepTimes(beyond="linear")
        self.clock = clock

        self.token_buckets = tuple(sorted(token_buckets or pow_buckets(8, token_budget)))
        if self.token_buckets[-1] < token_budget:
            raise ValueError(
                f"largest token bucket {self.token_buckets[-1]} < token_budget {token_budget}"
            )
        self.q_buckets = tuple(sorted(q_buckets or pow_buckets(1, self.token_buckets[-1])))
        if page_buckets is None:
            page_buckets = pow_buckets(1, self.pages_per_seq, cap=True)
        self.page_buckets = tuple(sorted(page_buckets))
        if self.page_buckets[-1] < self.pages_per_seq:
            raise ValueError(
                f"largest page bucket {self.page_buckets[-1]} < pages per sequence {self.pages_per_seq}"
            )

        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admission order
        self._live: dict[str, _Seq] = {}  # waiting + running, by request id
        self._free_slots = list(range(max_slots))  # heap: lowest slot first
        self._counter = 0
        # plans scheduled but not yet updated, oldest first: (plan, rows), each row
        # (sequence, tokens this step, first position). A sequence preempted after its row was
        # planned is WAITING when that plan is updated (nothing is admitted in a step that
        # preempts), so its stale row is recognised by status alone.
        self._inflight: deque[tuple[StepPlan, list[tuple[_Seq, int, int]]]] = deque()
        self.num_preemptions = 0
        self._stats = dict(prompt_tokens=0, cached_tokens=0, recompute_tokens=0,
                           recompute_cached_tokens=0, host_cached_tokens=0)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        n, m = len(req.prompt_ids), req.params.max_tokens
        if n == 0:
            raise ValueError(f"request {req.request_id!r}: empty prompt")
        if n + m > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r}: prompt ({n} tokens) + max_tokens ({m}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        # The last sampled token is never fed back, so K/V is needed for n + m - 1 tokens.
        if _cdiv(n + m - 1, self.page_size) > self.allocator.num_total:
            raise ValueError(
                f"request {req.request_id!r}: prompt + max_tokens needs more KV pages than the whole "
                f"pool holds ({self.allocator.num_total} pages of {self.page_size} tokens)"
            )
        if req.request_id in self._live:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        if req.lora is not None and self._lora is None:
            raise ValueError(f"request {req.request_id!r}: LoRA adapter given, no adapter slots")
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            raise QueueFull(f"waiting queue is full ({self.max_queue} requests)")
        p = req.params
        if p.seed is not None:
            seed = p.seed & 0xFFFFFFFF
        else:
            digest = hashlib.blake2b(f"{req.request_id}:{self._counter}".encode(), digest_size=4)
            seed = int.from_bytes(digest.digest(), "little")
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_ids))
        seq = _Seq(req=req, order=self._counter, seed=seed, stop_ids=frozenset(stop_ids))
        self._counter += 1
        self._waiting.append(seq)
        self._live[req.request_id] = seq

    def finish(self, request_id: str, reason: str) -> bool:
        """External stop (stop string matched, client gone): free slot and pages now. Returns
        False (and does nothing) when the request is no longer in flight, e.g. it already
        finished on its own in the same step."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._retire(seq, reason)
        return True

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request; True if it was in flight."""
        return self.finish(request_id, "abort")

    def fail_running(self) -> list[str]:
        """After a step that raised: retire (reason "error") every sequence that holds a slot or
        is in no queue, forget the plans in flight, keep the waiting queue. If the failure left
        the page or slot bookkeeping inconsistent (it struck mid-plan), start a fresh pool: no
        page is held once the running sequences are gone. Returns the retired request ids."""
        self._inflight.clear()
        queued = {id(s) for s in self._waiting}
        failed = [s for s in self._live.values() if id(s) not in queued]
        broken = False
        for seq in failed:
            if seq in self._running:
                self._running.remove(seq)
            try:
                self._release(seq)
            except AssertionError:  # PageAllocatorError: pages freed twice or never held
                broken = True
            seq.status, seq.finish_reason = FINISHED, "error"
            del self._live[seq.req.request_id]
        try:
            self.check_invariants()
        except AssertionError:
            broken = True
        if broken:
            self.allocator = PageAllocator(self.allocator.num_pages)
            self._free_slots = list(range(self.max_slots))
        return [s.req.request_id for s in failed]

    # ------------------------------------------------------------------ introspection

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def waiting_ids(self) -> list[str]:
        return [s.req.request_id for s in self._waiting]

    @property
    def running_ids(self) -> list[str]:
        return [s.req.request_id for s in self._running]

    def pages_of(self, request_id: str) -> list[int]:
        return list(self._live[request_id].pages)

    def slot_of(self, request_id: str) -> int | None:
        return self._live[request_id].slot

    def output_ids(self, request_id: str) -> list[int]:
        return list(self._live[request_id].output_ids)

    def cached_tokens_of(self, request_id: str) -> int:
        """Prompt tokens of a live request served from the prefix cache at its first admission
        (0 before admission or without prefix caching)."""
        return self._live[request_id].cached_tokens or 0

    def prefix_cache_stats(self) -> dict:
        """Counters since construction. prompt_tokens / cached_tokens: over first admissions;
        hit_rate = cached_tokens / prompt_tokens; recompute_*: the same over readmissions after
        preemption (prompt + outputs); cached_pages: unheld cached pages now; evictions: cached
        pages reused for other content."""
        st = dict(self._stats)
        st["hit_rate"] = st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0
        st["cached_pages"] = self.allocator.num_cached
        st["evictions"] = self.allocator.num_evictions
        return st

    def reset_prefix_cache(self) -> int:
        """Drop every cached page nobody holds, and the host tier's (e.g. after swapping
        weights). Returns the count of device pages dropped."""
        if self.host_tier is not None:
            self.host_tier.reset()
            self.allocator.evicted.clear()
        return self.allocator.reset_prefix_cache()

    def queues(self) -> tuple[list[_Seq], list[_Seq]]:
        """Snapshots of the waiting (in queue order) and running sequences (admission order),
        for the admission policy; safe from another thread."""
        return list(self._waiting), list(self._running)

    @property
    def latency_targets(self) -> SloConfig:
        """The admission policy's latency targets (frozen; read by stats and metrics)."""
        return self.admission.targets

    @property
    def lora_slots(self) -> LoraSlots | None:
        """Which adapter is in which device slot (None: no adapter slots); read-only use."""
        return self._lora.slots if self._lora else None

    def evict_lora(self, key: str) -> None:
        """Forget the unreferenced adapter `key` (unloaded): its slot is free again; ValueError
        while a running sequence uses it."""
        if self._lora is not None:
            self._lora.evict(key)

    # ------------------------------------------------------------------ admission policy

    def record_step_time(self, plan: StepPlan, seconds: float) -> None:
        """The measured seconds of the step that ran `plan` (what the policies predict from):
        by its token rows, and by its live sequences when every row decodes."""
        self.step_times.record(len(plan.token_ids), seconds)
        n = int(plan.num_seqs[0])
        if plan.num_tokens == n:
            self.decode_times.record(n, seconds)

    def predicted_wait(self, prompt_len: int, priority: int = 0) -> float:
        """Seconds until a request arriving now would get its first token (0 while nothing is
        measured); safe from another thread."""
        return self.admission.predicted_wait(self, prompt_len, priority)

    def check_overload(self, request_id: str, prompt_len: int, priority: int = 0) -> None:
        """Raise Overloaded when the policy refuses a request arriving now (with refuse_late:
        predicted to miss its TTFT budget)."""
        self.admission.check_overload(self, request_id, prompt_len, priority)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (cheap; for tests and soaks)."""
        a = self.allocator
        a.check_invariants()
        holders: dict[int, int] = {}
        for s in self._running:
            assert len(s.pages) == len(set(s.pages)), f"a page twice in one page table: {s.pages}"
            for p in s.pages:
                holders[p] = holders.get(p, 0) + 1
            # pages this sequence still writes into (the partial page and later) are its own
            for p in s.pages[s.num_computed // self.page_size:]:
                assert a.ref_count(p) == 1 and a.hash_of(p) is None, f"writable page {p} is shared"
            assert s.num_registered <= s.num_computed // self.page_size
        assert 0 not in holders, "the null page is held by a sequence"
        held = [p for p in range(1, a.num_pages) if a.ref_count(p) > 0]
        assert sorted(holders) == held, "a page is held by no sequence (leak) or vice versa"
        for p, c in holders.items():
            assert a.ref_count(p) == c, f"page {p}: ref count {a.ref_count(p)} != {c} holders"
        if not self.enable_prefix_caching:
            assert a.num_cached == 0
        slots = [s.slot for s in self._running]
        assert sorted(slots + self._free_slots) == list(range(self.max_slots)), "slots leaked"
        for s in self._running:
            assert s.status == RUNNING
            assert len(s.pages) >= _cdiv(s.num_computed, self.page_size)
            # planned proposals count as computed until update() rolls back the rejected ones
            assert s.num_computed <= s.num_tokens + (self.num_spec_tokens if self._inflight else 0)
        for s in self._waiting:
            assert s.status == WAITING and not s.pages and s.slot is None and s.num_computed == 0
        assert set(self._live) == {s.req.request_id for s in [*self._waiting, *self._running]}
        for s in self._waiting:
            assert not s.lora_slot, "a waiting sequence holds an adapter slot"
        for gate in self._gates:
            gate.check(self._running)

    # ------------------------------------------------------------------ the step

    def _num_new_tokens(self, seq: _Seq) -> int:
        """Tokens this sequence wants computed this step: its uncomputed tokens plus its
        speculative proposals (a decode with d proposals computes 1 + d tokens); none once its
        last token (the max_tokens-th) is pending."""
        if len(seq.output_ids) + seq.pending >= seq.req.params.max_tokens:
            return 0
        return seq.num_tokens - seq.num_computed + len(seq.draft)

    def decode_candidates(self) -> list:
        """Running sequences in pure decode that may take proposals this step, as
        `runtime.proposers.DraftRequest`-shaped records (duck-typed; no import of that module).
        Row order = plan order of decodes (admission order)."""
        from types import SimpleNamespace

        out = []
        if not self.num_spec_tokens or self._prompt_scoring_due():
            return out
        for seq in self._running:
            p = seq.req.params
            # rows wanting logprobs take no proposals (constrained rows do: the engine masks
            # every verify row with the grammar's state after the proposals before it)
            if (not seq.prefilled or seq.pending or seq.num_computed != seq.num_tokens - 1
                    or p.logprobs is not None):
                continue
            cap = min(self.num_spec_tokens, p.max_tokens - len(seq.output_ids) - 1)
            if cap <= 0:
                continue
            out.append(SimpleNamespace(
                request_id=seq.req.request_id, token_ids=[*seq.req.prompt_ids, *seq.output_ids],
                max_draft=cap, seed=seq.seed, temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, min_p=p.min_p))
        return out

    def _prompt_scoring_due(self) -> bool:
        """A request that wants prompt logprobs may prefill this step (running and not prefilled,
        or admissible now): such steps score every prompt row, which the verify step does not."""
        admissible = list(self._waiting)[:len(self._free_slots)]
        return any(s.req.params.prompt_logprobs is not None and not s.prefilled
                   for s in [*self._running, *admissible])

    def set_drafts(self, drafts: dict[str, Sequence[int]]) -> None:
        """Proposals for the next schedule(), by request id (replaces any earlier ones)."""
        for seq in self._running:
            seq.draft = []
        for rid, toks in drafts.items():
            seq = self._live.get(rid)
            if seq is None or seq.status != RUNNING or not toks:
                continue
            if not seq.prefilled or seq.pending or seq.num_computed != seq.num_tokens - 1:
                raise ValueError(f"request {rid!r} is not decoding (or its last token is not "
                                 "back yet); it cannot take proposals")
            cap = min(self.num_spec_tokens, seq.req.params.max_tokens - len(seq.output_ids) - 1)
            seq.draft = [int(t) for t in toks][: max(cap, 0)]

    def schedule(self) -> StepPlan | None:
        """Pick this step's tokens (one catch-up loop over running sequences, then admission) and
        return the padded plan, or None when nothing can run. Call update() with it next."""
        if len(self._inflight) >= 2:
            raise ValueError("two plans are outstanding: update() the oldest before scheduling")
        policy = self.admission
        running_tokens = sum(self._num_new_tokens(s) for s in self._running if s.prefilled)
        budget = policy.token_budget(self, running_tokens)
        self._waiting = policy.order(self, self._waiting)
        rows: list[tuple[_Seq, int]] = []  # (sequence, tokens this step), in plan row order
        preempted = False

        # Running sequences: decodes first, then chunk continuations (stable: admission order).
        for seq in sorted(self._running, key=lambda s: not s.prefilled):
            if seq.status != RUNNING:  # preempted earlier in this loop
                continue
            n = self._take(seq, budget)
            if not n:
                continue
            while not self._grow(seq, n):
                if self._shed(seq):  # optional tokens go before anyone is preempted
                    n = self._take(seq, budget)
                    continue
                victim = max(self._running, key=lambda s: s.age_key)
                budget += self._preempt(victim, rows)
                preempted = True
                if victim is seq:
                    break
            if seq.status == RUNNING:
                rows.append((seq, n))
                budget -= n

        # Admission, in the policy's order with no overtaking (the head also waits for its gates).
        while self._waiting and self._free_slots and budget > 0 and not preempted:
            seq = self._waiting[0]
            if self._awaits_prefix(seq) or not policy.admits(self, seq) or not self._acquire(seq):
                break
            n = self._admit_pages(seq, budget)
            if n is None:
                self._give_back(seq)
                break
            self._start(self._waiting.popleft())
            rows.append((seq, n))
            budget -= n

        if not rows:
            return None
        plan = self._build_plan(rows)
        self._inflight.append((plan, self._advance(plan, rows)))
        return plan

    def _start(self, seq: _Seq) -> None:
        seq.slot = heapq.heappop(self._free_slots)
        seq.admissions += 1
        seq.status = RUNNING
        self._running.append(seq)

    def _advance(self, plan: StepPlan, rows: list[tuple[_Seq, int]]) -> list[tuple[_Seq, int, int]]:
        """Count the planned tokens as computed (a sampling row leaves a pending token); the
        in-flight rows (sequence, tokens, first position)."""
        planned = []
        for s, (seq, n) in enumerate(rows):
            planned.append((seq, n, seq.num_computed))
            seq.num_computed += n
            if plan.samples[s]:
                seq.pending += 1
                seq.sample_row = s
                seq.prefilled = True
        return planned

    def _take(self, seq: _Seq, budget: int) -> int:
        """Tokens a running `seq` computes this step within `budget` (0: none); its speculative
        proposals are trimmed to fit (dropped with none)."""
        n = min(self._num_new_tokens(seq), budget)
        if seq.req.images:
            n = chunk_end(seq.req.images, seq.num_computed, n)
        if n <= 0:
            seq.draft = []
            return 0
        del seq.draft[max(0, n - (seq.num_tokens - seq.num_computed)):]
        return n

    def _shed(self, seq: _Seq) -> bool:
        """Drop `seq`'s proposals when the pages for them are short; False if it had none."""
        had = bool(seq.draft)
        seq.draft = []
        return had

    def _acquire(self, seq: _Seq) -> bool:
        """Take what every gate gives the queue's head; nothing held (False) if one refuses."""
        for i, gate in enumerate(self._gates):
            if not gate.acquire(seq):
                for held in self._gates[:i]:
                    held.release(seq)
                return False
        return True

    def _give_back(self, seq: _Seq) -> None:
        for gate in self._gates:
            gate.release(seq)

    def _grow(self, seq: _Seq, n: int) -> bool:
        """Give `seq` the pages for its next `n` tokens; False if the pool is short."""
        need = _cdiv(seq.num_computed + n, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.allocator.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _admit_pages(self, seq: _Seq, budget: int) -> int | None:
        """Give a waiting `seq` its cached prefix pages plus pages for its first chunk; return the
        chunk size, or None (and nothing changed) if the pool is short."""
        shared = self._cached_prefix(seq)
        hosted = self._hosted_prefix(seq, len(shared))  # host slots of the pages after them
        start = (len(shared) + len(hosted)) * self.page_size
        n = chunk_end(seq.req.images, start, min(seq.num_tokens - start, budget))
        if n <= 0:  # the first chunk would split an image: wait for a step with room
            return None
        need = _cdiv(start + n, self.page_size) - len(shared)
        reclaimed = sum(1 for p in shared if self.allocator.ref_count(p) == 0)  # leave the LRU
        if need > self.allocator.num_free - reclaimed:
            return None
        self.allocator.incref(shared)
        pages = self.allocator.allocate(need)
        assert pages is not None
        seq.pages = shared + pages
        seq.num_computed = start
        if hosted:  # their K/V arrive before the step: shareable from now on
            hashes = self._hashes(seq, len(shared) + len(hosted))
            for j, slot in enumerate(hosted):
                page = pages[j]
                self.allocator.register(page, hashes[len(shared) + j])
                self._restores.append((page, slot))
            self.host_tier.stats["restored"] += len(hosted)
            self._stats["host_cached_tokens"] += len(hosted) * self.page_size
        seq.num_registered = len(shared) + len(hosted)
        st = self._stats
        if seq.cached_tokens is None:  # first admission: its prompt
            seq.cached_tokens = start
            st["prompt_tokens"] += seq.num_tokens
            st["cached_tokens"] += start
        else:
            st["recompute_tokens"] += seq.num_tokens
            st["recompute_cached_tokens"] += start
        return n

    def _hashes(self, seq: _Seq, n_pages: int) -> list[bytes]:
        """The prefix hashes of `seq`'s first `n_pages` full pages (tokens must be known)."""
        have = len(seq.hashes)
        if have < n_pages:
            ps = self.page_size
            toks = [seq.token(i) for i in range(have * ps, n_pages * ps)]
            parent = seq.hashes[-1] if have else None
            salt = self.cache_salt + (b"lora:" + seq.req.lora.encode() if seq.req.lora else b"")
            extras = (span_hash_extras(seq.req.images, ps, have, n_pages - have)
                      if seq.req.images else None)
            seq.hashes += page_hashes(toks, ps, salt, parent=parent, extras=extras)
        return seq.hashes[:n_pages]

    def _prefix_hashes(self, seq: _Seq) -> list[bytes]:
        """The hashes of the full pages `seq` may take from the prefix cache: those ending
        before its last token; none without prefix caching or for a request that wants prompt
        logprobs (every prompt token's logits are computed)."""
        if not self.enable_prefix_caching or seq.req.params.prompt_logprobs is not None:
            return []
        return self._hashes(seq, (seq.num_tokens - 1) // self.page_size)

    def _cached_prefix(self, seq: _Seq) -> list[int]:
        """Cached pages matching `seq`'s leading full pages (`_prefix_hashes`)."""
        return self.allocator.lookup(self._prefix_hashes(seq))

    def _hosted_prefix(self, seq: _Seq, j: int) -> list[int]:
        """Host-tier slots of `seq`'s prefix pages from page j on, as far as the tier holds
        them."""
        hashes = self._prefix_hashes(seq)[j:]
        return self.host_tier.lookup(hashes) if self.host_tier is not None and hashes else []

    def _kv_moves(self) -> dict:
        """The host tier's copies before this plan's step: the pages evicted since the last
        plan (each given a host slot, unless the tier has its hash) and the planned restores."""
        if self.host_tier is None:
            return {"kv_offloads": [], "kv_restores": []}
        offloads = []
        for page, h in self.allocator.evicted:
            slot = self.host_tier.put(h)
            if slot is not None:
                offloads.append((page, slot))
        self.allocator.evicted.clear()
        restores, self._restores = self._restores, []
        return {"kv_offloads": offloads, "kv_restores": restores}

    def _awaits_prefix(self, seq: _Seq) -> bool:
        """Whether the first full page `seq` would not find cached is being computed by a
        running sequence (same prefix hash, not registered yet: a sibling sample of the same
        prompt admitted a step earlier): `seq` then waits until it is registered and shares it."""
        hashes = self._prefix_hashes(seq)
        j = len(self.allocator.lookup(hashes))
        return j < len(hashes) and any(
            r.num_registered <= j < r.num_known // self.page_size
            and self._hashes(r, j + 1)[j] == hashes[j] for r in self._running)

    def _register_full_pages(self, seq: _Seq, computed: int) -> None:
        """Publish the pages of `seq` whose tokens are all computed (the first `computed`, by
        steps whose results are back) and known."""
        full = min(computed, seq.num_known) // self.page_size
        if not self.enable_prefix_caching or full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for j in range(seq.num_registered, full):
            self.allocator.register(seq.pages[j], hashes[j])
        seq.num_registered = full

    def _release(self, seq: _Seq) -> None:
        self.allocator.free(reversed(seq.pages))
        self._give_back(seq)
        seq.pages = []
        seq.num_registered = 0
        if seq.slot is not None:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = None

    def _preempt(self, seq: _Seq, rows: list[tuple[_Seq, int]]) -> int:
        """Send running `seq` back to the queue's front; drop its row from this step's `rows`
        if it has one: return that row's tokens (0 without)."""
        freed = 0
        for i, (s, k) in enumerate(rows):
            if s is seq:
                del rows[i]
                freed = k
                break
        self._release(seq)
        seq.draft = []
        self._running.remove(seq)
        seq.num_computed = 0
        seq.pending = 0
        seq.prefilled = False
        seq.status = WAITING
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        return freed

    def _retire(self, seq: _Seq, reason: str) -> None:
        self._release(seq)
        if seq.status == RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        del self._live[seq.req.request_id]

    def _build_plan(self, rows: list[tuple[_Seq, int]]) -> StepPlan:
        """The padded plan of `rows`: its buckets, the core's arrays and each feature's
        (runtime/host/plan_rows.py)."""
        num_tokens = sum(n for _, n in rows)
        T = bucket(self.token_buckets, num_tokens)
        P = bucket(self.page_buckets, max(len(s.pages) for s, _ in rows))
        max_q_len = min(bucket(self.q_buckets, max(n for _, n in rows)), T)
        a = padding_arrays(GROUPS, T=T, S=self.max_slots, P=P, K=self.num_spec_tokens,
                           W=self.mask_words, num_seqs=len(rows))
        statics = self._rows.write(a, rows)
        return StepPlan(**a, max_q_len=max_q_len,
                        request_ids=[seq.req.request_id for seq, _ in rows], **statics,
                        **self._kv_moves())

    def update(self, plan: StepPlan, sampled: np.ndarray,
               num_accepted: np.ndarray | None = None) -> list[StepOutput]:
        """Apply the step's results. `sampled`: int [S], one token per sequence row (only rows with
        plan.samples[s] are read). Plans are updated in the order they were scheduled. Rows whose
        request was finished, aborted or preempted in between are ignored. After a verify step:
        `sampled` int [S, K+1] and `num_accepted` [S] (row s emits sampled[s, :num_accepted[s] + 1])."""
        if not self._inflight or plan is not self._inflight[0][0]:
            raise ValueError("update() must get the oldest plan not yet updated")
        if num_accepted is None and plan.has_drafts:
            raise ValueError("a plan with proposals needs update(plan, tokens, num_accepted)")
        _, rows = self._inflight.popleft()
        for seq in self._running:
            seq.draft = []
        if num_accepted is not None:
            return self._update_verify(rows, plan, sampled, num_accepted)
        outputs: list[StepOutput] = []
        for s, seq, n, start in self._sampled_rows(rows, plan):
            tok = int(sampled[s])
            seq.output_ids.append(tok)
            self._register_full_pages(seq, start + n)
            reason = None
            if tok in seq.stop_ids:
                reason = "stop"
            elif len(seq.output_ids) >= seq.req.params.max_tokens:
                reason = "length"
            if reason is not None:
                self._retire(seq, reason)
            outputs.append(StepOutput(seq.req.request_id, [tok], reason is not None, reason))
        return outputs

    def _sampled_rows(self, rows, plan):
        """(row, sequence, tokens, first position) of a plan's rows that sampled a token for a
        sequence still running (its pending token now known); the other rows still running
        publish their full pages."""
        for s, (seq, n, start) in enumerate(rows):
            if seq.status != RUNNING:
                continue
            if not plan.samples[s]:
                self._register_full_pages(seq, start + n)
                continue
            seq.pending -= 1
            yield s, seq, n, start

    def _update_verify(self, rows, plan, sampled, num_accepted) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for s, seq, n, start in self._sampled_rows(rows, plan):
            d = int(plan.num_draft[s])
            a = int(num_accepted[s])
            if not 0 <= a <= d:
                raise ValueError(f"row {s}: {a} accepted of {d} proposals")
            emitted, reason = [], None
            for tok in np.asarray(sampled[s, : a + 1]).tolist():
                emitted.append(int(tok))
                if tok in seq.stop_ids:
                    reason = "stop"
                elif len(seq.output_ids) + len(emitted) >= seq.req.params.max_tokens:
                    reason = "length"
                if reason is not None:
                    break
            seq.output_ids.extend(emitted)
            if reason is not None:
                self._retire(seq, reason)
            else:
                # K/V holds the last token and the accepted proposals; the new last token and any
                # rejected proposals are beyond the new length (rolled back by lengths)
                seq.num_computed = start + n - d + a
                keep = _cdiv(seq.num_computed, self.page_size)
                if len(seq.pages) > keep:
                    self.allocator.free(reversed(seq.pages[keep:]))
                    del seq.pages[keep:]
                self._register_full_pages(seq, seq.num_computed)
            outputs.append(StepOutput(seq.req.request_id, emitted, reason is not None, reason,
                                      num_proposed=d, num_accepted=a))
        return outputs
