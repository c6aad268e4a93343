"""Weights in place (runtime/weights.py): update_weights against a freshly built LLM, no
recompile, atomic failures, the drain / abort policies, sleep / wake, and scoring (LLM.score,
runtime.device.scoring.sequence_logprobs, the rollout's own logprobs) held to each other."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.device.scoring import sequence_logprobs
from jaxinfer.runtime.host.errors import EngineAsleep
from jaxinfer.runtime.weights import WeightError
from tests.engines import TINY

PROMPTS = ["hello there", "once upon a time", "the king said", "to be or not"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


class Compiles:
    """XLA compilations and traces in this process while inside the block."""

    def __enter__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def _on(self, name, secs, **_):
        if name in ("/jax/core/compile/backend_compile_duration",
                    "/jax/core/compile/jaxpr_trace_duration"):
            self.n += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    """An engine of its own (its weights change): the tiny Llama, TINY options."""
    return LLM(str(tiny_dir), **TINY)


@pytest.fixture(scope="module")
def trained(llm):
    """(params after 3 optax steps on the engine's own weights, their first version's outputs)."""
    import optax

    base = llm.get_weights()
    before = llm.generate(PROMPTS, GREEDY)
    cfg = llm.model.cfg
    tokens = jnp.asarray([llm.tokenizer.encode(p)[:4] + [5, 6, 7, 8] for p in PROMPTS], jnp.int32)
    opt = optax.adam(0.05)

    def loss(p):
        return -sequence_logprobs(p, cfg, tokens).mean()

    params, state = base, opt.init(base)
    for _ in range(3):
        g = jax.grad(loss)(params)
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params, before


def _tokens(outs):
    return [o.token_ids for o in outs]


def _lps(outs):
    return np.array([[e["logprob"] for e in o.logprobs] for o in outs])


def _fresh(tmp_path, llm, params, **options):
    from jaxinfer.checkpoints.orbax_io import save_converted

    d = save_converted(tmp_path / "new", llm.model.cfg, params, source="test",
                       tokenizer_dir=Path(llm.model.source))
    return d, LLM(str(d), **TINY, **options)


def test_update_equals_a_fresh_llm_and_compiles_nothing(llm, trained, tmp_path):
    params, before = trained
    llm.update_weights(llm.get_weights())  # the first update: its own small programs
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _tokens(before)
    with Compiles() as c:
        v = llm.update_weights(params)
        after = llm.generate(PROMPTS, GREEDY)
    assert c.n == 0, f"{c.n} compilations / traces after the first update"
    assert after[0].weight_version == v == llm.weight_version
    assert _tokens(after) != _tokens(before), "3 optimizer steps changed nothing"
    _, fresh = _fresh(tmp_path, llm, params)
    ref = fresh.generate(PROMPTS, GREEDY)
    assert _tokens(after) == _tokens(ref)
    np.testing.assert_allclose(_lps(after), _lps(ref), atol=1e-6, rtol=0)
    # the same weights from a directory (a trainer's: no tokenizer files), as a path
    from jaxinfer.checkpoints.orbax_io import save_converted

    bare = save_converted(tmp_path / "bare", llm.model.cfg, params, source="trainer")
    llm.update_weights(llm.get_weights())  # (back to a state to leave)
    llm.update_weights(str(bare), version="from-dir")
    again = llm.generate(PROMPTS, GREEDY)
    assert _tokens(again) == _tokens(ref) and again[0].weight_version == "from-dir"
    np.testing.assert_allclose(_lps(again), _lps(ref), atol=1e-6, rtol=0)


def test_get_weights_round_trips_bit_for_bit(llm):
    w = llm.get_weights()
    llm.update_weights(w)
    ptr = lambda a: a.addressable_data(0).unsafe_buffer_pointer()  # noqa: E731
    assert ptr(llm.engine.params.embed) == ptr(w.embed)  # on the engine's device: no copy
    w2 = llm.get_weights()
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(w2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert w.layers[0].wq.shape == (llm.model.cfg.hidden_size, llm.model.cfg.num_heads,
                                    llm.model.cfg.head_dim)


@pytest.mark.parametrize("break_it, named", [
    (lambda w: w.replace(layers=(w.layers[0].replace(wq=None),) + w.layers[1:]), "layers.0.wq"),
    (lambda w: w.replace(final_norm=jnp.ones(7)), "final_norm: shape (7,)"),
    (lambda w: w.replace(embed=w.embed.at[3, 1].set(jnp.nan)), "embed: holds NaN"),
    (lambda w: "/nonexistent/checkpoint", "nonexistent"),
    (lambda w: {"embed": 1}, "Params tree"),
])
def test_bad_weights_leave_the_old_version_serving(llm, break_it, named):
    before = llm.generate(PROMPTS, GREEDY)
    version = llm.weight_version
    with pytest.raises((WeightError, ValueError, FileNotFoundError)) as e:
        llm.update_weights(break_it(llm.get_weights()))
    assert named in str(e.value)
    after = llm.generate(PROMPTS, GREEDY)
    assert llm.weight_version == version and after[0].weight_version == version
    assert _tokens(after) == _tokens(before) and np.array_equal(_lps(after), _lps(before))


def test_a_fault_mid_update_leaves_the_old_version(llm, trained, monkeypatch):
    import jaxinfer.runtime.weights as weights

    before = llm.generate(PROMPTS, GREEDY)

    def boom(*a, **k):
        raise MemoryError("injected: out of device memory while placing the new weights")

    monkeypatch.setattr(weights, "engine_form", boom)
    with pytest.raises(MemoryError):
        llm.update_weights(trained[0])
    monkeypatch.undo()
    after = llm.generate(PROMPTS, GREEDY)
    assert _tokens(after) == _tokens(before) and np.array_equal(_lps(after), _lps(before))


def _run(engine, rids) -> dict:
    done = {}
    while len(done) < len(rids):
        for d in engine.step():
            if d.finished and d.request_id in rids:
                done[d.request_id] = d.output
    return done


def test_drain_finishes_old_requests_on_old_weights(llm, trained):
    params, _ = trained
    eng, long = llm.engine, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPTS[0])
    old_w = llm.get_weights()
    ref_old = llm.generate([ids], long)[0]
    v_old = llm.weight_version
    a = eng.add_request(ids, long)
    for _ in range(3):
        eng.step()
    v = llm.update_weights(params)  # drains a
    assert eng.weights_pending and llm.weight_version == v_old
    b = eng.add_request(ids, long)  # waits for the new weights
    out = _run(eng, {a, b})
    assert not eng.weights_pending and llm.weight_version == v
    assert out[a].weight_version == v_old and out[a].token_ids == ref_old.token_ids
    ref_new = llm.generate([ids], long)[0]
    assert out[b].weight_version == v and out[b].token_ids == ref_new.token_ids
    llm.update_weights(old_w)


def test_abort_policy_ends_unfinished_requests(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[1])
    a = eng.add_request(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.step()
    v = llm.update_weights(llm.get_weights(), policy="abort")
    assert llm.weight_version == v and not eng.weights_pending
    ends = [d for d in eng.step() if d.request_id == a]
    assert ends and ends[0].finished and ends[0].finish_reason == "abort"
    assert ends[0].output.weight_version != v
    with pytest.raises(ValueError, match="policy"):
        llm.update_weights(llm.get_weights(), policy="recompute-later")


def test_sleep_releases_device_memory_and_wakes_to_the_same_outputs(llm):
    # weights only the engine holds (get_weights() shares the arrays it does not transform)
    llm.update_weights(jax.tree.map(jnp.copy, llm.get_weights()))
    before = llm.generate(PROMPTS, GREEDY)
    one = llm.sleep(1)
    assert one["device_bytes_after"] < one["device_bytes_before"]
    with pytest.raises(EngineAsleep):
        llm.generate(PROMPTS[0], GREEDY)
    two = llm.sleep(2)
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine._host_params[0]))
    assert two["device_bytes_before"] - two["device_bytes_after"] >= weights
    woke = llm.wake_up()
    assert woke["device_bytes_after"] > woke["device_bytes_before"]
    after = llm.generate(PROMPTS, GREEDY)
    assert _tokens(after) == _tokens(before) and np.array_equal(_lps(after), _lps(before))


def test_sleep_refused_with_unfinished_requests(llm):
    rid = llm.engine.add_request(llm.tokenizer.encode("hi"), GREEDY)
    try:
        with pytest.raises(RuntimeError, match="unfinished"):
            llm.sleep(1)
    finally:
        llm.engine.abort(rid)


def test_score_equals_the_rollout_and_the_pure_function(llm):
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=0)
    outs = llm.generate(PROMPTS, sp)
    scored = llm.score(PROMPTS, [o.token_ids for o in outs])
    rollout = _lps(outs)
    # float tolerance, not bitwise: the rollout's steps batch rows differently (see the note)
    np.testing.assert_allclose(np.array(scored), rollout, atol=1e-5, rtol=0)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    for i, o in enumerate(outs):  # one sequence at a time: no padding to mask
        toks = jnp.asarray([ids[i] + o.token_ids], jnp.int32)
        lp = sequence_logprobs(llm.get_weights(), llm.model.cfg, toks)[0, len(ids[i]) - 1:]
        np.testing.assert_allclose(np.asarray(lp), rollout[i], atol=1e-5, rtol=0)


def test_sequence_logprobs_differentiates(llm):
    w, cfg = llm.get_weights(), llm.model.cfg
    toks = jnp.asarray([[1, 20, 30, 40, 50], [1, 60, 70, 80, 90]], jnp.int32)
    g = jax.grad(lambda p: sequence_logprobs(p, cfg, toks).sum())(w)
    norms = [float(jnp.abs(x).sum()) for x in jax.tree.leaves(g)]
    assert all(np.isfinite(norms)) and min(norms) > 0  # every tensor takes part
    # the derivative along the gradient's direction u is |g|: a finite difference agrees
    gnorm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
    eps = 1e-3
    moved = jax.tree.map(lambda x, d: x + eps * d / gnorm, w, g)
    f = lambda p: float(sequence_logprobs(p, cfg, toks).sum())  # noqa: E731
    assert abs((f(moved) - f(w)) / eps - gnorm) < 0.05 * gnorm


def test_int8_engine_requantizes_the_update(tiny_dir, trained, tmp_path, llm):
    params, _ = trained
    q = LLM(str(tiny_dir), **TINY, quantization="int8")
    v = q.update_weights(params)
    got = q.generate(PROMPTS, GREEDY)
    _, fresh = _fresh(tmp_path, llm, params, quantization="int8")
    ref = fresh.generate(PROMPTS, GREEDY)
    assert got[0].weight_version == v and _tokens(got) == _tokens(ref)
    np.testing.assert_allclose(_lps(got), _lps(ref), atol=1e-5, rtol=0)



def test_update_while_asleep_lands_on_wake(llm, trained):
    params, _ = trained
    base = llm.get_weights()
    llm.update_weights(params)
    ref = llm.generate(PROMPTS, GREEDY)
    llm.update_weights(base)
    llm.sleep(2)
    v = llm.update_weights(params)  # checked against the sleeping weights' shapes
    llm.wake_up()
    got = llm.generate(PROMPTS, GREEDY)
    assert got[0].weight_version == v
    assert _tokens(got) == _tokens(ref) and np.array_equal(_lps(got), _lps(ref))
    llm.update_weights(base)


@pytest.mark.parametrize("call, named", [
    (lambda llm: llm.update_weights(llm.get_weights(), version=[1]), "version"),
    (lambda llm: llm.update_weights(llm.get_weights(), version=True), "version"),
    (lambda llm: llm.sleep(True), "level"),
    (lambda llm: llm.sleep(3), "level"),
    (lambda llm: llm.score(PROMPTS[:1], None), "completions"),
    (lambda llm: llm.score(PROMPTS[:1], [[1.5, 2]]), "completions[0]"),
    (lambda llm: llm.score(PROMPTS[:1], [[10 ** 9]]), "prompt"),
    (lambda llm: llm.score(PROMPTS[:1], [[3] * 10_000]), "max_model_len"),
    (lambda llm: llm.score(PROMPTS[:2], [[3]]), "completions"),
])
def test_hostile_python_inputs_refused_naming_the_field(llm, call, named):
    version = llm.weight_version
    with pytest.raises(ValueError, match=re.escape(named)):
        call(llm)
    assert llm.weight_version == version and llm.engine.sleep_level == 0
    assert llm.generate(PROMPTS[0], GREEDY)[0].finish_reason == "length"
