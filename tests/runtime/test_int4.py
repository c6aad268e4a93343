"""int4 weights: the nibble layout against hand-worked bytes, round-to-nearest error bounds, the
einsum / take_rows paths against dequantize-then-matmul for every einsum the model uses, bad
group sizes, the activation-aware scaling (its search against plain RTN computed independently,
and its folding exact in float), and the LLM / convert / orbax round trip on the tiny model.

Stated tolerances:
- round to nearest: |w - dequant(w)| <= scale / 2 per element (asymmetric: scale = range / 15;
  symmetric: scale = max|w| / 7; both stored in f16, rounded up by <= 2^-10), plus the f16
  offset's rounding (<= 2^-11 |offset|) and f32 rounding;
- int4 einsum vs dequantize-then-einsum: rtol 1e-5 (the same dense product);
- scaling folded into the norms / w_up before any rounding: logits equal to the original
  model's within 1e-4 of their max |value| (float reassociation only).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints import awq
from jaxinfer.checkpoints.quantize import quantization_spec, quantize_params
from jaxinfer.runtime.device.quantization import (QuantizationError, QuantizedArray, einsum,
                                           pack_nibbles, param_bytes, quantize, quantize_int4,
                                           take_rows, unpack_nibbles)

from tests.runtime.test_quantization import MODEL_SPECS, _rand


def _np_dequant(q: QuantizedArray) -> np.ndarray:
    """An independent numpy dequantizer written from the layout: byte i on the group axis holds
    element 2i in its low nibble and 2i+1 in its high one; signed nibbles (two's complement)
    without offsets; w = v * scale + offset per group."""
    p = np.asarray(q.values)
    ax, g = q.group_axis, q.group_size
    lo, hi = (p & 0xF).astype(np.int16), (p >> 4).astype(np.int16)
    if q.offsets is None:
        lo, hi = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    v = np.empty(q.shape, np.float64)
    idx = [slice(None)] * p.ndim
    idx[ax] = slice(0, None, 2)
    v[tuple(idx)] = lo
    idx[ax] = slice(1, None, 2)
    v[tuple(idx)] = hi
    scale = np.repeat(np.asarray(q.scales, np.float64), g, axis=ax)
    off = 0.0 if q.offsets is None else np.repeat(np.asarray(q.offsets, np.float64), g, axis=ax)
    return v * scale + off


def test_nibble_layout_hand_worked():
    q = np.array([[-8, 7, 0, -1], [1, 2, 3, 4]], np.int8)
    packed = pack_nibbles(q, axis=1)
    # -8 -> 0x8 (low), 7 -> 0x7 (high): 0x78; 0 -> 0x0, -1 -> 0xF: 0xF0; 1,2 -> 0x21; 3,4 -> 0x43
    assert packed.tolist() == [[0x78, 0xF0], [0x21, 0x43]]
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray(packed), 1, True)), q)
    u = np.array([[15, 0], [8, 9]], np.int8)  # unsigned, packed along axis 0
    assert pack_nibbles(u, axis=0).tolist() == [[0x8F, 0x90]]
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(pack_nibbles(jnp.asarray(u), 0), 0,
                                                             False)), u)


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("shape,axis,group", [((256, 48), 0, 128), ((40, 64), 1, 32),
                                              ((8, 16, 24), 1, 128)])
def test_round_to_nearest_error_bound(shape, axis, group, zero_point):
    w = _rand(shape, 1)
    q = quantize_int4(w, axis, group, zero_point=zero_point)
    assert q.values.dtype == jnp.uint8 and q.shape == shape and q.fmt == "int4"
    assert q.values.shape[axis] == shape[axis] // 2  # two weights a byte
    assert q.group_size == min(group, shape[axis])
    ref = _np_dequant(q)
    np.testing.assert_allclose(np.asarray(q.dequantize()), ref, rtol=1e-6,
                               atol=1e-6 * np.abs(ref).max())  # f32 q * s + offset
    step = np.repeat(np.asarray(q.scales, np.float64), q.group_size, axis=axis)
    off = 0.0 if q.offsets is None else np.abs(
        np.repeat(np.asarray(q.offsets, np.float64), q.group_size, axis=axis))
    bound = step * 0.5 + off * 2.0 ** -11 + 1e-6 * np.abs(ref).max()
    assert np.all(np.abs(np.asarray(w) - ref) <= bound)
    assert q.scales.dtype == jnp.float16


@pytest.mark.parametrize("shape,axis", [((640, 2048), 0), ((2048, 640), 0), ((640, 4, 256), 0),
                                        ((4, 256, 640), 1), ((4096, 640), 1)])
def test_bytes_at_most_0_3x_bf16(shape, axis):
    """Gemma 3 270M's matrix shapes at the default group of 64, f16 scales and offsets."""
    q = quantize_int4(jnp.ones(shape), axis)
    assert q.group_size == 64 and q.nbytes == np.prod(shape) // 2 + 2 * 2 * np.prod(shape) // 64
    assert q.nbytes <= 0.3 * 2 * np.prod(shape)


@pytest.mark.parametrize("spec,xs,ws,axes", MODEL_SPECS)
def test_einsum_matches_dequantized(spec, xs, ws, axes):
    x, w = _rand(xs, 3, spread=False), _rand(ws, 4)
    q = quantize(w, "int4", axes, group_size=8)
    want = jnp.einsum(spec, x, q.dequantize())
    np.testing.assert_allclose(np.asarray(einsum(spec, x, q)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)
    if axes == (1,):  # an embedding table: rows read back as the dequantized rows
        ids = jnp.asarray([0, 7, 39, 7])
        np.testing.assert_allclose(np.asarray(take_rows(q, ids)),
                                   np.asarray(q.dequantize())[np.asarray(ids)], rtol=1e-6)


def test_bad_group_and_mode_name_the_weight():
    with pytest.raises(QuantizationError, match="layers.0.w_down: int4 group size 64 does not "
                                                "divide its contracted axis 0 of length 96"):
        quantize(jnp.ones((96, 8)), "int4", (0,), group_size=64, name="layers.0.w_down")
    with pytest.raises(QuantizationError, match="group size 5"):
        quantize(jnp.ones((5, 8)), "int4", (0,))  # capped at 5: odd, cannot pair nibbles
    with pytest.raises(QuantizationError, match="int4 weights run weight-only"):
        quantize(jnp.ones((16, 8)), "int4", (0,), mode="w8a8")


# ------------------------------------------------------------------ activation-aware scaling


def test_activation_scales_beat_round_to_nearest_on_outlier_channels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    x[:, :4] *= 40.0  # four salient input channels, as the norms' outputs of real models have
    w = rng.standard_normal((128, 96)).astype(np.float32)
    s, errors = awq.activation_scales(x, [w], 64, True)
    # alpha = 0 is plain round-to-nearest: its error, computed here with the quantizer itself
    rtn = np.asarray(quantize_int4(w, 0, 64).dequantize())
    want = float(np.sum(np.square(x @ w - x @ rtn, dtype=np.float64)))
    assert errors[0.0] == pytest.approx(want, rel=1e-3)
    best = min(errors, key=errors.get)
    assert best > 0 and errors[best] < 0.7 * errors[0.0]
    assert s[:4].min() > s[4:].max()  # the salient channels are scaled up
    assert np.sqrt(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


def test_clip_search_trades_outliers_for_a_finer_step():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    w = rng.laplace(size=(128, 32)).astype(np.float32)  # heavy tails, as trained weights
    clipped = np.asarray(awq.clip_search(x, w, 64, True))
    assert np.all(np.abs(clipped) <= np.abs(w)) and not np.array_equal(clipped, w)

    def error(v):  # ||x w - x Q(v)||^2, Q: the quantizer itself
        q = np.asarray(quantize_int4(v, 0, 64).dequantize())
        return float(np.sum(np.square(x @ w - x @ q, dtype=np.float64)))

    assert error(clipped) < 0.95 * error(w)  # measured 0.93
    # ratio 1 alone is the identity
    np.testing.assert_array_equal(
        np.asarray(awq._clip_best(jnp.asarray(x), jnp.asarray(w), jnp.ones(1), 16, True)), w)


class _Tok:
    bos_id = 1

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (self.vocab - 3) for c in text]


def test_scaling_folds_exactly_before_rounding(tiny_dir, monkeypatch):
    """With `make` keeping the float weight, the scaled model is the original one: the 1/s in
    the norms and w_up's columns undoes the s in the weights' rows."""
    from jaxinfer.checkpoints.hf import load_hf
    from tests.model_utils import run_sequence

    monkeypatch.setattr(awq, "ALPHAS", (0.7,))  # a scaling other than 1 everywhere
    monkeypatch.setattr(awq, "CLIP_RATIOS", (1.0,))  # no clipping: the float function kept
    cfg, params = load_hf(tiny_dir)
    floats = {f"layers.{i}.{w}": getattr(lp, w) for i, lp in enumerate(params.layers)
              for w in awq.SCALED_WEIGHTS}
    scaled = awq.scale_layers(params, cfg, _Tok(cfg.vocab_size), floats, lambda p, w: w, 64,
                              True)
    for name in ("attn_norm", "mlp_norm", "w_up"):  # all three folds applied
        assert not np.allclose(np.asarray(getattr(scaled.layers[0], name)),
                               np.asarray(getattr(params.layers[0], name))), name
    toks = list(np.random.default_rng(5).integers(3, cfg.vocab_size, 20))
    ref, _, _ = run_sequence(params, cfg, toks, page_size=8)
    got, _, _ = run_sequence(scaled, cfg, toks, page_size=8)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


# ------------------------------------------------------------------- LLM, convert, orbax


def test_llm_int4_convert_round_trip(tiny_dir, tmp_path, monkeypatch):
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.checkpoints.hf import load_hf
    from jaxinfer.checkpoints.orbax_io import load_converted
    from jaxinfer.serve.cli import main
    from tests.model_utils import assert_same_logits

    opts = dict(max_slots=2, page_size=8, max_model_len=64)
    llm = LLM(str(tiny_dir), quantization="int4", **opts)
    params = llm.get_weights()  # the model's own layout (the engine's may be a kernel's)
    spec = quantization_spec(params)
    assert spec["fmt"] == "int4" and spec["mode"] == "weight_only" and spec["zero_point"]
    assert "embed" in spec["weights"] and "layers.1.wo" in spec["weights"]
    cfg, f32 = load_hf(tiny_dir)
    for w in (params.layers[0].w_down, params.layers[0].w_up):  # whole groups of 64
        assert w.group_size == 64 and w.nbytes <= 0.3 * 2 * np.prod(w.shape)
    # the embedding table int8 per row (INT4_EMBEDDINGS), as 4-bit checkpoints keep it wider
    assert params.embed.fmt == "int8" and spec["embeddings"]["fmt"] == "int8"
    # the engine's int4 logits are those of its dequantized int4 weights
    dense = jax.tree.map(
        lambda a: a.dequantize() if isinstance(a, QuantizedArray) and a.fmt == "int4" else a,
        params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    assert_same_logits(params, dense, cfg, seed=6)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["O Romeo"], greedy)[0].token_ids) == 8

    out = tmp_path / "conv_int4"
    assert main(["convert", str(tiny_dir), str(out), "--quantize", "int4"]) == 0
    manifest = json.loads((out / "jaxinfer.json").read_text())["quantization"]
    assert manifest["fmt"] == "int4" and manifest["group_size"] == 64
    assert manifest["embeddings"]["fmt"] == "int8"
    import jaxinfer.runtime.device.quantization as rq

    def boom(*a, **k):
        raise AssertionError("re-quantized on load")

    monkeypatch.setattr(rq, "_int4_jit", boom)
    _, restored = load_converted(out)
    for (kp, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree_util.tree_flatten_with_path(restored)[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(kp))
    assert param_bytes(restored) < 0.3 * param_bytes(f32)


def test_quantize_params_int4_without_calibration(tiny_dir):
    from jaxinfer.checkpoints.hf import load_hf

    cfg, params = load_hf(tiny_dir)
    q = quantize_params(params, "int4", group_size=32)
    assert q.layers[0].wq.group_size == 32 and q.layers[0].wo.group_size == cfg.head_dim
    np.testing.assert_allclose(np.asarray(q.layers[0].attn_norm),
                               np.asarray(params.layers[0].attn_norm))  # nothing folded
