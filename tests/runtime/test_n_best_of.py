"""n and best_of: `LLM.generate` returns a prompt's completions in vLLM's shape (`outputs`),
seeded sample i as the request alone with seed + i, best_of ranked by cumulative logprob (HF
transformers' teacher-forced logprobs are the oracle), the samples sharing the prompt's full KV
pages; the serving loop and the HTTP API (`best_of`) do the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import SamplingParams
from jaxinfer.runtime.host.errors import RequestError
from tests.engines import TINY
from tests.http_helpers import http_server, post_json

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(hf, prompt, toks) -> list[float]:
    """HF's log-probability of each of `toks` after `prompt`, teacher-forced."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + toks])).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(toks)]


def alone(llm, seed, **kw):
    return llm.generate(PROMPT, SamplingParams(seed=seed, **kw))[0]


def test_n_samples_are_the_seeded_requests_alone(tiny_llm):
    kw = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    out = tiny_llm.generate([PROMPT], SamplingParams(n=3, seed=7, **kw))
    assert len(out) == 1
    out = out[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    want = [alone(tiny_llm, 7 + i, **kw).token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == want
    assert len({tuple(w) for w in want}) == 3  # the samples differ
    assert out.token_ids == want[0] and out.text == out.outputs[0].text
    assert out.usage["completion_tokens"] == 30
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)
    single = tiny_llm.generate(PROMPT, SamplingParams(seed=7, **kw))[0]  # n=1: as before
    assert single.completions is None and [c.token_ids for c in single.outputs] == [want[0]]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_best_of_returns_the_n_highest_cumulative_logprobs(tiny_llm, hf, logprobs):
    kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    out = tiny_llm.generate(PROMPT, SamplingParams(n=2, best_of=5, seed=3, logprobs=logprobs,
                                                   **kw))[0]
    pids = out.prompt_token_ids
    samples = [alone(tiny_llm, 3 + i, **kw).token_ids for i in range(5)]
    cum = [sum(hf_logprobs(hf, pids, s)) for s in samples]
    best = sorted(range(5), key=lambda i: -cum[i])[:2]
    assert [c.token_ids for c in out.outputs] == [samples[i] for i in best]
    assert [c.index for c in out.outputs] == [0, 1] and out.token_ids == samples[best[0]]
    for c, i in zip(out.outputs, best):
        assert c.cumulative_logprob == pytest.approx(cum[i], abs=1e-4)
        if logprobs is None:  # computed for the ranking, not returned
            assert c.logprobs is None and out.logprobs is None
        else:
            assert [len(e["top"]) for e in c.logprobs] == [1] * 8


def test_n8_samples_share_the_prompt_pages(tiny_llm, hf):
    """8 samples of a 100-token prompt (pages of 8): the first computes its 12 full pages, the
    7 siblings take them from the prefix cache (96 tokens each), and what they read there is
    right: every sampled token's logprob is HF's, teacher-forced."""
    prompt = np.random.RandomState(52).randint(3, 2000, size=100).tolist()
    before = tiny_llm.engine.scheduler.prefix_cache_stats()
    out = tiny_llm.generate([prompt], SamplingParams(n=8, max_tokens=4, temperature=1.0,
                                                     seed=1, logprobs=0, ignore_eos=True))[0]
    after = tiny_llm.engine.scheduler.prefix_cache_stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == 8 * 100
    assert after["cached_tokens"] - before["cached_tokens"] == 7 * 96
    for c in out.outputs:
        got = [e["logprob"] for e in c.logprobs]
        assert got == pytest.approx(hf_logprobs(hf, prompt, c.token_ids), abs=1e-4)


def test_stream_refuses_several_completions(tiny_llm):
    for sp in (SamplingParams(n=2), SamplingParams(best_of=2)):
        with pytest.raises(RequestError) as e:
            next(tiny_llm.stream(PROMPT, sp))
        assert e.value.field == "n"


# ---- the serving loop and HTTP -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    with http_server(llm_for(tiny_dir, tag="server", **TINY), max_queue=64, model_name="m") as s:
        yield s


def post(server, body):
    return post_json(server, "/v1/completions", {"model": "m", **body})


def test_loop_submit_seeds_each_sample(server, tiny_llm):
    """One SamplingParams for n samples through the serving loop (gRPC's path): sample i is the
    request alone with seed + i."""
    kw = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    ids = tiny_llm.tokenizer.encode(PROMPT)
    got = {}
    for deltas in server.loop.submit(ids, SamplingParams(seed=5, **kw), n=3):
        got.update({d.index: d.output.token_ids for d in deltas if d.finished})
    assert [got[i] for i in range(3)] == [alone(tiny_llm, 5 + i, **kw).token_ids for i in range(3)]


def test_http_best_of(server, tiny_llm):
    kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    status, out = post(server, {"prompt": PROMPT, "n": 2, "best_of": 4, "seed": 11, **kw})
    assert status == 200, out
    want = tiny_llm.generate(PROMPT, SamplingParams(n=2, best_of=4, seed=11, **kw))[0]
    assert [c["text"] for c in out["choices"]] == [c.text for c in want.outputs]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])
    for body in ({"n": 3, "best_of": 2}, {"best_of": 9}, {"n": 1, "best_of": 2, "stream": True}):
        status, err = post(server, {"prompt": PROMPT, "max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == "best_of", err
