"""Beam search (runtime/beam_search.py) against HF transformers' `generate(num_beams=k,
do_sample=False)` on a random-init Llama whose EOS the model actually emits: the same hypotheses
in the same order, `sequences_scores` within 1e-4, through `LLM.beam_search` and the HTTP API."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from jaxinfer.runtime.beam_search import BeamSearchParams
from jaxinfer.runtime.host.errors import RequestError
from tests.http_helpers import http_server, post_json

ENGINE = dict(max_slots=8, page_size=8, max_model_len=128)
EOS = 2  # the tiny tokenizer's EOS, and the HF config's
PROMPTS = [[1, 17, 300, 45, 900, 12, 33, 8, 77, 500, 61],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def beam_model(tiny_dir, tmp_path_factory):
    """A random-init HF Llama (the tiny Llama's tokenizer) with sharpened logits (no near-ties
    between candidates) whose EOS row is 3.5 x the mean row of its greedy tokens: EOS ends some
    hypotheses after 2 to 9 tokens, and some searches before max_tokens."""
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("beam_llama")
    hf = make_hf_model("llama", d, seed=1, hidden=64, layers=2, vocab=2000)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
        toks = []
        for p in PROMPTS:
            g = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            toks += g[0, len(p):].tolist()
        hf.lm_head.weight[EOS] = 3.5 * hf.lm_head.weight[toks].mean(0)
    hf.save_pretrained(d, safe_serialization=True)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, d / name)
    return d, hf


def hf_hypotheses(hf, prompt, k, lp, es, ignore_eos=False):
    """HF's k hypotheses of `prompt`: [(generated tokens, sequences_score)], best first."""
    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k,
                        do_sample=False, length_penalty=lp, early_stopping=es,
                        max_new_tokens=MAX_NEW, output_scores=True, return_dict_in_generate=True,
                        eos_token_id=None if ignore_eos else EOS, pad_token_id=0)
    out = []
    for i in range(k):
        n = int((r.beam_indices[i] != -1).sum())  # its generated length
        out.append((r.sequences[i, len(prompt):len(prompt) + n].tolist(),
                    float(r.sequences_scores[i])))
    return out


@pytest.mark.parametrize("k, lp, es, ignore_eos", [
    (4, 1.0, False, False), (4, 0.5, True, False), (3, 2.0, "never", False),
    (4, 1.0, False, True)])
def test_beam_search_equals_hf(beam_model, llm_for, k, lp, es, ignore_eos):
    d, hf = beam_model
    llm = llm_for(d, **ENGINE)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(
        beam_width=k, max_tokens=MAX_NEW, length_penalty=lp, early_stopping=es,
        ignore_eos=ignore_eos))
    ended = []
    for prompt, out in zip(PROMPTS, outs):
        want = hf_hypotheses(hf, prompt, k, lp, es, ignore_eos)
        assert [c.token_ids for c in out.outputs] == [w[0] for w in want]
        for c, (toks, score) in zip(out.outputs, want):
            assert c.cumulative_logprob / len(toks) ** lp == pytest.approx(score, abs=1e-4)
            assert c.finish_reason == ("stop" if toks[-1] == EOS and not ignore_eos else "length")
            assert c.text == llm.tokenizer.decode(toks)
        assert [c.index for c in out.outputs] == list(range(k))
        assert out.token_ids == out.outputs[0].token_ids and out.prompt_token_ids == prompt
        ended += [toks[-1] == EOS for toks, _ in want]
        # the beams' full pages come from the prefix cache: after round 1 each beam request
        # computes at most its last page (page_size tokens)
        m = out.metrics
        assert m["tokens_cached"] > 0
        assert m["tokens_computed"] <= len(prompt) + (m["requests"] - 1) * ENGINE["page_size"]
    if ignore_eos:
        assert not any(ended)
    elif es in (False, True):  # the oracle did exercise EOS-ended hypotheses, and early ends
        assert any(ended) and max(len(c.token_ids) for c in outs[1].outputs) < MAX_NEW


def test_beam_search_params_refused_naming_the_field(beam_model, llm_for):
    for kw, field in [(dict(beam_width=11), "beam_width"), (dict(beam_width=0), "beam_width"),
                      (dict(early_stopping="sometimes"), "early_stopping"),
                      (dict(early_stopping=1), "early_stopping"),
                      (dict(length_penalty=math.nan), "length_penalty"),
                      (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(RequestError) as e:
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
        assert e.value.field == field
    llm = llm_for(beam_model[0], **ENGINE)
    with pytest.raises(RequestError) as e:  # prompt + max_tokens past max_model_len
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=120))
    assert e.value.field == "max_tokens"


@pytest.fixture(scope="module")
def server(beam_model, llm_for):
    with http_server(llm_for(beam_model[0], tag="server", **ENGINE), max_queue=64, model_name="m") as s:
        yield s


def post(server, body):
    return post_json(server, "/v1/completions", {"model": "m", **body})


def test_http_use_beam_search_equals_hf(beam_model, server):
    d, hf = beam_model
    status, out = post(server, {"prompt": PROMPTS, "use_beam_search": True, "n": 4,
                                "length_penalty": 0.5, "max_tokens": MAX_NEW,
                                "temperature": 0})
    assert status == 200, out
    from jaxinfer.runtime.host.tokenizer import load_tokenizer

    tok = load_tokenizer(d)
    want = [w for p in PROMPTS for w in hf_hypotheses(hf, p, 4, 0.5, False)]
    assert [c["index"] for c in out["choices"]] == list(range(8))
    assert [c["text"] for c in out["choices"]] == [tok.decode(w[0]) for w in want]
    assert [c["finish_reason"] for c in out["choices"]] == [
        "stop" if w[0][-1] == EOS else "length" for w in want]
    assert out["usage"]["completion_tokens"] == sum(len(w[0]) for w in want)


@pytest.mark.parametrize("body, field", [
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 2, "top_k": 5}, "top_k"),
    ({"use_beam_search": True, "n": 2, "best_of": 3}, "best_of"),
    ({"use_beam_search": True, "n": 2, "length_penalty": "long"}, "length_penalty"),
    ({"length_penalty": 2.0}, "length_penalty"),
])
def test_http_beam_search_bad_fields_are_400(server, body, field):
    status, out = post(server, {"prompt": PROMPTS[0], "max_tokens": 4, **body})
    assert status == 400 and out["error"]["param"] == field, out
    status, _ = post(server, {"prompt": PROMPTS[0], "max_tokens": 2})  # still serving
    assert status == 200
