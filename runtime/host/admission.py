"""Admission policies: the order of the waiting queue, when its head may go in, and how many
tokens a step may carry. No JAX.

The scheduler (runtime/host/scheduler.py) holds one policy and asks it, each step:

    budget  = policy.token_budget(sched, decode_tokens)  # tokens this step, decodes included
    waiting = policy.order(sched, waiting)               # the waiting queue in admission order
    policy.admits(sched, head)                           # may the queue's head go in now?

and when a request arrives, from any thread (it reads snapshots: `sched.queues()`):

    policy.predicted_wait(sched, prompt_len, priority)   # seconds until its first token
    policy.check_overload(sched, request_id, prompt_len, priority)  # raise Overloaded, or not

A policy reads the scheduler (token_budget, token_buckets, step_times, decode_times, clock,
num_running, queues()) and changes none of it: the scheduler applies what it returns.
`targets` (a frozen SloConfig): the latency targets it works to, for the engine's stats and the
serving metrics. `admission_policy(slo)` picks the built-in one for EngineConfig.slo.

FirstComeFirstServed (the default): arrival order, preempted sequences first (they re-enter the
queue at its front). When a waiting request has a non-zero priority the queue is sorted by
`wait_key`: (1) starving, waited longer than `targets.starve_s` (default 30 s): oldest first, so
no request waits forever; (2) everyone else by priority (lower first, as vLLM), then arrival.
The whole token budget every step, no admission cap, no refusal.

LatencyTargets(slo), for an ITL budget `itl_s` and / or a TTFT budget `ttft_s`:
* ITL budget: a step that carries decodes takes at most the largest token bucket whose predicted
  step time plus DEVIATIONS x its deviation fits the budget (a budget is a tail target: steps
  that merely average within it would miss it every other time), so the prefill chunk riding
  along and the sequences admitted shrink when steps get slow, and grow back when there is
  room. The running decodes themselves always go (they are what the budget protects), so the
  decode batch is capped at admission: the head is admitted only while a decode-only step of
  one more sequence is predicted to fit (`decode_times`; the first sequence is always
  admitted). With nothing measured yet every count is allowed: the first steps measure.
* The queue is always sorted by `wait_key`, and with a TTFT budget on-time requests go before
  late ones within a priority: a request is late once its wait plus the predicted time of its
  own prefill (`lead_s`) passes the budget. Admitted now, it would miss anyway; serving the
  ones that can still meet it first raises attainment, and keeps the earliest-deadline order
  among those from collapsing under overload. The starvation bound defaults to 5 x ttft_s.
* Overload: `predicted_wait` is the time to prefill the prompt tokens queued ahead (in the
  queue's order), those of running sequences still prefilling and its own, at the prefill rate
  measured at the full token budget; with `refuse_late` a request predicted to miss its TTFT
  budget is refused at once (Overloaded, with a retry hint) instead of queueing.

A gate (runtime/host/lora_slots.py: LoraGate) is a resource a request holds while it runs:
`acquire(seq)` when the queue's head is admitted (False: the head waits, nobody overtakes it),
`release(seq)` when it gives the slot back (pages short at admission, preemption, finish,
abort, failure; a no-op for a sequence holding nothing), `check(running)` for the scheduler's
invariants.
"""

from __future__ import annotations

import logging
import math
from collections import deque

from jaxinfer.runtime.config import SloConfig
from jaxinfer.runtime.host.errors import Overloaded
from jaxinfer.runtime.host.slo import prefill_seconds
from jaxinfer.runtime.plan import bucket

log = logging.getLogger(__name__)


def wait_key(priority: int, arrival: float, order: int | float, now: float, targets: SloConfig,
             lead_s: float = 0.0) -> tuple:
    """Sort key of a waiting request (smallest first; `order`: add_request's counter, `lead_s`:
    predicted seconds of its own prefill); see the module docstring."""
    waited = now - arrival
    if waited > targets.starve_s:
        return (0, 0, 0, arrival, order)
    late = targets.ttft_s is not None and waited + lead_s > targets.ttft_s
    return (1, priority, int(late), arrival, order)


class FirstComeFirstServed:
    """The default policy (module docstring). `targets`: only its starvation bound applies."""

    def __init__(self, targets: SloConfig | None = None):
        self.targets = targets or SloConfig()

    def token_budget(self, sched, decode_tokens: int) -> int:
        return sched.token_budget

    def order(self, sched, waiting: deque) -> deque:
        if len(waiting) > 1 and self.sorts(waiting):
            now = sched.clock()
            return deque(sorted(waiting, key=lambda s: self.key(sched, s, now)))
        return waiting

    def sorts(self, waiting: deque) -> bool:
        """Whether the queue is sorted by `key` this step (else it keeps its order)."""
        return any(s.req.params.priority for s in waiting)

    def admits(self, sched, seq) -> bool:
        return True

    def lead_s(self, sched, tokens: int) -> float:
        """Seconds of a request's own prefill that its wait counts with (none here)."""
        return 0.0

    def key(self, sched, seq, now: float) -> tuple:
        if seq.cached_tokens is not None:  # preempted: readmitted before anyone new
            return (-1, seq.order)
        r = seq.req
        return wait_key(r.params.priority, r.arrival_time, seq.order, now, self.targets,
                        self.lead_s(sched, seq.num_tokens))

    def predicted_wait(self, sched, prompt_len: int, priority: int = 0) -> float:
        rate = sched.step_times.prefill_rate(bucket(sched.token_buckets, sched.token_budget))
        if not rate:
            return 0.0
        now = sched.clock()
        # added now: it sorts after every queued request of equal key (math.inf: the next order)
        mine = wait_key(priority, now, math.inf, now, self.targets, self.lead_s(sched, prompt_len))
        waiting, running = sched.queues()
        ahead = sum(s.num_tokens for s in waiting if self.key(sched, s, now) < mine)
        ahead += sum(max(s.num_tokens - s.num_computed, 0) for s in running if not s.prefilled)
        return (ahead + prompt_len) / rate

    def check_overload(self, sched, request_id: str, prompt_len: int, priority: int = 0) -> None:
        return None


class LatencyTargets(FirstComeFirstServed):
    """ITL and TTFT budgets, refusal of late requests (module docstring)."""

    def __init__(self, targets: SloConfig):
        super().__init__(targets)
        self._floor_warned = False

    def token_budget(self, sched, decode_tokens: int) -> int:
        """The largest token bucket whose predicted step fits the ITL budget when the step has
        decodes, never below the decodes themselves."""
        itl = self.targets.itl_s
        if itl is None or not decode_tokens:
            return sched.token_budget
        fits = [b for b in sched.token_buckets if sched.step_times.fits(b, itl)]
        # nothing fits: the decodes go alone (a prompt chunk in their padding rows still costs
        # its attention and cache writes: +11 % on Gemma 3 270M at 16 rows here)
        return max(min(sched.token_budget, fits[-1] if fits else 0), decode_tokens)

    def sorts(self, waiting: deque) -> bool:
        return self.targets.active or super().sorts(waiting)

    def admits(self, sched, seq) -> bool:
        """The decode batch's cap: one more sequence only while its decode step fits."""
        itl, running = self.targets.itl_s, sched.num_running
        if itl is None or not running or sched.decode_times.fits(running + 1, itl):
            return True
        self._warn_floor(sched)
        return False

    def lead_s(self, sched, tokens: int) -> float:
        if self.targets.ttft_s is None:
            return 0.0
        return prefill_seconds(sched.step_times, tokens, sched.token_budget, sched.token_buckets)

    def check_overload(self, sched, request_id: str, prompt_len: int, priority: int = 0) -> None:
        """With refuse_late: raise Overloaded when a request arriving now is predicted to miss
        its TTFT budget."""
        ttft = self.targets.ttft_s
        if not self.targets.refuse_late:
            return
        wait = self.predicted_wait(sched, prompt_len, priority)
        if wait > ttft:
            who = f"request {request_id!r}: " if request_id else ""  # (an arrival has none)
            raise Overloaded(
                f"{who}predicted time to first token {wait:.2f} s exceeds the {ttft:.2f} s "
                "budget (server overloaded)", retry_after_s=wait - ttft)

    def _warn_floor(self, sched) -> None:
        """Say once when the ITL budget is below a one-sequence decode step: it cannot be met,
        and requests then run about one at a time."""
        one, itl = sched.decode_times.predict(1), self.targets.itl_s
        if one is not None and one > itl and not self._floor_warned:
            self._floor_warned = True
            log.warning("the ITL budget (%.0f ms) is below the measured step of one decoding "
                        "sequence (%.0f ms): it cannot be met; sequences decode one at a time",
                        itl * 1e3, one * 1e3)


def admission_policy(slo: SloConfig | None) -> FirstComeFirstServed:
    """The built-in policy for latency targets `slo` (EngineConfig.slo): LatencyTargets when it
    sets a budget, else first come first served (with its starvation bound)."""
    if slo is not None and slo.active:
        return LatencyTargets(slo)
    return FirstComeFirstServed(slo)
