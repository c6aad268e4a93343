"""batch_invariant=True: each request's logprobs (and tokens) bitwise equal to the same request
run alone with max_slots=1, whatever else shares its steps: 64 mixed-length requests (greedy
and seeded sampling) under chunked prefill, prefix-cache hits, preemption and both scheduling
modes; LLM.score's teacher-forced logprobs bitwise equal to the rollout's; the same for a
mixture-of-experts model (one device and two), on four devices, under n-gram speculation and
for the TPU kernel (interpreted). The default mode is shown not to be (the
reason for the option)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.config import OptionError

from tests.runtime.test_tensor_parallel import on_8_devices

BASE = dict(page_size=8, max_model_len=256)
N = 64


def _workload(seed: int = 0):
    """64 prompts of 3-120 tokens, a quarter of them sharing a 40-token prefix; greedy and
    seeded sampling, 4-24 tokens each, logprobs of the chosen token and the top 2."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(5, 1900, 40)]
    prompts = []
    for i in range(N):
        own = [int(t) for t in rng.integers(5, 1900, int(rng.integers(3, 80)))]
        prompts.append(shared + own if i % 4 == 0 else own)
    params = [SamplingParams(max_tokens=int(rng.integers(4, 24)), ignore_eos=True, logprobs=2,
                             temperature=float(rng.choice([0.0, 0.8])), seed=i)
              for i in range(N)]
    return prompts, params


def _lps(out) -> list[float]:
    return [e["logprob"] for e in out.logprobs]


@pytest.fixture(scope="module")
def alone(tiny_dir):
    """Every request of the workload run alone (max_slots=1: one sequence a step)."""
    llm = LLM(str(tiny_dir), **BASE, max_slots=1, batch_invariant=True)
    prompts, params = _workload()
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize("options, what", [
    (dict(max_slots=8, prefill_chunk=32), "batches of 8, prompts chunked by 32"),
    (dict(max_slots=16, prefill_chunk=48, async_scheduling=False), "synchronous scheduling"),
    (dict(max_slots=8, prefill_chunk=32, num_pages=40), "a page pool small enough to preempt"),
])
def test_logprobs_bitwise_equal_to_the_request_alone(tiny_dir, alone, options, what):
    llm = LLM(str(tiny_dir), **BASE, **options, batch_invariant=True)
    prompts, params = _workload()
    got = llm.generate(prompts, params)
    ref = alone[1]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref], what
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if _lps(a) != _lps(b)]
    assert bad == [], f"{what}: {len(bad)} of {N} requests' logprobs differ"
    top = [[e["top"] for e in o.logprobs] for o in got]
    assert top == [[e["top"] for e in o.logprobs] for o in ref]
    sched = llm.engine.scheduler
    assert sched.prefix_cache_stats()["cached_tokens"] > 0, "no prefix-cache hit was exercised"
    if "num_pages" in options:
        assert sched.num_preemptions > 0, "no preemption was exercised"


def test_the_default_mode_is_not_batch_invariant(tiny_dir):
    """Why the option exists: the same workload batched vs alone, without it."""
    prompts, params = _workload()
    batched = LLM(str(tiny_dir), **BASE, max_slots=8, prefill_chunk=32).generate(prompts, params)
    single = LLM(str(tiny_dir), **BASE, max_slots=1).generate(prompts, params)
    differ = sum(_lps(a) != _lps(b) for a, b in zip(batched, single)
                 if a.token_ids == b.token_ids)
    assert differ > N // 2


def test_score_equals_the_rollout_bitwise(alone):
    llm, outs = alone
    prompts, _ = _workload()
    scored = llm.score(prompts[:16], [o.token_ids for o in outs[:16]])
    assert scored == [_lps(o) for o in outs[:16]]


@pytest.mark.parametrize("options, named", [
    (dict(tensor_parallel=4, enable_lora=True), "LoRA"),
    (dict(speculative={"method": "draft", "model": "a-draft", "k": 2}), "n-gram"),
])
def test_refused_where_not_invariant_yet(tiny_dir, options, named):
    with pytest.raises(OptionError, match=named):
        LLM(str(tiny_dir), **BASE, batch_invariant=True, **options)


@on_8_devices
def test_two_devices_are_batch_invariant_too(tiny_dir):
    """tensor_parallel=2: every cross-device sum has two terms (a + b == b + a), so the
    workload batched with chunks, prefix hits and preemption equals each request alone on the
    same two devices, bit for bit, and LLM.score on them equals the rollout."""
    prompts, params = _workload()
    mode = dict(BASE, batch_invariant=True, tensor_parallel=2)
    ref = LLM(str(tiny_dir), **mode, max_slots=1).generate(prompts, params)
    llm = LLM(str(tiny_dir), **mode, max_slots=8, prefill_chunk=32, num_pages=40)
    got = llm.generate(prompts, params)
    assert llm.engine.mesh is not None and llm.engine.mesh.shape["model"] == 2
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if _lps(a) != _lps(b)]
    assert bad == [], f"{len(bad)} of {N} requests' logprobs differ"
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.prefix_cache_stats()["cached_tokens"] > 0
    # scoring through the same two devices equals the rollout too
    assert llm.score(prompts[:8], [o.token_ids for o in got[:8]]) == [_lps(o) for o in got[:8]]


def test_ngram_speculation_changes_no_token_or_logprob(tiny_dir):
    """With n-gram speculation (k 3) in batches of 16, chunked: every request's tokens (greedy
    and seeded sampling, with and without top-p) and logprobs bitwise equal to the request
    alone without speculation. The verify step accepts a proposal while it equals the plain
    sampler's own draw for that position, and runs its rows in the head's fixed blocks."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(5, 1900, int(rng.integers(2, 6)))]
               * int(rng.integers(3, 12)) for _ in range(16)]  # repeating: n-grams to propose
    params = [SamplingParams(max_tokens=int(rng.integers(8, 32)), ignore_eos=True,
                             logprobs=2 if i % 3 == 0 else None,  # (those take no proposals)
                             temperature=float(rng.choice([0.0, 0.5])),
                             top_p=float(rng.choice([1.0, 0.9])), seed=i) for i in range(16)]
    ref = LLM(str(tiny_dir), **BASE, max_slots=1, batch_invariant=True).generate(prompts, params)
    llm = LLM(str(tiny_dir), **BASE, max_slots=16, prefill_chunk=32, batch_invariant=True,
              speculative={"method": "ngram", "k": 3, "n": 2})
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]
    accepted = [o.metrics["spec_accepted"] for o in got]
    sampled = [a for a, p in zip(accepted, params) if p.temperature > 0]
    assert sum(accepted) >= 5 and sum(sampled) > 0, (accepted, sampled)


def test_the_tpu_kernel_at_a_fixed_block_is_batch_invariant():
    """attention_backend='pallas_interpret' (the TPU kernel, interpreted): in this mode the
    kernel takes one block of 8 query rows whatever the step's token count (its default block
    grows with T, up to 32), so a sequence's 5 rows give the same bits alone in a step of 8 rows
    as between two other sequences in a step of 64; at the default block they do not."""
    import jax.numpy as jnp

    from jaxinfer.runtime.device.attention import AttentionMetadata, attend

    rng = np.random.default_rng(0)
    hq, hkv, dh, ps = 4, 2, 64, 8
    k, v = (jnp.asarray(rng.standard_normal((hkv, 40, ps, dh)), jnp.float32) for _ in "kv")
    own = rng.standard_normal((5, hq, dh)).astype(np.float32)  # 5 new rows, 40 in the cache

    def rows_of(seqs, t: int, row_tiles: bool) -> np.ndarray:  # seqs: (q rows, kv_len, pages)
        q, cu, s = np.zeros((t, hq, dh), np.float32), [0], len(seqs)
        for rows, _, _ in seqs:
            q[cu[-1]:cu[-1] + len(rows)] = rows
            cu.append(cu[-1] + len(rows))
        md = AttentionMetadata(
            positions=jnp.zeros((t,), jnp.int32), slot_mapping=jnp.zeros((t,), jnp.int32),
            cu_q_lens=jnp.asarray(cu + [cu[-1]] * (8 - s), jnp.int32),
            kv_lens=jnp.asarray([n for _, n, _ in seqs] + [0] * (8 - s), jnp.int32),
            page_indices=jnp.asarray([p + [0] * (8 - len(p)) for _, _, p in seqs]
                                     + [[0] * 8] * (8 - s), jnp.int32),
            num_seqs=jnp.asarray([s], jnp.int32), logits_indices=jnp.zeros((1,), jnp.int32),
            max_q_len=t)
        return np.asarray(attend(jnp.asarray(q), k, v, md, sm_scale=dh ** -0.5,
                                 sliding_window=None, soft_cap=None,
                                 backend="pallas_interpret", row_tiles=row_tiles))

    mine = (own, 40, [3, 9, 4, 12, 7])
    others = ((rng.standard_normal((20, hq, dh)).astype(np.float32), 30, [1, 2, 5, 6]),
              (rng.standard_normal((30, hq, dh)).astype(np.float32), 50, list(range(13, 20))))
    for fixed in (True, False):
        alone = rows_of([mine], 8, fixed)[:5]
        among = rows_of([others[0], mine, others[1]], 64, fixed)[20:25]
        np.testing.assert_allclose(among, alone, rtol=1e-5, atol=1e-5)
        assert np.array_equal(among, alone) == fixed


@on_8_devices
def test_four_devices_sum_in_a_fixed_order(tiny_dir):
    """tensor_parallel=4: a product split along its contracted axis (wo, w_down) reaches every
    device as the 4 partials, all-gathered and added in device order (runtime/device/
    fixed_sums.py), never through an all-reduce of a layer's rows, whose order an
    accelerator's collective may pick by message size; the workload batched equals each
    request alone bit for bit. Quantized weights are refused on > 2 devices."""
    import re

    llm, _, _ = _equal_alone(tiny_dir, 16, tensor_parallel=4)
    body = llm.engine._step.body  # this engine's compiled body programs
    hlos = [job.future.result().as_text() for key, job in body.table.items()
            if key[0] == body.fixed and job.future.done()]
    assert hlos
    d = 64  # the tiny Llama's width; 2 layers x (wo, w_down)
    for hlo in hlos:
        assert len(re.findall(rf"= f32\[4,8,{d}\]\S* all-gather\(", hlo)) == 4
        # the one all-reduce left is the embedding's lookup of the step's rows (one device
        # holds each row, the others add zeros: exact in any order)
        assert len(re.findall(r" all-reduce\(", hlo)) == 1
    head = llm.engine._step.head  # the logits gathered whole before any sum over the vocabulary
    hlos = [job.future.result().as_text() for key, job in head.table.items()
            if key[0] == head.fixed and job.future.done()]
    assert hlos and all(re.search(r"= f32\[8,2000\]\S* all-gather\(", h) for h in hlos)
    assert not any(" all-reduce(" in h for h in hlos)
    with pytest.raises(OptionError, match="float weights"):
        LLM(str(tiny_dir), **BASE, batch_invariant=True, tensor_parallel=4, quantization="int8")


def test_the_trainers_function_equals_the_rollout_bitwise(alone):
    """LLM.logprob_fn() on get_weights(): the pure function a trainer differentiates gives the
    rollout's logprobs bit for bit, and its gradient exists."""
    import jax
    import jax.numpy as jnp

    llm, outs = alone
    prompts, _ = _workload()
    fn, w = llm.logprob_fn(), llm.get_weights()
    for p, o in list(zip(prompts, outs))[:8]:
        lp = fn(w, jnp.asarray([p + o.token_ids], jnp.int32))[0, len(p) - 1:]
        assert np.asarray(lp).tolist() == _lps(o)
    toks = jnp.asarray([prompts[1][:6] + outs[1].token_ids[:4]], jnp.int32)
    g = jax.grad(lambda w_: fn(w_, toks).sum())(w)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g))
    assert float(jnp.abs(g.layers[0].wq).sum()) > 0


def _equal_alone(d, n: int, **mode) -> tuple:
    """The workload's first n requests on the model in d batched (8 slots, chunks of 32, a page
    pool that preempts) against each alone: tokens and logprobs bitwise equal, preemption and
    prefix hits exercised; -> (the batched LLM, the prompts, its outputs)."""
    prompts, params = (x[:n] for x in _workload())
    mode = dict(BASE, batch_invariant=True, **mode)
    ref = LLM(str(d), **mode, max_slots=1).generate(prompts, params)
    llm = LLM(str(d), **mode, max_slots=8, prefill_chunk=32, num_pages=40)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if _lps(a) != _lps(b)]
    assert bad == [], f"{len(bad)} of {n} requests' logprobs differ"
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.prefix_cache_stats()["cached_tokens"] > 0
    return llm, prompts, got


def test_mixture_of_experts_is_batch_invariant_too(moe_dir):
    """A Qwen3-MoE (16 experts, top 4): each block of 8 rows meets its experts in blocks of one
    shape (runtime/device/moe.py `_blocked`, on every platform in this mode) and a token's 4
    expert outputs are summed in rank order, so what the other rows routed where changes no
    bit; the trainer's function on get_weights() equals the rollout and differentiates
    through the experts."""
    import jax
    import jax.numpy as jnp

    llm, prompts, outs = _equal_alone(moe_dir[0], 24)
    fn, w = llm.logprob_fn(), llm.get_weights()
    for p, o in list(zip(prompts, outs))[:4]:
        lp = fn(w, jnp.asarray([p + o.token_ids], jnp.int32))[0, len(p) - 1:]
        assert np.asarray(lp).tolist() == _lps(o)
    toks = jnp.asarray([prompts[1][:6] + outs[1].token_ids[:4]], jnp.int32)
    g = jax.grad(lambda w_: fn(w_, toks).sum())(w)
    assert float(jnp.abs(g.layers[0].we_gate).sum()) > 0


@on_8_devices
def test_mixture_of_experts_on_two_devices(moe_dir):
    """tensor_parallel=2 splits the experts between the devices (8 each); each token's output
    is the sum of two partial sums, so it stays bitwise equal to the request alone."""
    llm, _, _ = _equal_alone(moe_dir[0], 16, tensor_parallel=2)
    assert llm.engine.mesh.shape["model"] == 2
