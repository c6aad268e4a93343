"""The output processor: everything between a step's sampled tokens and what a caller receives.
Host only, no JAX.

Per request it keeps what a result is made of: the incremental detokenizer (the request's
`skip_special_tokens` and `spaces_between_special_tokens`), the text with stop strings cut (a
suffix that may still complete a stop string is held back, never streamed; with
`include_stop_str_in_output` the text ends with the stop string and nothing is held back; none
ends the output before `min_tokens` tokens), the logprob entries of each token, the prompt
logprobs filled as prefill chunks come back, and the latency stamps. Each step it turns the
scheduler's outputs into one `RequestDelta` per request that advanced; the last delta of a
request is `finished` and carries its `RequestOutput`, and the processor forgets the request
there. Every front end formats `RequestDelta`: `LLM.generate` and
`LLM.stream`, the serving loop (gRPC, HTTP), JSONL batch and Ray read nothing else.

    outputs = OutputProcessor(tokenizer)
    outputs.add(rid, prompt_ids, params, now=t)
    outputs.scheduled(plan.request_ids, now, cached_tokens_of)      # first scheduled, cache hits
    outputs.record_prompt_logprobs(plan, rows)                      # prefill rows [T, 1 + 2n]
    delta = outputs.tokens(rid, new_ids, finished, reason, row, n, now)
    delta.finished and delta.output                                 # the RequestOutput

A logprob entry is {"token_id", "logprob", "top": [(id, logprob) x k]}; prompt logprobs are one
per prompt token, None for the first (nothing predicts it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.host.tokenizer import IncrementalDetokenizer

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class RequestMetrics:
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    speculative: bool = False  # report the spec_* figures below
    spec_proposed: int = 0  # proposals verified
    spec_accepted: int = 0  # proposals accepted
    spec_steps: int = 0  # verify steps with at least one proposal

    def summary(self) -> dict:
        itl = list(np.diff(self.token_times)) if len(self.token_times) > 1 else []
        return {
            "queue_s": None if self.scheduled is None else self.scheduled - self.arrival,
            "ttft_s": None if self.first_token is None else self.first_token - self.arrival,
            "itl_s": [float(x) for x in itl],
            "itl_s_mean": float(np.mean(itl)) if itl else None,
            "e2e_s": None if self.finished is None else self.finished - self.arrival,
            "cached_tokens": self.cached_tokens,
        } | (self._spec_summary() if self.speculative else {})

    def _spec_summary(self) -> dict:
        """acceptance_rate = accepted / proposed; mean_accepted_len = tokens emitted per verify
        step with proposals (accepted + the correction/bonus token), as vLLM reports it."""
        p, a, n = self.spec_proposed, self.spec_accepted, self.spec_steps
        return {"spec_proposed": p, "spec_accepted": a,
                "acceptance_rate": a / p if p else None,
                "mean_accepted_len": (a + n) / n if n else None}


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM shapes it: `RequestOutput.outputs` lists them.
    `cumulative_logprob`: the sum of its tokens' logprobs (None when none were computed)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    """A finished request (the last RequestDelta carries it). Its fields describe one
    completion; `outputs` lists every completion of the prompt (vLLM's shape): the request
    itself, or the n samples / beams `LLM.generate` (n, best_of) and `LLM.beam_search` group
    under the first one's fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # one of FINISH_REASONS
    metrics: dict = field(default_factory=dict)  # queue_s, ttft_s, itl_s (list), itl_s_mean, e2e_s, cached_tokens
    logprobs: list[dict] | None = None  # one entry per token when asked for
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    # one per prompt token: None for the first, then {"token_id", "logprob", "top"} as logprobs
    prompt_logprobs: list[dict | None] | None = None
    lora_name: str | None = None  # the LoRA adapter that served it (None: the base model)
    cumulative_logprob: float | None = None  # its tokens' logprobs summed, when computed
    completions: list[CompletionOutput] | None = None  # grouped samples (None: this one)
    # the engine's weight version that produced every token of it (Engine.update_weights)
    weight_version: int | str = 0

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.completions is not None:
            return self.completions
        return [CompletionOutput(0, self.text, self.token_ids, self.cumulative_logprob,
                                 self.logprobs, self.finish_reason)]

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": sum(len(c.token_ids) for c in self.outputs),
                "cached_tokens": int(self.metrics.get("cached_tokens", 0))}


@dataclass
class RequestDelta:
    """What one step added to one request: new text (stop strings held back and cut), the new
    token ids and their logprob entries (when asked for), the prompt's logprobs on the request's
    first delta (when asked for), and on the last one `finished`, the reason and the whole
    `output`. `index`: the sample's index within a request of n samples (set by the serving loop;
    0 from the engine)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None
    index: int = 0

    @property
    def error(self) -> str | None:
        return self.output.error if self.output is not None else None


@dataclass
class _State:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    lora: str | None
    weight_version: int | str = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    text: str = ""  # the whole text so far (stop strings cut)
    emitted: int = 0  # chars of `text` already delivered
    stop_end: int = 0  # a stop string must end at or past this char (min_tokens not reached)
    sent_prompt: bool = False  # the prompt logprobs went out with a delta


class OutputProcessor:
    """The unfinished requests' output state (see the module docstring). `speculative`: report
    the per-request acceptance figures in the metrics."""

    def __init__(self, tokenizer, speculative: bool = False):
        self.tokenizer = tokenizer
        self.speculative = speculative
        self._live: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> list[str]:
        return list(self._live)

    def users_of(self, lora_name: str) -> int:
        """Unfinished requests served by the LoRA adapter `lora_name`."""
        return sum(1 for st in self._live.values() if st.lora == lora_name)

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
            now: float, lora: str | None = None, prompt: str | None = None,
            weight_version: int | str = 0) -> None:
        if request_id in self._live:
            raise ValueError(f"duplicate request_id {request_id!r}")
        ids = list(prompt_ids)
        self._live[request_id] = _State(
            request_id=request_id, prompt=prompt, prompt_ids=ids, params=params,
            detok=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                         params.spaces_between_special_tokens),
            metrics=RequestMetrics(arrival=now, speculative=self.speculative), lora=lora,
            weight_version=weight_version,
            prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else [])

    # ---- what a step reports ------------------------------------------------------------------
    def scheduled(self, request_ids: Sequence[str], now: float,
                  cached_tokens_of: Callable[[str], int]) -> None:
        """Stamp the first time each request is scheduled, and its prompt tokens served from the
        prefix cache (call before the scheduler retires anyone)."""
        for rid in request_ids:
            st = self._live.get(rid)
            if st is not None and st.metrics.scheduled is None:
                st.metrics.scheduled = now
                st.metrics.cached_tokens = cached_tokens_of(rid)

    def speculation(self, request_id: str, proposed: int, accepted: int) -> None:
        m = self._live[request_id].metrics
        m.spec_proposed += proposed
        m.spec_accepted += accepted
        m.spec_steps += 1

    def record_prompt_logprobs(self, plan, rows: np.ndarray) -> None:
        """rows [T, 1 + 2n]: token row t scores prompt token prompt_targets[t], at position
        positions[t] + 1, of the request of its sequence row (a prefill recomputed after
        preemption writes the same values again)."""
        n, cu = plan.num_logprobs, plan.cu_q_lens
        for s, rid in enumerate(plan.request_ids):
            st = self._live.get(rid)
            if st is None or st.params.prompt_logprobs is None:
                continue
            k = st.params.prompt_logprobs
            for t in range(int(cu[s]), int(cu[s + 1])):
                target = int(plan.prompt_targets[t])
                if target >= 0:
                    st.prompt_logprobs[int(plan.positions[t]) + 1] = logprob_entry(
                        target, rows[t], n, k)

    def tokens(self, request_id: str, new_ids: Sequence[int], finished: bool,
               reason: str | None, row: np.ndarray, num_logprobs: int, now: float,
               error: str | None = None) -> RequestDelta:
        """The delta of a request that got `new_ids` this step (`finished`: the scheduler ended
        it, for `reason`). `row` [1 + 2n]: the step's logprob columns of its sequence row. A stop
        string completed by these tokens ends it too (not one completed before `min_tokens`
        tokens): the delta is then finished with "stop" while `finished` was False (the caller
        retires it from the scheduler); the text ends before it, or after it with
        `include_stop_str_in_output` (which holds nothing back while streaming)."""
        st = self._live[request_id]
        p, first_lp = st.params, len(st.logprobs)
        stop_at = None  # several tokens in one step: none after a completed stop string
        for idx, tok in enumerate(new_ids):
            st.token_ids.append(tok)
            st.metrics.token_times.append(now)
            if st.metrics.first_token is None:
                st.metrics.first_token = now
            if p.logprobs is not None and num_logprobs:
                st.logprobs.append(logprob_entry(tok, row[1:], num_logprobs, p.logprobs))
            st.text += st.detok.add(tok)
            _no_stop_yet(st)
            if len(new_ids) > 1 and p.stop and idx + 1 < len(new_ids) and _find_stop(st):
                stop_at = idx + 1
                break
        if stop_at is not None:
            new_ids = new_ids[:stop_at]
        if finished:
            st.text += st.detok.flush()
            _no_stop_yet(st)
        match = _find_stop(st)
        if match is not None:
            st.text = st.text[:match[1] if p.include_stop_str_in_output else match[0]]
            finished, reason = True, "stop"
        held = 0 if p.include_stop_str_in_output else _holdback(st.text, p.stop)
        upto = len(st.text) if finished else len(st.text) - held
        text = st.text[st.emitted:upto]
        st.emitted = max(st.emitted, upto)
        delta = RequestDelta(request_id, text, list(new_ids), st.logprobs[first_lp:],
                             prompt_logprobs=self._prompt_once(st))
        if finished:
            self._end(st, delta, reason, now, error)
        return delta

    def finish(self, request_id: str, reason: str, now: float,
               error: str | None = None) -> RequestDelta | None:
        """End a request with no new tokens ("abort", "error"): its last delta (no text: what
        was held back stays in `output.text` only), or None when it is not live."""
        st = self._live.get(request_id)
        if st is None:
            return None
        delta = RequestDelta(request_id, prompt_logprobs=self._prompt_once(st))
        self._end(st, delta, reason, now, error)
        return delta

    # ---- internals ---------------------------------------------------------------------------
    def _prompt_once(self, st: _State) -> list[dict | None] | None:
        if st.params.prompt_logprobs is None or st.sent_prompt:
            return None
        st.sent_prompt = True
        return list(st.prompt_logprobs)

    def _end(self, st: _State, delta: RequestDelta, reason: str | None, now: float,
             error: str | None) -> None:
        st.metrics.finished = now
        p = st.params
        delta.finished, delta.finish_reason = True, reason
        delta.output = RequestOutput(
            request_id=st.request_id, prompt=st.prompt, prompt_token_ids=list(st.prompt_ids),
            text=st.text, token_ids=list(st.token_ids), finish_reason=reason,
            metrics=st.metrics.summary(),
            logprobs=st.logprobs if p.logprobs is not None else None, error=error,
            prompt_logprobs=st.prompt_logprobs if p.prompt_logprobs is not None else None,
            lora_name=st.lora, weight_version=st.weight_version, cumulative_logprob=sum(e["logprob"] for e in st.logprobs)
            if p.logprobs is not None else None)
        del self._live[st.request_id]


def best_of(samples: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """The n samples a request of n returns: all, in order, when there are n; else the n with
    the highest cumulative logprob, best first (each needs its `cumulative_logprob`)."""
    if len(samples) == n:
        return list(samples)
    return sorted(samples, key=lambda o: -o.cumulative_logprob)[:n]


def grouped(samples: Sequence[RequestOutput]) -> RequestOutput:
    """Samples of one prompt as one RequestOutput: the first's, `outputs` listing them all."""
    return replace(samples[0], completions=[
        CompletionOutput(i, o.text, o.token_ids, o.cumulative_logprob, o.logprobs,
                         o.finish_reason) for i, o in enumerate(samples)])


def logprob_entry(token: int, cols: np.ndarray, n: int, k: int) -> dict:
    """cols [1 + 2n]: the token's logprob, the top-n logprobs, their ids -> the entry of a
    token with its top k <= n."""
    return {"token_id": int(token), "logprob": float(cols[0]),
            "top": [(int(i), float(v)) for v, i in zip(cols[1:1 + k], cols[1 + n:1 + n + k])]}


def _max_len(stops) -> int:
    return max((len(s) for s in stops), default=0)


def _no_stop_yet(st: _State) -> None:
    """Before min_tokens tokens no stop string ends the output: the text so far cannot hold the
    end of one."""
    if len(st.token_ids) < st.params.min_tokens:
        st.stop_end = len(st.text) + 1


def _find_stop(st: _State) -> tuple[int, int] | None:
    """(start, end) of the first stop string in the text not yet delivered (its first chars may
    have been held back), ending at or past `stop_end`; None if there is none."""
    stops = st.params.stop
    start = max(0, st.emitted - _max_len(stops))
    hits = [(i, i + len(s)) for s in stops
            if (i := st.text.find(s, max(start, st.stop_end - len(s)))) >= 0]
    return min(hits) if hits else None


def _holdback(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
