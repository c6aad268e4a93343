"""Asynchronous scheduling in the host scheduler (one plan ahead), with the fake paged engine of
test_scheduler.py taught to read fed tokens from the previous step's samples. No JAX.

The driver plans and "launches" step n+1 before it gives step n's tokens to update(), like the
engine does. The fake engine's tokens depend on every K/V it reads back, so a wrong feed row, a
page handed to two owners or a stale row applied after preemption changes the outputs, which must
equal each request run alone (and the synchronous loop's).
"""

import numpy as np
import pytest

from jaxinfer.runtime.host.scheduler import Request, Scheduler
from tests.runtime.test_scheduler import FakeEngine, check_plan, drive, greedy, rows, run_alone


class FedFakeEngine(FakeEngine):
    def step(self, plan, prev=None):
        fed = plan.feed_rows >= 0
        if fed.any():
            assert prev is not None, "a plan feeds rows but nothing is in flight"
            assert (plan.token_ids[fed] == 0).all()
            plan.token_ids = np.where(fed, prev[np.maximum(plan.feed_rows, 0)], plan.token_ids)
        return super().step(plan)


def drive_async(sched, arrivals, max_steps=5000):
    """Like test_scheduler.drive, one plan ahead. Returns (results, plans, stats)."""
    engine = FedFakeEngine(sched.allocator.num_pages, sched.page_size)
    results, plans = {}, []
    stats = dict(fed_rows=0, dropped_rows=0)
    inflight = None  # (plan, sampled)
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add_request(req)
            results[req.request_id] = ([], None)
        if not sched.has_work and inflight is None and step > max(arrivals, default=0):
            return results, plans, stats
        plan = sched.schedule()
        launched = None
        if plan is not None:
            check_plan(plan, sched)
            plans.append(plan)
            fed = plan.feed_rows[: plan.num_tokens] >= 0
            stats["fed_rows"] += int(fed.sum())
            if fed.any():  # only decode rows are fed, and only from the plan in flight
                q = np.diff(plan.cu_q_lens)
                row_of_token = np.repeat(np.arange(len(q)), q)[: plan.num_tokens]
                assert (q[row_of_token[fed]] == 1).all()
                assert inflight is not None
                prev_rows = dict(zip(inflight[0].request_ids, range(len(inflight[0].request_ids))))
                for t in np.flatnonzero(fed):
                    rid = plan.request_ids[row_of_token[t]]
                    assert plan.feed_rows[t] == prev_rows[rid]
                    assert inflight[0].samples[plan.feed_rows[t]]
            launched = (plan, engine.step(plan, None if inflight is None else inflight[1]))
        if inflight is not None:
            done_plan, sampled = inflight
            outs = sched.update(done_plan, sampled)
            live = {o.request_id for o in outs}
            stats["dropped_rows"] += sum(1 for s, rid in enumerate(done_plan.request_ids)
                                         if done_plan.samples[s] and rid not in live)
            for out in outs:
                toks, _ = results[out.request_id]
                results[out.request_id] = (toks + out.new_token_ids, out.finish_reason)
        sched.check_invariants()
        inflight = launched
    raise AssertionError("did not finish")


def workload(seed, n=24):
    rng = np.random.default_rng(seed)
    arrivals = {}
    for i in range(n):
        prompt = rng.integers(1, 100, int(rng.integers(1, 30))).tolist()
        stop = (int(rng.integers(0, 101)),) if i % 3 == 0 else ()
        params = greedy(int(rng.integers(1, 14)), stop_token_ids=stop)
        arrivals.setdefault(int(rng.integers(0, 20)), []).append(Request(f"r{i}", prompt, params))
    return arrivals


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_outputs_equal_alone_and_sync_with_chunking_and_preemption(seed, prefix):
    def make():
        return Scheduler(max_slots=4, num_pages=14, page_size=4, max_model_len=64, token_budget=12,
                         enable_prefix_caching=prefix)

    sched = make()
    results, plans, stats = drive_async(sched, workload(seed))
    for reqs in workload(seed).values():
        for req in reqs:
            assert results[req.request_id] == run_alone(req.prompt_ids, req.params), req.request_id
    sync_results, _ = drive(make(), workload(seed))
    assert results == sync_results
    assert sched.num_preemptions > 0 and any(rows(p)[0][1] > 1 for p in plans)  # both exercised
    assert stats["fed_rows"] > 0
    assert sched.free_pages == sched.allocator.num_total  # cached pages count as free
    assert not sched.has_work


def test_stop_token_costs_one_dropped_row_and_never_shows():
    sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=64, token_budget=16)
    prompt = [5, 7, 11]
    free_run, _ = run_alone(prompt, greedy(6))
    stop = free_run[2]  # the third token stops it
    req = Request("A", prompt, greedy(6, stop_token_ids=(stop,)))
    results, plans, stats = drive_async(sched, {0: [req]})
    assert results["A"] == (free_run[:3], "stop")
    # plans: prefill, then decodes fed from the step before; the one after the stop is dropped
    assert [rows(p) for p in plans] == [[("A", 3, True)]] + [[("A", 1, True)]] * 3
    assert stats["dropped_rows"] == 1 and stats["fed_rows"] == 3
    assert sched.free_pages == sched.allocator.num_total


def test_last_token_pending_is_not_planned_again():
    sched = Scheduler(max_slots=2, num_pages=16, page_size=4, max_model_len=64, token_budget=16)
    eng = FedFakeEngine(16, 4)
    sched.add_request(Request("A", [1, 2, 3], greedy(2)))
    p1 = sched.schedule()
    s1 = eng.step(p1)
    p2 = sched.schedule()  # A's second (last) token, fed from p1 row 0
    assert rows(p2) == [("A", 1, True)] and p2.feed_rows[0] == 0 and (p2.feed_rows[1:] == -1).all()
    s2 = eng.step(p2, s1)
    with pytest.raises(ValueError, match="two plans are outstanding"):
        sched.schedule()
    with pytest.raises(ValueError, match="oldest plan"):
        sched.update(p2, s2)
    [out] = sched.update(p1, s1)
    assert out.new_token_ids == [int(s1[0])] and not out.finished
    assert sched.schedule() is None  # its max_tokens-th token is in flight: nothing to plan
    [out] = sched.update(p2, s2)
    assert out.finished and out.finish_reason == "length"
    assert [int(s1[0]), int(s2[0])] == run_alone([1, 2, 3], greedy(2))[0]
    assert sched.free_pages == sched.allocator.num_total


def test_preempted_sequence_drops_its_pending_token_and_recomputes_it():
    # A (older) and B share 5 pages of 4 tokens; when B's decode needs a page there is none:
    # B itself (youngest) is preempted while its previous token is still in flight
    sched = Scheduler(max_slots=2, num_pages=6, page_size=4, max_model_len=40, token_budget=16)
    a = Request("A", [1] * 7, greedy(9), arrival_time=0.0)
    b = Request("B", [2] * 8, greedy(9), arrival_time=1.0)
    results, plans, _ = drive_async(sched, {0: [a, b]})
    assert sched.num_preemptions >= 1
    assert results["A"] == run_alone(a.prompt_ids, a.params)
    assert results["B"] == run_alone(b.prompt_ids, b.params)
    assert sched.free_pages == sched.allocator.num_total
