"""Step times for the latency targets: measured seconds per step and predictions. No JAX.

StepTimes keeps an exponential moving average of the measured seconds of a step per size and of
their mean deviation from it (the engine records every step through
`Scheduler.record_step_time`; as TCP estimates round trips), and predicts unmeasured sizes from
the measured ones (linear between neighbours; beyond them proportional for token rows, the slope
of the two largest for live sequence counts). The scheduler keeps two: `step_times` by token
rows, `decode_times` by live sequences of decode-only steps. The admission policies
(runtime/host/admission.py) read them: the ITL budget's token cap and decode batch cap, the
prefill time a TTFT budget counts (`prefill_seconds`), the wait of a new arrival.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from jaxinfer.runtime.plan import bucket

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


def prefill_seconds(times: StepTimes, tokens: int, token_budget: int,
                    token_buckets: Sequence[int]) -> float:
    """Predicted seconds to prefill `tokens` prompt tokens once admitted: steps of the token
    budget at their measured times (0 while unmeasured)."""
    full, rest = divmod(tokens, token_budget)
    t = full * (times.predict(bucket(token_buckets, token_budget)) or 0)
    if rest:
        t += times.predict(bucket(token_buckets, rest)) or 0
    return t
