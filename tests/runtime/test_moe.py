"""Mixture of experts: the gathered, grouped (ragged_dot) and blocked forms against the
dense-over-experts reference, with float and quantized (int8, fp8, int4) expert weights, their
lowering for TPU and CUDA, and a Qwen3-MoE checkpoint served by the engine against HF
transformers (greedy, under chunked prefill and preemption), float and int8. Logits of
Qwen3-MoE, Qwen2-MoE and Mixtral against HF: tests/runtime/test_model_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.runtime.device.moe import (_blocked, _gathered, _grouped, block_rows, moe_mlp,
                                  moe_mlp_dense, route)
from jaxinfer.runtime.device.quantization import QuantizedArray, quantize

D, F, T = 32, 24, 13


def silu_glu(g, u):
    return jax.nn.silu(g) * u


def _weights(e: int, seed: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    n = lambda k, *s, scale=0.3: scale * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    return (n(ks[0], T, D, scale=1.0), n(ks[1], D, e, scale=2.0), n(ks[2], e, D, F),
            n(ks[3], e, D, F), n(ks[4], e, F, D))


@pytest.mark.parametrize("e,k", [(8, 2), (8, 8), (64, 2), (64, 8), (128, 2), (128, 8)])
def test_grouped_and_gathered_experts_equal_the_dense_reference(e, k):
    h, router, wg, wu, wd = _weights(e, seed=e + k)
    kw = dict(k=k, norm_topk=k == 2, glu=silu_glu)
    want = jax.jit(lambda *a: moe_mlp_dense(*a, **kw))(h, router, wg, wu, wd)

    for fn in (_grouped, _gathered, _blocked, None, "fixed"):
        fixed = dict(kw, fixed_blocks=fn == "fixed")
        got = (jax.jit(lambda *a: moe_mlp(*a, **fixed)) if fn in (None, "fixed")
               else _form(fn, k, k == 2))(h, router, wg, wu, wd)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    used = np.unique(np.asarray(route(h, router, k, False)[1]))
    assert len(used) < e or e == 8  # experts that receive no token are in the mix
    # hand-worked: one token, top-1 with renormalisation is exactly its expert's MLP
    one = jax.jit(lambda *a: moe_mlp(*a, k=1, norm_topk=True, glu=silu_glu))(
        h[:1], router, wg, wu, wd)
    x = np.asarray(h[0], np.float64)
    j = int(np.argmax(x @ np.asarray(router, np.float64)))
    g, u = x @ np.asarray(wg[j], np.float64), x @ np.asarray(wu[j], np.float64)
    ref = (g / (1 + np.exp(-g)) * u) @ np.asarray(wd[j], np.float64)
    np.testing.assert_allclose(np.asarray(one[0]), ref, atol=1e-5, rtol=1e-5)


def _form(fn, k, norm_topk):
    """One of moe_mlp's forms alone, whatever T * k is."""
    return jax.jit(lambda h, *ws: fn(h, *route(h, ws[0], k, norm_topk), *ws[1:], None, silu_glu))


def test_biased_clamped_experts_every_form_equals_numpy():
    """gpt-oss's experts: a router bias, per-expert gate / up / down biases and the clamped GLU,
    through every form, against a plain numpy loop over tokens (softmax over the top-k biased
    logits)."""
    from jaxinfer.runtime.config import ModelConfig
    from jaxinfer.runtime.device.model import _expert_glu

    e, k, lim, alpha = 8, 2, 0.5, 1.702
    h, router, wg, wu, wd = _weights(e, seed=11)
    ks = jax.random.split(jax.random.key(12), 4)
    rb, bg, bu, bd = (0.3 * jax.random.normal(kk, s) for kk, s in
                      zip(ks, [(e,), (e, F), (e, F), (e, D)]))
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=D, intermediate_size=F,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=D,
                      swiglu_limit=lim, swiglu_alpha=alpha)
    glu = _expert_glu(cfg, None)
    kw = dict(k=k, norm_topk=True, glu=glu, router_bias=rb, biases=(bg, bu, bd))
    x, r = np.asarray(h, np.float64), np.asarray(router, np.float64)
    want = np.zeros((T, D))
    for t in range(T):
        logits = x[t] @ r + np.asarray(rb)
        top = np.argsort(-logits)[:k]
        p = np.exp(logits[top] - logits[top].max())
        for j, wj in zip(top, p / p.sum()):
            g = np.minimum(x[t] @ np.asarray(wg[j]) + np.asarray(bg[j]), lim)
            u = np.clip(x[t] @ np.asarray(wu[j]) + np.asarray(bu[j]), -lim, lim)
            m = (u + 1) * g / (1 + np.exp(-alpha * g))
            want[t] += wj * (m @ np.asarray(wd[j]) + np.asarray(bd[j]))
    assert np.mean(np.abs(x @ np.asarray(wg[0]) + np.asarray(bg[0])) > lim) > 0.1  # it clamps
    got = jax.jit(lambda *a: moe_mlp_dense(*a, **kw))(h, router, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    w, ex = route(h, router, k, True, rb)
    for fn in (_grouped, _gathered, _blocked):
        got = jax.jit(lambda *a: fn(h, w, ex, *a, (bg, bu, bd), glu))(wg, wu, wd)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5,
                                   err_msg=fn.__name__)


def test_blocks_hold_every_pair_in_their_static_count():
    """Hand-worked: 13 tokens x top-8 = 104 pairs over 8 experts -> blocks of 8 rows (13 pairs
    an expert on average, rounded down to a power of two), ceil(104 / 8) + 8 = 21 blocks; one
    expert taking every token's first choice (13 pairs -> 2 blocks) still fits."""
    assert block_rows(104, 8) == 8 and block_rows(104, 128) == 8 and block_rows(4096, 8) == 128
    h, router, wg, wu, wd = _weights(8, seed=3)
    router = router.at[:, 0].add(100.0)  # expert 0 first for every token
    want = moe_mlp_dense(h, router, wg, wu, wd, k=8, norm_topk=False, glu=silu_glu)
    got = _form(_blocked, 8, False)(h, router, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_experts_equal_the_reference_on_their_widened_weights(fmt):
    """Every form with QuantizedArray experts (per expert and output channel; int4 in groups
    along the contracted axis) equals the dense reference over the widened weights."""
    e, k = 16, 4
    h, router, *ws = _weights(e, seed=7)
    qs = [quantize(w, fmt, (1,), mode="weight_only", group_size=8) for w in ws]
    assert all(isinstance(q, QuantizedArray) and q.shape == w.shape for q, w in zip(qs, ws))
    widened = [q.dequantize() for q in qs]
    want = moe_mlp_dense(h, router, *widened, k=k, norm_topk=True, glu=silu_glu)
    for fn in (_grouped, _gathered, _blocked):
        got = _form(fn, k, True)(h, router, *qs)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5,
                                   err_msg=f"{fmt} {fn.__name__}")
    # the quantized experts are not the float ones: the check above could tell them apart
    exact = moe_mlp_dense(h, router, *ws, k=k, norm_topk=True, glu=silu_glu)
    assert np.abs(np.asarray(exact) - np.asarray(want)).max() > 1e-4


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_grouped_experts_lower_for_accelerators(platform):
    args = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _weights(64, 0)]
    for k in (2, 8):  # T * k = 26 <= E: gathered; 104 > E: grouped (ragged_dot)
        fn = jax.jit(lambda *a: moe_mlp(*a, k=k, norm_topk=True, glu=silu_glu))
        exported = jax.export.export(fn, platforms=[platform])(*args)
        assert exported.platforms == (platform,) and exported.out_avals[0].shape == (T, D)
        assert ("ragged" in exported.mlir_module()) == (k == 8) or platform == "cuda"
    # batch-invariant mode: the fixed-shape blocks on every platform, whatever T * k is
    fixed = jax.jit(lambda *a: moe_mlp(*a, k=8, norm_topk=True, glu=silu_glu, fixed_blocks=True))
    text = jax.export.export(fixed, platforms=[platform])(*args).mlir_module()
    assert "ragged" not in text and "stablehlo.while" in text  # lax.map over the blocks


def test_qwen3_moe_served_greedy_equals_hf_under_chunking_and_preemption(moe_dir):
    from jaxinfer import LLM, SamplingParams

    d, hf = moe_dir
    llm = LLM(str(d), max_slots=4, page_size=8, num_pages=20, max_model_len=128,
              prefill_chunk=16)
    prompts = ["The king is dead; long live the king. " * 4, "Hello", "O Romeo, Romeo " * 5,
               "Now is the winter of our discontent", "Cry havoc " * 6, "Et tu, Brute?"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=20,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == want[0, len(o.prompt_token_ids):].tolist(), p
    assert llm.engine.scheduler.free_pages == 19


def test_int8_experts_load_quantized_and_track_the_float_model(moe_dir):
    """quantization="int8" makes every stacked expert weight an int8 QuantizedArray (1/4 of the
    f32 bytes plus a scale per expert and channel) and its teacher-forced logits stay close to
    the float model's (the router and shared weights as every int8 model has them)."""
    from jaxinfer.checkpoints.hf import load_hf
    from jaxinfer.checkpoints.quantize import placer
    from tests.model_utils import run_sequence

    d, _ = moe_dir
    cfg, f32 = load_hf(d)
    _, q8 = load_hf(d, place=placer("int8", jnp.float32))
    for lf, lq in zip(f32.layers, q8.layers):
        for name in ("we_gate", "we_up", "we_down"):
            q, w = getattr(lq, name), getattr(lf, name)
            assert isinstance(q, QuantizedArray) and q.fmt == "int8" and q.shape == w.shape
            assert q.values.nbytes * 4 == w.nbytes and q.scales.shape == (w.shape[0], 1,
                                                                            w.shape[2])
    prompt = list(range(5, 40))
    want, _, _ = run_sequence(f32, cfg, prompt, page_size=8, decode_steps=0)
    got, _, _ = run_sequence(q8, cfg, prompt, page_size=8, decode_steps=0)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < rel < 0.05, rel


def test_qwen_moe_config_dense_layers_shared_expert_and_bad_values():
    """decoder_sparse_step / mlp_only_layers place dense layers as HF builds them (experts where
    i is not MLP-only and (i + 1) % step == 0); wrong-typed or out-of-range fields are a
    ConfigError naming the file."""
    from jaxinfer.checkpoints.hf_config import from_hf_config
    from jaxinfer.runtime.config import ConfigError

    base = dict(model_type="qwen2_moe", vocab_size=100, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, mlp_only_layers=[3])
    cfg = from_hf_config(base)
    assert (cfg.dense_layers, cfg.shared_expert_size, cfg.shared_expert_gate, cfg.qkv_bias) == (
        (3,), 24, True, True)
    assert from_hf_config({**base, "decoder_sparse_step": 2}).dense_layers == (0, 2, 3)
    for bad, word in [({"mlp_only_layers": ["x"]}, "config.json"),
                      ({"mlp_only_layers": 5}, "config.json"),
                      ({"num_experts": None}, "config.json"),
                      ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                      ({"shared_expert_intermediate_size": -4}, "shared_expert_size")]:
        with pytest.raises(ConfigError, match=word):
            from_hf_config({**base, **bad})
