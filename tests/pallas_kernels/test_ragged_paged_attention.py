"""Ragged paged attention: reference vs hand-worked numbers and a float64 oracle; each Pallas
kernel (TPU Mosaic and GPU Triton, both in interpret mode on CPU) vs the reference; validators.

Every case builds a page pool in which each slot that holds no valid KV (the null page 0, unused
pages, the tail of partially filled pages) is NaN, with pages handed out in a shuffled order, so
any read of a wrong slot poisons the output. Inactive sequence rows (>= num_seqs) hold garbage.

Tolerances: f32 kernels vs the f32 reference atol = rtol = 1e-4 (measured ~1e-6);
bf16 kernels (bf16 inputs, p cast to bf16 before p @ v) vs the f32 reference on the same bf16
inputs atol = rtol = 3e-2.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    validate_dynamic,
    validate_static,
)

# TPU interpret mode that fills scratch (VMEM) with NaN and raises on out-of-bounds reads, so a
# kernel reading a buffer slot it never filled (or a DMA it did not wait for) shows up as NaN.
# It simulates DMAs and semaphores op by op (~5x slower than plain interpret=True), so the wide
# config sweep uses interpret=True and the targeted block/DMA tests use this.
TPU_STRICT = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}

_reference_jit = jax.jit(ragged_paged_attention_reference,
                         static_argnames=("sm_scale", "sliding_window", "soft_cap"))


# ------------------------------------------------------------------------------------ helpers


@dataclass
class Case:
    args: tuple  # (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    owned: np.ndarray  # bool[T]: rows owned by a live sequence


def make_case(
    seqs,  # [(q_len, kv_len)] of the live sequences, in order
    *,
    num_q_heads=2,
    num_kv_heads=2,
    head_dim=64,
    page_size=8,
    dtype=jnp.float32,
    pad_rows=3,
    extra_seq_rows=2,
    extra_pages_per_seq=1,
    seed=0,
) -> Case:
    rng = np.random.default_rng(seed)
    n = len(seqs)
    max_seqs = n + extra_seq_rows
    pages_of = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = max([1, *pages_of]) + extra_pages_per_seq
    num_pages = 1 + sum(pages_of) + 4  # null page + used + a few never used
    perm = rng.permutation(np.arange(1, num_pages))  # shuffled page ids (never 0)
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    k = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    used = 0
    for s, (_, kv) in enumerate(seqs):
        page_indices[s, : pages_of[s]] = perm[used: used + pages_of[s]]
        used += pages_of[s]
        for j in range(kv):
            page, slot = page_indices[s, j // page_size], j % page_size
            k[:, page, slot] = rng.standard_normal((num_kv_heads, head_dim))
            v[:, page, slot] = rng.standard_normal((num_kv_heads, head_dim))
    q_lens = [ql for ql, _ in seqs]
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1: n + 1] = np.cumsum(q_lens)
    num_tokens = int(cu[n]) + pad_rows
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:n] = [kv for _, kv in seqs]
    # garbage in the inactive rows: must be ignored
    kv_lens[n:] = 10_000
    cu[n + 1:] = num_tokens + 7
    page_indices[n:] = rng.integers(0, num_pages, size=(max_seqs - n, pages_per_seq))
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    owned = np.zeros(num_tokens, bool)
    owned[: cu[n]] = True
    args = (
        jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
        jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu),
        jnp.asarray([n], jnp.int32),
    )
    return Case(args, owned)


def oracle(args, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None) -> np.ndarray:
    """Float64 loop over sequences, rows and heads: the definition, written out plainly.
    sinks [Hq]: one more logit per head in the softmax, its value vector 0."""
    q, k, v, kv_lens, pt, cu, num_seqs = (np.asarray(a, np.float64) if i < 3 else np.asarray(a)
                                          for i, a in enumerate(args))
    num_q_heads, page_size = q.shape[1], k.shape[2]
    group = num_q_heads // k.shape[0]
    out = np.zeros_like(q)
    for s in range(int(num_seqs[0])):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            pos = kv_lens[s] - q_len + i
            keys = [j for j in range(kv_lens[s])
                    if j <= pos and (sliding_window is None or pos - j < sliding_window)]
            for h in range(num_q_heads):
                kk = np.stack([k[h // group, pt[s, j // page_size], j % page_size] for j in keys])
                vv = np.stack([v[h // group, pt[s, j // page_size], j % page_size] for j in keys])
                sc = kk @ q[cu[s] + i, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(sc.max(), sink)
                w = np.exp(sc - top)
                out[cu[s] + i, h] = w @ vv / (w.sum() + np.exp(sink - top))
    return out


def check_close(out, expected, dtype, owned):
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN in output: a masked or unused KV slot was read"
    tol = TOL[dtype]
    np.testing.assert_allclose(out, np.asarray(expected, np.float32), atol=tol, rtol=tol)
    assert (out[~owned] == 0).all(), "padding rows must be exactly 0"


# ------------------------------------------------------------------- (a) hand-worked numbers


def _tiny(q_rows, num_seqs=1):
    """1 head, head_dim 2, page_size 2, one sequence of kv_len 3 (last q row is padding):
    K = [[1,0],[0,1],[1,1]], V = [[1,2],[3,4],[5,6]]. Positions 0, 1 live on page 3, position 2
    on page 1 slot 0; page 0 (null), page 2 (unused) and page 1 slot 1 are NaN."""
    nan = np.nan
    k = np.full((1, 4, 2, 2), nan, np.float32)  # [Hkv, N, ps, D]
    v = np.full((1, 4, 2, 2), nan, np.float32)
    k[0, 3] = [[1, 0], [0, 1]]
    v[0, 3] = [[1, 2], [3, 4]]
    k[0, 1, 0] = [1, 1]
    v[0, 1, 0] = [5, 6]
    page_indices = np.array([[3, 1]], np.int32)
    q = np.asarray(q_rows, np.float32)[:, None, :]  # [T, 1, 2]
    cu = np.array([0, len(q_rows) - 1], np.int32)
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([3], jnp.int32),
            jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray([num_seqs], jnp.int32))


def test_reference_hand_worked_decode():
    # one decode query q = [1, 0] at position 2 sees all 3 keys; scores = [1, 0, 1]
    out = ragged_paged_attention_reference(*_tiny([[1, 0], [9, 9]]), sm_scale=1.0)
    e = math.e
    expected = np.array([6 * e + 3, 8 * e + 4]) / (2 * e + 1)  # (e*v0 + v1 + e*v2) / (2e + 1)
    np.testing.assert_allclose(np.asarray(out[0, 0]), expected, rtol=1e-6)
    assert (np.asarray(out[1]) == 0).all()  # padding row


def test_reference_hand_worked_prefill_causal_window_softcap():
    # 3 prefill queries (positions 0, 1, 2), q = [2, 0] each: scores vs keys = [2, 0, 2]
    args = _tiny([[2, 0], [2, 0], [2, 0], [9, 9]])
    e2 = math.exp(2.0)
    row0 = [1, 2]  # only key 0
    row1 = (e2 * np.array([1, 2]) + np.array([3, 4])) / (e2 + 1)
    row2 = (e2 * np.array([1, 2]) + np.array([3, 4]) + e2 * np.array([5, 6])) / (2 * e2 + 1)
    out = ragged_paged_attention_reference(*args, sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(out[:3, 0]), [row0, row1, row2], rtol=1e-6)

    # window 2: position 2 sees keys 1, 2 only; position 1 sees keys 0, 1
    out = ragged_paged_attention_reference(*args, sm_scale=1.0, sliding_window=2)
    row2_w = (np.array([3, 4]) + e2 * np.array([5, 6])) / (1 + e2)
    np.testing.assert_allclose(np.asarray(out[:3, 0]), [row0, row1, row2_w], rtol=1e-6)

    # soft cap 1: a score of 2 becomes tanh(2); 0 stays 0
    out = ragged_paged_attention_reference(*args, sm_scale=1.0, soft_cap=1.0)
    et = math.exp(math.tanh(2.0))
    row1_c = (et * np.array([1, 2]) + np.array([3, 4])) / (et + 1)
    np.testing.assert_allclose(np.asarray(out[1, 0]), row1_c, rtol=1e-6)

    # sm_scale 0.5 halves the scores: e^1 weights
    out = ragged_paged_attention_reference(*args, sm_scale=0.5)
    e1 = math.e
    np.testing.assert_allclose(np.asarray(out[1, 0]), (e1 * np.array([1, 2]) + np.array([3, 4])) / (e1 + 1),
                               rtol=1e-6)


def test_reference_no_live_sequences_is_all_zero():
    out = ragged_paged_attention_reference(*_tiny([[1, 0], [9, 9]], num_seqs=0), sm_scale=1.0)
    assert (np.asarray(out) == 0).all()


# ------------------------------------------------------- reference vs float64 oracle (wide)

REF_OPTIONS = [(None, None), (4, None), (None, 5.0), (1, 2.0)]  # (sliding_window, soft_cap)


# every GQA ratio x page size; the window / soft-cap options rotate so each pair meets each option
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (8, 1), (6, 2)], ids=lambda h: f"hq{h[0]}kv{h[1]}")
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("opt", [0, 1])
def test_reference_matches_oracle(heads, page_size, opt):
    window, soft_cap = REF_OPTIONS[(opt * 2 + heads[0] + page_size // 8) % len(REF_OPTIONS)]
    seqs = [(0, 0), (1, 1), (1, page_size - 1), (1, page_size), (1, page_size + 1), (5, page_size + 1),
            (7, 3 * page_size + 2)]
    case = make_case(seqs, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=16, page_size=page_size)
    out = _reference_jit(*case.args, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)
    expected = oracle(case.args, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)
    check_close(out, expected, jnp.float32, case.owned)


def test_reference_is_jittable_and_bf16_keeps_dtype():
    case = make_case([(3, 10), (1, 4)], dtype=jnp.bfloat16)
    f = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=0.2))
    out = f(*case.args)
    assert out.dtype == jnp.bfloat16
    check_close(out, oracle(case.args, sm_scale=0.2), jnp.bfloat16, case.owned)


# ---------------------------------------------------------------- (b) kernels vs reference

# (num_q_heads, num_kv_heads, head_dim, page_size, dtype, sliding_window, soft_cap):
# a covering subset: every GQA ratio, head_dim, page size, dtype, window and cap appears, most
# pairs too. bf16 on TPU needs page_size >= 16 (sublane packing), see the validator test.
KERNEL_CONFIGS = [
    (2, 2, 64, 8, jnp.float32, None, None),
    (8, 2, 128, 16, jnp.float32, 6, None),
    (8, 1, 256, 32, jnp.float32, None, 30.0),
    (8, 2, 64, 32, jnp.float32, 17, 5.0),
    (6, 2, 128, 8, jnp.float32, None, None),  # GQA 3: not a power of two
    (8, 2, 64, 16, jnp.bfloat16, 9, 20.0),
    (2, 2, 128, 32, jnp.bfloat16, None, None),
    (8, 1, 128, 16, jnp.bfloat16, 40, None),
]


def _cfg_id(c):
    hq, hkv, d, ps, dt, w, cap = c
    return f"g{hq // hkv}-d{d}-ps{ps}-{jnp.dtype(dt).name}-w{w}-cap{cap}"


def _mixed_seqs(page_size):
    # kv lengths 0, 1, ps-1, ps, ps+1, long; q lengths 0, 1, 5 (verify k+1), 12 (prefill chunk)
    return [(1, 1), (0, 0), (1, page_size - 1), (5, page_size), (1, page_size + 1),
            (12, 4 * page_size + 3), (1, 6 * page_size), (5, page_size + 1)]


def _run(platform, case, strict=True, **kw):
    interpret = TPU_STRICT if platform == "tpu" and strict else True
    return ragged_paged_attention(*case.args, platform=platform, interpret=interpret, **kw)


@functools.lru_cache(maxsize=None)
def _config_case(cfg):
    """The case of a kernel config and its reference output, shared by both platforms."""
    hq, hkv, d, ps, dtype, window, cap = cfg
    case = make_case(_mixed_seqs(ps), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                     dtype=dtype, seed=KERNEL_CONFIGS.index(cfg))
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    return case, kw, _reference_jit(*case.args, **kw)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("cfg", KERNEL_CONFIGS, ids=_cfg_id)
def test_kernel_matches_reference(platform, cfg):
    dtype = cfg[4]
    case, kw, expected = _config_case(cfg)
    validate_dynamic(*case.args, **kw, platform=platform)
    out = _run(platform, case, strict=False, **kw)
    assert out.shape == case.args[0].shape and out.dtype == dtype
    check_close(out, expected, dtype, case.owned)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernel_many_blocks(platform):
    """Small blocks: rows of one sequence span several query blocks, one block holds several
    sequences, KV spans many double-buffered page blocks, the window starts mid-sequence."""
    ps = 16
    seqs = [(1, 50), (1, 3), (40, 100), (2, 17), (1, 16), (1, 33), (3, 70)]
    case = make_case(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=ps, seed=3)
    for window in (None, 20):
        kw = dict(sm_scale=0.125, sliding_window=window)
        out = _run(platform, case, **kw, block_q=16, pages_per_block=2)
        check_close(out, oracle(case.args, **kw), jnp.float32, case.owned)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernel_decode_batch_and_empty_step(platform):
    # 12 decode rows (one per sequence) spread over several query blocks
    seqs = [(1, kv) for kv in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 5)]
    case = make_case(seqs, num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=8, seed=5)
    out = _run(platform, case, sm_scale=0.1, block_q=8 if platform == "tpu" else 2)
    check_close(out, oracle(case.args, sm_scale=0.1), jnp.float32, case.owned)

    # no live sequence: every row is padding and comes back exactly 0
    q, k, v, kv_lens, pt, cu, _ = case.args
    out = ragged_paged_attention(q, k, v, kv_lens, pt, cu, jnp.asarray([0], jnp.int32),
                                 sm_scale=0.1, platform=platform,
                                 interpret=TPU_STRICT if platform == "tpu" else True)
    assert (np.asarray(out) == 0).all()


def test_tpu_kernel_double_buffering_has_no_races():
    """The TPU interpreter's race detector sees DMAs and VMEM accesses; a compute that reads a
    buffer slot before its copy was waited on, or a copy into the slot being read, is a race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    case = make_case([(3, 40), (5, 17), (9, 60)], num_q_heads=2, num_kv_heads=1, page_size=8, seed=7)
    params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
    out = ragged_paged_attention(*case.args, sm_scale=0.2, platform="tpu", interpret=params,
                                 pages_per_block=2, block_q=8)
    out.block_until_ready()
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    check_close(out, oracle(case.args, sm_scale=0.2), jnp.float32, case.owned)


def test_kernel_under_jit_and_default_platform():
    case = make_case([(2, 5), (1, 9)], seed=11)
    f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.2, interpret=True))  # tpu on CPU
    check_close(f(*case.args), oracle(case.args, sm_scale=0.2), jnp.float32, case.owned)


# ------------------------------------------------------------------------------ (c) validators


def _good(**over):
    case = make_case([(2, 10), (1, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                     extra_seq_rows=0)
    names = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    d = dict(zip(names, case.args))
    d.update(over)
    return tuple(d[n] for n in names)


def test_validators_accept_a_good_case():
    validate_static(*_good(), sm_scale=0.1, platform="tpu")
    validate_static(*_good(), sm_scale=0.1, platform="gpu")
    validate_dynamic(*_good(), sm_scale=0.1)


@pytest.mark.parametrize("over,match", [
    (dict(q=jnp.zeros((5, 4, 32))), "q head_dim 32 != k/v head_dim 64"),
    (dict(q=jnp.zeros((5, 3, 64))), "num_q_heads 3 must be a positive multiple of num_kv_heads 2"),
    (dict(q=jnp.zeros((5, 4 * 64))), r"q must be \[T, num_q_heads, head_dim\]"),
    (dict(v_pages=jnp.zeros((2, 9, 8, 32))), "k_pages shape .* != v_pages shape"),
    (dict(v_pages=jnp.zeros((2, 8, 8, 64), jnp.bfloat16)), "k_pages dtype float32 != v_pages dtype bfloat16"),
    (dict(q=jnp.zeros((5, 4, 64), jnp.bfloat16)), "k/v_pages dtype float32 must equal q dtype bfloat16"),
    (dict(q=jnp.zeros((5, 4, 64), jnp.int32)), "q dtype int32 unsupported"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), r"kv_lens shape \(3,\) must be \(2,\)"),
    (dict(kv_lens=jnp.zeros((2,), jnp.uint32)), "kv_lens dtype must be int32"),
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), r"cu_q_lens shape \(2,\) must be \(3,\)"),
    (dict(num_seqs=jnp.zeros((), jnp.int32)), r"num_seqs shape \(\) must be \(1,\)"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), "page_indices must be"),
])
def test_validate_static_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        validate_static(*_good(**over), sm_scale=0.1)
    # the public entry points validate too
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_reference(*_good(**over), sm_scale=0.1)


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(sliding_window=2.5), "sliding_window must be a positive int"),
    (dict(soft_cap=0.0), "soft_cap must be a positive finite float"),
    (dict(soft_cap=-1.0), "soft_cap must be a positive finite float"),
    (dict(sm_scale=float("nan")), "sm_scale must be finite"),
    (dict(platform="metal"), "platform must be one of"),
])
def test_validate_static_rejects_options(kw, match):
    kw = {"sm_scale": 0.1, **kw}
    with pytest.raises(ValueError, match=match):
        validate_static(*_good(), **kw)


@pytest.mark.parametrize("platform,shape_over,match", [
    ("tpu", dict(head_dim=96), "TPU kernel: head_dim 96 unsupported; it must be a multiple of 64"),
    ("gpu", dict(head_dim=96), "GPU kernel: head_dim 96 unsupported"),
    ("gpu", dict(head_dim=512), "GPU kernel: head_dim 512 unsupported"),
    ("gpu", dict(page_size=12), "GPU kernel: page_size 12 must be a power of two"),
    ("tpu", dict(page_size=12), "TPU kernel: page_size 12 must be a multiple of 8 for float32"),
    ("tpu", dict(page_size=8, dtype=jnp.bfloat16), "TPU kernel: page_size 8 must be a multiple of 16 for bfloat16"),
])
def test_backend_constraints(platform, shape_over, match):
    d, ps, dt = shape_over.get("head_dim", 64), shape_over.get("page_size", 8), shape_over.get("dtype", jnp.float32)
    args = _good(q=jnp.zeros((5, 4, d), dt), k_pages=jnp.zeros((2, 9, ps, d), dt),
                 v_pages=jnp.zeros((2, 9, ps, d), dt))
    validate_static(*args, sm_scale=0.1)  # fine without a platform: the reference takes any shape
    with pytest.raises(ValueError, match=match):
        validate_static(*args, sm_scale=0.1, platform=platform)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*args, sm_scale=0.1, platform=platform, interpret=True)


def test_validate_dynamic_rejects():
    q, k, v, kv_lens, pt, cu, n = _good()
    num_pages = k.shape[1]

    def bad(match, **over):
        d = dict(kv_lens=kv_lens, page_indices=pt, cu_q_lens=cu, num_seqs=n) | over
        with pytest.raises(ValueError, match=match):
            validate_dynamic(q, k, v, d["kv_lens"], d["page_indices"], d["cu_q_lens"], d["num_seqs"],
                             sm_scale=0.1)

    bad(rf"page index out of range: page_indices\[0, 1\] = {num_pages} not in \[0, {num_pages}\)",
        page_indices=pt.at[0, 1].set(num_pages))
    bad(r"page index out of range: page_indices\[1, 0\] = -1", page_indices=pt.at[1, 0].set(-1))
    bad(r"page_indices\[0, 0\] is the null page 0 but holds KV of sequence 0", page_indices=pt.at[0, 0].set(0))
    bad("sequence 1: q_len 1 exceeds kv_len 0", kv_lens=kv_lens.at[1].set(0))
    bad("sequence 0: kv_len 1000 exceeds pages_per_seq", kv_lens=kv_lens.at[0].set(1000))
    bad("cu_q_lens must be non-decreasing", cu_q_lens=jnp.asarray([0, 2, 1], jnp.int32))
    bad(r"cu_q_lens\[num_seqs\] 99 exceeds the 6 query rows", cu_q_lens=jnp.asarray([0, 2, 99], jnp.int32))
    bad(r"num_seqs 3 must be in \[0, 2\]", num_seqs=jnp.asarray([3], jnp.int32))
    bad("kv_lens.* is negative", kv_lens=kv_lens.at[0].set(-1))
    # rows >= num_seqs are ignored: garbage there is fine
    validate_dynamic(q, k, v, kv_lens.at[1].set(-5), pt.at[1].set(-1), cu, jnp.asarray([1], jnp.int32))


def test_dispatch_needs_interpret_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU-only message")  # runs on every CPU CI machine
    with pytest.raises(ValueError, match="no Pallas kernel runs natively on CPU"):
        ragged_paged_attention(*_good(), sm_scale=0.1)
    with pytest.raises(ValueError, match="TPU kernel: block_q 12 must be a power of two"):
        ragged_paged_attention(*_good(), sm_scale=0.1, platform="tpu", interpret=True, block_q=12)
    with pytest.raises(ValueError, match="GPU kernel: pages_per_block 1 must be a power of two with"):
        ragged_paged_attention(*_good(), sm_scale=0.1, platform="gpu", interpret=True, pages_per_block=1)


# --------------------------------------------------------------------------- benchmark smoke


def test_bench_attention_tool_runs(tmp_path, capsys):
    from jaxinfer.tools import bench_attention

    out = tmp_path / "bench.json"
    rc = bench_attention.main(["--backend", "reference", "--batches", "2", "--contexts", "40",
                               "--prefill-contexts", "40", "--chunk", "8", "--warmup", "1",
                               "--repeats", "1", "--copy-mb", "8", "--head-dim", "64",
                               "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "reference" and report["copy_bandwidth_gbs"] > 0
    kinds = [(r["kind"], r["batch"], r["context"], r["q_tokens"]) for r in report["results"]]
    assert kinds == [("decode", 2, 40, 2), ("prefill", 1, 40, 8)]
    # KV bytes: kv_len * Hkv * D * (K and V) * 4 bytes, summed over sequences
    assert report["results"][0]["kv_bytes"] == 2 * 40 * 1 * 64 * 2 * 4
    assert all(r["median_ms"] > 0 and r["gbs"] > 0 for r in report["results"])
    assert "decode" in capsys.readouterr().out
