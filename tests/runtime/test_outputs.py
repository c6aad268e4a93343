"""The output processor (runtime/host/outputs.py) on hand-worked cases, with a character
tokenizer (id i is the character "abcdefghijklmnopqrstuvwxyz "[i]) and hand-built logprob
rows; then LLM.stream's deltas against LLM.generate's result on the tiny model."""

import numpy as np
import pytest

from jaxinfer.runtime.host.outputs import OutputProcessor, RequestDelta
from jaxinfer.runtime.host.requests import SamplingParams

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
