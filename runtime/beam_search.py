"""Beam search over the engine, one token per round, scored as HF transformers scores it.

    searches = [BeamSearch(prompt_ids, BeamSearchParams(beam_width=4, max_tokens=32), limits)]
    run_searches(searches, run_round)       # run_round([(ids, SamplingParams)]) -> RequestOutputs
    out = searches[0].output(tokenizer)     # RequestOutput; .outputs: the k beams, best first

Each round every live beam is one engine request of max_tokens=1 asking for its top K =
max(2, 1 + #EOS ids) x k logprobs (so k <= MAX_LOGPROBS // 2 = 10 with one EOS id). The
engine's prefix cache shares what the beams have in common: a finished request's full pages stay
registered, so the next round's beams (their parent + one token) take them back by reference
count; only each beam's last, partial page (fewer than page_size tokens) is computed again every
round. `run_searches` drives any number of searches in lock step, one engine batch per round;
`LLM.beam_search` runs the rounds through `LLM.generate`, the HTTP server through its serving
loop. Host only: no JAX here.

Scoring is transformers 5.x `_beam_search` with do_sample=False (equal sequences and
`sequences_scores` to `generate(num_beams=k, num_return_sequences=k, length_penalty=lp,
early_stopping=es)`), rule by rule:
  * round 1 expands the prompt alone; the K best (beam, token) candidates by cumulative logprob
    are kept; a candidate ending in EOS, or reaching max_tokens, is finished;
  * the next beams: the k best unfinished candidates;
  * only finished candidates among the k best of the K become hypotheses, scored cumulative
    logprob / generated_length ** length_penalty (the length counts the EOS token); the k best
    hypotheses are kept;
  * the search ends at max_tokens; with early_stopping=True once k hypotheses exist; otherwise
    once k hypotheses exist and the best live beam's cumulative logprob / L ** length_penalty is
    not above the worst hypothesis, L being the generated length so far (early_stopping=False)
    or max_tokens (early_stopping="never" with length_penalty > 0).
The k hypotheses come back best score first; their tokens include the EOS that ended them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.outputs import CompletionOutput, RequestOutput
from jaxinfer.runtime.host.requests import (MAX_LOGPROBS, SAMPLING_FIELDS, Field, Limits,
                                            SamplingParams, check_field, check_request)

BEAM_FIELDS = {
    "beam_width": Field("int", None, 1, MAX_LOGPROBS // 2, doc="beams kept (and returned)"),
    "max_tokens": SAMPLING_FIELDS["max_tokens"],
    "ignore_eos": SAMPLING_FIELDS["ignore_eos"],
    "length_penalty": Field("float", 1.0, -10.0, 10.0,
                            doc="a hypothesis scores cumulative logprob / length ** this"),
}


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (no temperature: the search ranks the model's own logprobs)
    plus HF's `early_stopping` (False, True or "never"). Bad values raise RequestError."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        for name in BEAM_FIELDS:
            object.__setattr__(self, name, check_field(name, getattr(self, name), BEAM_FIELDS))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise RequestError("early_stopping", f"must be true, false or \"never\", got "
                                                 f"{self.early_stopping!r}")


class BeamSearch:
    """One prompt's search: `requests()` (the live beams' token ids) and `advance(outputs)`
    (their engine outputs, in that order) until `done`; then `output()`."""

    def __init__(self, prompt_ids: Sequence[int], params: BeamSearchParams, limits: Limits,
                 prompt: str | None = None):
        self.prompt_ids, self.prompt, self.p = list(prompt_ids), prompt, params
        check_request(self.prompt_ids, SamplingParams(max_tokens=params.max_tokens), limits)
        self.eos = frozenset(() if params.ignore_eos else limits.eos_ids)
        per_beam = max(2, 1 + len(self.eos))  # candidates kept per beam, as HF keeps them
        self.K = per_beam * params.beam_width
        if self.K > MAX_LOGPROBS:
            raise RequestError("beam_width", f"at most {MAX_LOGPROBS // per_beam} with this "
                                             f"model's {len(self.eos)} EOS ids")
        self.round_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.K,
                                           ignore_eos=True)
        self.running: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]  # (cumulative, tokens)
        self.finals: list[tuple[float, float, tuple[int, ...]]] = []  # (score, cumulative, tokens)
        self.done = False
        self.metrics = {"rounds": 0, "requests": 0, "tokens_computed": 0, "tokens_cached": 0}

    def requests(self) -> list[list[int]]:
        return [self.prompt_ids + list(toks) for _, toks in self.running]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        p, k = self.p, self.p.beam_width
        gen = len(self.running[0][1]) + 1  # every candidate's generated length
        cands = sorted(((cum + lp, toks + (tok,)) for (cum, toks), out in zip(self.running, outputs)
                        for tok, lp in out.logprobs[0]["top"]), key=lambda c: -c[0])[:self.K]
        last = gen >= p.max_tokens
        ended = [last or toks[-1] in self.eos for _, toks in cands]
        self.running = [c for c, e in zip(cands, ended) if not e][:k]
        new = [(cum / gen ** p.length_penalty, cum, toks)
               for (cum, toks), e in zip(cands[:k], ended) if e]
        self.finals = sorted(self.finals + new, key=lambda f: -f[0])[:k]
        full = len(self.finals) == k
        length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen
        best = self.running[0][0] / length ** p.length_penalty if self.running else None
        improvable = not full or (best is not None and best > self.finals[-1][0])
        self.done = last or not improvable or (full and p.early_stopping is True)
        m = self.metrics
        m["rounds"] += 1
        m["requests"] += len(outputs)
        for out in outputs:
            cached = out.usage["cached_tokens"]
            m["tokens_cached"] += cached
            m["tokens_computed"] += len(out.prompt_token_ids) - cached

    def output(self, tokenizer, request_id: str = "beam") -> RequestOutput:
        """The k hypotheses, best score first, as one RequestOutput (its fields: the best)."""
        beams = [CompletionOutput(i, tokenizer.decode(list(toks)), list(toks), cum, None,
                                  "stop" if toks[-1] in self.eos else "length")
                 for i, (_, cum, toks) in enumerate(self.finals)]
        b = beams[0]
        return RequestOutput(request_id, self.prompt, self.prompt_ids, b.text, b.token_ids,
                             b.finish_reason, metrics=dict(self.metrics),
                             cumulative_logprob=b.cumulative_logprob, completions=beams)


def rounds(searches: Sequence[BeamSearch]):
    """A generator driving `searches` in lock step: yields each round's requests [(token ids,
    SamplingParams)], is sent their outputs in that order."""
    while live := [s for s in searches if not s.done]:
        asks = [s.requests() for s in live]
        outs = yield [(ids, s.round_params) for s, a in zip(live, asks) for ids in a]
        i = 0
        for s, a in zip(live, asks):
            s.advance(outs[i:i + len(a)])
            i += len(a)


def run_searches(searches: Sequence[BeamSearch],
                 run_round: Callable[[list], Sequence[RequestOutput]]) -> None:
    """Run every round through `run_round` until each search is done."""
    gen = rounds(searches)
    try:
        asks = next(gen)
        while True:
            asks = gen.send(run_round(asks))
    except StopIteration:
        pass
