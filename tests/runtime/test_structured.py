"""Structured output: token masks fused into the step, matchers advanced by the engine.

Oracles: llguidance's own numpy mask application (for the jitted unpacking), sentencepiece's
decoding (for the vocabulary handed to llguidance), `re.fullmatch` / `json` / `jsonschema` (for
what the constrained model emits), and the same requests served alone or unconstrained.
"""

import functools
import json
import re

import numpy as np
import pytest

from jaxinfer import RequestError, SamplingParams
from jaxinfer.runtime.host.structured import StructuredOutputs, token_bytes

PROMPTS = ["To be, or not to be", "Hello", "Now is the winter of our discontent", "O Romeo",
           "All the world's a stage", "Cry havoc", "Et tu, Brute?", "Good night, sweet prince"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["king", "fool"]}}}}
CONSTRAINTS = [  # (structured_outputs, check(text))
    ({"regex": r"[a-z]{3,6} [0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3,6} [0-9]{2}", t)),
    ({"choice": ["Hamlet", "Macbeth", "Lear"]}, lambda t: t in ("Hamlet", "Macbeth", "Lear")),
    ({"grammar": 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,2}/'},
     lambda t: re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", t)),
    ({"json": SCHEMA}, lambda t: _valid_json(t, SCHEMA)),
]


def _valid_json(text, schema):
    import jsonschema

    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm  # 4 slots: the 8-request batches also queue


def test_mask_unpacking_equals_llguidance_numpy():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxinfer.runtime.device.sampling import allow_tokens

    rng = np.random.default_rng(0)
    S, V = 3, 70  # V not a multiple of 32: the last word is partial
    logits = rng.standard_normal((S, V)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (S, 3), dtype=np.int64).astype(np.int32)
    constrained = np.array([1, 0, 1], np.int32)
    got = np.asarray(allow_tokens(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(constrained)))
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    want[1] = logits[1]  # an unconstrained row is left alone
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got[0]).sum() > 10 and not np.isinf(got[1]).any()


def test_vocabulary_bytes_spell_what_sentencepiece_decodes(llm):
    tok = llm.tokenizer
    pieces = token_bytes(tok, llm.engine.cfg.vocab_size)
    assert len(pieces) == llm.engine.cfg.vocab_size
    for text in PROMPTS + ["naïve café — 1,234\nnext  line", "{\"a\": [1, 2]}"]:
        ids = tok.encode(text, add_special_tokens=False)
        spelled = b"".join(pieces[i] for i in ids).decode()
        assert spelled.removeprefix(" ") == tok.decode(ids), text  # decode drops the dummy " "
    for i in tok.special_ids:  # never spelled by text
        assert pieces[i].startswith(b"\xff")


@pytest.mark.parametrize("so, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
    ({"json": {"maximum": float("nan")}}, "structured_outputs.json"),
    ({"json": functools.reduce(lambda d, _: {"items": d}, range(5000), {})},
     "structured_outputs.json"),
    ({"json": {"type": "string", "pattern": "(" * 500}}, "structured_outputs.json"),
    ({"regex": "a" * (1 << 17)}, "structured_outputs.regex"),
    ({"regex": "a("}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"jsn": {}}, "structured_outputs.jsn"),
])
def test_bad_constraints_are_refused_at_the_door_naming_the_field(llm, so, field):
    with pytest.raises(RequestError) as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=4, structured_outputs=so))
    assert e.value.field == field
    assert not llm.engine.num_unfinished


def test_shortest_bytes_is_the_shortest_match_by_hand():
    from jaxinfer.runtime.host.shortest_output import shortest_bytes

    shortest = '{"name": "", "age": 0, "tags": []}'  # written by hand, valid, nothing shorter
    assert _valid_json(shortest, SCHEMA)
    nested = {"type": "object", "required": ["p"], "properties": {"p": {
        "anyOf": [{"type": "array", "minItems": 2, "items": {"enum": ["ab", 7]}},
                  {"type": "string", "minLength": 9}]}}}
    cases = [({"json": SCHEMA}, len(shortest)), ({"json": nested}, len('{"p": [7, 7]}')),
             ({"regex": r"[a-z]{3,6} [0-9]{2}"}, 6), ({"choice": ["Hamlet", "Lear"]}, 4),
             ({"json_object": True}, 2), ({"grammar": 'start: "abc"'}, 0)]  # Lark: no bound
    for so, want in cases:
        assert shortest_bytes(StructuredOutputs.from_json(so)) == want, so


def test_a_constraint_that_cannot_fit_in_max_tokens_is_refused(llm):
    """The shortest match of [a-z]{n} is n bytes; no token spells more than the vocabulary's
    longest piece (read off sentencepiece here), so fewer than ceil(n / longest) tokens cannot
    hold it: refused at the door naming max_tokens. One more char per token always fits."""
    sp = llm.engine.tokenizer.processor
    longest = max(len(sp.IdToPiece(i).replace("\u2581", " ").encode()) for i in range(sp.GetPieceSize())
                  if not (sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i) or sp.IsByte(i)))
    n = 2 * longest + 1
    so = {"regex": f"[a-z]{{{n}}}"}
    with pytest.raises(RequestError) as e:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, structured_outputs=so))
    assert e.value.field == "max_tokens" and "at least 3" in str(e.value)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=n + 1, temperature=0,
                                                 structured_outputs=so))[0]
    assert re.fullmatch(f"[a-z]{{{n}}}", out.text) and out.finish_reason == "stop"
    assert not llm.engine.num_unfinished


def test_ignore_eos_with_a_constraint_is_refused():
    with pytest.raises(RequestError) as e:
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    assert e.value.field == "ignore_eos"


def test_constrained_rows_match_and_the_others_are_untouched(llm, tiny_dir, llm_for):
    """8 rows in one batch: 4 constraints (greedy and sampled) next to unconstrained rows. Every
    constrained output matches; unconstrained rows give exactly their tokens alone; nothing
    compiles beyond the unconstrained programs; the synchronous engine gives the same tokens
    (with asynchronous scheduling a constrained row's step is applied before the next is planned)."""
    plain = [SamplingParams(max_tokens=12, temperature=t, seed=7 + i, ignore_eos=True)
             for i, t in enumerate((0.0, 1.0, 0.0, 1.0))]
    alone = [llm.generate([PROMPTS[4 + i]], sp)[0].token_ids for i, sp in enumerate(plain)]
    llm.engine.warmup()
    warm = llm.engine.compile_count, llm.engine._step.compiled()
    for temperature in (0.0, 1.0):
        sps = [SamplingParams(max_tokens=48, temperature=temperature, seed=i, structured_outputs=so)
               for i, (so, _) in enumerate(CONSTRAINTS)]
        outs = llm.generate(PROMPTS, sps + plain)
        for (so, check), o in zip(CONSTRAINTS, outs[:4]):
            assert o.finish_reason == "stop" and check(o.text), (so, o.text, o.finish_reason)
        assert [o.token_ids for o in outs[4:]] == alone
    assert (llm.engine.compile_count, llm.engine._step.compiled()) == warm

    sync = llm_for(tiny_dir, max_slots=4, page_size=8, max_model_len=256, async_scheduling=False)
    again = sync.generate(PROMPTS[:4], sps)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:4]]


def test_constrained_requests_under_speculative_decoding(tiny_dir, llm_for, llm):
    """Constrained rows take proposals, each verify row masked by the grammar's state after the
    proposals before it: greedy rows emit what plain decoding emits, proposals the grammar
    refuses are never emitted, sampled rows still match."""
    spec = llm_for(tiny_dir, max_slots=4, page_size=8, max_model_len=256,
                   speculative={"method": "ngram", "k": 3, "n": 1})
    sps = [SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=so)
           for so, _ in CONSTRAINTS]
    got = spec.generate(PROMPTS[:4], sps)
    want = llm.generate(PROMPTS[:4], sps)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    proposed = sum(o.metrics["spec_proposed"] for o in got)
    accepted = sum(o.metrics["spec_accepted"] for o in got)
    assert proposed > 0 and 0 < accepted < proposed, (proposed, accepted)
    sampled = spec.generate(PROMPTS[4:], [SamplingParams(
        max_tokens=48, temperature=1.0, seed=i, structured_outputs=so)
        for i, (so, _) in enumerate(CONSTRAINTS)])
    for (so, check), o in zip(CONSTRAINTS, sampled):
        assert o.finish_reason == "stop" and check(o.text), (so, o.text)
    assert sum(o.metrics["spec_accepted"] for o in sampled) > 0


def test_a_grammar_complete_before_max_tokens_stops_and_max_tokens_truncates(llm):
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"choice": ["yes", "no"]})
    o = llm.generate(["Hello"], sp)[0]
    assert o.text in ("yes", "no") and o.finish_reason == "stop"
    so = StructuredOutputs(regex="[a-z]{30}")
    need = llm.engine.grammars.min_tokens(so)  # the fewest the door lets through
    short = SamplingParams(max_tokens=need, temperature=0.0, structured_outputs=so)
    o = llm.generate(["Hello"], short)[0]
    assert o.finish_reason == "length" and len(o.token_ids) == need
    assert re.fullmatch("[a-z]+", o.text)


def test_structured_outputs_json_round_trip():
    so = StructuredOutputs.from_json({"json": json.dumps({"type": "object"})})
    assert so == StructuredOutputs(json={"type": "object"}) and so.kind == "json"
    assert hash(so) == hash(StructuredOutputs(json='{"type":"object"}'))



def test_a_grammar_failing_mid_generation_ends_that_request_only(llm, monkeypatch):
    """A matcher that rejects a token, or that cannot be built, fails its request with
    finish_reason "error" and the reason; the batch's other rows finish as usual."""
    eng = llm.engine
    real = eng.constraints.advance
    calls = []

    def breaks_on_third(rid, toks):
        calls.append(rid)
        return ("error", "structured output: broken") if len(calls) == 3 else real(rid, toks)

    monkeypatch.setattr(eng.constraints, "advance", breaks_on_third)
    so = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"regex": "[a-z]{20}"})
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    bad, ok = llm.generate(["Hello", "O Romeo"], [so, plain])
    assert (bad.finish_reason, bad.error) == ("error", "structured output: broken")
    assert len(bad.token_ids) == 3 and ok.finish_reason == "length" and len(ok.token_ids) == 6
    monkeypatch.undo()

    def cannot_build(so):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(eng.grammars, "_matcher", cannot_build)
    bad, ok = llm.generate(["Hello", "O Romeo"], [so, plain])
    assert bad.finish_reason == "error" and "out of memory" in bad.error and not bad.token_ids
    assert ok.finish_reason == "length" and not eng.num_unfinished
