"""Logits processors (runtime/host/processors.py, runtime/device/processors.py) against
independent oracles on the tiny random Llama: HF transformers' own processors through
`generate` (repetition penalty, bad words, min new tokens, sequence bias), and a greedy loop over
HF's logits with the OpenAI formula written out in numpy (presence / frequency penalties,
allowed_token_ids). Then composition: a mixed batch equals each request alone; n-gram speculation,
preemption with recompute, prefix caching and asynchronous scheduling change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import LLM, RequestError, SamplingParams

PROMPTS = ["The king is dead; long live the king. " * 3, "To be, or not to be",
           "Brevity is the soul of wit " * 4, "O Romeo"]
N = 24


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def _ids(llm, prompts):
    return [llm.tokenizer.encode(p) for p in prompts]


def _hf_generate(hf, ids, n=N, **kw):
    """HF greedy with its logits processors (kw: generate's own arguments)."""
    kw.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          **kw)
    return out[0, len(ids):].tolist()


def _numpy_greedy(hf, ids, process, n=N):
    """Greedy over HF's logits, each step's logits through `process(logits, output_so_far)`."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            out.append(int(np.argmax(process(logits, out))))
    return out


def _greedy(**kw):
    return SamplingParams(**{"max_tokens": N, "temperature": 0.0, "ignore_eos": True, **kw})


def test_repetition_penalty_equals_hf(tiny_llm, hf):
    ids = _ids(tiny_llm, PROMPTS)
    plain = [o.token_ids for o in tiny_llm.generate(ids, _greedy())]
    for pen in (1.3, 0.8):
        got = tiny_llm.generate(ids, _greedy(repetition_penalty=pen))
        for p, o, base in zip(ids, got, plain):
            assert o.token_ids == _hf_generate(hf, p, repetition_penalty=pen), (pen, p)
    # the penalty changed something (a random model repeats itself)
    assert [o.token_ids for o in tiny_llm.generate(ids, _greedy(repetition_penalty=1.3))] != plain


def test_presence_and_frequency_penalties_equal_the_openai_formula(tiny_llm, hf):
    """logit[t] -= frequency * count(t in output) + presence * (count > 0): output tokens only."""
    ids = _ids(tiny_llm, PROMPTS[:3])
    for pres, freq in ((1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)):
        def process(x, out):
            c = np.bincount(out, minlength=x.shape[0])[:x.shape[0]].astype(np.float64)
            return x - freq * c - pres * (c > 0)

        got = tiny_llm.generate(ids, _greedy(presence_penalty=pres, frequency_penalty=freq))
        for p, o in zip(ids, got):
            assert o.token_ids == _numpy_greedy(hf, p, process), (pres, freq, p)


def test_logit_bias_equals_hf_sequence_bias(tiny_llm, hf):
    ids = _ids(tiny_llm, PROMPTS[:2])
    plain = tiny_llm.generate(ids, _greedy())
    # push down the tokens greedy picks and push up two others
    picked = sorted({t for o in plain for t in o.token_ids[:6]})[:6]
    bias = {t: -4.0 for t in picked} | {901: 3.0, 1500: 2.5}
    got = tiny_llm.generate(ids, _greedy(logit_bias=bias))
    for p, o, base in zip(ids, got, plain):
        want = _hf_generate(hf, p, sequence_bias={(t,): b for t, b in bias.items()})
        assert o.token_ids == want and o.token_ids != base.token_ids, p


def test_bad_words_equal_hf_no_bad_words(tiny_llm, hf):
    """Each word banned as tokenized alone and after a space, multi-token words only when the
    tokens before their last one were just generated (HF's NoBadWordsLogitsProcessor)."""
    ids = _ids(tiny_llm, PROMPTS[:3])
    plain = tiny_llm.generate(ids, _greedy())
    # words made of what greedy writes: a one-token and a multi-token word from each output
    words = []
    for o in plain:
        words += [tiny_llm.tokenizer.decode(o.token_ids[2:3]).strip(),
                  tiny_llm.tokenizer.decode(o.token_ids[4:7]).strip()]
    words = [w for w in dict.fromkeys(words) if w]
    tok = tiny_llm.tokenizer
    banned = [list(t) for w in words for t in dict.fromkeys(
        (tuple(tok.encode(w, add_special_tokens=False)),
         tuple(tok.encode(" " + w, add_special_tokens=False))))]
    got = tiny_llm.generate(ids, _greedy(bad_words=words))
    changed = 0
    for p, o, base in zip(ids, got, plain):
        assert o.token_ids == _hf_generate(hf, p, bad_words_ids=banned), p
        changed += o.token_ids != base.token_ids
        for b in banned:  # no banned sequence anywhere in the output
            assert not any(o.token_ids[i:i + len(b)] == b for i in range(len(o.token_ids)))
    assert changed


def test_min_tokens_equals_hf_min_new_tokens(tiny_llm, hf):
    """A stop token greedy emits early is held back until min_tokens tokens are out, as HF's
    MinNewTokensLengthLogitsProcessor holds back its EOS ids."""
    ids = _ids(tiny_llm, PROMPTS[:3])
    plain = tiny_llm.generate(ids, _greedy())
    for p, base in zip(ids, plain):
        stop = base.token_ids[1]  # greedy's second token: it would stop at 2 tokens
        for m in (0, 5):
            o = tiny_llm.generate([p], SamplingParams(max_tokens=N, temperature=0.0,
                                                      stop_token_ids=[stop], min_tokens=m))[0]
            want = _hf_generate(hf, p, min_new_tokens=m, eos_token_id=[stop])
            if stop in want:
                want = want[:want.index(stop) + 1]
            assert o.token_ids == want, (p, m)
            assert len(o.token_ids) >= max(m, 2) and o.token_ids[-1] == stop or \
                o.finish_reason == "length"


def test_allowed_token_ids_restrict_to_the_set(tiny_llm, hf):
    ids = _ids(tiny_llm, PROMPTS[:2])
    allowed = list(range(100, 180)) + [7, 1999]

    def process(x, out):
        y = np.full_like(x, -np.inf)
        y[allowed] = x[allowed]
        return y

    got = tiny_llm.generate(ids, _greedy(allowed_token_ids=allowed))
    for p, o in zip(ids, got):
        assert set(o.token_ids) <= set(allowed)
        assert o.token_ids == _numpy_greedy(hf, p, process), p


MIXED = [dict(repetition_penalty=1.4), dict(), dict(frequency_penalty=0.9, presence_penalty=0.3,
         logit_bias={5: 2.0}), dict(), dict(bad_words=["king", "the"], min_tokens=3),
         dict(allowed_token_ids=list(range(40, 400)))]


def _mixed_params(seeded: bool):
    """One request per MIXED row; `seeded`: sampled (temperature 0.9, per-request seeds)."""
    t = dict(temperature=0.9, seed=11) if seeded else dict(temperature=0.0)
    return [SamplingParams(max_tokens=N, ignore_eos=True, **t, **kw) for kw in MIXED]


@pytest.mark.parametrize("seeded", [False, True])
def test_a_mixed_batch_equals_each_request_alone(tiny_llm, llm_for, tiny_dir, seeded):
    """Half the rows with processors, half without, all in one batch: each equal to its request
    run in an engine of one slot."""
    prompts = _ids(tiny_llm, (PROMPTS * 2)[:len(MIXED)])
    params = _mixed_params(seeded)
    together = tiny_llm.generate(prompts, params)
    alone = llm_for(tiny_dir, max_slots=1, page_size=8, max_model_len=1024)
    for p, sp, o in zip(prompts, params, together):
        assert o.token_ids == alone.generate([p], sp)[0].token_ids, (p, sp)


def test_speculation_preemption_prefix_cache_and_async_change_nothing(tiny_dir, tiny_llm,
                                                                      llm_for):
    """Greedy with processors: the shared engine's outputs equal those of an n-gram speculative
    engine (proposals verified under the counts of their own prefix), of a synchronous engine,
    and of an engine so short of pages that it preempts and recomputes (the slot's row rebuilt
    from the prompt and the output so far), with prefix caching hitting on repeated prompts."""
    prompts = _ids(tiny_llm, (PROMPTS * 2)[:len(MIXED)] + PROMPTS[:2])
    params = _mixed_params(False) + _mixed_params(False)[:2]
    want = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    spec = llm_for(tiny_dir, max_slots=4, page_size=8, max_model_len=256,
                   speculative={"method": "ngram", "k": 4, "n": 2})
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert spec.engine.stats()["spec_accepted"] > 0  # proposals were taken
    sync = llm_for(tiny_dir, async_scheduling=False, max_slots=4, page_size=8, max_model_len=256)
    assert [o.token_ids for o in sync.generate(prompts, params)] == want
    small = LLM(str(tiny_dir), max_slots=4, page_size=8, num_pages=14, max_model_len=128,
                prefill_chunk=16)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.engine.scheduler.num_preemptions > 0


def test_processed_logprobs_are_the_distribution_sampled_from(tiny_dir, tiny_llm, llm_for):
    """logprobs_mode processed_logprobs: a token biased out of reach has no mass; raw (the
    default) still reports the model's own."""
    p = _ids(tiny_llm, PROMPTS[:1])
    raw = tiny_llm.generate(p, _greedy(logprobs=3, max_tokens=4))[0]
    first = raw.token_ids[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3,
                        logit_bias={first: -100.0})
    biased_raw = tiny_llm.generate(p, sp)[0]
    assert biased_raw.token_ids[0] != first
    assert biased_raw.logprobs[0]["top"][0][0] == first  # the model's own favourite
    proc = llm_for(tiny_dir, logprobs_mode="processed_logprobs", **dict(
        max_slots=4, page_size=8, max_model_len=256)).generate(p, sp)[0]
    assert proc.token_ids == biased_raw.token_ids
    assert first not in [t for t, _ in proc.logprobs[0]["top"]]
    assert proc.logprobs[0]["top"][0][0] == proc.token_ids[0]


@pytest.mark.parametrize("kw, field", [
    (dict(bad_words=["x " * 40]), "bad_words[0]"),
    (dict(logit_bias={2000: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[5, 2000]), "allowed_token_ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(min_tokens=30, max_tokens=20), "min_tokens"),
])
def test_bad_processor_input_is_refused_naming_the_field(tiny_llm, kw, field):
    with pytest.raises(RequestError) as e:
        tiny_llm.generate(["hi"], SamplingParams(**{"max_tokens": 20, **kw}))
    assert e.value.field == field
    # and the engine keeps serving
    assert len(tiny_llm.generate(["hi"], _greedy(max_tokens=2))[0].token_ids) == 2


def test_verify_positions_see_their_own_proposals():
    """process_verify at position j equals the plain step's processors after the row's first j
    proposals were recorded one by one (counts and recent tokens), for random states, with
    rows of 0..K proposals and a row without processors."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.processors import apply, init_state, process_verify, record
    from jaxinfer.runtime.host.processors import Dims

    rng = np.random.default_rng(0)
    v, s, k, r = 50, 4, 3, 6
    dims = Dims(v, stops=2, bias=2, bad=4, history=3)
    st = init_state(r, dims.shapes())
    st = st._replace(
        counts=jnp.asarray(rng.integers(0, 3, (r, v)), jnp.int32),
        recent=jnp.asarray(rng.integers(0, 6, (r, 3)), jnp.int32),
        penalties=jnp.asarray(np.c_[rng.uniform(0.5, 2, r), rng.uniform(-1, 1, (r, 2))],
                              jnp.float32),
        allowed=jnp.full((r, dims.words), -1, jnp.int32),
        stop_ids=jnp.full((r, 2), v, jnp.int32), bias_ids=jnp.full((r, 2), v, jnp.int32),
        # bad words ending in 5..9 after the prefix (x, y): proposals of 0..5 complete them
        bad=jnp.asarray(np.where(np.arange(4)[None, :, None] < 2,
                                 np.array([-1, -1, 0, 5])[None, None], -1)
                        .repeat(r, 0).astype(np.int32)).at[:, 1].set(
                            jnp.array([-1, 1, 2, 7], jnp.int32)))
    slots = jnp.array([4, 0, -1, 2], jnp.int32)
    draft = jnp.asarray(rng.integers(0, 6, (s, k)), jnp.int32)
    num_draft = jnp.array([3, 1, 2, 0], jnp.int32)
    positions = jnp.array([7, 9, 4, 2], jnp.int32)
    logits = jnp.asarray(rng.normal(size=(s, k + 1, v)), jnp.float32)
    got = np.asarray(process_verify(logits, st, slots, positions, draft, num_draft))
    for i in range(s):
        for j in range(k + 1):
            if slots[i] < 0:
                np.testing.assert_array_equal(got[i, j], logits[i, j])
                continue
            if j > num_draft[i]:
                continue  # past the row's proposals: never read
            after = record(st, slots[i:i + 1], draft[i:i + 1], jnp.array([j], jnp.int32))
            row = jax.tree.map(lambda a: a[slots[i]][None], after)
            want = apply(logits[i, j][None], row, positions[i:i + 1] + j, jnp.array([True]))
            np.testing.assert_allclose(got[i, j], np.asarray(want)[0], rtol=1e-6, err_msg=(i, j))


def test_processors_under_a_structured_output_constraint(tiny_llm):
    """Processors, then the grammar's mask: with the choice greedy takes biased away (or left out
    of allowed_token_ids) the constrained output is the other choice, still a valid one."""
    choices = ["alpha", "omega"]
    base = dict(max_tokens=8, temperature=0.0, structured_outputs={"choice": choices})
    first = tiny_llm.generate(["Pick one:"], SamplingParams(**base))[0]
    assert first.text in choices
    other = choices[1 - choices.index(first.text)]
    for kw in (dict(logit_bias={first.token_ids[0]: -100.0}, repetition_penalty=1.2),
               dict(allowed_token_ids=[t for t in range(tiny_llm.engine.text_vocab)
                                       if t != first.token_ids[0]])):
        out = tiny_llm.generate(["Pick one:"], SamplingParams(**base, **kw))[0]
        assert out.text == other and out.finish_reason == "stop", kw


def test_real_gemma_processors_equal_hf(llm_for, gemma_hf):
    """The real Gemma 3 270M (262k vocabulary): repetition penalty, sequence bias, bad words and
    min new tokens together, greedy, through the engine vs HF generate with the same processors
    (HF applies them in the same order: bias, repetition, then the bans)."""
    llm = llm_for("gemma3-270m", max_slots=2, page_size=16, max_model_len=128)
    tok = llm.tokenizer
    prompts = ["The capital of France is", "Once upon a time"]
    words = ["France", "city", "little"]
    banned = [list(t) for w in words for t in dict.fromkeys(
        (tuple(tok.encode(w, add_special_tokens=False)),
         tuple(tok.encode(" " + w, add_special_tokens=False))))]
    bias = {tok.encode(" Paris", add_special_tokens=False)[0]: -3.0,
            tok.encode(" the", add_special_tokens=False)[0]: 1.5}
    eos = list(llm.engine.eos_ids)
    sp = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, logit_bias=bias,
                        bad_words=words, min_tokens=12)
    for text, o in zip(prompts, llm.generate(prompts, sp)):
        ids = tok.encode(text)
        want = _hf_generate(gemma_hf, ids, 16, repetition_penalty=1.3, bad_words_ids=banned,
                            sequence_bias={(t,): b for t, b in bias.items()},
                            min_new_tokens=12, eos_token_id=eos)
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert o.token_ids == want[:cut], text
