"""The output processor (runtime/host/outputs.py) on hand-worked cases, with a character
tokenizer (id i is the character "abcdefghijklmnopqrstuvwxyz "[i]) and hand-built logprob
rows; the text controls (special tokens kept, spaces between them) against transformers'
decoding of the tiny model's tokenizer; then LLM.stream's deltas against LLM.generate's result
and truncate_prompt_tokens against the truncated prompt on the tiny model."""

import dataclasses

import numpy as np
import pytest

from jaxinfer.runtime.host.outputs import OutputProcessor, RequestDelta
from jaxinfer.runtime.host.requests import RequestError, SamplingParams

CHARS = "abcdefghijklmnopqrstuvwxyz "


class CharTokenizer:
    special_ids = frozenset()
    vocab_size = len(CHARS)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i] for i in ids)


def ids(text):
    return [CHARS.index(c) for c in text]


def row(token, lp, top):
    """A step's logprob columns for one sequence row: [token, its logprob, top-n logprobs,
    top-n ids] with n = len(top)."""
    return np.array([token, lp, *[v for _, v in top], *[i for i, _ in top]], np.float32)


def feed(proc, rid, text, finish_at=None, n=0, **kw):
    """Feed `text` one token a step; the deltas (the request finishes with "length" at token
    `finish_at` when given)."""
    out = []
    for k, t in enumerate(ids(text)):
        last = finish_at is not None and k + 1 == finish_at
        out.append(proc.tokens(rid, [t], last, "length" if last else None,
                               row(t, -0.5, [(t, -0.5)] * n), n, now=float(k), **kw))
        if out[-1].finished:
            break
    return out


def test_stop_string_is_held_back_then_cut():
    proc = OutputProcessor(CharTokenizer())
    proc.add("r", ids("x"), SamplingParams(max_tokens=20, stop=["end"]), now=0.0)
    ds = feed(proc, "r", "an enemy ends")
    # "an " streams; "e", "en" could begin "end" and are held; at "ene" only the last "e"
    # still could: "en" goes out, then "em"; the final "e", "en", "end" are held, then cut
    assert [d.text for d in ds] == ["a", "n", " ", "", "", "en", "em", "y", " ", "", "", ""]
    last = ds[-1]
    assert last.finished and last.finish_reason == "stop" and "r" not in proc
    assert last.output.text == "an enemy " == "".join(d.text for d in ds)
    assert last.output.token_ids == ids("an enemy end")  # the stop string's tokens stay


def test_several_tokens_in_one_step_stop_at_the_string():
    """Speculative decoding hands a step several tokens: those after a completed stop string
    are dropped from the delta and the output."""
    proc = OutputProcessor(CharTokenizer())
    proc.add("r", ids("x"), SamplingParams(max_tokens=20, stop=["cd"]), now=0.0)
    d = proc.tokens("r", ids("abcdef"), False, None, row(0, 0, []), 0, now=1.0)
    assert d.finished and d.finish_reason == "stop"
    assert d.token_ids == ids("abcd") and d.text == "ab" and d.output.text == "ab"


def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back():
    proc = OutputProcessor(CharTokenizer())
    proc.add("r", ids("x"), SamplingParams(max_tokens=20, stop=["end"],
                                           include_stop_str_in_output=True), now=0.0)
    ds = feed(proc, "r", "an enemy ends")
    assert [d.text for d in ds] == list("an enemy end")  # every char as it comes
    assert ds[-1].finish_reason == "stop" and ds[-1].output.text == "an enemy end"
    # several tokens in one step: cut right after the stop string
    proc.add("s", ids("x"), SamplingParams(max_tokens=20, stop=["zz", "cd"],
                                           include_stop_str_in_output=True), now=0.0)
    d = proc.tokens("s", ids("abcdef"), False, None, row(0, 0, []), 0, now=1.0)
    assert (d.finish_reason, d.text, d.token_ids, d.output.text) == ("stop", "abcd", ids("abcd"),
                                                                     "abcd")


@pytest.mark.parametrize("min_tokens,include,texts,out", [
    # "ab" completes at token 2 < 3: not a stop, it streams; the next "ab" ends at token 5
    (3, False, ["", "ab", "x", "", ""], "abx"),
    (3, True, ["a", "b", "x", "a", "b"], "abxab"),
    (2, False, ["", ""], ""),  # ends at token 2 = min_tokens: a stop
    (0, False, ["", ""], ""),
])
def test_a_stop_string_cannot_end_the_output_before_min_tokens(min_tokens, include, texts, out):
    proc = OutputProcessor(CharTokenizer())
    sp = SamplingParams(max_tokens=20, stop=["ab"], min_tokens=min_tokens,
                        include_stop_str_in_output=include)
    proc.add("r", ids("x"), sp, now=0.0)
    ds = feed(proc, "r", "abxabq")
    assert [d.text for d in ds] == texts
    assert ds[-1].finish_reason == "stop" and ds[-1].output.text == out
    # the same tokens in one step (speculative decoding): the same cut
    proc.add("s", ids("x"), sp, now=0.0)
    d = proc.tokens("s", ids("abxabq"), False, None, row(0, 0, []), 0, now=1.0)
    assert d.output.text == out and len(d.token_ids) == len(texts)


@pytest.fixture(scope="module")
def sp_pair(tiny_dir):
    """The tiny model's sentencepiece tokenizer (ours) and transformers' (the oracle)."""
    transformers = pytest.importorskip("transformers")
    from jaxinfer.runtime.host.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir), transformers.LlamaTokenizer.from_pretrained(str(tiny_dir))


def _hf_text(hf, ids, skip, spaces):
    """HF's decode; with special tokens kept and spaces between them, the rule of HF's Python
    tokenizers (vLLM's): each special token and each run between them apart, joined by " "."""
    if skip or not spaces:
        return hf.decode(ids, skip_special_tokens=skip)
    parts, run = [], []
    for i in ids:
        if i in hf.all_special_ids:
            parts += [hf.decode(run)] if run else []
            parts.append(hf.convert_ids_to_tokens(i))
            run = []
        else:
            run.append(i)
    return " ".join(parts + ([hf.decode(run)] if run else []))


@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True), (False, False)])
def test_special_tokens_in_the_text_as_hf_decodes_them(sp_pair, skip, spaces):
    tok, hf = sp_pair
    bos, eos = hf.bos_token_id, hf.eos_token_id
    prompt = tok.encode("Hello world")
    gen = (tok.encode("the king", add_special_tokens=False) + [eos, bos]
           + tok.encode(" is dead", add_special_tokens=False) + [eos, eos])
    proc = OutputProcessor(tok)
    proc.add("r", prompt, SamplingParams(max_tokens=len(gen), skip_special_tokens=skip,
                                         spaces_between_special_tokens=spaces), now=0.0)
    ds = [proc.tokens("r", [t], k + 1 == len(gen), "length" if k + 1 == len(gen) else None,
                      row(t, 0, []), 0, now=float(k)) for k, t in enumerate(gen)]
    want = _hf_text(hf, prompt + gen, skip, spaces)[len(_hf_text(hf, prompt, skip, spaces)):]
    assert ds[-1].output.text == want == "".join(d.text for d in ds)
    assert ("</s>" in want) == (not skip) and ("</s> <s>" in want) == (not skip and spaces)


def test_truncate_prompt_tokens_runs_the_last_k(tiny_llm):
    ids = tiny_llm.tokenizer.encode("To be, or not to be, that is the question " * 40)
    assert len(ids) > tiny_llm.engine.limits.max_model_len  # too long unless truncated
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = tiny_llm.generate([ids], dataclasses.replace(sp, truncate_prompt_tokens=20))[0]
    want = tiny_llm.generate([ids[-20:]], sp)[0]
    assert got.prompt_token_ids == ids[-20:] and got.usage["prompt_tokens"] == 20
    assert got.token_ids == want.token_ids and got.text == want.text
    short = tiny_llm.generate([ids[:5]], dataclasses.replace(sp, truncate_prompt_tokens=20))[0]
    assert short.prompt_token_ids == ids[:5]  # shorter than k: all of it
    with pytest.raises(RequestError) as e:
        tiny_llm.generate([ids], sp)
    assert e.value.field == "prompt"


def test_logprob_entries_ride_with_their_tokens_and_prompt_logprobs_come_once():
    proc = OutputProcessor(CharTokenizer())
    sp = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=2)
    proc.add("r", ids("abc"), sp, now=0.0)

    class Plan:  # one prefill step scoring prompt tokens 1 and 2 (positions 0 and 1 predict)
        request_ids = ["r"]
        num_logprobs = 2
        cu_q_lens = np.array([0, 3])
        positions = np.array([0, 1, 2])
        prompt_targets = np.array([1, 2, -1])

    rows = np.array([[-1.0, -0.2, -1.5, 1, 4], [-2.0, -0.3, -2.0, 7, 2], [9, 9, 9, 9, 9]])
    proc.record_prompt_logprobs(Plan, rows)
    d1 = proc.tokens("r", [5], False, None, row(5, -0.25, [(5, -0.25), (6, -2.0)]), 2, now=1.0)
    want_prompt = [None, {"token_id": 1, "logprob": -1.0, "top": [(1, -0.2), (4, -1.5)]},
                   {"token_id": 2, "logprob": -2.0, "top": [(7, -0.3), (2, -2.0)]}]
    assert d1.prompt_logprobs == want_prompt
    assert d1.logprobs == [{"token_id": 5, "logprob": -0.25, "top": [(5, -0.25)]}]  # top k=1
    d2 = proc.tokens("r", [6], False, None, row(6, -1.0, [(6, -1.0), (5, -1.1)]), 2, now=2.0)
    assert d2.prompt_logprobs is None  # once
    assert d2.logprobs == [{"token_id": 6, "logprob": -1.0, "top": [(6, -1.0)]}]
    d3 = proc.tokens("r", [7], True, "length", row(7, -3.0, [(0, -0.1), (7, -3.0)]), 2, now=3.0)
    out = d3.output
    assert out.finish_reason == "length" and out.text == "fgh" and out.token_ids == [5, 6, 7]
    assert out.logprobs == d1.logprobs + d2.logprobs + d3.logprobs
    assert out.prompt_logprobs == want_prompt
    assert out.metrics["ttft_s"] == 1.0 and out.metrics["itl_s"] == [1.0, 1.0]


def test_no_logprobs_unless_asked_and_abort_ends_with_an_output():
    proc = OutputProcessor(CharTokenizer())
    proc.add("r", ids("ab"), SamplingParams(max_tokens=9, stop=["zz"]), now=0.0, lora="sql",
             prompt="ab")
    d = proc.tokens("r", ids("z"), False, None, row(25, -0.1, [(25, -0.1)]), 1, now=1.0)
    assert d.logprobs == [] and d.prompt_logprobs is None and d.text == ""  # "z" held back
    assert proc.users_of("sql") == 1 and proc.users_of("other") == 0
    end = proc.finish("r", "abort", now=2.0)
    assert isinstance(end, RequestDelta) and end.finished and end.text == ""
    out = end.output
    assert (out.finish_reason, out.text, out.prompt, out.lora_name) == ("abort", "z", "ab", "sql")
    assert out.logprobs is None and out.usage == {"prompt_tokens": 2, "completion_tokens": 1,
                                                  "cached_tokens": 0}
    assert "r" not in proc and proc.users_of("sql") == 0 and proc.finish("r", "abort", 3.0) is None
    with pytest.raises(ValueError, match="duplicate"):
        proc.add("s", [1], SamplingParams(), now=0.0)
        proc.add("s", [1], SamplingParams(), now=0.0)


def test_stream_yields_logprobs_that_add_up_to_generate(tiny_llm):
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=1,
                        ignore_eos=True)
    want = tiny_llm.generate(["Once upon a time"], sp)[0]
    deltas = list(tiny_llm.stream("Once upon a time", sp))
    assert deltas[-1].finished and deltas[-1].output.token_ids == want.token_ids
    assert [e for d in deltas for e in d.logprobs] == want.logprobs
    assert len(want.logprobs) == 8 and all(len(e["top"]) == 3 for e in want.logprobs)
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    firsts = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert firsts == [want.prompt_logprobs] and want.prompt_logprobs[0] is None
    assert not tiny_llm.engine.num_unfinished
