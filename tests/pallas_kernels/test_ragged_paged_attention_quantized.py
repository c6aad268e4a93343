"""Quantized KV pages (int8, fp8 e4m3) in both ragged paged-attention kernels (TPU Mosaic and
GPU Triton, interpret mode on CPU): vs the jnp reference on the same quantized pages, and vs
attention over the unquantized f32/bf16 pages; the validators.

Pages hold x / scale with one f32 scale per token per kv head (absmax / 127, rounded, for int8;
absmax / 448 for e4m3). Slots that hold no valid KV (null page 0, unused pages, page tails) hold
random garbage -- for fp8 including its NaN codes -- and NaN scales, so a kernel that lets an
unused slot's value or scale reach the output returns NaN.

Tolerances: vs the quantized reference, as for float pages (f32 1e-4, bf16 3e-2; the kernel
scales the scores / probabilities where the reference dequantizes K / V, which differs only by
rounding). vs unquantized KV attention (the cost of the format itself), max abs error and
relative RMS error: int8 <= 0.05 and 2% (measured on these cases: <= 0.027 and <= 0.9%); e4m3
(3 mantissa bits: relative step 1/8 at every magnitude) <= 0.15 and 4.5% (measured: <= 0.118 and
<= 3.3%).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention, validate_dynamic
from tests.pallas_kernels.test_ragged_paged_attention import (
    _mixed_seqs,
    _reference_jit,
    check_close,
    make_case,
)

COST = {"int8": (0.05, 0.02), "fp8": (0.15, 0.045)}  # kind -> (max abs, relative RMS) vs unquantized
KINDS = list(COST)


def quantize_case(case, seed=0, kind="int8"):
    """(args with int8 / fp8 k/v pages, k_scale, v_scale) from a float case whose unused slots
    are NaN."""
    rng = np.random.default_rng(seed)
    q, k, v, *meta = case.args
    pages, scales = [], []
    for x in (k, v):
        x = np.asarray(x, np.float32)  # [Hkv, N, ps, D]
        unused = np.isnan(x).any(-1)  # [Hkv, N, ps]
        x = np.nan_to_num(x)
        amax = np.abs(x).max(-1)
        top = 127.0 if kind == "int8" else 448.0
        scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)  # [Hkv, N, ps]
        y = np.clip(x / scale[..., None], -top, top)
        garbage = rng.integers(0, 256, size=(int(unused.sum()), x.shape[-1]), dtype=np.uint8)
        if kind == "int8":
            vals = np.round(y).astype(np.int8)
            vals[unused] = garbage.view(np.int8)
        else:
            vals = y.astype(jnp.float8_e4m3fn)
            garbage[:, ::5] = 0x7F  # e4m3's NaN code, in every garbage row
            vals[unused] = garbage.view(jnp.float8_e4m3fn)
        scale[unused] = np.nan
        pages.append(jnp.asarray(vals))
        scales.append(jnp.asarray(scale))
    return (q, pages[0], pages[1], *meta), scales[0], scales[1]


def check_cost(out, unquantized, owned, kind):
    """Quantized KV vs attention over the unquantized pages: a bounded quantization error."""
    atol, max_rms = COST[kind]
    out = np.asarray(out.astype(jnp.float32))[owned]
    exp = np.asarray(unquantized.astype(jnp.float32))[owned]
    np.testing.assert_allclose(out, exp, atol=atol, rtol=0)
    rel_rms = np.sqrt(np.mean((out - exp) ** 2) / np.mean(exp ** 2))
    assert rel_rms <= max_rms, f"{kind}: relative RMS error {rel_rms:.4f} > {max_rms}"


# (num_q_heads, num_kv_heads, head_dim, page_size, q dtype, sliding_window, soft_cap): every
# head_dim, a GQA ratio of 1, 3, 4 and 8, both q dtypes, a window and a soft cap.
INT8_CONFIGS = [
    (2, 2, 64, 8, jnp.float32, None, None),
    (8, 2, 128, 16, jnp.bfloat16, 9, 20.0),
    (8, 1, 256, 32, jnp.float32, None, 30.0),
    (6, 2, 128, 16, jnp.bfloat16, 17, None),
]


def _cfg_id(c):
    hq, hkv, d, ps, dt, w, cap = c
    return f"g{hq // hkv}-d{d}-ps{ps}-{jnp.dtype(dt).name}-w{w}-cap{cap}"


@functools.lru_cache(maxsize=None)
def _quantized_case(cfg, kind):
    """(case, quantized args, k_scale, v_scale, kw, quantized reference, unquantized reference)."""
    hq, hkv, d, ps, dtype, window, cap = cfg
    seed = INT8_CONFIGS.index(cfg) + 20
    case = make_case(_mixed_seqs(ps), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                     dtype=dtype, seed=seed)
    args, ks, vs = quantize_case(case, seed, kind)
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    ref = _reference_jit(*args, k_scale=ks, v_scale=vs, **kw)
    return case, args, ks, vs, kw, ref, _reference_jit(*case.args, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("cfg", INT8_CONFIGS, ids=_cfg_id)
def test_quantized_kernel_matches_reference(platform, cfg, kind):
    case, args, ks, vs, kw, ref, unquantized = _quantized_case(cfg, kind)
    validate_dynamic(*args, **kw, platform=platform, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention(*args, **kw, k_scale=ks, v_scale=vs, platform=platform,
                                 interpret=True)
    assert out.shape == case.args[0].shape and out.dtype == cfg[4]
    check_close(out, ref, cfg[4], case.owned)
    check_cost(out, unquantized, case.owned, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_quantized_kernel_many_blocks(platform, kind):
    """Small blocks: several query blocks per sequence, several sequences per block, KV over many
    double-buffered page blocks, a window starting mid-sequence. TPU runs the strict interpreter:
    VMEM starts as NaN (stale scale rows must not leak), out-of-bounds reads raise, and its race
    detector checks the scale DMAs against the compute."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    seqs = [(1, 50), (1, 3), (20, 70), (2, 17), (1, 16), (3, 33)]
    case = make_case(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seed=31)
    args, ks, vs = quantize_case(case, seed=31, kind=kind)
    interpret = True
    if platform == "tpu":
        interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise",
                                          detect_races=True)
    for window in (None, 20):
        kw = dict(sm_scale=0.125, sliding_window=window)
        out = ragged_paged_attention(*args, **kw, k_scale=ks, v_scale=vs, platform=platform,
                                     interpret=interpret, block_q=16, pages_per_block=2)
        if platform == "tpu":
            assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
        check_close(out, _reference_jit(*args, k_scale=ks, v_scale=vs, **kw), jnp.float32, case.owned)
        check_cost(out, _reference_jit(*case.args, **kw), case.owned, kind)


# ------------------------------------------------------------------------------- validators


def _int8_good():
    case = make_case([(2, 10), (1, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    args, ks, vs = quantize_case(case)
    return case, args, ks, vs


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_int8_validators(platform):
    case, args, ks, vs = _int8_good()
    q, k, v, *meta = args

    def bad(match, *a, **kw):
        with pytest.raises(ValueError, match=match):
            ragged_paged_attention(*a, sm_scale=0.1, platform=platform, interpret=True, **kw)

    bad(r"k/v_pages dtype int8 must equal q dtype float32 \(int8 / fp8 pages need k_scale / "
        r"v_scale\)", *args)
    bad("pass both k_scale and v_scale", *args, k_scale=ks)
    bad("pass both k_scale and v_scale", *args, v_scale=vs)
    bad("k/v_scale given: k/v_pages must be int8 or float8_e4m3fn, got float32", *case.args,
        k_scale=ks, v_scale=vs)
    bad(r"k_scale shape \(2, 3, 16\) must be \(2, 7, 16\)", *args, k_scale=ks[:, :3], v_scale=vs)
    bad(r"v_scale shape .* must be", *args, k_scale=ks, v_scale=vs[..., None])
    bad("k_scale dtype must be float32, got bfloat16", *args, k_scale=ks.astype(jnp.bfloat16),
        v_scale=vs)
    bad("k_pages dtype int8 != v_pages dtype float32", q, k, case.args[2], *meta, k_scale=ks,
        v_scale=vs)
