"""Mixture of experts: the grouped (ragged_dot) path against the dense-over-experts reference,
its lowering for TPU and CUDA, and a Qwen3-MoE checkpoint served by the engine against HF
transformers (greedy, under chunked prefill and preemption). Logits of Qwen3-MoE and Mixtral
against HF: tests/runtime/test_model_hf.py."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.runtime.moe import _gathered, _grouped, moe_mlp, moe_mlp_dense, route

D, F, T = 32, 24, 13


def _weights(e: int, seed: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    n = lambda k, *s, scale=0.3: scale * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    return (n(ks[0], T, D, scale=1.0), n(ks[1], D, e, scale=2.0), n(ks[2], e, D, F),
            n(ks[3], e, D, F), n(ks[4], e, F, D))


@pytest.mark.parametrize("e,k", [(8, 2), (8, 8), (64, 2), (64, 8), (128, 2), (128, 8)])
def test_grouped_and_gathered_experts_equal_the_dense_reference(e, k):
    h, router, wg, wu, wd = _weights(e, seed=e + k)
    kw = dict(k=k, norm_topk=k == 2, act=jax.nn.silu)
    want = jax.jit(lambda *a: moe_mlp_dense(*a, **kw))(h, router, wg, wu, wd)

    def path(fn):  # one of moe_mlp's two forms, whatever T * k is
        return jax.jit(lambda h, *ws: fn(h, *route(h, ws[0], k, k == 2), *ws[1:], jax.nn.silu))

    for fn in (_grouped, _gathered, None):
        got = (jax.jit(lambda *a: moe_mlp(*a, **kw)) if fn is None else path(fn))(
            h, router, wg, wu, wd)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    used = np.unique(np.asarray(route(h, router, k, False)[1]))
    assert len(used) < e or e == 8  # experts that receive no token are in the mix
    # hand-worked: one token, top-1 with renormalisation is exactly its expert's MLP
    one = jax.jit(lambda *a: moe_mlp(*a, k=1, norm_topk=True, act=jax.nn.silu))(
        h[:1], router, wg, wu, wd)
    x = np.asarray(h[0], np.float64)
    j = int(np.argmax(x @ np.asarray(router, np.float64)))
    g, u = x @ np.asarray(wg[j], np.float64), x @ np.asarray(wu[j], np.float64)
    ref = (g / (1 + np.exp(-g)) * u) @ np.asarray(wd[j], np.float64)
    np.testing.assert_allclose(np.asarray(one[0]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_grouped_experts_lower_for_accelerators(platform):
    args = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _weights(64, 0)]
    for k in (2, 8):  # T * k = 26 <= E: gathered; 104 > E: grouped (ragged_dot)
        fn = jax.jit(lambda *a: moe_mlp(*a, k=k, norm_topk=True, act=jax.nn.silu))
        exported = jax.export.export(fn, platforms=[platform])(*args)
        assert exported.platforms == (platform,) and exported.out_avals[0].shape == (T, D)
        assert ("ragged" in exported.mlir_module()) == (k == 8) or platform == "cuda"


@pytest.fixture(scope="module")
def moe_dir(tiny_dir, tmp_path_factory):
    """A random-init HF Qwen3-MoE (16 experts, top 4) with the tiny Llama's tokenizer."""
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_hf_model("qwen3_moe", d, hidden=64, layers=2, vocab=2000)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, d / name)
    return d, hf


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
