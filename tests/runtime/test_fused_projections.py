"""Fused QKV and gate/up projections (runtime/device/fused_projections.py): the fused product split
back gives the separate products (float, int8, fp8, int4 per group); a whole model's logits are
unchanged, with and without the output-major layout; weights that cannot join stay separate;
the engine's default and override."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints.quantize import quantize_params
from jaxinfer.runtime.config import EngineConfig, ModelConfig
from jaxinfer.runtime.device.fused_projections import fuse_layer, fuse_projections, split_qkv
from jaxinfer.runtime.device.model import init_params
from jaxinfer.runtime.device.quantization import QuantizedArray, einsum
from jaxinfer.runtime.device.weight_layout import OutputMajor, output_major_layers
from tests.model_utils import assert_same_logits

HI = jax.lax.Precision.HIGHEST


def _cfg(kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=4, num_kv_heads=kv_heads, head_dim=8)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_split_gives_each_head_its_own_product(kv_heads):
    """q head j * G + g, k head j and v head j of the fused product equal the separate
    products, computed by hand with numpy."""
    params = init_params(_cfg(kv_heads), jax.random.PRNGKey(1), scale=0.3)
    lp, fused = params.layers[0], fuse_layer(params.layers[0])
    g = 4 // kv_heads
    assert fused.wq is None and fused.wqkv.shape == (32, kv_heads, g + 2, 8)
    assert fuse_layer(fused).wqkv is fused.wqkv  # fusing twice changes nothing
    assert fused.w_gate is None and fused.w_gate_up.shape == (32, 48, 2)
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    q, k, v = split_qkv(jnp.einsum("td,dhgk->thgk", x, fused.wqkv, precision=HI))
    for name, got in (("wq", q), ("wk", k), ("wv", v)):
        want = np.einsum("td,dhk->thk", x, np.asarray(getattr(lp, name)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    gu = np.einsum("td,dfc->tfc", x, np.asarray(fused.w_gate_up))
    np.testing.assert_allclose(gu[..., 0], x @ np.asarray(lp.w_gate), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gu[..., 1], x @ np.asarray(lp.w_up), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,mode", [("int8", "weight_only"), ("int8", "w8a8"),
                                      ("fp8", "weight_only"), ("int4", "weight_only")])
def test_quantized_weights_join_with_their_scales(fmt, mode):
    """A quantized fused weight's product equals the separate quantized products: each output
    channel (or group) keeps its own scale."""
    params = init_params(_cfg(), jax.random.PRNGKey(2), scale=0.3)
    q = quantize_params(params, fmt, mode=None if fmt == "int4" else mode,
                        quantize_embeddings=False)
    lp = q.layers[1]
    fused = fuse_layer(lp)
    assert isinstance(fused.wqkv, QuantizedArray) and isinstance(fused.w_gate_up, QuantizedArray)
    assert fused.wqkv.fmt == lp.wq.fmt and fused.wqkv.mode == lp.wq.mode
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 32)), jnp.float32)
    got = split_qkv(einsum("td,dhgk->thgk", x, fused.wqkv))
    for w, y in zip((lp.wq, lp.wk, lp.wv), got):
        np.testing.assert_allclose(np.asarray(y), np.asarray(einsum("td,dhk->thk", x, w)),
                                   rtol=2e-5, atol=2e-5)
    gu = einsum("td,dfc->tfc", x, fused.w_gate_up)
    for c, w in enumerate((lp.w_gate, lp.w_up)):
        np.testing.assert_allclose(np.asarray(gu[..., c]), np.asarray(einsum("td,df->tf", x, w)),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["as_loaded", "output_major"])
def test_model_logits_unchanged(layout):
    cfg = _cfg(kv_heads=1)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    fused = fuse_projections(params)
    if layout == "output_major":
        fused = output_major_layers(fused, pieces=2)
        assert isinstance(fused.layers[0].wqkv, OutputMajor)
        assert isinstance(fused.layers[0].w_gate_up, OutputMajor)
    assert_same_logits(params, fused, cfg, seed=4)


def test_what_cannot_join_stays_separate():
    params = init_params(_cfg(kv_heads=1), jax.random.PRNGKey(0))
    lp = params.layers[0]
    # K/V heads that do not split over the tensor-parallel devices: Q shards, K/V replicate
    tp2 = fuse_layer(lp, tensor_parallel=2)
    assert tp2.wqkv is None and tp2.wq is lp.wq and tp2.w_gate_up is not None
    # a float and a quantized weight, or differing dtypes, do not join
    mixed = lp.replace(wk=quantize_params(params, "int8").layers[0].wk)
    assert fuse_layer(mixed).wqkv is None
    assert fuse_layer(lp.replace(w_up=lp.w_up.astype(jnp.bfloat16))).w_gate_up is None
    # an MoE layer without the dense MLP keeps its (absent) gate/up
    moe = lp.replace(w_gate=None, w_up=None, w_down=None)
    assert fuse_layer(moe).w_gate_up is None


def test_engine_setting(tiny_llm, tiny_dir):
    """Default: fused, except over CPU's output-major layer weights; either way when told."""
    from jaxinfer import LLM
    from jaxinfer.runtime.host.requests import SamplingParams

    kw = dict(max_slots=4, page_size=8, max_model_len=256)
    lp = tiny_llm.engine.params.layers[0]  # CPU default: output-major, not fused
    assert isinstance(lp.wq, OutputMajor) and lp.wqkv is None
    as_loaded = LLM(str(tiny_dir), weight_layout="as_loaded", **kw).engine.params.layers[0]
    assert as_loaded.wq is None and isinstance(as_loaded.wqkv, jax.Array)
    fused = LLM(str(tiny_dir), fuse_projections=True, **kw)
    lp = fused.engine.params.layers[0]
    assert lp.wq is None and isinstance(lp.wqkv, OutputMajor)
    assert isinstance(lp.w_gate_up, OutputMajor)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    assert ([o.token_ids for o in tiny_llm.generate(prompts, sp)]
            == [o.token_ids for o in fused.generate(prompts, sp)])
    with pytest.raises(ValueError, match="fuse_projections must be True, False or None"):
        EngineConfig(fuse_projections="yes")
