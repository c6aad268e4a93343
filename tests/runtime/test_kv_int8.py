"""int8 KV cache: per-token-per-head quantization, the cache update, the XLA attention path and
the jnp kernel reference on int8 pages, the model and the engine with kv_cache_dtype="int8";
the model and the engine with fp8 (e4m3) pages beside it, and fp8's quantization at the end.

Tolerances: attention on int8 K/V vs f32 K/V of the same data: atol 0.05 (K/V ~ N(0, 1): the
per-element error is <= scale/2 ~ 1.3% of the head's max |x|; measured ~0.01). The XLA path vs
the reference on the same int8 pages (same math): atol 1e-4. Model logits with int8 KV vs f32 KV:
max |diff| <= 5% of the f32 logits' max |value|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    validate_static,
)
from jaxinfer.runtime.device.attention import xla_ragged_paged_attention
from jaxinfer.runtime.config import EngineConfig, ModelConfig
from jaxinfer.runtime.device.kv_cache import QuantizedPages, init_cache, quantize_kv, write_pages
from tests.pallas_kernels.test_ragged_paged_attention import make_case

CASES = [  # (seqs, Hq, Hkv, head_dim, page_size, window, soft_cap)
    ([(1, 1)], 2, 2, 64, 8, None, None),  # decode at the very start
    ([(1, 17), (1, 8), (1, 9)], 4, 2, 64, 8, None, None),  # decode at page boundaries +-1
    ([(12, 12), (3, 20)], 4, 1, 128, 16, None, None),  # prefill + chunked prefill, GQA 4
    ([(5, 30), (1, 7)], 2, 2, 64, 8, 6, 30.0),  # sliding window + soft cap
]


def _int8_pages(pages):
    vals, scales = quantize_kv(pages)  # NaN slots -> NaN scales: a leak would poison the output
    return vals, scales


@pytest.mark.parametrize("seqs,hq,hkv,dh,ps,window,cap", CASES)
def test_int8_kv_attention_xla_and_reference_vs_f32(seqs, hq, hkv, dh, ps, window, cap):
    case = make_case(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=dh, page_size=ps)
    q, k, v, kv_lens, pt, cu, n = case.args
    kq, ks = _int8_pages(k)
    vq, vs = _int8_pages(v)
    kw = dict(sm_scale=dh ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(ragged_paged_attention_reference(q, k, v, kv_lens, pt, cu, n, **kw))
    ref8 = np.asarray(ragged_paged_attention_reference(q, kq, vq, kv_lens, pt, cu, n, **kw,
                                                       k_scale=ks, v_scale=vs))
    max_q = max(ql for ql, _ in seqs)
    xla8 = np.asarray(jax.jit(
        lambda *a: xla_ragged_paged_attention(*a, **kw, max_q_len=max_q, k_scale=ks, v_scale=vs)
    )(q, kq, vq, kv_lens, pt, cu, n))
    owned = case.owned
    assert np.isfinite(ref8).all() and np.isfinite(xla8).all()
    np.testing.assert_allclose(ref8[owned], want[owned], atol=0.05)
    np.testing.assert_allclose(xla8[owned], ref8[owned], atol=1e-4, rtol=1e-4)
    assert np.all(xla8[~owned] == 0)
    err = np.abs(ref8[owned] - want[owned]).max()
    assert err > 0  # the pages really are quantized


def test_quantize_kv_error_bound_and_write_pages():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 32)) * rng.uniform(0.01, 10, (5, 2, 1)), jnp.float32)
    q, s = quantize_kv(x)
    assert q.dtype == jnp.int8 and s.shape == (5, 2)
    err = np.abs(np.asarray(q, np.float32) * np.asarray(s)[..., None] - np.asarray(x))
    assert np.all(err <= np.asarray(s)[..., None] / 2 * (1 + 1e-6))
    zq, zs = quantize_kv(jnp.zeros((1, 1, 4)))  # an all-zero token: scale 1, values 0
    assert float(zs[0, 0]) == 1.0 and not np.any(np.asarray(zq))

    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32)
    cache = init_cache(cfg, num_pages=3, page_size=4, dtype="int8")
    pages = cache.k[0]
    assert isinstance(pages, QuantizedPages) and pages.values.dtype == jnp.int8
    slots = jnp.asarray([5, 6, 7, 8, 11], jnp.int32)  # page 1 offsets 1..3, page 2 offsets 0, 3
    new = write_pages(pages, x, slots)
    got = np.asarray(new.dequantize()).reshape(2, 12, 32)[:, np.asarray(slots)]  # [Hkv, T, Dh]
    np.testing.assert_allclose(got.transpose(1, 0, 2), np.asarray(x),
                               atol=float(np.asarray(s).max()) / 2 * 1.001)
    np.testing.assert_array_equal(np.asarray(new.scales).reshape(2, 12)[:, np.asarray(slots)],
                                  np.asarray(s).T)
    untouched = np.asarray(new.values).reshape(2, 12, 32)[:, [0, 1, 2, 3, 4, 9, 10]]
    assert not np.any(untouched)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_int8_cache_holds_at_least_1_9x_the_tokens(head_dim):
    cfg = ModelConfig(family="gemma3", vocab_size=8, hidden_size=64, intermediate_size=8,
                      num_layers=2, num_heads=4, num_kv_heads=1, head_dim=head_dim)
    b16 = init_cache(cfg, 9, 16, jnp.bfloat16)
    f32 = init_cache(cfg, 9, 16, jnp.float32)
    i8 = init_cache(cfg, 9, 16, "int8")
    # bytes per token: int8 stores Dh bytes + one f32 scale per head, bf16 2 * Dh bytes
    assert i8.bytes_per_token == 2 * 2 * 1 * (head_dim + 4)
    assert b16.bytes_per_token / i8.bytes_per_token >= 1.9
    assert f32.bytes_per_token / i8.bytes_per_token >= 3.8


def test_validators_and_kernels_on_int8_pages():
    case = make_case([(1, 9)], head_dim=64)
    q, k, v, kv_lens, pt, cu, n = case.args
    kq, ks = _int8_pages(k)
    vq, vs = _int8_pages(v)
    with pytest.raises(ValueError, match="int8 / fp8 pages need k_scale"):
        validate_static(q, kq, vq, kv_lens, pt, cu, n)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        validate_static(q, kq, vq, kv_lens, pt, cu, n, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale shape"):
        validate_static(q, kq, vq, kv_lens, pt, cu, n, k_scale=ks[:, :1], v_scale=vs)
    with pytest.raises(ValueError, match="must be int8"):
        validate_static(q, k, v, kv_lens, pt, cu, n, k_scale=ks, v_scale=vs)
    # the kernels read int8 pages (swept in tests/pallas_kernels/test_ragged_paged_attention_int8.py)
    ref = ragged_paged_attention_reference(q, kq, vq, kv_lens, pt, cu, n, sm_scale=0.125,
                                           k_scale=ks, v_scale=vs)
    for platform in ("tpu", "gpu"):
        out = ragged_paged_attention(q, kq, vq, kv_lens, pt, cu, n, sm_scale=0.125, platform=platform,
                                     interpret=True, k_scale=ks, v_scale=vs)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from jaxinfer.checkpoints.hf import load_hf
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("kv8_llama")
    make_hf_model("llama", d, hidden=128, layers=2, vocab=512)
    return d, *load_hf(d)


# (the 8-bit format, the bound on |logits - f32 KV logits| as a fraction of the logits' max)
@pytest.mark.parametrize("kv, tol", [("int8", 0.05), ("fp8", 0.1)])
def test_model_logits_with_quantized_kv_close_to_f32_kv(tiny_llama, kv, tol):
    from tests.model_utils import run_sequence

    _, cfg, params = tiny_llama
    toks = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 37))
    f_pre, f_ids, f_dec = run_sequence(params, cfg, toks, page_size=8, decode_steps=6)
    q_pre, q_ids, q_dec = run_sequence(params, cfg, toks, page_size=8, decode_steps=6,
                                       cache_dtype=kv)
    scale = np.abs(f_pre).max()
    assert np.abs(q_pre - f_pre).max() <= tol * scale
    assert np.abs(q_dec - f_dec).max() <= tol * scale
    assert np.abs(q_pre - f_pre).max() > 0  # the quantized cache was really used


# (the 8-bit format, its values' dtype, the least share of greedy tokens equal to f32 KV's)
@pytest.mark.parametrize("kv, values, agree", [("int8", jnp.int8, 0.8),
                                               ("fp8", jnp.float8_e4m3fn, 0.7)])
def test_engine_quantized_kv_generate(tiny_dir, tiny_llm, kv, values, agree):
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["To be, or not to be", "Now is the winter of our discontent"]
    f = tiny_llm.generate(prompts, sp)  # the f32 cache's tokens (slots and length change none)
    llm = LLM(str(tiny_dir), max_slots=2, page_size=8, max_model_len=128, kv_cache_dtype=kv)
    assert isinstance(llm.engine.cache.k[0], QuantizedPages)
    assert llm.engine.cache.k[0].values.dtype == values
    q = llm.generate(prompts, sp)
    same = sum(a == b for x, y in zip(f, q) for a, b in zip(x.token_ids, y.token_ids))
    assert same >= agree * sum(len(x.token_ids) for x in f)


def test_unknown_kv_cache_dtype_names_the_option():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="fp4")


# ------------------------------------------------------------------------------------ fp8 (e4m3)


def test_fp8_quantize_error_bound_and_cache():
    """e4m3 values: relative error <= 2^-4 (3 mantissa bits) for normal values, absolute
    <= 2^-10 x scale for subnormal ones; the pool is float8_e4m3fn with f32 scales, the same
    bytes per token as int8."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 32)) * rng.uniform(0.01, 10, (5, 2, 1)), jnp.float32)
    q, s = quantize_kv(x, jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (5, 2)
    deq = np.asarray(q.astype(jnp.float32)) * np.asarray(s)[..., None]
    bound = np.maximum(np.abs(np.asarray(x)) / 16, np.asarray(s)[..., None] * 2.0 ** -10)
    assert np.all(np.abs(deq - np.asarray(x)) <= bound * (1 + 1e-6))
    assert np.allclose(np.abs(np.asarray(q.astype(jnp.float32))).max(-1), 448.0)  # full range
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32)
    f8, i8 = init_cache(cfg, 3, 4, "fp8"), init_cache(cfg, 3, 4, "int8")
    assert f8.k[0].values.dtype == jnp.float8_e4m3fn and f8.bytes_per_token == i8.bytes_per_token
    new = write_pages(f8.k[0], x, jnp.asarray([5, 6, 7, 8, 11], jnp.int32))
    got = np.asarray(new.dequantize()).reshape(2, 12, 32)[:, [5, 6, 7, 8, 11]].transpose(1, 0, 2)
    np.testing.assert_allclose(got, deq, rtol=1e-6)
