"""Host scheduler tests with a fake step function (JetStream mock-engine idea). No JAX.

The fake engine keeps a paged "KV cache" of (token, position) per cache slot: each step writes the
plan's token rows at slot_mapping, and for each sampling row it reads positions 0..kv_len-1 back
through that row's page table. The next token is arithmetic over the tokens read back, so it
equals `next_token(prompt + outputs)` only if slot mapping, page tables, kv_lens and page ownership
are right — any leak or overwrite by another sequence changes the tokens.
"""

import ast
import dataclasses
import inspect
import re
import textwrap
from collections import deque

import numpy as np
import pytest

from jaxinfer.runtime.config import SloConfig
from jaxinfer.runtime.host import plan_rows
from jaxinfer.runtime.host.image_prompt import ImageSpan
from jaxinfer.runtime.host.admission import FirstComeFirstServed, LatencyTargets, admission_policy
from jaxinfer.runtime.host.lora_slots import LoraGate
from jaxinfer.runtime.host.plan_rows import (CORE_FIELDS, FILLED_BY_ENGINE, OPTIONAL, WRITERS,
                                             PlanRows)
from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.host.errors import QueueFull
from jaxinfer.runtime.host.scheduler import Request, Scheduler
from jaxinfer.runtime.plan import PLAN_FIELDS

V = 101  # fake vocabulary


def next_token(tokens):
    return (sum((i + 1) * t for i, t in enumerate(tokens)) + 3 * len(tokens)) % V


def run_alone(prompt, params, eos_ids=()):
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if t in stop:
            return out, "stop"
        if len(out) == params.max_tokens:
            return out, "length"


class FakeEngine:
    def __init__(self, num_pages, page_size):
        self.ps = page_size
        self.cache = np.full((num_pages * page_size, 2), -1, np.int64)  # (token, position)

    def step(self, plan):
        # like the device step: every token row is written, padding rows into the null page
        self.cache[plan.slot_mapping] = np.stack([plan.token_ids, plan.positions], 1)
        sampled = np.zeros(len(plan.kv_lens), np.int32)
        for s in range(int(plan.num_seqs[0])):
            kv = int(plan.kv_lens[s])
            pos = np.arange(kv)
            slots = plan.page_indices[s, pos // self.ps] * self.ps + pos % self.ps
            got = self.cache[slots]
            assert (got[:, 1] == pos).all(), f"row {s} read K/V of wrong positions"
            if plan.samples[s]:
                sampled[s] = next_token(got[:, 0].tolist())
        return sampled


def check_plan(plan, sched):
    """Plan-level invariants: no page shared by two live rows (with prefix caching: no page
    written by one row is in another's table, and written pages are private and unhashed), no
    live row on the null page, consistent row accounting, padding rows inert."""
    n = int(plan.num_seqs[0])
    ps = sched.page_size
    seen = set()
    tables, written = [], []
    for s in range(n):
        kv = int(plan.kv_lens[s])
        a, b = int(plan.cu_q_lens[s]), int(plan.cu_q_lens[s + 1])
        q = b - a
        assert q >= 1 and kv >= q
        row = plan.page_indices[s, : -(-kv // ps)].tolist()
        assert 0 not in row
        if not sched.enable_prefix_caching:
            assert not seen & set(row), f"page shared by two live sequences: {row}"
        seen |= set(row)
        tables.append(set(row))
        written.append(set((plan.slot_mapping[a:b] // ps).tolist()))
        assert plan.logits_indices[s] == plan.cu_q_lens[s + 1] - 1
        assert plan.sample_positions[s] == kv
    for s in range(n):  # a page written this step is in no other live page table and not cached
        for p in written[s]:
            assert all(p not in t for r, t in enumerate(tables) if r != s), f"shared page {p} written"
            assert sched.allocator.hash_of(p) is None
            if plan.request_ids[s] in sched.running_ids:  # (not aborted since schedule())
                assert sched.allocator.ref_count(p) == 1
    t = plan.num_tokens
    assert (plan.cu_q_lens[n:] == t).all()
    assert (plan.kv_lens[n:] == 0).all() and (plan.page_indices[n:] == 0).all()
    assert not plan.samples[n:].any()
    assert (plan.token_ids[t:] == 0).all() and (plan.slot_mapping[t:] == 0).all()
    assert (plan.positions[t:] == 0).all()
    assert len(set(plan.slot_mapping[:t].tolist())) == t  # no two token rows write one cache slot
    assert len(plan.token_ids) in sched.token_buckets and len(plan.kv_lens) == sched.max_slots
    assert plan.max_q_len >= int(np.diff(plan.cu_q_lens).max())


def drive(sched, arrivals, engine=None, on_step=None, max_steps=5000):
    """Run to completion. arrivals: {step: [Request, ...]}. Returns ({rid: (tokens, reason)}, plans)."""
    engine = engine or FakeEngine(sched.allocator.num_pages, sched.page_size)
    results, plans = {}, []
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add_request(req)
            results[req.request_id] = ([], None)
        if not sched.has_work and step > max(arrivals, default=0):
            return results, plans
        plan = sched.schedule()
        sched.check_invariants()
        if on_step is not None:
            on_step(step, plan)
        if plan is None:
            continue
        check_plan(plan, sched)
        plans.append(plan)
        for out in sched.update(plan, engine.step(plan)):
            toks, _ = results[out.request_id]
            results[out.request_id] = (toks + out.new_token_ids, out.finish_reason)
        sched.check_invariants()
    raise AssertionError("did not finish")


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def rows(plan):
    """[(request_id, q_len, samples)] per live row."""
    q = np.diff(plan.cu_q_lens)
    return [(r, int(q[s]), bool(plan.samples[s])) for s, r in enumerate(plan.request_ids)]


def live_pages(plan, s):
    return [p for p in plan.page_indices[s].tolist() if p]


# --------------------------------------------------------------------------- plan arrays by hand


def test_plan_arrays_by_hand_with_padding():
    sched = Scheduler(max_slots=3, num_pages=8, page_size=4, max_model_len=16, token_budget=8)
    assert sched.token_buckets == (8,) and sched.page_buckets == (1, 2, 4)
    sched.add_request(Request("A", [10, 11, 12, 13, 14], greedy(5)))
    bp = SamplingParams(max_tokens=5, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1234, logprobs=2)
    sched.add_request(Request("B", [20, 21, 22], bp))

    p = sched.schedule()
    assert p.request_ids == ["A", "B"]
    assert p.token_ids.tolist() == [10, 11, 12, 13, 14, 20, 21, 22]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # A owns pages 1, 2; B owns page 3 (page_size 4)
    assert p.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    assert p.cu_q_lens.tolist() == [0, 5, 8, 8]
    assert p.kv_lens.tolist() == [5, 3, 0]
    assert p.page_indices.tolist() == [[1, 2], [3, 0], [0, 0]]
    assert p.num_seqs.tolist() == [2]
    assert p.logits_indices.tolist() == [4, 7, 0]
    assert p.samples.tolist() == [True, True, False]
    assert p.sample_positions.tolist() == [5, 3, 0]
    assert p.max_q_len == 8
    np.testing.assert_allclose(p.temperature, [0.0, 0.7, 0.0])
    assert p.top_k.tolist() == [0, 5, 0]
    np.testing.assert_allclose(p.top_p, [1.0, 0.9, 1.0])
    np.testing.assert_allclose(p.min_p, [0.0, 0.05, 0.0])
    assert p.seeds[1] == 1234 and p.seeds[2] == 0 and p.seeds.dtype == np.uint32
    assert p.num_logprobs == 20
    assert p.token_ids.dtype == p.positions.dtype == p.slot_mapping.dtype == np.int32
    assert p.page_indices.dtype == p.cu_q_lens.dtype == p.kv_lens.dtype == np.int32
    assert p.temperature.dtype == np.float32
    assert p.num_tokens == 8
    outs = sched.update(p, np.array([30, 40, 99], np.int32))
    got = [(o.request_id, o.new_token_ids, o.finished) for o in outs]
    assert got == [("A", [30], False), ("B", [40], False)]

    p = sched.schedule()  # two decodes, padded to T=8
    assert p.token_ids.tolist() == [30, 40, 0, 0, 0, 0, 0, 0]
    assert p.positions.tolist() == [5, 3, 0, 0, 0, 0, 0, 0]
    assert p.slot_mapping.tolist() == [9, 15, 0, 0, 0, 0, 0, 0]  # page 2 off 1; page 3 off 3
    assert p.cu_q_lens.tolist() == [0, 1, 2, 2]
    assert p.kv_lens.tolist() == [6, 4, 0]
    assert p.page_indices.tolist() == [[1, 2], [3, 0], [0, 0]]
    assert p.logits_indices.tolist() == [0, 1, 0]
    assert p.samples.tolist() == [True, True, False]
    assert p.sample_positions.tolist() == [6, 4, 0]
    assert p.max_q_len == 1
    sched.update(p, np.array([31, 41, 0], np.int32))

    p = sched.schedule()  # B's position 4 starts a new page: page 4
    assert p.token_ids[:2].tolist() == [31, 41]
    assert p.slot_mapping[:2].tolist() == [10, 16]
    assert p.page_indices.tolist() == [[1, 2], [3, 4], [0, 0]]
    assert p.kv_lens.tolist() == [7, 5, 0]
    assert sched.allocator.free_list == [5, 6, 7]
    assert sched.slot_of("A") == 0 and sched.slot_of("B") == 1


def test_buckets_token_page_and_q():
    sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=20, token_budget=20)
    assert sched.token_buckets == (8, 16, 32)
    assert sched.page_buckets == (1, 2, 4, 5)  # up to pages_per_seq = 5, the last not a power of 2
    assert sched.q_buckets == (1, 2, 4, 8, 16, 32)
    sched.add_request(Request("A", list(range(1, 10)), greedy(3)))  # 9 tokens -> 3 pages
    p = sched.schedule()
    assert len(p.token_ids) == 16 and p.page_indices.shape == (2, 4) and p.max_q_len == 16
    assert p.page_indices[0].tolist() == [1, 2, 3, 0]
    sched.update(p, np.array([5, 0]))
    sched.add_request(Request("B", list(range(1, 18)), greedy(3)))  # 17 tokens -> 5 pages
    p = sched.schedule()
    assert rows(p) == [("A", 1, True), ("B", 17, True)]
    assert len(p.token_ids) == 32 and p.page_indices.shape == (2, 5) and p.max_q_len == 32

    custom = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=20, token_budget=20,
                       token_buckets=[24], q_buckets=[4, 64], page_buckets=[8])
    custom.add_request(Request("A", [1, 2, 3], greedy(3)))
    p = custom.schedule()
    assert len(p.token_ids) == 24 and p.max_q_len == 4 and p.page_indices.shape == (2, 8)
    custom.update(p, np.array([1, 0]))
    custom.add_request(Request("B", list(range(10)), greedy(3)))
    p = custom.schedule()
    assert p.max_q_len == 24  # the q bucket 64 is capped at T
    with pytest.raises(ValueError):
        Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=20, token_budget=20,
                  token_buckets=[16])


# --------------------------------------------------------------------------- admission and chunking


def test_chunked_prefill_interleaves_with_decodes():
    sched = Scheduler(max_slots=4, num_pages=64, page_size=4, max_model_len=64, token_budget=8)
    prompts = {"A": [1, 2, 3], "B": [4, 5], "C": list(range(30, 50))}
    arrivals = {0: [Request("A", prompts["A"], greedy(10)), Request("B", prompts["B"], greedy(10))],
                1: [Request("C", prompts["C"], greedy(4))]}
    results, plans = drive(sched, arrivals)
    assert [rows(p) for p in plans[:6]] == [
        [("A", 3, True), ("B", 2, True)],
        [("A", 1, True), ("B", 1, True), ("C", 6, False)],
        [("A", 1, True), ("B", 1, True), ("C", 6, False)],
        [("A", 1, True), ("B", 1, True), ("C", 6, False)],
        [("A", 1, True), ("B", 1, True), ("C", 2, True)],
        [("A", 1, True), ("B", 1, True), ("C", 1, True)],
    ]
    assert plans[1].positions[2:8].tolist() == [0, 1, 2, 3, 4, 5]
    assert plans[2].positions[2:8].tolist() == [6, 7, 8, 9, 10, 11]
    assert plans[4].positions[2:4].tolist() == [18, 19]
    assert plans[4].token_ids[2:4].tolist() == [48, 49]
    assert [p.max_q_len for p in plans[1:6]] == [8, 8, 8, 2, 1]
    assert [p.num_tokens for p in plans[1:6]] == [8, 8, 8, 4, 3]
    for rid, prompt in prompts.items():
        params = greedy(4 if rid == "C" else 10)
        assert results[rid] == run_alone(prompt, params)


def test_fcfs_admission_and_slot_reused_at_once():
    sched = Scheduler(max_slots=2, num_pages=32, page_size=4, max_model_len=32, token_budget=32)
    for rid, mt in [("A", 2), ("B", 5), ("C", 2), ("D", 1)]:
        sched.add_request(Request(rid, [7, 8, 9] if rid != "D" else [1], greedy(mt)))
    p = sched.schedule()
    assert p.request_ids == ["A", "B"] and sched.waiting_ids == ["C", "D"]
    assert (sched.slot_of("A"), sched.slot_of("B")) == (0, 1)
    sched.update(p, np.array([11, 12]))
    p = sched.schedule()
    assert p.request_ids == ["A", "B"]  # no free slot for C
    outs = sched.update(p, np.array([13, 14]))
    assert outs[0].request_id == "A" and outs[0].finished and outs[0].finish_reason == "length"
    assert sched.running_ids == ["B"] and sched.free_pages == 31 - 1
    p = sched.schedule()  # A's slot goes to C, the head of the queue, the very next step
    assert rows(p) == [("B", 1, True), ("C", 3, True)]
    assert sched.slot_of("C") == 0 and sched.waiting_ids == ["D"]
    # free queue was [3..31, 1] (A freed page 1 at the back); B's position 4 took page 3 first
    assert sched.pages_of("B") == [2, 3] and sched.pages_of("C") == [4]


def test_head_of_line_blocks_admission_and_exact_pages():
    # 4 usable pages of 4 tokens. C (12 tokens, 3 pages) cannot start while A holds 2 pages;
    # D (1 page) would fit but must not overtake C.
    sched = Scheduler(max_slots=3, num_pages=5, page_size=4, max_model_len=16, token_budget=32)
    sched.add_request(Request("A", list(range(8)), greedy(2)))
    sched.add_request(Request("C", list(range(12)), greedy(1)))
    sched.add_request(Request("D", [1, 2], greedy(1)))
    p = sched.schedule()
    assert p.request_ids == ["A"] and sched.waiting_ids == ["C", "D"]
    assert sched.pages_of("A") == [1, 2] and sched.allocator.free_list == [3, 4]
    sched.update(p, np.array([5, 0, 0]))
    p = sched.schedule()  # A's decode at position 8 takes page 3; C still does not fit
    assert p.request_ids == ["A"] and sched.pages_of("A") == [1, 2, 3]
    assert sched.allocator.free_list == [4]
    outs = sched.update(p, np.array([6, 0, 0]))
    assert outs[0].finished and outs[0].finish_reason == "length"
    assert sched.allocator.free_list == [4, 3, 2, 1]  # A's pages come back tail first
    p = sched.schedule()
    assert p.request_ids == ["C", "D"]
    assert sched.pages_of("C") == [4, 3, 2] and sched.pages_of("D") == [1]
    assert p.page_indices.tolist() == [[4, 3, 2, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # P bucket 4
    outs = sched.update(p, np.array([7, 8, 0]))
    assert all(o.finished for o in outs) and not sched.has_work
    assert sched.allocator.free_list == [2, 3, 4, 1]
    assert sched.schedule() is None


# --------------------------------------------------------------------------- preemption


def test_preempts_youngest_and_resumes_with_identical_tokens():
    # 4 usable pages of 2 tokens: A (3-token prompt) and B (2-token prompt) both want 3 pages.
    sched = Scheduler(max_slots=3, num_pages=5, page_size=2, max_model_len=16, token_budget=16)
    reqs = [Request("A", [1, 2, 3], greedy(4), arrival_time=0.0),
            Request("B", [4, 5], greedy(4), arrival_time=1.0)]
    pages = []
    results, plans = drive(sched, {0: reqs}, on_step=lambda step, plan: pages.append(
        {r: sched.pages_of(r) for r in sched.running_ids}))
    assert [rows(p) for p in plans] == [
        [("A", 3, True), ("B", 2, True)],
        [("A", 1, True), ("B", 1, True)],
        [("A", 1, True)],  # A needs a 3rd page: B (youngest) preempted, its [3, 4] freed as [4, 3]
        [("A", 1, True)],  # B (queue head) needs 2 pages, 1 free: waits; A finishes
        [("B", 4, True)],  # B recomputes prompt + its 2 outputs and samples its 3rd token
        [("B", 1, True)],
    ]
    assert pages == [
        {"A": [1, 2], "B": [3]},
        {"A": [1, 2], "B": [3, 4]},
        {"A": [1, 2, 4]},
        {"A": [1, 2, 4]},
        {"B": [3, 4]},  # A freed [4, 2, 1] behind page 3: queue [3, 4, 2, 1]
        {"B": [3, 4, 2]},
    ]
    assert sched.waiting_ids == []
    assert sched.num_preemptions == 1
    b_tokens = [4, 5] + results["B"][0][:2]
    assert plans[4].token_ids[:4].tolist() == b_tokens and plans[4].positions[:4].tolist() == [0, 1, 2, 3]
    for r in reqs:
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)
    assert sched.free_pages == 4 and sched.allocator.free_list == [1, 2, 4, 3]


def test_asker_preempts_itself_when_youngest():
    sched = Scheduler(max_slots=3, num_pages=4, page_size=2, max_model_len=16, token_budget=16)
    reqs = [Request("A", [1, 2, 3], greedy(3), arrival_time=0.0),
            Request("B", [4, 5], greedy(4), arrival_time=1.0)]
    results, plans = drive(sched, {0: reqs})
    assert [rows(p) for p in plans] == [
        [("A", 3, True), ("B", 2, True)],
        [("A", 1, True)],  # B needs a page, none free, B is the youngest: B preempts itself
        [("A", 1, True)],  # A takes page 3 (B's); B cannot restart until A finishes
        [("B", 3, True)],
        [("B", 1, True)],
        [("B", 1, True)],
    ]
    assert live_pages(plans[2], 0) == [1, 2, 3]
    assert live_pages(plans[3], 0) == [3, 2]  # A freed [3, 2, 1] tail first
    assert live_pages(plans[5], 0) == [3, 2, 1]
    assert sched.num_preemptions == 1
    for r in reqs:
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)


def test_no_admission_in_a_step_that_preempted():
    # After B is preempted one page is left, enough for a 2-token chunk of B's recompute; B must
    # not be readmitted in the same step (it would thrash), only once A has finished.
    sched = Scheduler(max_slots=2, num_pages=5, page_size=2, max_model_len=16, token_budget=3)
    reqs = [Request("A", [1, 2], greedy(4), arrival_time=0.0),
            Request("B", [3, 4], greedy(3), arrival_time=1.0),
            Request("C", [9], greedy(1), arrival_time=2.0)]  # waits for a slot
    results, plans = drive(sched, {0: reqs})
    assert [rows(p) for p in plans[:6]] == [
        [("A", 2, True), ("B", 1, False)],
        [("A", 1, True), ("B", 1, True)],
        [("A", 1, True), ("B", 1, True)],
        [("A", 1, True)],  # B preempted here; A finishes (4 tokens)
        [("B", 3, False)],  # B, back at the queue FRONT, recomputes [3, 4, b1, b2]: chunks 3, 1
        [("B", 1, True), ("C", 1, True)],
    ]
    assert live_pages(plans[3], 0) == [1, 3, 4]
    for r in reqs:
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)


def test_victim_already_scheduled_this_step_is_unscheduled():
    # X arrived earlier (arrival_time) but was queued after Y, so X is still prefilling when Y
    # decodes. X's chunk needs pages: Y (youngest) is preempted although already in this plan.
    sched = Scheduler(max_slots=3, num_pages=4, page_size=2, max_model_len=16, token_budget=4)
    y = Request("Y", [7, 7], greedy(3), arrival_time=5.0)
    x = Request("X", [1, 2, 3, 4, 5], greedy(2), arrival_time=1.0)
    results, plans = drive(sched, {0: [y, x]})
    assert rows(plans[0]) == [("Y", 2, True), ("X", 2, False)]
    assert rows(plans[1]) == [("X", 3, True)]
    assert live_pages(plans[1], 0) == [2, 3, 1]  # Y's [1, 3] came back as [3, 1]
    assert plans[1].positions[:3].tolist() == [2, 3, 4]
    assert sched.num_preemptions == 1
    for r in (x, y):
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)


# --------------------------------------------------------------------------- finishing


def test_eos_stop_tokens_ignore_eos_and_length():
    def one(params, eos_ids, sampled):
        sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=64, token_budget=16)
        sched.add_request(Request("r", [1, 2, 3], params, eos_ids=eos_ids))
        outs = []
        for tok in sampled:
            p = sched.schedule()
            outs += sched.update(p, np.array([tok, 0]))
            if outs[-1].finished:
                break
        assert not sched.has_work and sched.free_pages == 15
        return [o.new_token_ids[0] for o in outs], outs[-1].finish_reason

    seq = [5, 6, 2, 9, 4, 8]
    assert one(greedy(10), (2,), seq) == ([5, 6, 2], "stop")
    assert one(greedy(6, ignore_eos=True), (2,), seq) == (seq, "length")
    assert one(greedy(10, ignore_eos=True, stop_token_ids=(9,)), (2,), seq) == ([5, 6, 2, 9], "stop")
    assert one(greedy(10, stop_token_ids=(6,)), (2,), seq) == ([5, 6], "stop")
    assert one(greedy(3), (), seq) == ([5, 6, 2], "length")
    assert one(greedy(1), (5,), seq) == ([5], "stop")  # stop wins over length on the same token


def test_finish_external_frees_slot_and_pages_at_once():
    sched = Scheduler(max_slots=1, num_pages=9, page_size=4, max_model_len=32, token_budget=16)
    sched.add_request(Request("A", [1, 2, 3, 4, 5], greedy(10)))
    sched.add_request(Request("B", [6], greedy(2)))
    p = sched.schedule()
    sched.update(p, np.array([9]))
    assert sched.pages_of("A") == [1, 2] and sched.waiting_ids == ["B"]
    assert sched.finish("A", "stop") is True
    assert sched.free_pages == 8 and sched.allocator.free_list == [3, 4, 5, 6, 7, 8, 2, 1]
    assert sched.finish("A", "stop") is False  # no longer in flight: a no-op
    p = sched.schedule()
    assert p.request_ids == ["B"] and sched.slot_of("B") == 0 and sched.pages_of("B") == [3]


def test_abort_waiting_and_running_and_between_schedule_and_update():
    sched = Scheduler(max_slots=1, num_pages=9, page_size=4, max_model_len=32, token_budget=16)
    for rid in "ABC":
        sched.add_request(Request(rid, [1, 2, 3, 4, 5], greedy(10)))
    p = sched.schedule()
    sched.update(p, np.array([9]))
    assert sched.abort("B") is True  # waiting
    assert sched.waiting_ids == ["C"] and sched.free_pages == 6
    assert sched.abort("A") is True  # running
    assert sched.free_pages == 8 and sched.num_running == 0
    assert sched.abort("A") is False and sched.abort("nope") is False
    p = sched.schedule()
    assert p.request_ids == ["C"]
    assert sched.abort("C") is True  # in the plan already: update ignores its row
    assert sched.update(p, np.array([9])) == []
    assert sched.free_pages == 8 and not sched.has_work
    sched.check_invariants()


def test_update_requires_the_latest_plan():
    sched = Scheduler(max_slots=1, num_pages=9, page_size=4, max_model_len=32, token_budget=16)
    sched.add_request(Request("A", [1, 2], greedy(3)))
    p = sched.schedule()
    sched.update(p, np.array([1]))
    with pytest.raises(ValueError):
        sched.update(p, np.array([1]))


# --------------------------------------------------------------------------- add_request errors


def test_add_request_errors():
    sched = Scheduler(max_slots=1, num_pages=5, page_size=4, max_model_len=32, token_budget=16, max_queue=2)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", [], greedy(3)))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("l", list(range(30)), greedy(3)))
    # 4 usable pages of 4 tokens hold 16 tokens of K/V: prompt 10 + 7 outputs needs 16 (ok), + 8 not
    sched.add_request(Request("ok", list(range(10)), greedy(7)))
    with pytest.raises(ValueError, match="pool"):
        sched.add_request(Request("big", list(range(10)), greedy(8)))
    with pytest.raises(ValueError, match="in flight"):
        sched.add_request(Request("ok", [1], greedy(1)))
    sched.add_request(Request("q2", [1], greedy(1)))
    with pytest.raises(QueueFull):
        sched.add_request(Request("q3", [1], greedy(1)))
    assert sched.waiting_ids == ["ok", "q2"]
    sched.update(sched.schedule(), np.array([0]))  # "ok" leaves the queue: room again
    sched.add_request(Request("q3", [1], greedy(1)))
    assert sched.waiting_ids == ["q2", "q3"]


def test_seeds_given_or_derived_deterministically():
    def seeds(seed_b):
        sched = Scheduler(max_slots=3, num_pages=9, page_size=4, max_model_len=32, token_budget=16)
        sched.add_request(Request("a", [1], SamplingParams(seed=None)))
        sched.add_request(Request("b", [1], SamplingParams(seed=seed_b)))
        sched.add_request(Request("c", [1], SamplingParams(seed=None)))
        return sched.schedule().seeds.tolist()

    s1, s2 = seeds(7), seeds(2**32 + 7)
    assert s1 == s2 and s1[1] == 7
    assert s1[0] != s1[2]


# --------------------------------------------------------------------------- soak


@pytest.mark.parametrize("caching", [False, True])
def test_randomized_soak_matches_running_alone(caching):
    rng = np.random.default_rng(1234)
    sched = Scheduler(max_slots=5, num_pages=14, page_size=4, max_model_len=40, token_budget=16,
                      enable_prefix_caching=caching)
    arrivals, reqs = {}, {}
    for i in range(200):
        prompt = rng.integers(1, V, rng.integers(1, 25)).tolist()
        params = greedy(int(rng.integers(1, 16)), ignore_eos=bool(rng.random() < 0.2),
                        stop_token_ids=tuple(rng.integers(0, V, rng.integers(0, 2)).tolist()))
        eos = tuple(rng.integers(0, V, rng.integers(0, 3)).tolist())
        r = Request(f"r{i}", prompt, params, eos_ids=eos, arrival_time=float(i))
        reqs[r.request_id] = r
        arrivals.setdefault(int(rng.integers(0, 400)), []).append(r)
    aborted = set()

    def cancel_some(step, plan):  # between schedule() and update(): the plan's row is dropped
        live = sched.running_ids + sched.waiting_ids
        if live and rng.random() < 0.03:
            rid = live[int(rng.integers(len(live)))]
            assert sched.abort(rid)
            aborted.add(rid)

    results, plans = drive(sched, arrivals, on_step=cancel_some)
    assert len(results) == 200 and 3 <= len(aborted) <= 30
    for rid, r in reqs.items():
        want = run_alone(r.prompt_ids, r.params, r.eos_ids)
        if rid in aborted:
            got = results[rid][0]
            assert got == want[0][: len(got)] and results[rid][1] is None, rid
        else:
            assert results[rid] == want, rid
    assert sched.num_preemptions >= 10  # the pool is small enough to force preemption
    assert any(not p.samples[: int(p.num_seqs[0])].all() for p in plans)  # chunked prefills ran
    assert sched.free_pages == 13 and not sched.has_work


# --------------------------------------------------------------------------- prefix caching


def cached_sched(**kw):
    return Scheduler(enable_prefix_caching=True, **kw)


def serve_one(sched, engine, req, plans=None):
    """Add `req`, run until it finishes (other running sequences step along); return its tokens."""
    sched.add_request(req)
    toks = []
    while sched.has_work and req.request_id in sched.waiting_ids + sched.running_ids:
        plan = sched.schedule()
        sched.check_invariants()
        check_plan(plan, sched)
        if plans is not None:
            plans.append(plan)
        for out in sched.update(plan, engine.step(plan)):
            if out.request_id == req.request_id:
                toks += out.new_token_ids
        sched.check_invariants()
    return toks


def test_prefix_pages_shared_exact_ids_and_last_token_always_computed():
    sched = cached_sched(max_slots=2, num_pages=9, page_size=4, max_model_len=32, token_budget=16)
    eng = FakeEngine(9, 4)
    a = Request("A", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], greedy(2))
    plans = []
    assert serve_one(sched, eng, a, plans) == run_alone(a.prompt_ids, a.params)[0]
    assert live_pages(plans[0], 0) == [1, 2, 3]
    # A computed 11 tokens: pages 1, 2 are full and registered; page 3 (partial) is not.
    # Released tail first: 3 -> free queue back, 2 then 1 -> cached LRU.
    assert sched.allocator.free_list == [4, 5, 6, 7, 8, 3]
    assert sched.allocator.cached_list == [2, 1]
    assert sched.free_pages == 8  # cached pages count as available
    assert sched.prefix_cache_stats()["cached_pages"] == 2

    # B shares A's first 8 tokens: takes pages 1, 2 (ref 0 -> 1), computes only token 8.
    b = Request("B", [1, 2, 3, 4, 5, 6, 7, 8, 50], greedy(3))
    sched.add_request(b)
    p = sched.schedule()
    assert rows(p) == [("B", 1, True)]
    assert p.token_ids[:1].tolist() == [50] and p.positions[:1].tolist() == [8]
    assert p.page_indices[0].tolist()[:3] == [1, 2, 4] and p.slot_mapping[:1].tolist() == [16]
    assert p.kv_lens[0] == 9
    assert sched.cached_tokens_of("B") == 8
    assert sched.allocator.ref_count(1) == sched.allocator.ref_count(2) == 1
    assert sched.allocator.cached_list == []
    sched.update(p, eng.step(p))

    # C, whose whole 8-token prompt is two cached full pages, while B still holds them: it shares
    # only page 1 (ref 2) so that its last token is computed; its own copy of page 2's tokens goes
    # into page 5 and is NOT registered (the hash already names page 2).
    c = Request("C", [1, 2, 3, 4, 5, 6, 7, 8], greedy(1))
    sched.add_request(c)
    p = sched.schedule()
    assert rows(p) == [("B", 1, True), ("C", 4, True)]
    assert p.positions[1:5].tolist() == [4, 5, 6, 7]
    assert live_pages(p, 1) == [1, 5]
    assert sched.allocator.ref_count(1) == 2 and sched.allocator.ref_count(2) == 1
    assert sched.cached_tokens_of("C") == 4
    outs = sched.update(p, eng.step(p))
    assert [o.request_id for o in outs if o.finished] == ["C"]
    assert sched.allocator.hash_of(5) is None
    assert sched.allocator.free_list[-1] == 5  # the duplicate page went back as truly free
    assert sched.allocator.ref_count(1) == 1
    st = sched.prefix_cache_stats()
    assert (st["prompt_tokens"], st["cached_tokens"]) == (10 + 9 + 8, 8 + 4)
    assert st["hit_rate"] == pytest.approx(12 / 27)

    while sched.has_work:
        p = sched.schedule()
        sched.update(p, eng.step(p))
    sched.check_invariants()
    assert sched.free_pages == 8 and sched.allocator.num_cached + len(sched.allocator.free_list) == 8
    assert all(sched.allocator.ref_count(p) == 0 for p in range(9))


def test_lru_eviction_order_and_hits_after_eviction():
    ps = 2
    sched = cached_sched(max_slots=1, num_pages=8, page_size=ps, max_model_len=16, token_budget=16)
    eng = FakeEngine(8, ps)
    al = sched.allocator
    A = [1, 2, 3, 4, 5]
    B = [6, 7, 8, 9, 5]
    serve_one(sched, eng, Request("A", A, greedy(1)))  # pages 1, 2, 3; 1 and 2 registered
    assert al.free_list == [4, 5, 6, 7, 3] and al.cached_list == [2, 1]
    serve_one(sched, eng, Request("B", B, greedy(1)))  # pages 4, 5, 6; 4 and 5 registered
    assert al.free_list == [7, 3, 6] and al.cached_list == [2, 1, 5, 4]
    # D reuses A's prefix: pages 1, 2 leave the LRU, come back at its most-recently-used end
    serve_one(sched, eng, Request("D", [1, 2, 3, 4, 9], greedy(1)))
    assert sched.prefix_cache_stats()["cached_tokens"] == 4
    assert al.free_list == [3, 6, 7] and al.cached_list == [5, 4, 2, 1]
    # E (9 tokens, 5 pages, no hit): the 3 truly free pages, then evicts B's pages, LRU first
    plans = []
    serve_one(sched, eng, Request("E", list(range(20, 29)), greedy(1)), plans)
    assert live_pages(plans[0], 0) == [3, 6, 7, 5, 4]
    # E's full pages 3, 6, 7, 5 are registered; 4 holds only token 8 (partial): truly free after
    assert al.num_evictions == 2 and al.hash_of(4) is None and al.hash_of(5) is not None
    assert al.cached_list == [2, 1, 5, 7, 6, 3] and al.free_list == [4]
    # A's prefix survived: a hit of 4 tokens (G takes truly free page 4 for its last token)
    g = Request("G", A, greedy(1))
    plans = []
    assert serve_one(sched, eng, g, plans) == run_alone(A, g.params)[0]
    assert live_pages(plans[0], 0) == [1, 2, 4]
    assert sched.prefix_cache_stats()["cached_tokens"] == 8
    # B's prefix was evicted: a miss
    serve_one(sched, eng, Request("F", B, greedy(1)))
    assert sched.prefix_cache_stats()["cached_tokens"] == 8
    sched.check_invariants()
    assert len(al.free_list) + al.num_cached == 7 and al.num_free == 7


def test_pages_filled_during_decode_are_registered_and_shared():
    sched = cached_sched(max_slots=2, num_pages=12, page_size=4, max_model_len=32, token_budget=16)
    eng = FakeEngine(12, 4)
    a = Request("A", [1, 2, 3], greedy(7, ignore_eos=True))
    sched.add_request(a)
    out_a = []
    for step in range(3):  # prefill (3 tokens), then decodes of positions 3, 4
        p = sched.schedule()
        out_a += [o.new_token_ids[0] for o in sched.update(p, eng.step(p))]
        first = sched.pages_of("A")[0]
        assert (sched.allocator.hash_of(first) is not None) == (step >= 1)  # full after pos 3
    # B = A's first 4 tokens + 1 more: shares A's page while A still runs (ref 2)
    b = Request("B", [1, 2, 3, out_a[0], 99], greedy(2))
    sched.add_request(b)
    p = sched.schedule()
    assert rows(p) == [("A", 1, True), ("B", 1, True)]
    assert live_pages(p, 1)[0] == sched.pages_of("A")[0]
    assert sched.allocator.ref_count(sched.pages_of("A")[0]) == 2
    sched.update(p, eng.step(p))
    while sched.has_work:
        p = sched.schedule()
        check_plan(p, sched)
        sched.update(p, eng.step(p))
        sched.check_invariants()
    assert sched.prefix_cache_stats()["cached_tokens"] == 4
    # and a request replaying all of A's text hits the pages A filled while decoding
    full = [1, 2, 3] + run_alone(a.prompt_ids, a.params)[0]  # 10 tokens: 2 full pages
    c = Request("C", full[:9] + [7], greedy(1))
    assert serve_one(sched, eng, c) == run_alone(c.prompt_ids, c.params)[0]
    assert sched.prefix_cache_stats()["cached_tokens"] == 4 + 8


def test_preempted_sequence_reuses_its_own_cached_pages():
    # The preemption scenario of test_preempts_youngest_... with caching: B's full first page
    # stays cached when B is preempted (its partial page is truly free and A takes that one), so
    # B's recompute is 2 tokens instead of 4; the pages it then needs are evicted LRU first.
    sched = cached_sched(max_slots=3, num_pages=5, page_size=2, max_model_len=16, token_budget=16)
    reqs = [Request("A", [1, 2, 3], greedy(4), arrival_time=0.0),
            Request("B", [4, 5], greedy(4), arrival_time=1.0)]
    pages = []
    results, plans = drive(sched, {0: reqs}, on_step=lambda step, plan: pages.append(
        {r: sched.pages_of(r) for r in sched.running_ids}))
    assert [rows(p) for p in plans] == [
        [("A", 3, True), ("B", 2, True)],
        [("A", 1, True), ("B", 1, True)],
        [("A", 1, True)],  # B preempted: page 4 (partial) -> free, page 3 -> cached
        [("A", 1, True)],  # B's hit (page 3) needs 1 more page, none available: waits
        [("B", 2, True)],  # B shares its old page 3, recomputes b1, b2 only
        [("B", 1, True)],
    ]
    assert pages == [
        {"A": [1, 2], "B": [3]},
        {"A": [1, 2], "B": [3, 4]},
        {"A": [1, 2, 4]},
        {"A": [1, 2, 4]},
        {"B": [3, 4]},  # A released [4, 2, 1] all registered -> LRU [3, 4, 2, 1]; 4 evicted
        {"B": [3, 4, 2]},  # 2 evicted next
    ]
    assert plans[4].positions[:2].tolist() == [2, 3]
    for r in reqs:
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)
    st = sched.prefix_cache_stats()
    assert st["recompute_tokens"] == 4 and st["recompute_cached_tokens"] == 2
    assert st["evictions"] == 2 and st["cached_tokens"] == 0
    assert sched.num_preemptions == 1
    assert sched.allocator.free_list == [2] and sched.allocator.cached_list == [1, 4, 3]


def test_abort_drops_shared_references():
    sched = cached_sched(max_slots=3, num_pages=10, page_size=2, max_model_len=32, token_budget=32)
    eng = FakeEngine(10, 2)
    serve_one(sched, eng, Request("A", [1, 2, 3, 4, 5], greedy(1)))
    assert sched.allocator.cached_list == [2, 1]
    sched.add_request(Request("B", [1, 2, 3, 4, 6], greedy(5)))
    sched.add_request(Request("C", [1, 2, 3, 4, 7], greedy(5)))
    sched.add_request(Request("W", [1, 2, 3, 4, 8], greedy(5)))  # waits: no slot... (3 slots)
    p = sched.schedule()
    assert p.request_ids == ["B", "C", "W"]
    assert sched.allocator.ref_count(1) == 3 and sched.allocator.ref_count(2) == 3
    assert sched.abort("C")  # between schedule and update
    assert sched.allocator.ref_count(1) == 2
    sched.update(p, eng.step(p))
    sched.check_invariants()
    assert sched.abort("B") and sched.abort("W")
    sched.check_invariants()
    assert sched.allocator.ref_count(1) == 0 and sched.allocator.cached_list[-2:] == [2, 1]
    assert sched.free_pages == 9 and not sched.has_work


def test_shared_prefix_soak_identical_tokens_no_leaks():
    """Many requests over a few shared system prefixes, a small pool (preemption + eviction),
    aborts: every finished request's tokens equal running it alone, with caching on or off, and
    every page ends free or cached with ref count 0."""
    def run(caching):
        rng = np.random.default_rng(7)
        sched = Scheduler(max_slots=4, num_pages=24, page_size=4, max_model_len=64,
                          token_budget=24, enable_prefix_caching=caching)
        systems = [rng.integers(1, V, n).tolist() for n in (12, 17, 8)]
        arrivals, reqs = {}, {}
        for i in range(150):
            sysp = systems[int(rng.integers(len(systems)))] if rng.random() < 0.8 else []
            prompt = sysp + rng.integers(1, V, rng.integers(1, 10)).tolist()
            params = greedy(int(rng.integers(1, 12)), ignore_eos=bool(rng.random() < 0.5))
            r = Request(f"r{i}", prompt, params, eos_ids=(0,), arrival_time=float(i))
            reqs[r.request_id] = r
            arrivals.setdefault(int(rng.integers(0, 300)), []).append(r)
        aborted = set()

        def cancel_some(step, plan):
            live = sched.running_ids + sched.waiting_ids
            if live and rng.random() < 0.02:
                rid = live[int(rng.integers(len(live)))]
                assert sched.abort(rid)
                aborted.add(rid)

        results, _ = drive(sched, arrivals, on_step=cancel_some)
        for rid, r in reqs.items():
            want = run_alone(r.prompt_ids, r.params, r.eos_ids)
            got = results[rid]
            if rid in aborted:
                assert got[0] == want[0][: len(got[0])], rid
            else:
                assert got == want, rid
        al = sched.allocator
        al.check_invariants()
        assert len(al.free_list) + al.num_cached == al.num_total
        assert all(al.ref_count(p) == 0 for p in range(al.num_pages))
        return sched, results, aborted

    on, res_on, ab_on = run(True)
    off, res_off, ab_off = run(False)
    both = set(res_on) - ab_on - ab_off
    assert len(both) > 120 and all(res_on[r] == res_off[r] for r in both)
    st = on.prefix_cache_stats()
    assert st["hit_rate"] > 0.3 and st["evictions"] > 0 and on.num_preemptions > 0
    assert st["recompute_cached_tokens"] > 0
    assert off.prefix_cache_stats()["cached_tokens"] == 0 and off.allocator.num_cached == 0


# --------------------------------------------------------------------------- speculative decoding


class FakeVerifyEngine(FakeEngine):
    """Verify step on the fake cache: at each verify row j of a row, the target's token is
    next_token(K/V read back through the page table up to that row's position); proposals are
    accepted greedily while they agree, then the target's token follows."""

    def verify(self, plan):
        self.cache[plan.slot_mapping] = np.stack([plan.token_ids, plan.positions], 1)
        S, K = plan.draft_ids.shape
        toks = np.full((S, K + 1), -1, np.int64)
        n_acc = np.zeros(S, np.int64)
        for s in range(int(plan.num_seqs[0])):
            if not plan.samples[s]:
                continue
            d = int(plan.num_draft[s])
            for j in range(d + 1):
                pos = int(plan.positions[plan.verify_indices[s, j]])
                assert pos + 1 == plan.sample_positions[s] + j
                kv = np.arange(pos + 1)
                got = self.cache[plan.page_indices[s, kv // self.ps] * self.ps + kv % self.ps]
                assert (got[:, 1] == kv).all(), "verify row read K/V of wrong positions"
                t = next_token(got[:, 0].tolist())
                toks[s, j] = t
                if j == d or plan.draft_ids[s, j] != t:
                    n_acc[s] = j
                    break
        return toks, n_acc


def propose_with_errors(cands, step):
    """The true continuation, with one wrong token at a position varying by step (or none)."""
    out = {}
    for c in cands:
        toks, props = list(c.token_ids), []
        for j in range(c.max_draft):
            t = next_token(toks)
            if (step + hash(c.request_id)) % 5 == j:
                t = (t + 1) % V
            props.append(t)
            toks.append(t)
        out[c.request_id] = props
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculative_verify_rolls_back_rejected_tokens_no_leaks(prefix_caching):
    sched = Scheduler(max_slots=3, num_pages=14, page_size=4, max_model_len=64, token_budget=16,
                      num_spec_tokens=3, enable_prefix_caching=prefix_caching)
    eng = FakeVerifyEngine(14, 4)
    prompts = [[i % 7 + 1 for i in range(n)] for n in (9, 13, 5, 17, 9, 13)]
    reqs = [Request(f"r{i}", p, greedy(12 + i)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    results = {r.request_id: [] for r in reqs}
    proposed = accepted = verify_steps = 0
    for step in range(500):
        if not sched.has_work:
            break
        cands = sched.decode_candidates()
        for c in cands:
            assert c.max_draft == min(3, sched._live[c.request_id].req.params.max_tokens
                                      - len(sched.output_ids(c.request_id)) - 1)
        sched.set_drafts(propose_with_errors(cands, step))
        plan = sched.schedule()
        sched.check_invariants()
        check_plan_spec(plan, sched)
        if plan.has_drafts:
            verify_steps += 1
            toks, n_acc = eng.verify(plan)
            outs = sched.update(plan, toks, n_acc)
        else:
            outs = sched.update(plan, eng.step(plan))
        for o in outs:
            results[o.request_id] += o.new_token_ids
            proposed += o.num_proposed
            accepted += o.num_accepted
            # rollback by lengths: no page beyond what the accepted tokens need
            if not o.finished:
                seq = sched._live[o.request_id]
                assert len(seq.pages) == -(-seq.num_computed // 4)
                assert seq.num_computed == seq.num_tokens - 1
        sched.check_invariants()
    else:
        raise AssertionError("did not finish")
    for r in reqs:  # rejected tokens never appear: every output is the oracle's
        assert results[r.request_id] == run_alone(r.prompt_ids, r.params)[0]
    assert verify_steps > 5 and 0 < accepted < proposed
    assert sched.free_pages == 13  # nothing leaked
    if prefix_caching:
        # pages that were full of rejected tokens were never registered: serving the same
        # prompts again (sharing cached pages) still yields the oracle's tokens
        for r in reqs:
            again = Request(r.request_id + "b", r.prompt_ids, r.params)
            assert serve_one(sched, eng, again) == run_alone(r.prompt_ids, r.params)[0]
        assert sched.prefix_cache_stats()["cached_tokens"] > 0


def check_plan_spec(plan, sched):
    """Plan invariants with proposals: a row with d proposals has q_len >= 1 + d, its draft tokens
    are its last token rows, and sample_positions is the position after its last real token."""
    for s in range(int(plan.num_seqs[0])):
        d = int(plan.num_draft[s])
        a, b = int(plan.cu_q_lens[s]), int(plan.cu_q_lens[s + 1])
        assert b - a >= 1 + d
        assert plan.token_ids[b - d:b].tolist() == plan.draft_ids[s, :d].tolist()
        assert plan.sample_positions[s] == plan.kv_lens[s] - d
        assert plan.verify_indices[s, 0] == b - 1 - d and plan.verify_indices[s, -1] == b - 1


def test_speculative_proposals_trimmed_to_max_tokens_and_dropped_before_preempting():
    sched = Scheduler(max_slots=2, num_pages=5, page_size=4, max_model_len=32, token_budget=16,
                      num_spec_tokens=4)
    eng = FakeVerifyEngine(5, 4)
    sched.add_request(Request("A", [1, 2, 3], greedy(3)))
    plan = sched.schedule()
    sched.update(plan, eng.step(plan))  # prefill: 1 output
    (c,) = sched.decode_candidates()
    assert c.max_draft == 1  # 3 - 1 outputs - 1 (the verify's own token)
    sched.set_drafts({"A": [7, 7, 7, 7]})
    plan = sched.schedule()
    assert plan.num_draft[0] == 1 and rows(plan) == [("A", 2, True)]
    toks, n_acc = eng.verify(plan)
    sched.update(plan, toks, n_acc)
    # page pressure: B holds 3 of the 4 usable pages; A's 4 proposals would need a new page
    sched2 = Scheduler(max_slots=2, num_pages=5, page_size=4, max_model_len=32, token_budget=16,
                       num_spec_tokens=4)
    eng2 = FakeVerifyEngine(5, 4)
    sched2.add_request(Request("A", [1, 2, 3], greedy(8)))
    sched2.add_request(Request("B", [5] * 9, greedy(2)))
    plan = sched2.schedule()
    sched2.update(plan, eng2.step(plan))
    assert sched2.free_pages == 0
    sched2.set_drafts({"A": [1, 2, 3, 4]})
    plan = sched2.schedule()
    assert sched2.num_preemptions == 0 and not plan.has_drafts
    assert rows(plan)[0] == ("A", 1, True)
    with pytest.raises(ValueError, match="not decoding"):
        sched3 = Scheduler(max_slots=1, num_pages=5, page_size=4, max_model_len=32,
                           token_budget=16, num_spec_tokens=2)
        sched3.add_request(Request("C", [1, 2, 3, 4, 5], greedy(4)))
        sched3.schedule()  # admitted, not yet computed
        sched3.set_drafts({"C": [1]})


# --------------------------------------------------------------- admission policies, gates, rows


FEATURE_WORDS = {"slo", "itl", "ttft", "lora", "loras", "adapter", "draft", "drafts", "proposals",
                 "spec", "speculative", "logprob", "logprobs", "constrained", "structured", "mask",
                 "priority"}


def feature_words(source: str) -> set[str]:
    """The feature words among the identifiers, attribute names and strings of `source`."""
    words = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, (ast.arg, ast.keyword)):
            name = node.arg or ""
        elif isinstance(node, ast.FunctionDef):
            name = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        words |= set(re.split(r"[^a-z0-9]+", name.lower()))
    return words & FEATURE_WORDS


def test_schedule_names_no_feature():
    assert feature_words(inspect.getsource(Scheduler.schedule)) == set()
    planted = '''
    def schedule(self):
        if self.slo.itl_s is not None and not self.lora_slots.acquire(seq.req.lora):
            seq.draft = []
    '''
    assert feature_words(planted) == {"slo", "itl", "lora", "draft"}


class Reverse(FirstComeFirstServed):
    """Admits from the back of the queue, at most 5 tokens a step; notes the decodes' tokens."""

    def __init__(self):
        super().__init__()
        self.decode_tokens = []

    def token_budget(self, sched, decode_tokens):
        self.decode_tokens.append(decode_tokens)
        return 5

    def order(self, sched, waiting):
        return deque(reversed(waiting))


class Nobody(FirstComeFirstServed):
    def admits(self, sched, seq):
        return False


def test_a_plugged_in_policy_orders_budgets_and_admits():
    sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=32, token_budget=16,
                      admission=Reverse())
    for rid, prompt in (("A", [1, 2, 3]), ("B", [4, 5]), ("C", [6, 7, 8, 9])):
        sched.add_request(Request(rid, prompt, greedy(2)))
    # queue reversed: C (4 tokens), then B's first token of 2: 5 tokens; A waits (no slot)
    p = sched.schedule()
    assert p.request_ids == ["C", "B"]
    assert p.token_ids.tolist() == [6, 7, 8, 9, 4, 0, 0, 0]
    assert p.positions.tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    assert p.slot_mapping.tolist() == [4, 5, 6, 7, 8, 0, 0, 0]  # C: page 1, B: page 2
    assert p.cu_q_lens.tolist() == [0, 4, 5] and p.kv_lens.tolist() == [4, 1]
    assert p.page_indices.tolist() == [[1], [2]] and p.logits_indices.tolist() == [3, 4]
    assert p.samples.tolist() == [True, False] and p.sample_positions.tolist() == [4, 1]
    assert p.max_q_len == 4 and sched.waiting_ids == ["A"]
    sched.update(p, np.array([50, 0], np.int32))
    # C decodes into a new page (3), B finishes its prompt
    p = sched.schedule()
    assert p.request_ids == ["C", "B"] and p.token_ids[:2].tolist() == [50, 5]
    assert p.positions[:2].tolist() == [4, 1] and p.slot_mapping[:2].tolist() == [12, 9]
    assert p.page_indices.tolist() == [[1, 3], [2, 0]] and p.samples.tolist() == [True, True]
    outs = sched.update(p, np.array([51, 60], np.int32))
    assert [(o.request_id, o.finished) for o in outs] == [("C", True), ("B", False)]
    p = sched.schedule()  # C's slot is A's
    assert p.request_ids == ["B", "A"] and p.token_ids[:4].tolist() == [60, 1, 2, 3]
    assert p.positions[:4].tolist() == [2, 0, 1, 2] and sched.slot_of("A") == 0
    assert sched.admission.decode_tokens == [0, 1, 1]
    closed = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=32, token_budget=16,
                       admission=Nobody())
    closed.add_request(Request("A", [1, 2, 3], greedy(2)))
    assert closed.schedule() is None
    assert closed.waiting_ids == ["A"] and closed.free_pages == 15


def test_every_plan_field_has_exactly_one_writer_and_each_writes_only_its_own(monkeypatch):
    full = PlanRows(page_size=4, num_spec_tokens=2, lora_gate=LoraGate(1))
    assert {type(w) for w in full.writers} == set(WRITERS)
    owners = [*CORE_FIELDS, *FILLED_BY_ENGINE, *(f for w in full.writers for f in w.fields)]
    assert sorted(owners) == sorted(f.name for f in PLAN_FIELDS)  # each field exactly once
    assert {type(w) for w in PlanRows(page_size=4).writers} == set(WRITERS) - set(OPTIONAL)

    # a plan run through the writers one at a time: each changes exactly its own arrays
    changed: dict[str, set] = {}

    def diffing(name, write):
        def run(a, *args):
            before = {k: v.copy() for k, v in a.items()}
            out = write(a, *args)
            changed.setdefault(name, set()).update(
                k for k in a if not np.array_equal(before[k], a[k]))
            return out
        return run

    monkeypatch.setattr(plan_rows, "write_core", diffing("core", plan_rows.write_core))
    sched = Scheduler(max_slots=4, num_pages=32, page_size=4, max_model_len=32, token_budget=16,
                      num_spec_tokens=2, max_loras=1)
    for w in sched._rows.writers:
        w.write = diffing(type(w).__name__, w.write)
    sampled = SamplingParams(max_tokens=6, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1,
                             seed=7, logprobs=1, structured_outputs={"regex": "[a-z]+"})
    sched.add_request(Request("A", [1, 2, 3, 4, 5], sampled, lora="x",
                              procs="any spec"))  # (ProcessorRows reads only its presence)
    sched.add_request(Request("B", [6, 7, 8], greedy(6, prompt_logprobs=1)))
    sched.add_request(Request("C", [1, 5, 5, 2], greedy(6), images=(
        ImageSpan(1, 2, b"img", np.zeros((2, 2, 3), np.float32), bidirectional=True),),
        rope_positions=np.arange(12, dtype=np.int32).reshape(4, 3), rope_delta=5))
    first = sched.schedule()
    second = sched.schedule()  # one plan ahead: both decodes read their pending tokens
    assert second.feed_rows[:2].tolist() == [0, 1]
    assert first.see_until[:first.num_tokens].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 2, 2, 3]
    assert [(t, im.key, j, k) for t, im, j, k in first.mm_items] == [(9, b"img", 0, 2)]
    assert first.rope_positions[:9].tolist() == [[p] * 3 for p in (0, 1, 2, 3, 4, 0, 1, 2)] + [
        [0, 1, 2]]  # A, B: their positions; C: its own
    assert first.see_until_on and first.mrope
    for plan in (first, second):
        sched.update(plan, np.array([9, 9, 9, 0], np.int32))
    sched.set_drafts({c.request_id: [1, 2] for c in sched.decode_candidates()})
    assert sched.schedule().has_drafts
    assert changed["core"] == set(CORE_FIELDS) - {"num_seqs"}  # num_seqs: padding_arrays
    writers = {type(w).__name__: set(w.fields) for w in sched._rows.writers}
    assert {name: changed[name] for name in writers} == writers


def test_lora_gate_holds_the_head_until_its_adapter_has_a_slot_and_plans_the_loads():
    sched = Scheduler(max_slots=3, num_pages=6, page_size=4, max_model_len=32, token_budget=16,
                      max_loras=1)
    sched.add_request(Request("A", [1, 2, 3], greedy(2), lora="x"))
    sched.add_request(Request("B", [4, 5], greedy(1), lora="y"))
    sched.add_request(Request("C", [6, 7], greedy(1)))
    p = sched.schedule()  # B waits for the one adapter slot, C behind it too (no overtaking)
    assert p.request_ids == ["A"] and p.lora_loads == [(1, "x")]
    assert p.lora_ids.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sched.lora_slots.refs() == {"x": 1} and sched.waiting_ids == ["B", "C"]
    sched.update(p, np.array([9, 0, 0], np.int32))
    p = sched.schedule()
    assert p.request_ids == ["A"] and p.lora_loads == []
    sched.update(p, np.array([9, 0, 0], np.int32))  # A done: "x" idle, its slot reusable
    p = sched.schedule()
    assert p.request_ids == ["B", "C"] and p.lora_loads == [(1, "y")]
    assert p.lora_ids.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert sched.lora_slots.loaded() == {"y": 1} and sched.lora_slots.refs() == {"y": 1}
    sched.check_invariants()
    # pages short at admission: the slot is given back (the load stays recorded: the adapter
    # is resident when the request comes back)
    short = Scheduler(max_slots=2, num_pages=3, page_size=4, max_model_len=16, token_budget=16,
                      max_loras=1)
    short.add_request(Request("D", list(range(1, 9)), greedy(1)))
    short.add_request(Request("E", [1, 2], greedy(1), lora="x"))
    p = short.schedule()
    assert p.request_ids == ["D"] and p.lora_loads == [(1, "x")]
    assert short.lora_slots.refs() == {} and short.waiting_ids == ["E"]
    short.check_invariants()
    short.update(p, np.array([9, 0], np.int32))
    p = short.schedule()
    assert p.request_ids == ["E"] and p.lora_loads == [] and p.lora_ids[:2].tolist() == [1, 1]
    with pytest.raises(ValueError, match="in use"):
        short.evict_lora("x")
    short.update(p, np.array([9, 0], np.int32))
    short.evict_lora("x")
    assert short.lora_slots.loaded() == {}


def test_lora_gate_gives_the_slot_back_on_preemption_abort_finish_and_failure():
    sched = Scheduler(max_slots=2, num_pages=4, page_size=2, max_model_len=16, token_budget=16,
                      max_loras=2)
    sched.add_request(Request("F", [1, 2, 3], greedy(4), arrival_time=0.0, lora="x"))
    sched.add_request(Request("G", [4, 5], greedy(4), arrival_time=1.0, lora="y"))
    p = sched.schedule()  # F: pages 1, 2; G: page 3; none left
    sched.update(p, np.array([9, 9], np.int32))
    p = sched.schedule()  # G's next position needs a page: G, the youngest, preempts itself
    assert p.request_ids == ["F"] and sched.num_preemptions == 1
    assert sched.lora_slots.refs() == {"x": 1} and sched.waiting_ids == ["G"]
    sched.check_invariants()
    assert sched.abort("F") and sched.lora_slots.refs() == {}
    sched.update(p, np.array([9, 0], np.int32))
    p = sched.schedule()  # G back, recomputing
    assert p.request_ids == ["G"] and sched.lora_slots.refs() == {"y": 1}
    assert sched.finish("G", "stop") and sched.lora_slots.refs() == {}
    sched.update(p, np.array([9, 0], np.int32))
    sched.add_request(Request("H", [1, 2], greedy(2), lora="x"))
    sched.schedule()
    assert sched.lora_slots.refs() == {"x": 1}
    assert sched.fail_running() == ["H"] and sched.lora_slots.refs() == {}
    sched.check_invariants()


def test_record_step_time_by_token_rows_and_decode_batch_and_the_targets_view():
    sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=32, token_budget=16)
    sched.add_request(Request("A", [1, 2, 3], greedy(3)))
    sched.add_request(Request("B", [4, 5], greedy(3)))
    p = sched.schedule()  # 5 prompt tokens in 8 rows
    sched.record_step_time(p, 0.010)
    assert sched.step_times.predict(8) == pytest.approx(0.010)
    assert sched.decode_times.predict(2) is None  # not a decode-only step
    sched.update(p, np.array([9, 9], np.int32))
    p = sched.schedule()  # two decodes in 8 rows
    sched.record_step_time(p, 0.006)
    assert sched.step_times.predict(8) == pytest.approx(0.010 + 0.25 * (0.006 - 0.010))
    assert sched.decode_times.predict(2) == pytest.approx(0.006)
    assert sched.latency_targets == SloConfig() and sched.lora_slots is None
    sched.evict_lora("x")  # no adapter slots: nothing to forget
    timed = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=32, token_budget=16,
                      admission=admission_policy(SloConfig(ttft_s=1.0)))
    assert timed.latency_targets.ttft_s == 1.0 and isinstance(timed.admission, LatencyTargets)
    with pytest.raises(dataclasses.FrozenInstanceError):
        timed.latency_targets.ttft_s = 2.0
