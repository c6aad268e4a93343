"""Attention sinks (gpt-oss) in ragged paged attention: one raw logit per q head joins the softmax
with a zero value vector. The reference vs hand-worked numbers and the float64 oracle; both Pallas
kernels (TPU Mosaic and GPU Triton, interpret mode on CPU) vs the reference, with float and int8
pages, windows and soft caps; the validator. Lowering with sinks: test_lowering.py.

Kernel tolerances as in test_ragged_paged_attention.py (f32 1e-4, bf16 3e-2).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    validate_static,
)
from tests.pallas_kernels.test_ragged_paged_attention import (
    KERNEL_CONFIGS,
    _config_case,
    _good,
    _reference_jit,
    _run,
    check_close,
    make_case,
    oracle,
)
from tests.pallas_kernels.test_ragged_paged_attention_quantized import INT8_CONFIGS, _quantized_case


def _sinks(num_q_heads, seed):
    """Sinks on the scale of the scores; head 0's (100) outweighs every key: its rows come out ~0
    (exp(100 - m) overflows f32 in the kernels' final sum: must give 0, not NaN)."""
    sinks = 2.0 * np.random.default_rng(seed).standard_normal(num_q_heads)
    sinks[0] = 100.0
    return jnp.asarray(sinks, jnp.float32)


# ------------------------------------------------------------------------ reference: by hand


def _two_keys():
    """2 q heads on 1 kv head, head_dim 1, page_size 2: keys k = [1, 0], values v = [2, 4] on
    page 2 (pages 0 and 1 NaN); one decode row at position 1 with q = [1] (head 0), [2] (head 1);
    row 1 is padding."""
    k = np.full((1, 3, 2, 1), np.nan, np.float32)  # [Hkv, N, ps, D]
    v = np.full((1, 3, 2, 1), np.nan, np.float32)
    k[0, 2, :, 0] = [1, 0]
    v[0, 2, :, 0] = [2, 4]
    q = np.array([[[1], [2]], [[9], [9]]], np.float32)  # [T, Hq, D]
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([2], jnp.int32),
            jnp.asarray([[2]], jnp.int32), jnp.asarray([0, 1], jnp.int32),
            jnp.asarray([1], jnp.int32))


def test_reference_sinks_hand_worked():
    args = _two_keys()
    sinks = jnp.asarray([0.0, 1.0])
    e = math.e

    def check(expected, **kw):
        out = ragged_paged_attention_reference(*args, sinks=sinks, **kw)
        np.testing.assert_allclose(np.asarray(out[0, :, 0]), expected, rtol=1e-6)
        assert (np.asarray(out[1]) == 0).all()  # padding row

    # scores head 0: [1, 0], sink 0; head 1: [2, 0], sink 1
    check([(2 * e + 4) / (e + 1 + 1), (2 * e**2 + 4) / (e**2 + 1 + e)], sm_scale=1.0)
    # sm_scale halves the scores, not the sinks: head 0 [0.5, 0], head 1 [1, 0]
    check([(2 * e**0.5 + 4) / (e**0.5 + 1 + 1), (2 * e + 4) / (e + 1 + e)], sm_scale=0.5)
    # soft cap 1 caps the scores, not the sinks: head 0 [tanh 1, 0], head 1 [tanh 2, 0]
    t1, t2 = math.exp(math.tanh(1.0)), math.exp(math.tanh(2.0))
    check([(2 * t1 + 4) / (t1 + 1 + 1), (2 * t2 + 4) / (t2 + 1 + e)], sm_scale=1.0, soft_cap=1.0)
    # window 1 masks key 0, not the sinks: score 0 against sink 0 / 1
    check([4 / (1 + 1), 4 / (1 + e)], sm_scale=1.0, sliding_window=1)


# --------------------------------------------------------------- reference: float64 oracle


@pytest.mark.parametrize("heads,page_size,window,soft_cap", [
    ((8, 2), 8, 4, 5.0),
    ((6, 2), 16, None, None),  # GQA 3
])
def test_reference_sinks_match_oracle(heads, page_size, window, soft_cap):
    seqs = [(1, 1), (1, page_size + 1), (5, page_size + 1), (7, 3 * page_size + 2)]
    case = make_case(seqs, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=16,
                     page_size=page_size, seed=page_size)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)
    sinks = _sinks(heads[0], seed=1)
    out = _reference_jit(*case.args, sinks=sinks, **kw)
    check_close(out, oracle(case.args, sinks=np.asarray(sinks), **kw), jnp.float32, case.owned)
    # the sinks matter here: heads 1.. move by more than the tolerance, head 0 is ~0
    plain = np.asarray(_reference_jit(*case.args, **kw))
    assert np.abs(np.asarray(out) - plain)[case.owned, 1:].max() > 1e-2
    assert np.abs(np.asarray(out)[:, 0]).max() < 1e-30


@pytest.mark.parametrize("floor", [-1e30, -np.inf])
def test_reference_sinks_at_floor_equal_no_sinks(floor):
    case = make_case([(1, 9), (6, 20)], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=4)
    kw = dict(sm_scale=0.3, sliding_window=7, soft_cap=5.0)
    out = _reference_jit(*case.args, sinks=jnp.full((4,), floor, jnp.float32), **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference_jit(*case.args, **kw)))


# ------------------------------------------------------------------- kernels vs reference


@functools.lru_cache(maxsize=None)
def _kernel_case(name):
    """(args, kernel kw, reference with sinks, q dtype, owned rows) of a named case."""
    if name == "mixed-f32-g4-w6":  # decode, verify and prefill-chunk rows in one step
        case, kw, _ = _config_case(KERNEL_CONFIGS[1])
        args, dtype = case.args, KERNEL_CONFIGS[1][4]
    elif name == "mixed-int8-bf16-g4-w9-cap20":
        case, args, ks, vs, kw, _, _ = _quantized_case(INT8_CONFIGS[1], "int8")
        kw = dict(kw, k_scale=ks, v_scale=vs)
        dtype = INT8_CONFIGS[1][4]
    else:  # "decode-f32-g3-w5": decode rows only, GQA 3 (group padding on GPU), many KV blocks
        seqs = [(1, kv) for kv in (1, 9, 16, 17, 33, 40)]
        case = make_case(seqs, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=8, seed=41)
        args, dtype = case.args, jnp.float32
        kw = dict(sm_scale=0.125, sliding_window=5)
    kw = dict(kw, sinks=_sinks(args[0].shape[1], seed=len(name)))
    return args, kw, _reference_jit(*args, **kw), dtype, case.owned


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("name", ["mixed-f32-g4-w6", "mixed-int8-bf16-g4-w9-cap20", "decode-f32-g3-w5"])
def test_kernel_sinks_match_reference(platform, name):
    args, kw, expected, dtype, owned = _kernel_case(name)
    blocks = dict(pages_per_block=2) if name.startswith("decode") else {}
    out = ragged_paged_attention(*args, platform=platform, interpret=True, **kw, **blocks)
    assert out.dtype == dtype
    check_close(out, expected, dtype, owned)


def test_tpu_kernel_sinks_strict_interpreter():
    """The strict interpreter (VMEM starts as NaN, out-of-bounds reads raise, the SMEM sinks
    included) over two kv heads, two q blocks (block_q 8) and several KV blocks."""
    case = make_case([(1, 12), (9, 30)], num_q_heads=4, num_kv_heads=2, head_dim=64, seed=43)
    kw = dict(sm_scale=0.2, sinks=_sinks(4, seed=2))
    out = _run("tpu", case, **kw, block_q=8, pages_per_block=2)
    check_close(out, oracle(case.args, sm_scale=0.2, sinks=np.asarray(kw["sinks"])), jnp.float32,
                case.owned)


# ------------------------------------------------------------------------------- validator


@pytest.mark.parametrize("sinks,match", [
    (jnp.zeros((5,)), r"sinks shape \(5,\) must be \(4,\) \(one logit per q head\)"),
    (jnp.zeros((2,)), r"sinks shape \(2,\) must be \(4,\)"),  # one per kv head is not enough
    (jnp.zeros((1, 4)), r"sinks shape \(1, 4\) must be \(4,\)"),
    (jnp.zeros((4,), jnp.int32), "sinks dtype must be a float dtype, got int32"),
])
def test_validate_rejects_bad_sinks(sinks, match):
    validate_static(*_good(), sm_scale=0.1, sinks=jnp.zeros((4,)))  # [Hq] of a float dtype is fine
    with pytest.raises(ValueError, match=match):
        validate_static(*_good(), sm_scale=0.1, sinks=sinks)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_reference(*_good(), sm_scale=0.1, sinks=sinks)
    for platform in ("tpu", "gpu"):
        with pytest.raises(ValueError, match=match):
            ragged_paged_attention(*_good(), sm_scale=0.1, sinks=sinks, platform=platform,
                                   interpret=True)
