"""Speculative decoding through the LLM API on the random-init tiny Llama (+ a second, unrelated
tiny Llama sharing its tokenizer as a bad draft): greedy output identical to plain decoding for
32 prompts with both proposers, alone and under continuous batching with preemption; draft =
target accepts everything; stops / max_tokens with several tokens per step; no page leaks."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.proposers import NgramProposer
from jaxinfer.tools.make_test_model import make

BASE = [
    "To be, or not to be", "Hello", "The king is dead; long live the king. " * 6,
    "Now is the winter of our discontent", "A", "What light through yonder window breaks?",
    "Friends, Romans, countrymen, lend me your ears; " * 4, "Good night, sweet prince",
    "Double, double toil and trouble", "Is this a dagger which I see before me " * 3,
    "O Romeo", "All the world's a stage", "Out, damned spot!", "Brevity is the soul of wit " * 5,
    "Cry havoc", "Et tu, Brute?",
]
PROMPTS = BASE + [f"Repeat: {p} {p}" for p in BASE]  # 32; the second half invites n-gram hits
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
OPTS = dict(page_size=8, max_model_len=256)


@pytest.fixture(scope="module")
def dirs(tiny_dir, tmp_path_factory):
    """(target: the session's tiny Llama, draft: an unrelated one with the same tokenizer)"""
    return tiny_dir, make(tmp_path_factory.mktemp("spec") / "draft", "tiny", seed=1)


@pytest.fixture(scope="module")
def plain(dirs, llm_for):
    return llm_for(dirs[0], max_slots=4, **OPTS)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def _specs(dirs):
    # one k for every method: engines with equal slots share their compiled verify programs
    return {"ngram": {"method": "ngram", "k": 4, "n": 3},
            "draft": {"method": "draft", "model": str(dirs[1]), "k": 4},
            "self": {"method": "draft", "model": str(dirs[0]), "k": 4}}  # draft = target


@pytest.fixture(scope="module")
def spec(dirs, llm_for):
    """spec(method): the shared speculative engine for a method (4 slots, OPTS: the shapes
    of `plain`); every test leaves it empty (_no_leaks)."""
    return lambda method: llm_for(dirs[0], max_slots=4, speculative=_specs(dirs)[method], **OPTS)


def _no_leaks(llm):
    eng = llm.engine
    sch = eng.scheduler
    sch.check_invariants()
    assert sch.num_running == 0 and sch.num_waiting == 0
    assert sch.free_pages == sch.allocator.num_total
    if hasattr(eng.proposer, "allocator"):
        assert not eng.proposer.shadows
        assert eng.proposer.allocator.num_free == eng.proposer.allocator.num_total


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_batch1(spec, reference, method):
    """One request at a time (every step verifies one row), through the module's engine."""
    llm = spec(method)
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == reference
    proposed = sum(o.metrics["spec_proposed"] for o in outs)
    accepted = sum(o.metrics["spec_accepted"] for o in outs)
    assert proposed > 100 and accepted < proposed  # real proposals, some rejected
    if method == "ngram":
        assert accepted > 0  # (the unrelated random draft is rejected throughout: pure rollback)
    _no_leaks(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_continuous_batching_under_page_pressure(dirs, reference, method):
    # 4 slots, 31 usable pages of 8 tokens, 16-token chunks: the long prompts need up to 26
    # pages each, so sequences get preempted and recomputed while others verify proposals
    llm = LLM(str(dirs[0]), max_slots=4, num_pages=32, prefill_chunk=16,
              speculative=_specs(dirs)[method], page_size=8, max_model_len=256)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
    assert sum(o.metrics["spec_proposed"] for o in outs) > 100
    if method == "ngram":
        assert sum(o.metrics["spec_accepted"] for o in outs) > 50
    _no_leaks(llm)


def test_draft_equal_to_target_accepts_every_proposal(spec, reference):
    llm = spec("self")
    assert llm.engine.proposer.params is llm.engine.params  # the target's own weights, shared
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        assert o.metrics["acceptance_rate"] == 1.0
        assert o.metrics["spec_proposed"] == 18  # 23 tokens after the first: 4+4+4+4+2 proposals
        assert o.metrics["mean_accepted_len"] == pytest.approx(23 / 5)
    _no_leaks(llm)


def test_stops_and_max_tokens_with_several_tokens_per_step(plain, spec):
    spec = spec("self")
    prompt = PROMPTS[2]
    free = plain.generate([prompt], GREEDY)[0].token_ids
    # a stop token in the middle of a step's accepted run: output ends at it, nothing after
    stop_tok = free[7]
    first = free.index(stop_tok)
    sp = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_tok])
    a, b = plain.generate([prompt], sp)[0], spec.generate([prompt], sp)[0]
    assert b.token_ids == a.token_ids == free[:first + 1] and b.finish_reason == "stop"
    # max_tokens not a multiple of k + 1
    for m in (1, 2, 6, 7, 11):
        sp = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        o = spec.generate([prompt], sp)[0]
        assert o.token_ids == free[:m] and o.finish_reason == "length"
    # a stop string completed inside a step: same text and tokens as plain decoding
    text = plain.generate([prompt], GREEDY)[0].text
    stop = text[10:13]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    a, b = plain.generate([prompt], sp)[0], spec.generate([prompt], sp)[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")
    assert stop not in b.text
    # streaming carries the same tokens
    streamed = [t for d in spec.stream(prompt, GREEDY) for t in d.token_ids]
    assert streamed == free
    # logprobs requests decode without proposals and get the plain logprobs; a request scoring
    # its prompt holds proposals back while it prefills and gets the plain prompt logprobs
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    a, b = plain.generate([prompt], sp)[0], spec.generate([prompt, PROMPTS[9]],
                                                          [sp, GREEDY])[0]
    assert b.token_ids == a.token_ids
    assert [x["token_id"] for x in b.prompt_logprobs[1:]] == a.prompt_token_ids[1:]
    assert np.allclose([x["logprob"] for x in b.prompt_logprobs[1:]],
                       [x["logprob"] for x in a.prompt_logprobs[1:]], atol=1e-5)
    assert [[i for i, _ in x["top"]] for x in b.logprobs] == [[i for i, _ in x["top"]] for x in a.logprobs]
    assert np.allclose([[v for _, v in x["top"]] for x in b.logprobs],
                       [[v for _, v in x["top"]] for x in a.logprobs], atol=1e-4)
    _no_leaks(spec)


def test_seeded_sampling_reproducible_and_rejected_tokens_never_emitted(spec):
    llm = spec("draft")
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=5, ignore_eos=True)
    a = llm.generate(PROMPTS[:6], sp)
    b = llm.generate(PROMPTS[:6], sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 20 for o in a)
    assert sum(o.metrics["spec_proposed"] - o.metrics["spec_accepted"] for o in a) > 0
    _no_leaks(llm)


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
    ng = NgramProposer(k=3, n=3)
    assert ng.lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # suffix [2, 3] (no [9, 2, 3])
    assert ng.lookup([1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 3) == [8, 1, 2]  # latest occurrence
    assert ng.lookup([5, 6, 7, 5, 6], 4) == [7, 5, 6]
    assert ng.lookup([1, 2, 3], 3) == []  # no earlier match
    assert ng.lookup([4, 4], 2) == [4]


def test_config_errors(dirs, tmp_path):
    target = str(dirs[0])
    for bad, msg in [({"method": "medusa"}, "method"), ({"method": "ngram", "k": 0}, "k must"),
                     ({"method": "draft"}, "needs 'model'"), ({"method": "ngram", "x": 1}, "unknown"),
                     ("ngram", "dict")]:
        with pytest.raises(ValueError, match=msg):
            LLM(target, speculative=bad, **OPTS)
    other = make(tmp_path / "v1000", "tiny", seed=2, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab"):
        LLM(target, speculative={"method": "draft", "model": str(other), "k": 2}, **OPTS)


def test_no_new_compilations_after_warmup(dirs):
    """warmup() covers the verify step and the draft model's steps too: serving mixed greedy
    requests (prefills, chunks, verify steps, plain decode steps) compiles nothing more, with
    every page-table width (1, 4; the draft's shadows 1, 4, 5)."""
    llm = LLM(str(dirs[0]), max_slots=2, speculative={"method": "draft", "model": str(dirs[0]),
                                                      "k": 3},
              page_size=16, max_model_len=64, prefill_chunk=16, min_page_bucket=1,
              compile_mode="blocking")  # (background warm-up: tests/runtime/test_programs.py)
    assert llm.engine.proposer.page_buckets == (1, 4, 5)
    compiled = llm.engine.warmup()
    assert compiled == llm.engine.compile_count > 0
    assert llm.engine._verify.count > 0 and llm.engine.proposer.compile_count > 0
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 2000, size=rng.randint(1, 40)).tolist() for _ in range(12)]
    sps = [SamplingParams(max_tokens=int(rng.randint(1, 24)), temperature=0.0, ignore_eos=True)
           for _ in prompts]
    outs = llm.generate(prompts, sps)
    assert sum(o.metrics["spec_accepted"] for o in outs) > 0  # draft = target: verify steps ran
    assert llm.engine.compile_count == compiled


def test_served_acceptance_rate_is_the_engines(dirs):
    """`jaxinfer_spec_acceptance_rate` is accepted / verified proposals over every request the
    loop served (NaN before the first verify), equal to the per-request figures summed."""
    import math

    from jaxinfer.serve.engine_loop import EngineLoop
    from jaxinfer.serve.metrics import ServingMetrics, parse_text

    # its own engine (the loop's thread owns it), at the shapes of `spec`
    llm = LLM(str(dirs[0]), max_slots=4, speculative=_specs(dirs)["ngram"], **OPTS)
    loop = EngineLoop(llm.engine)
    metrics = ServingMetrics(loop)
    try:
        assert math.isnan(parse_text(metrics.render().decode())["jaxinfer_spec_acceptance_rate"])
        results = []
        for prompt in PROMPTS[16:20]:  # repeated text: the n-gram proposer has hits
            h = loop.submit(llm.tokenizer.encode(prompt), GREEDY)
            results += [u.output for step in h for u in step if u.finished]
        proposed = sum(r.metrics["spec_proposed"] for r in results)
        accepted = sum(r.metrics["spec_accepted"] for r in results)
        assert len(results) == 4 and proposed > 0
        m = parse_text(metrics.render().decode())
        assert m["jaxinfer_spec_proposed_tokens_total"] == proposed
        assert m["jaxinfer_spec_accepted_tokens_total"] == accepted
        assert m["jaxinfer_spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    finally:
        loop.shutdown(drain=False)
