"""Latency targets in the host scheduler, with a fake clock and fake step times. No JAX."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.config import SloConfig
from jaxinfer.runtime.host.admission import admission_policy
from jaxinfer.runtime.host.errors import Overloaded
from jaxinfer.runtime.host.scheduler import Request, Scheduler
from jaxinfer.runtime.host.slo import StepTimes, prefill_seconds


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def sched(clock, slo=None, times=None, **kw):
    opts = dict(max_slots=8, num_pages=400, page_size=8, max_model_len=512, token_budget=64,
                token_buckets=(8, 16, 32, 64), admission=admission_policy(slo), step_times=times,
                clock=clock)
    return Scheduler(**opts | kw)


def add(s, rid, prompt_len, t, max_tokens=4, priority=0):
    s.add_request(Request(rid, list(range(1, prompt_len + 1)),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                         priority=priority), arrival_time=t))


def step(s):
    """One schedule + update with token 7 for every sampling row; -> (plan, outputs)."""
    plan = s.schedule()
    if plan is None:
        return None, []
    return plan, s.update(plan, np.full(len(plan.kv_lens), 7, np.int32))


def linear(ms_per_token: float) -> StepTimes:
    st = StepTimes()
    for b in (8, 16, 32, 64):
        st.record(b, b * ms_per_token / 1e3)
    return st


def test_step_times_average_and_predict_between_and_beyond_measurements():
    st = StepTimes(alpha=0.5)
    assert st.predict(16) is None and st.fits(16, 0.001)  # nothing measured: allowed
    st.record(16, 0.010)
    st.record(16, 0.020)  # EMA: 0.010 + 0.5 * 0.010
    st.record(64, 0.060)
    assert st.predict(16) == pytest.approx(0.015)
    assert st.predict(40) == pytest.approx(0.015 + 0.5 * 0.045)  # between: linear
    assert st.predict(8) == pytest.approx(0.0075) and st.predict(128) == pytest.approx(0.12)
    assert st.prefill_rate(64) == pytest.approx(64 / 0.06)
    # the ITL cap keeps a margin of 2 mean deviations: steady 15 ms steps fit 16 ms, jittery
    # ones (mean deviation 5 ms) do not
    assert st.deviation(16) == pytest.approx(0.005) and not st.fits(16, 0.020)
    assert st.fits(16, 0.0251) and st.fits(16, 0.016, deviations=0)
    with pytest.raises(ValueError, match="ttft_s"):
        SloConfig(ttft_s=0)
    with pytest.raises(ValueError, match="TTFT budget"):
        SloConfig(refuse_late=True)


def test_itl_budget_caps_steps_with_decodes_and_rises_when_steps_get_faster():
    clock = Clock()
    times = linear(1.0)  # 1 ms per token row: a 20 ms budget fits 16 rows
    s = sched(clock, SloConfig(itl_s=0.020), times)
    for i in range(4):
        add(s, f"d{i}", 5, 0.0, max_tokens=40)
    step(s)  # the four short prompts prefill together (no decodes yet: no cap)
    add(s, "long", 300, 0.0, max_tokens=4)
    sizes = []
    while s.num_waiting or any(not q.prefilled for q in s._running):
        plan, _ = step(s)
        sizes.append(plan.num_tokens)
    # every step carried the 4 decodes and at most 12 prompt tokens: 16 rows (1 + 300 / 12 steps)
    assert max(sizes) == 16 and len(sizes) == 25
    # faster steps: the cap rises to the whole token budget
    for _ in range(30):  # the moving average and the deviation follow
        for b in (8, 16, 32, 64):
            times.record(b, b * 0.1e-3)
    add(s, "long2", 300, 0.0, max_tokens=4)
    plan, _ = step(s)
    assert plan.num_tokens == 64
    # without a budget the same state takes the full budget at once
    free = sched(clock, None, linear(1.0))
    for i in range(4):
        add(free, f"d{i}", 5, 0.0, max_tokens=40)
    step(free)
    add(free, "long", 300, 0.0)
    assert step(free)[0].num_tokens == 64


def test_decode_batch_is_capped_at_admission_by_the_predicted_decode_step(caplog):
    clock = Clock()
    dec = StepTimes(beyond="linear")
    for n, ms in ((1, 10.0), (2, 12.0), (4, 16.0)):  # 2 ms per sequence past the weights
        dec.record(n, ms / 1e3)
    # beyond the largest count: the slope of the two largest; below and with one: flat
    assert dec.predict(6) == pytest.approx(0.020) and dec.predict(3) == pytest.approx(0.014)
    one = StepTimes(beyond="linear")
    one.record(4, 0.016)
    assert one.predict(1) == one.predict(9) == pytest.approx(0.016)
    # 19 ms fits 5 decoding sequences (18 ms), not 6
    s = sched(clock, SloConfig(itl_s=0.019), linear(0.1), decode_times=dec)
    for i in range(8):
        add(s, f"r{i}", 5, 0.0, max_tokens=6)
    most, done = 0, set()
    while s.has_work:
        most = max(most, s.num_running)
        done |= {o.request_id for o in step(s)[1] if o.finished}
    assert most == 5 and len(done) == 8  # the rest go when running ones finish
    # a budget no step meets still admits one sequence at a time (nobody waits forever)
    tight = sched(clock, SloConfig(itl_s=0.005), linear(0.1), decode_times=dec)
    for i in range(3):
        add(tight, f"t{i}", 5, 0.0, max_tokens=2)
    most = 0
    while tight.has_work:
        most = max(most, tight.num_running)
        step(tight)
    assert most == 1
    assert caplog.text.count("below the measured step of one decoding sequence (10 ms)") == 1
    # no token bucket fits (8 rows: 8 ms > 5 ms): decodes go alone, no prompt chunk rides along
    alone = sched(clock, SloConfig(itl_s=0.005), linear(1.0))
    add(alone, "a", 5, 0.0, max_tokens=8)
    step(alone)
    add(alone, "b", 20, 0.0, max_tokens=2)
    assert [step(alone)[0].num_tokens for _ in range(3)] == [1, 1, 1]
    # no budget: all eight run at once
    free = sched(clock, None, linear(0.1), decode_times=dec)
    for i in range(8):
        add(free, f"r{i}", 5, 0.0, max_tokens=6)
    step(free)
    assert free.num_running == 8


def test_priority_orders_admission_and_fcfs_without_it():
    clock = Clock()
    s = sched(clock, max_slots=1)
    for rid, prio in (("a", 5), ("b", -1), ("c", 0), ("d", -1)):
        add(s, rid, 4, 0.0, max_tokens=1, priority=prio)
    order = []
    while s.has_work:
        plan, outs = step(s)
        order += [o.request_id for o in outs if o.finished]
    assert order == ["b", "d", "c", "a"]  # lower first, ties by arrival
    f = sched(clock, max_slots=1)
    for rid in "xyz":
        add(f, rid, 4, 0.0, max_tokens=1)
    order = []
    while f.has_work:
        order += [o.request_id for o in step(f)[1] if o.finished]
    assert order == ["x", "y", "z"]


def test_ttft_budget_serves_on_time_requests_before_late_ones_and_starving_first():
    clock = Clock()
    s = sched(clock, SloConfig(ttft_s=1.0), max_slots=1)
    add(s, "early", 4, 0.0, max_tokens=1)  # late at now=1.2
    add(s, "recent", 4, 0.5, max_tokens=1)  # on time at 1.2: goes first
    add(s, "ancient", 4, -10.0, max_tokens=1, priority=9)  # waited past 5 x 1 s: starving
    clock.t = 1.2
    order = []
    while s.has_work:
        order += [o.request_id for o in step(s)[1] if o.finished]
    assert order == ["ancient", "recent", "early"]


def test_a_request_whose_own_prefill_would_end_past_the_ttft_budget_counts_as_late():
    """1 ms per token row: a 300-token prompt prefills in 4 x 64 + 64 ms = 0.32 s, so after
    0.8 s of waiting it can no longer start within a 1 s budget, and a short prompt that can
    goes first; 0.3 s earlier both are on time and arrival order holds."""
    clock = Clock()
    for now, order in ((0.8, ["recent", "early"]), (0.5, ["early", "recent"])):
        s = sched(clock, SloConfig(ttft_s=1.0), linear(1.0), max_slots=1)
        assert prefill_seconds(s.step_times, 300, s.token_budget,
                               s.token_buckets) == pytest.approx(0.32)
        add(s, "early", 300, 0.0, max_tokens=1)
        add(s, "recent", 4, 0.1, max_tokens=1)
        clock.t = now
        done = []
        while s.has_work:
            done += [o.request_id for o in step(s)[1] if o.finished]
        assert done == order


def test_no_request_waits_past_the_starvation_bound_under_a_priority_flood():
    """A low-priority request among a steady stream of urgent ones: admitted once it has
    waited 5 x the TTFT budget, whatever arrives."""
    clock = Clock()
    s = sched(clock, SloConfig(ttft_s=0.05), max_slots=1)
    add(s, "low", 4, 0.0, max_tokens=2, priority=100)
    done, n = {}, 0
    while "low" not in done:
        add(s, f"u{n}", 4, clock.t, max_tokens=2, priority=-5)
        n += 1
        for o in step(s)[1]:
            if o.finished:
                done[o.request_id] = clock.t
        clock.t += 0.01  # 10 ms steps; urgent requests arrive every step
        assert clock.t < 2.0, "the low-priority request starved"
    assert 0.25 <= done["low"] <= 0.35  # admitted right after waiting 5 x 50 ms


def test_overload_refusal_predicts_the_wait_and_hints_the_retry():
    clock = Clock()
    times = linear(1.0)  # 64 rows in 64 ms: 1000 prompt tokens / s
    s = sched(clock, SloConfig(ttft_s=0.5, refuse_late=True), times, max_slots=1)
    add(s, "a", 300, 0.0, max_tokens=1)
    add(s, "b", 100, 0.0, max_tokens=1)
    assert s.predicted_wait(50) == pytest.approx(0.45)
    s.check_overload("c", 99)  # 400 + 99 tokens: 0.499 s, within budget
    with pytest.raises(Overloaded, match="exceeds the 0.50 s budget") as e:
        s.check_overload("c", 150)
    assert e.value.retry_after_s == pytest.approx(0.05)
    # a request that would jump the queue (better priority) is predicted from its place
    s.check_overload("urgent", 150, priority=-1)
    off = sched(clock, SloConfig(ttft_s=0.5), times, max_slots=1)
    add(off, "a", 400, 0.0)
    off.check_overload("c", 400)  # refusal off: never raises


def test_attainment_counters_per_target_and_goodput():
    from types import SimpleNamespace

    from jaxinfer.serve.metrics import ServingMetrics

    loop = SimpleNamespace(stats=lambda: {"ttft_target_s": 1.0, "itl_target_s": 0.1}, on_finish=[])
    m = ServingMetrics(loop)
    for ttft, itl in ((0.5, [0.05, 0.09]), (2.0, [0.05]), (0.5, [0.05, 0.3]), (0.2, [])):
        m._attainment({"ttft_s": ttft, "itl_s": itl})

    def value(counter, **labels):
        return sum(s.value for metric in counter.collect() for s in metric.samples
                   if s.name.endswith("_total") and s.labels == labels)

    assert value(m.slo_met, target="ttft") == 3 and value(m.slo_missed, target="ttft") == 1
    assert value(m.slo_met, target="itl") == 3 and value(m.slo_missed, target="itl") == 1
    assert value(m.goodput) == 2
