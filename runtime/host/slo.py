"""Latency targets for the scheduler: step-time predictions and the waiting queue's order. No JAX.

StepTimes keeps an exponential moving average of the measured seconds of a step per token bucket
and of their mean deviation from it (the engine records every step; as TCP estimates round
trips), and predicts unmeasured buckets from the measured ones (linear between neighbours,
proportional beyond them). The scheduler uses it two ways:

* ITL budget (`itl_s`): a step that carries decodes takes at most the largest token count whose
  predicted step time plus DEVIATIONS x its deviation fits the budget (a budget is a tail
  target: steps that merely average within it would miss it every other time), so the prefill
  chunk riding along and the sequences admitted shrink when steps get slow, and grow back when there is room. The running decodes
  themselves always go (they are what the budget protects), so the decode batch is capped at
  admission: a request is admitted only while a decode-only step of one more sequence is
  predicted to fit (a second StepTimes, by live sequence count; the first sequence is always
  admitted). With nothing measured yet every count is allowed: the first steps measure.
* TTFT budget (`ttft_s`) and priorities: `wait_key` orders the waiting queue. A request's class
  is (1) starving: it has waited longer than `max_wait_s` (default 5 x ttft_s, or 30 s): these go
  first, oldest first, so no request waits forever; (2) everyone else by priority (lower first,
  as vLLM), then on-time before late, then arrival. A request is late once its wait plus the
  predicted time of its own prefill (`lead_s`) passes the TTFT budget: admitted now, it would
  miss anyway; serving the ones that can still meet it first raises attainment, and keeps the
  earliest-deadline order among those from collapsing under overload (the request served next
  is one that makes it, not one about to miss).
* Overload: `predicted_wait(tokens_ahead)` is the time to prefill the prompt tokens queued
  ahead at the measured prefill rate; with refusal on, a request that would wait past its TTFT
  budget is refused at once with a retry hint instead of queueing.
"""

from __future__ import annotations

from bisect import bisect_left

from jaxinfer.runtime.config import SloConfig

DEVIATIONS = 2.0  # margin of the ITL cap, in mean deviations of the step time


class StepTimes:
    """Measured seconds per step by size (EMA), and predictions between and beyond. Sizes are
    token rows (`beyond="proportional"`: a step's cost scales with its rows past the measured
    ones) or live sequences of decode-only steps (`beyond="linear"`: the slope of the two
    largest measured counts, never negative; flat with one, as the weights dominate)."""

    def __init__(self, alpha: float = 0.25, beyond: str = "proportional"):
        if beyond not in ("proportional", "linear"):
            raise ValueError(f"beyond must be 'proportional' or 'linear', got {beyond!r}")
        self.alpha = alpha
        self.beyond = beyond
        self._ema: dict[int, float] = {}
        self._dev: dict[int, float] = {}  # mean |seconds - ema|
        self._keys: list[int] = []  # sorted buckets with a measurement

    def record(self, tokens: int, seconds: float) -> None:
        old = self._ema.get(tokens)
        if old is None:
            self._keys.insert(bisect_left(self._keys, tokens), tokens)
            self._ema[tokens], self._dev[tokens] = seconds, 0.0
        else:
            a = self.alpha
            self._dev[tokens] += a * (abs(seconds - old) - self._dev[tokens])
            self._ema[tokens] = old + a * (seconds - old)

    def _estimate(self, table: dict[int, float], tokens: int) -> float:
        ks = self._keys
        if tokens in table:
            return table[tokens]
        i = bisect_left(ks, tokens)
        if self.beyond == "linear" and i in (0, len(ks)):
            if i == 0 or len(ks) == 1:
                return table[ks[0] if i == 0 else ks[-1]]
            lo, hi = ks[-2], ks[-1]
            slope = max((table[hi] - table[lo]) / (hi - lo), 0.0)
            return table[hi] + slope * (tokens - hi)
        if i == 0:
            return table[ks[0]] * tokens / ks[0]
        if i == len(ks):
            return table[ks[-1]] * tokens / ks[-1]
        lo, hi = ks[i - 1], ks[i]
        f = (tokens - lo) / (hi - lo)
        return table[lo] + f * (table[hi] - table[lo])

    def predict(self, tokens: int) -> float | None:
        """Seconds of a step of `tokens` rows (None: nothing measured)."""
        return self._estimate(self._ema, tokens) if self._keys else None

    def deviation(self, tokens: int) -> float:
        return self._estimate(self._dev, tokens) if self._keys else 0.0

    def fits(self, tokens: int, budget_s: float, deviations: float = DEVIATIONS) -> bool:
        """Whether a step of `tokens` rows stays within `budget_s` with a margin of
        `deviations` mean deviations (True while nothing is measured)."""
        t = self.predict(tokens)
        return t is None or t + deviations * self.deviation(tokens) <= budget_s

    def prefill_rate(self, tokens: int) -> float | None:
        """Prompt tokens per second in steps of `tokens` rows (None: not measured)."""
        t = self.predict(tokens)
        return tokens / t if t else None

    def snapshot(self) -> dict[int, float]:
        return dict(self._ema)


def wait_key(priority: int, arrival: float, order: int, now: float, slo: SloConfig,
             lead_s: float = 0.0) -> tuple:
    """Sort key of a waiting request (smallest first; `lead_s`: predicted seconds of its own
    prefill); see the module docstring."""
    waited = now - arrival
    if waited > slo.starve_s:
        return (0, 0, 0, arrival, order)
    late = slo.ttft_s is not None and waited + lead_s > slo.ttft_s
    return (1, priority, int(late), arrival, order)
