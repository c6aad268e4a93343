"""int8 / fp8 weights: quantize/dequantize error bounds, the einsum wrapper vs dequantize-then-
matmul for every einsum spec the model uses (both matmul paths), tiny models vs f32, the LLM and
`jaxinfer convert --quantize` (bit-exact orbax round trip, no re-quantization), bad input, and
bench_quality on the tiny model.

Stated tolerances:
- int8: |w - dequant(w)| <= scale / 2 per element (round to nearest);
- fp8 e4m3fn: relative error <= 2^-4 for |w| / scale >= 2^-6 (normal range, 3 mantissa bits),
  absolute error <= 2^-10 * scale below it (half the subnormal step 2^-9);
- weight-only einsum vs dequantize-then-einsum: rtol 1e-5 (same products, the scale applied to the
  output instead of the weight);
- W8A8 einsum: equals the exact product of the quantized activations and weights (rtol 1e-5), and
  differs from dequantize-then-einsum by at most sum_k |x_k - xq_k s_x| |w_k| (the activation
  rounding, bounded by s_x / 2 * sum_k |w_k|);
- random-init tiny models (Qwen2, Gemma 3; measured int8 <= 5%, fp8 <= 23%): max |logit - f32
  logit| <= 6% (int8) / 25% (fp8) of the f32 logits' max |value| (these logits are small, max
  ~1, so relative errors look large; Gemma 3 270M figures come from tools/bench_quality.py).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints.quantize import quantization_spec, quantize_params
from jaxinfer.runtime.device.quantization import (
    QuantizationError,
    QuantizedArray,
    default_mode,
    dequantize,
    einsum,
    param_bytes,
    quantize,
    take_rows,
)

# (spec, x shape, w shape, the weight's reduce axes): every weight einsum in runtime/device/model.py
MODEL_SPECS = [
    ("td,dhk->thk", (5, 16), (16, 4, 8), (0,)),  # wq / wk / wv
    ("thk,hkd->td", (5, 4, 8), (4, 8, 16), (0, 1)),  # wo
    ("td,df->tf", (5, 16), (16, 24), (0,)),  # w_gate / w_up
    ("tf,fd->td", (5, 24), (24, 16), (0,)),  # w_down
    ("nd,vd->nv", (3, 16), (40, 16), (1,)),  # lm_head / tied embed
    ("td,df->tf", (1, 16), (16, 24), (0,)),  # a single token (the padded int8 path)
    ("nd,vd->nv", (1, 16), (40, 16), (1,)),
]


def _rand(shape, seed, spread=True):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    if spread:  # channels of very different magnitude: per-channel scales matter
        a *= np.exp(rng.uniform(-3, 3, shape[-1:]))
    return jnp.asarray(a, jnp.float32)


# ---------------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("shape,axes", [((64, 48), (0,)), ((40, 32), (1,)), ((8, 4, 16), (0, 1)),
                                        ((16, 4, 8), (0,))])
def test_int8_error_bound(shape, axes):
    w = _rand(shape, 0)
    q = quantize(w, "int8", axes)
    assert q.values.dtype == jnp.int8 and q.scales.dtype == jnp.float32
    assert all(q.scales.shape[a] == 1 for a in axes) and q.scales.ndim == w.ndim
    err = np.abs(np.asarray(dequantize(q)) - np.asarray(w))
    bound = np.broadcast_to(np.asarray(q.scales) / 2, err.shape)
    assert np.all(err <= bound * (1 + 1e-6))
    assert np.abs(np.asarray(q.values)).max() == 127  # the channel max maps to +-127
    assert err.max() > 0


@pytest.mark.parametrize("shape,axes", [((64, 48), (0,)), ((40, 32), (1,)), ((8, 4, 16), (0, 1))])
def test_fp8_error_bound(shape, axes):
    w = _rand(shape, 1)
    q = quantize(w, "fp8", axes)
    assert q.values.dtype == jnp.float8_e4m3fn
    s = np.broadcast_to(np.asarray(q.scales), w.shape)
    wn, dq = np.asarray(w), np.asarray(dequantize(q))
    normal = np.abs(wn) / s >= 2.0 ** -6
    rel = np.abs(dq - wn)[normal] / np.abs(wn)[normal]
    assert rel.max() <= 2.0 ** -4 * (1 + 1e-6)
    assert np.all(np.abs(dq - wn)[~normal] <= 2.0 ** -10 * s[~normal] * (1 + 1e-6))
    assert np.abs(np.asarray(q.values, np.float32)).max() == 448  # channel max -> e4m3 max


def test_zero_channel_and_nonfinite_free():
    w = jnp.zeros((4, 3)).at[:, 1].set(jnp.asarray([0.5, -1.0, 0.25, 2.0]))
    for fmt in ("int8", "fp8"):
        q = quantize(w, fmt, (0,))
        assert np.isfinite(np.asarray(q.scales)).all()
        np.testing.assert_array_equal(np.asarray(dequantize(q))[:, [0, 2]], 0)


# -------------------------------------------------------------------------------- the wrapper


@pytest.mark.parametrize("spec,xs,ws,axes", MODEL_SPECS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_weight_only_einsum_equals_dequantize_then_matmul(spec, xs, ws, axes, fmt):
    x, w = _rand(xs, 2, spread=False), _rand(ws, 3)
    q = quantize(w, fmt, axes, mode="weight_only")
    got = np.asarray(jax.jit(lambda x, q: einsum(spec, x, q))(x, q))
    want = np.asarray(jnp.einsum(spec, x, dequantize(q), precision="highest"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("spec,xs,ws,axes", MODEL_SPECS)
def test_w8a8_einsum_exact_on_quantized_operands_and_bounded(spec, xs, ws, axes):
    x, w = _rand(xs, 4, spread=False), _rand(ws, 5)
    q = quantize(w, "int8", axes, mode="w8a8")
    got = np.asarray(jax.jit(lambda x, q: einsum(spec, x, q))(x, q))
    # the activation quantization the path performs: per token over x's contracted axes
    xl, wl, out = spec.replace("->", ",").split(",")
    red = tuple(i for i, c in enumerate(xl) if c in wl and c not in out)
    xn = np.asarray(x, np.float64)
    sx = np.abs(xn).max(axis=red, keepdims=True) / 127
    xq = np.round(xn / sx) * sx
    wd = np.asarray(dequantize(q), np.float64)
    exact = np.einsum(spec, xq, wd)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    bound = np.einsum(spec, np.abs(xn - xq), np.abs(wd))  # |(x - xq) . w| <= |x - xq| . |w|
    assert np.all(np.abs(got - np.einsum(spec, xn, wd)) <= bound * (1 + 1e-4) + 1e-5)


@pytest.mark.parametrize("spec,xs,ws,axes", [
    ("tf,fd->td", (6, 1024), (1024, 32), (0,)),  # w_down: GeGLU output with outlier channels
    ("td,df->tf", (1, 1024), (1024, 24), (0,)),  # single token, grouped and padded
    ("nd,vd->nv", (3, 2048), (40, 2048), (1,)),
])
def test_w8a8_grouped_activation_scales(spec, xs, ws, axes):
    """Contractions over >= MIN_GROUPS * ACT_GROUP channels quantize activations per token per group of
    ACT_GROUP channels: exact on those operands, and closer to f32 than one scale per token
    when a few channels are outliers."""
    from jaxinfer.runtime.device.quantization import ACT_GROUP

    rng = np.random.default_rng(8)
    xn = rng.standard_normal(xs)
    xn[..., [5, 17, 90]] *= 60.0  # a few outlier channels (all in the first group)
    x = jnp.asarray(xn, jnp.float32)
    q = quantize(_rand(ws, 9), "int8", axes, mode="w8a8")
    got = np.asarray(jax.jit(lambda x, q: einsum(spec, x, q))(x, q), np.float64)
    wd = np.asarray(dequantize(q), np.float64)
    xn = np.asarray(x, np.float64)
    g = xn.reshape(xs[:-1] + (xs[-1] // ACT_GROUP, ACT_GROUP))
    sx = np.abs(g).max(axis=-1, keepdims=True) / 127
    xq = (np.round(g / sx) * sx).reshape(xs)
    exact = np.einsum(spec, xq, wd)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    s_tok = np.abs(xn).max(axis=-1, keepdims=True) / 127
    per_token = np.einsum(spec, np.round(xn / s_tok) * s_tok, wd)
    ref = np.einsum(spec, xn, wd)
    assert np.abs(got - ref).mean() < 0.9 * np.abs(per_token - ref).mean()


def test_w8a8_single_row_equals_batched_row():
    x, q = _rand((2, 16), 6, spread=False), quantize(_rand((40, 16), 7), "int8", (1,), mode="w8a8")
    one = np.asarray(einsum("nd,vd->nv", x[:1], q))
    two = np.asarray(einsum("nd,vd->nv", x, q))
    np.testing.assert_array_equal(one[0], two[0])


def test_bf16_activations_and_unfactorable_spec_and_take_rows():
    x, w = _rand((5, 16), 8, spread=False), _rand((16, 24), 9)
    for mode in ("w8a8", "weight_only"):
        q = quantize(w, "int8", (0,), mode=mode)
        y = einsum("td,df->tf", x.astype(jnp.bfloat16), q)
        assert y.dtype == jnp.bfloat16
        ref = np.asarray(jnp.einsum("td,df->tf", x, dequantize(q)))
        assert np.abs(np.asarray(y, np.float32) - ref).max() <= 0.03 * np.abs(ref).max()
    # a spec contracting an axis the scales vary along: falls back to dequantize-then-matmul
    x2 = _rand((5, 24), 10, spread=False)
    for mode in ("w8a8", "weight_only"):
        q = quantize(w, "int8", (0,), mode=mode)  # scales per column f, vary along contracted f
        y = einsum("tf,df->td", x2, q)
        np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.einsum(
            "tf,df->td", x2, dequantize(q), precision="highest")), rtol=1e-5, atol=1e-4)
    emb = quantize(_rand((40, 16), 11), "int8", (1,), dtype=jnp.bfloat16)
    ids = jnp.asarray([3, 0, 39, 3])
    rows = take_rows(emb, ids)
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows),
                                  np.asarray(dequantize(emb, jnp.bfloat16))[np.asarray(ids)])


def test_bad_formats_and_modes():
    w = _rand((8, 8), 12)
    with pytest.raises(QuantizationError, match="quantization must be one of"):
        quantize(w, "nf4", (0,))
    with pytest.raises(QuantizationError, match="fp8 with mode 'w8a8'.*cannot run"):
        quantize(w, "fp8", (0,), mode="w8a8")
    with pytest.raises(QuantizationError, match="mode must be one of"):
        quantize(w, "int8", (0,), mode="int4_awq")
    from jaxinfer.checkpoints.quantize import placer

    with pytest.raises(QuantizationError, match="fp8 weights need float32 or bfloat16"):
        placer("fp8", jnp.float16)


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from jaxinfer.checkpoints.hf import load_hf
    from tests.gemma_fixtures import tiny_gemma3_hf
    from tests.hf_models import make_hf_model

    out = {}
    d = tmp_path_factory.mktemp("q_llama")
    make_hf_model("qwen2", d, hidden=128, layers=2, vocab=512)  # tied embeddings + qkv bias
    out["qwen2"] = load_hf(d)
    d = tmp_path_factory.mktemp("q_gemma")
    tiny_gemma3_hf(d)
    out["gemma3"] = load_hf(d)
    return out


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.parametrize("fmt,mode,tol,top1", [("int8", "w8a8", 0.06, 0.9),
                                               ("int8", "weight_only", 0.06, 0.9),
                                               ("fp8", "weight_only", 0.25, 0.65)])
def test_tiny_model_logits_within_tolerance(tiny_models, family, fmt, mode, tol, top1):
    from tests.model_utils import run_sequence

    cfg, params = tiny_models[family]
    qp = quantize_params(params, fmt, mode=mode)
    assert isinstance(qp.embed, QuantizedArray) and isinstance(qp.layers[0].wo, QuantizedArray)
    assert not isinstance(qp.final_norm, QuantizedArray)
    toks = list(np.random.default_rng(2).integers(3, cfg.vocab_size, 24))
    f_pre, f_ids, f_dec = run_sequence(params, cfg, toks, page_size=8, decode_steps=4)
    q_pre, q_ids, q_dec = run_sequence(qp, cfg, toks, page_size=8, decode_steps=4)
    scale = np.abs(f_pre).max()
    err = np.abs(q_pre - f_pre).max()
    assert 0 < err <= tol * scale
    assert np.mean(q_pre.argmax(-1) == f_pre.argmax(-1)) >= top1
    if q_ids == f_ids:  # decode logits are comparable only on the same inputs
        assert np.abs(q_dec - f_dec).max() <= tol * scale


def test_int8_param_bytes_at_most_0_3x_f32(tiny_models):
    cfg, params = tiny_models["qwen2"]
    full = param_bytes(params)
    assert param_bytes(quantize_params(params, "int8")) <= 0.3 * full
    assert param_bytes(quantize_params(params, "fp8")) <= 0.3 * full
    keep = quantize_params(params, "int8", quantize_embeddings=False)
    assert not isinstance(keep.embed, QuantizedArray)
    assert param_bytes(keep) > param_bytes(quantize_params(params, "int8"))


# ------------------------------------------------------------------- LLM, convert, orbax


GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["To be, or not to be", "Now is the winter of our discontent", "O Romeo"]


@pytest.fixture(scope="module")
def f32_tokens(tiny_dir, llm_for):
    from jaxinfer import SamplingParams

    llm = llm_for(tiny_dir, max_slots=4, page_size=8, max_model_len=128)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_llm_quantized_generate_and_convert_round_trip(tiny_dir, tmp_path, f32_tokens, fmt,
                                                       monkeypatch):
    from jaxinfer.checkpoints.orbax_io import load_converted
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.serve.cli import main

    llm = LLM(str(tiny_dir), quantization=fmt, max_slots=4, page_size=8, max_model_len=128)
    spec = quantization_spec(llm.engine.params)
    # int8 on CPU: weight-only where the CPU kernels load, else W8A8 (quantization.default_mode)
    assert spec["fmt"] == fmt and spec["mode"] == default_mode(fmt)
    assert "embed" in spec["weights"] and "layers.1.w_down" in spec["weights"]
    toks = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]
    agree = np.mean([a == b for x, y in zip(toks, f32_tokens) for a, b in zip(x, y)])
    # free-running: one flip shifts the rest (this model's greedy path has near ties: int8
    # W8A8 agreed 0.89 here, weight-only 0.61 on XLA's path and the kernels alike); the
    # teacher-forced logits of both modes are held within 0.06 in
    # test_tiny_model_logits_within_tolerance
    assert agree >= 0.5

    out = tmp_path / f"conv_{fmt}"
    assert main(["convert", str(tiny_dir), str(out), "--quantize", fmt]) == 0
    manifest = json.loads((out / "jaxinfer.json").read_text())
    assert manifest["quantization"]["fmt"] == fmt and manifest["dtype"] == "float32"
    # loading needs no re-quantization: the quantizer must not run
    import jaxinfer.runtime.device.quantization as rq

    def boom(*a, **k):
        raise AssertionError("re-quantized on load")

    monkeypatch.setattr(rq, "_quantize_jit", boom)
    cfg, restored = load_converted(out)
    # the model's own layout (the engine runs fp8 in a CPU kernel's)
    a = jax.tree_util.tree_flatten_with_path(llm.get_weights())[0]
    b = jax.tree_util.tree_flatten_with_path(restored)[0]
    assert [k for k, _ in a] == [k for k, _ in b]
    for (kp, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(kp)
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert jax.tree.structure(restored) == jax.tree.structure(llm.get_weights())  # static fields
    llm2 = LLM(str(out), max_slots=4, page_size=8, max_model_len=128)
    assert llm2.config.quantization == fmt
    assert [o.token_ids for o in llm2.generate(PROMPTS, SamplingParams(**GREEDY))] == toks
    other = "fp8" if fmt == "int8" else "int8"
    with pytest.raises(ValueError, match=f"holds {fmt} weights"):
        LLM(str(out), quantization=other, max_slots=1, page_size=8, max_model_len=64)


def test_llm_bad_quantization_input(tiny_dir):
    from jaxinfer import LLM
    from jaxinfer.serve.cli import main

    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_dir), quantization="nf4")
    with pytest.raises(QuantizationError, match="fp8 with mode 'w8a8'.*cannot run on 'cpu'"):
        LLM(str(tiny_dir), quantization="fp8", quant_mode="w8a8")
    with pytest.raises(QuantizationError, match="quantization mode must be one of"):
        LLM(str(tiny_dir), quantization="int8", quant_mode="fast")
    with pytest.raises(SystemExit):
        main(["convert", str(tiny_dir), "/tmp/never", "--quantize", "nf4"])


def test_llm_keep_embeddings_and_bf16_int8(tiny_dir, f32_tokens):
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(tiny_dir), quantization="int8", quantize_embeddings=False, dtype="bfloat16",
              max_slots=4, page_size=8, max_model_len=128)
    p = llm.get_weights()
    assert p.embed.dtype == jnp.bfloat16 and p.lm_head.dtype == jnp.bfloat16
    assert isinstance(p.layers[0].wq, QuantizedArray)
    toks = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]
    agree = np.mean([a == b for x, y in zip(toks, f32_tokens) for a, b in zip(x, y)])
    assert agree >= 0.6


def test_bench_quality_tiny(tiny_dir):
    from jaxinfer.tools.bench_quality import run, table

    res = run(str(tiny_dir), variants=("f32", "int8", "f32+kv8"), ppl_tokens=128, chunk=64,
              agree_prompts=2, agree_len=16, decode_tokens=4, batches=(1, 2), log=lambda s: None)
    v = res["variants"]
    assert v["f32"]["agree_generated"] == 1.0 and v["f32"]["agree_corpus"] == 1.0
    assert v["int8"]["param_bytes_vs_f32"] <= 0.3
    assert v["f32+kv8"]["kv_bytes_per_token"] < v["f32"]["kv_bytes_per_token"]
    assert v["int8"]["agree_positions"] == 32
    for row in v.values():
        assert np.isfinite(row["perplexity"]) and row["decode_tok_s_b2"] > 0
    assert "| int8 |" in table(res)


# ------------------------------------------------------------------- SmoothQuant smoothing


class _StubTokenizer:
    """Characters -> ids in [3, vocab): enough for a calibration pass on a tiny model."""

    def __init__(self, vocab: int):
        self.vocab, self.bos_id = vocab, 2

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (self.vocab - 3) for c in text]


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_smoothing_keeps_the_float_function(tiny_models, family):
    from jaxinfer.checkpoints.smoothing import calibration_tokens, norm_input_maxima, smooth_layers
    from tests.model_utils import run_sequence

    cfg, params = tiny_models[family]
    maxima = norm_input_maxima(params, cfg, calibration_tokens(_StubTokenizer(cfg.vocab_size)))
    sp = smooth_layers(params, maxima, 0.5)
    for lp, sl in zip(params.layers, sp.layers):  # it did move ranges around
        s = np.asarray(lp.attn_norm) / np.asarray(sl.attn_norm)
        assert s.max() / s.min() > 1.5
        np.testing.assert_allclose(np.asarray(sl.wq), np.asarray(lp.wq) * s[:, None, None],
                                   rtol=1e-6)
    toks = list(np.random.default_rng(3).integers(3, cfg.vocab_size, 24))
    f_pre, f_ids, f_dec = run_sequence(params, cfg, toks, page_size=8, decode_steps=3)
    s_pre, s_ids, s_dec = run_sequence(sp, cfg, toks, page_size=8, decode_steps=3)
    np.testing.assert_allclose(s_pre, f_pre, atol=1e-4, rtol=1e-4)
    assert s_ids == f_ids
    np.testing.assert_allclose(s_dec, f_dec, atol=1e-4, rtol=1e-4)


def test_norm_input_maxima_is_the_first_norm_output(tiny_models):
    from jaxinfer.runtime.device.model import rms_norm
    from jaxinfer.checkpoints.smoothing import norm_input_maxima

    cfg, params = tiny_models["gemma3"]
    toks = list(np.random.default_rng(4).integers(3, cfg.vocab_size, 40))
    maxima = norm_input_maxima(params, cfg, toks)
    assert set(maxima) == {f"layers.{i}.{n}" for i in range(cfg.num_layers)
                           for n in ("attn_norm", "mlp_norm")}
    x = np.asarray(params.embed)[toks] * cfg.embed_scale  # layer 0 reads the scaled embeddings
    want = np.abs(np.asarray(rms_norm(jnp.asarray(x), params.layers[0].attn_norm,
                                      cfg.rms_norm_eps))).max(0)
    np.testing.assert_allclose(maxima["layers.0.attn_norm"], want, rtol=1e-5)


def test_smoothing_scales_balance_activation_and_weight_ranges():
    from jaxinfer.checkpoints.smoothing import smoothing_scales

    rng = np.random.default_rng(5)
    x_max, w_max = np.exp(rng.uniform(-3, 4, 64)), np.exp(rng.uniform(-5, 0, 64))
    s = smoothing_scales(x_max, w_max, 0.5)
    np.testing.assert_allclose(x_max / s, w_max * s, rtol=1e-5)  # alpha 0.5: equal ranges
    np.testing.assert_allclose(x_max / smoothing_scales(x_max, w_max, 1.0), 1.0, rtol=1e-5)
    x_max[:3], w_max[3:5] = 0.0, 0.0  # dead channels keep s = 1
    s = smoothing_scales(x_max, w_max, 0.5)
    assert np.all(s[:5] == 1.0) and np.all(np.isfinite(s)) and np.all(s > 0)


def test_smoothing_lowers_w8a8_error_on_outlier_channels():
    """Activations with a few large channels (as after a norm in a real model): per-token int8
    activations lose the small channels; smoothed operands give the same product, quantized
    closer to the exact one."""
    from jaxinfer.checkpoints.smoothing import _row_max, smoothing_scales

    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 256))
    x[:, [3, 70, 150]] *= 60.0
    w = rng.standard_normal((256, 96)) * 0.05
    exact = x @ w
    s = smoothing_scales(np.abs(x).max(0), _row_max(w), 0.5)

    def err(xx, ww):
        q = quantize(jnp.asarray(ww, jnp.float32), "int8", (0,), mode="w8a8")
        y = np.asarray(einsum("td,df->tf", jnp.asarray(xx, jnp.float32), q), np.float64)
        return np.sqrt(np.mean((y - exact) ** 2))

    assert err(x / s, w * s[:, None]) < 0.5 * err(x, w)


def test_quantize_params_smooths_int8_w8a8_only(tiny_models):
    from jaxinfer.checkpoints.smoothing import SMOOTHED_WEIGHTS

    cfg, params = tiny_models["gemma3"]
    tok = _StubTokenizer(cfg.vocab_size)
    plain = quantize_params(params, "int8", mode="w8a8")
    smooth = quantize_params(params, "int8", mode="w8a8", cfg=cfg, tokenizer=tok)
    again = quantize_params(params, "int8", mode="w8a8", cfg=cfg, tokenizer=tok)
    wo = quantize_params(params, "int8", mode="weight_only", cfg=cfg, tokenizer=tok)
    for lp, pl, sm, ag, w in zip(params.layers, plain.layers, smooth.layers, again.layers,
                                 wo.layers):
        np.testing.assert_array_equal(np.asarray(pl.attn_norm), np.asarray(lp.attn_norm))
        np.testing.assert_array_equal(np.asarray(w.mlp_norm), np.asarray(lp.mlp_norm))
        s = np.asarray(lp.mlp_norm) / np.asarray(sm.mlp_norm)
        assert not np.allclose(s, 1.0)
        # the quantized consumer is the smoothed float weight, to int8 rounding
        want = np.asarray(lp.w_up) * s[:, None]
        step = np.abs(want).max(0, keepdims=True) / 127
        assert np.all(np.abs(np.asarray(sm.w_up.dequantize()) - want) <= step / 2 + 1e-7)
        for name in SMOOTHED_WEIGHTS:  # deterministic
            np.testing.assert_array_equal(np.asarray(getattr(sm, name).values),
                                          np.asarray(getattr(ag, name).values))
        np.testing.assert_array_equal(np.asarray(sm.wo.values), np.asarray(pl.wo.values))


def test_llm_int8_is_smoothed_at_load_weight_only_is_not(tiny_dir, tiny_llm):
    from jaxinfer import LLM

    kw = dict(max_slots=1, page_size=8, max_model_len=64)
    f32 = tiny_llm.engine.params  # the f32 weights: an engine's slots and length do not change them
    w8a8 = LLM(str(tiny_dir), quantization="int8", quant_mode="w8a8", **kw).engine.params
    wo = LLM(str(tiny_dir), quantization="int8", quant_mode="weight_only", **kw).engine.params
    for lf, lq, lw in zip(f32.layers, w8a8.layers, wo.layers):
        for norm in ("attn_norm", "mlp_norm"):
            assert not np.allclose(np.asarray(getattr(lq, norm)), np.asarray(getattr(lf, norm)))
            np.testing.assert_array_equal(np.asarray(getattr(lw, norm)),
                                          np.asarray(getattr(lf, norm)))
