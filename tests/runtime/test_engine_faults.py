"""A request can fail; the engine cannot. A step that raises fails the requests that held slots
(finish reason "error", pages and slots freed) and the engine serves the rest with the same
tokens as an engine that never faulted. A vocabulary padded past the tokenizer's never samples
the padding rows."""

import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import LLM, SamplingParams
from jaxinfer.tools.make_test_model import make
from tests.faults import fail_once

ENGINE = dict(max_slots=2, page_size=8, max_model_len=128, prefill_chunk=32)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter",
           "Once more unto the breach", "All the world's a stage"]


@pytest.fixture(scope="module")
def ref(tiny_dir, llm_for):
    return {p: o.token_ids for p, o in zip(PROMPTS, llm_for(tiny_dir, **ENGINE).generate(
        PROMPTS, GREEDY))}


def _fail_once(engine, on_call: int, delete_cache: bool = False):
    """Make the engine's jitted step raise on its `on_call`-th call, once (tests/faults.py)."""
    return fail_once(engine, on_call, delete_cache).calls


def _run(engine, prompts, params):
    ids = [engine.add_request(engine.tokenizer.encode(p), params) for p in prompts]
    done = {}
    for _ in range(500):
        for d in engine.step():
            if d.finished:
                done[d.request_id] = d.output
        if len(done) == len(ids):
            break
    return [done[r] for r in ids]


@pytest.mark.parametrize("delete_cache", [False, True])
def test_failed_step_fails_only_running_requests_and_the_rest_are_exact(tiny_dir, ref,
                                                                        delete_cache):
    llm = LLM(str(tiny_dir), **ENGINE)
    eng = llm.engine
    _fail_once(eng, on_call=3, delete_cache=delete_cache)
    out = _run(eng, PROMPTS, GREEDY)
    failed = [o for o in out if o.finish_reason == "error"]
    # two slots: the two requests admitted first held them when the step failed
    assert [o.request_id for o in failed] == [o.request_id for o in out[:2]]
    assert all("injected device failure" in o.error for o in failed)
    for p, o in zip(PROMPTS[2:], out[2:]):  # queued ones ran afterwards, token for token
        assert o.finish_reason == "length" and o.token_ids == ref[p]
    assert eng.faults == 1 and eng.consecutive_faults == 0
    sch = eng.scheduler
    sch.check_invariants()
    assert sch.num_running == 0 and not sch.has_work
    assert sch.free_pages == sch.allocator.num_total  # free counts evictable cached pages
    # and the engine keeps serving: the failed prompts again give the reference tokens
    again = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in again] == [ref[p] for p in PROMPTS[:2]]


def test_fault_mid_plan_leaves_consistent_pages(tiny_dir, llm_for, ref, monkeypatch):
    """A failure inside the scheduler's plan building (pages already taken for the new rows)
    leaks no page or slot."""
    llm = llm_for(tiny_dir, **ENGINE)  # the plan builder is patched back by monkeypatch
    sch = llm.engine.scheduler
    real, calls = sch._build_plan, []

    def build(rows):
        calls.append(1)
        if len(calls) == 2:
            raise OverflowError("Python int too large to convert to C int")
        return real(rows)

    monkeypatch.setattr(sch, "_build_plan", build)
    out = _run(llm.engine, PROMPTS[:3], GREEDY)
    assert sum(o.finish_reason == "error" for o in out) >= 1
    assert all(o.token_ids == ref[p] for p, o in zip(PROMPTS, out) if o.finish_reason != "error")
    sch.check_invariants()
    assert sch.free_pages == sch.allocator.num_total  # free counts evictable cached pages


def test_llm_generate_reports_a_failed_request(tiny_dir, llm_for, ref):
    llm = llm_for(tiny_dir, **ENGINE)
    failing = fail_once(llm.engine, on_call=1)
    try:
        out = llm.generate(PROMPTS[:3], GREEDY)
    finally:  # the shared engine gets its own step back
        llm.engine._step = failing.real
    assert [o.finish_reason for o in out] == ["error", "error", "length"]
    assert out[0].error and out[0].token_ids == [] and out[2].token_ids == ref[PROMPTS[2]]


# ---- a vocabulary padded past the tokenizer's ---------------------------------------------------
@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    """Tokenizer of 2000 tokens, model of 2048 rows whose padding rows dominate the logits: an
    engine that samples them would emit ids no tokenizer can decode."""
    d = make(tmp_path_factory.mktemp("padded"), "tiny", seed=0, vocab_size=2000,
             model_vocab_size=2048)
    path = d / "model.safetensors"
    w = load_file(path)
    w["lm_head.weight"][2000:] = 10.0 * w["lm_head.weight"][:48]  # 10x the logits of ids 0..47
    save_file(w, path, metadata={"format": "pt"})
    return d


def test_padded_vocabulary_rows_are_never_sampled(padded_dir):
    llm = LLM(str(padded_dir), **ENGINE)
    assert llm.engine.cfg.vocab_size == 2048 and llm.tokenizer.vocab_size == 2000
    # the padding rows win the raw argmax: the mask is what keeps them out
    import jax.numpy as jnp

    from jaxinfer.runtime.device.model import compute_logits
    h = jnp.ones((1, llm.engine.cfg.hidden_size), jnp.float32)
    assert int(jnp.argmax(compute_logits(llm.engine.params, h, llm.engine.cfg)[0])) >= 2000
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=2.0, top_p=0.99, seed=4, logprobs=5,
                             ignore_eos=True)]
    out = llm.generate(PROMPTS[:3], params)
    for o in out:
        assert o.finish_reason == "length" and len(o.token_ids) == 12
        assert max(o.token_ids) < 2000 and isinstance(o.text, str)
    assert all(t < 2000 for e in out[2].logprobs for t, _ in e["top"])
