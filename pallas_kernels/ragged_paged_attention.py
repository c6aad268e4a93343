"""Ragged paged attention: the jnp reference, the validators and the kernel dispatch.

One call serves a whole step: decode (q_len 1), speculative verify (q_len k+1) and chunked prefill
(q_len = chunk) of many sequences, their query rows packed sequence after sequence.

Layouts (T query rows, S sequence rows, P pages per sequence, N pages in the pool):
  q             [T, Hq, D]            rows cu_q_lens[s]:cu_q_lens[s+1] belong to sequence s
  k/v_pages     [Hkv, N, ps, D]       page 0 is the null page (never read for valid positions)
  kv_lens       i32[S]                KV length of s INCLUDING this step's tokens
  page_indices  i32[S, P]             pages of s; entries past its length point at page 0
  cu_q_lens     i32[S + 1]
  num_seqs      i32[1]                rows >= num_seqs of the three above are ignored
  k/v_scale     f32[Hkv, N, ps]       optional, with int8 (round(x / scale)) or float8_e4m3fn
                                      (x / scale) k/v_pages: x = value * scale, one scale per
                                      token per kv head
  sinks         f32[Hq]               optional (gpt-oss): one logit per q head joining each of its
                                      softmaxes, with a zero value vector; used raw (not scaled,
                                      capped or masked). With s_j the visible keys' scores (after
                                      sm_scale and soft_cap), m = max(max_j s_j, sinks[h]):
                                      out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m))

Query i of sequence s sits at position p = kv_len_s - q_len_s + i and attends KV positions j with
j <= p and, with a sliding window w, p - j < w (the window counts the token itself). Rows owned by
no live sequence come back 0. GQA: q head h reads kv head h // (Hq // Hkv).

The kernels live beside this file: `ragged_paged_attention_tpu` (Mosaic) and
`ragged_paged_attention_gpu` (Triton). Both run on CPU with `interpret=True`, and both read int8
and fp8 (e4m3) pages: widened to q's dtype in the kernel, the scales applied to the score columns (K) and to the
probabilities before p @ V (V); no dequantized copy of the pages is made. Sinks join a row's
online softmax (m, l, acc) once its keys are done: out = acc / (l + e^(sink - m)).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.pallas_kernels.masking import MASK_FLOOR

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # with k/v_scale
PLATFORMS = ("tpu", "gpu")
GPU_HEAD_DIMS = (16, 32, 64, 128, 256)  # Triton tiles: a power of two in 16..256


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


# ----------------------------------------------------------------------------------- validators


def validate_static(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, N, ps, D]
    v_pages,  # [Hkv, N, ps, D]
    kv_lens,  # i32[S]
    page_indices,  # i32[S, P]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    platform: str | None = None,
    k_scale=None,
    v_scale=None,
    sinks=None,
) -> None:
    """Shape, dtype and option checks that need no array values (safe under jit tracing).

    `platform` ("tpu" | "gpu" | None) adds that kernel's layout constraints.
    Raises ValueError with the offending names and values.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got shape {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages shape {k_pages.shape} != v_pages shape {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, head_dim_kv = k_pages.shape
    if head_dim != head_dim_kv:
        raise ValueError(f"q head_dim {head_dim} != k/v head_dim {head_dim_kv}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
        )
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"empty page pool: num_pages {num_pages}, page_size {page_size}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} unsupported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (int8 KV) or neither")
    if k_scale is not None:
        if jnp.dtype(k_pages.dtype) not in QUANTIZED_KV_DTYPES:
            raise ValueError(f"k/v_scale given: k/v_pages must be int8 or float8_e4m3fn, got "
                             f"{k_pages.dtype}")
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(sc.shape) != tuple(k_pages.shape[:3]):
                raise ValueError(f"{name} shape {sc.shape} must be {k_pages.shape[:3]} "
                                 "([num_kv_heads, num_pages, page_size])")
            if jnp.dtype(sc.dtype) != jnp.dtype(jnp.float32):
                raise ValueError(f"{name} dtype must be float32, got {sc.dtype}")
    elif jnp.dtype(k_pages.dtype) != jnp.dtype(q.dtype):
        raise ValueError(f"k/v_pages dtype {k_pages.dtype} must equal q dtype {q.dtype} "
                         "(int8 / fp8 pages need k_scale / v_scale)")
    if sinks is not None:
        if tuple(sinks.shape) != (num_q_heads,):
            raise ValueError(f"sinks shape {sinks.shape} must be ({num_q_heads},) (one logit per q head)")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"sinks dtype must be a float dtype, got {sinks.dtype}")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [num_seqs, pages_per_seq], got shape {page_indices.shape}")
    max_seqs, _ = page_indices.shape
    if kv_lens.shape != (max_seqs,):
        raise ValueError(f"kv_lens shape {kv_lens.shape} must be ({max_seqs},) to match page_indices rows")
    if cu_q_lens.shape != (max_seqs + 1,):
        raise ValueError(f"cu_q_lens shape {cu_q_lens.shape} must be ({max_seqs + 1},) (page_indices rows + 1)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs shape {num_seqs.shape} must be (1,)")
    for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} dtype must be int32, got {a.dtype}")
    if sm_scale is not None and not np.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and not (np.isfinite(soft_cap) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive finite float or None, got {soft_cap}")

    if platform is None:
        return
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    if platform == "tpu":
        if head_dim % 64:
            raise ValueError(f"TPU kernel: head_dim {head_dim} unsupported; it must be a multiple of 64")
        sublanes = 8 * (4 // jnp.dtype(q.dtype).itemsize)  # 8 rows f32, 16 rows bf16/f16
        if page_size % sublanes:
            raise ValueError(
                f"TPU kernel: page_size {page_size} must be a multiple of {sublanes} for {q.dtype}"
            )
    else:
        if head_dim not in GPU_HEAD_DIMS:
            raise ValueError(
                f"GPU kernel: head_dim {head_dim} unsupported; Triton tiles need a power of two in 16..256"
            )
        if not _is_pow2(page_size):
            raise ValueError(f"GPU kernel: page_size {page_size} must be a power of two")


def validate_dynamic(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, N, ps, D]
    v_pages,  # [Hkv, N, ps, D]
    kv_lens,  # i32[S]
    page_indices,  # i32[S, P]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
    **static_kw: Any,
) -> None:
    """Checks of the metadata values (host side; pulls the small int arrays to numpy).

    Not callable under jit. Page ids covering valid KV positions must lie in [1, num_pages); every
    page-table entry must lie in [0, num_pages) (kernels may fetch whole blocks of pages).
    """
    validate_static(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **static_kw)
    num_tokens = q.shape[0]
    _, num_pages, page_size, _ = k_pages.shape
    kv = np.asarray(kv_lens)
    pt = np.asarray(page_indices)
    cu = np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs)[0])
    max_seqs, pages_per_seq = pt.shape
    if not 0 <= n <= max_seqs:
        raise ValueError(f"num_seqs {n} must be in [0, {max_seqs}]")
    if n == 0:
        return
    cu_live = cu[: n + 1]
    if cu_live[0] < 0:
        raise ValueError(f"cu_q_lens[0] {cu_live[0]} must be >= 0")
    q_lens = np.diff(cu_live)
    if (q_lens < 0).any():
        s = int(np.argmax(q_lens < 0))
        raise ValueError(f"cu_q_lens must be non-decreasing; sequence {s} has q_len {q_lens[s]}")
    if cu_live[-1] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs] {cu_live[-1]} exceeds the {num_tokens} query rows")
    kv_live = kv[:n]
    if (kv_live < 0).any():
        s = int(np.argmax(kv_live < 0))
        raise ValueError(f"kv_lens[{s}] = {kv_live[s]} is negative")
    bad = q_lens > kv_live
    if bad.any():
        s = int(np.argmax(bad))
        raise ValueError(f"sequence {s}: q_len {q_lens[s]} exceeds kv_len {kv_live[s]}")
    too_long = kv_live > pages_per_seq * page_size
    if too_long.any():
        s = int(np.argmax(too_long))
        raise ValueError(
            f"sequence {s}: kv_len {kv_live[s]} exceeds pages_per_seq {pages_per_seq} * page_size {page_size}"
        )
    pt_live = pt[:n]
    oob = (pt_live < 0) | (pt_live >= num_pages)
    if oob.any():
        s, j = (int(x) for x in np.argwhere(oob)[0])
        raise ValueError(f"page index out of range: page_indices[{s}, {j}] = {pt_live[s, j]} not in [0, {num_pages})")
    used = np.arange(pages_per_seq)[None, :] < -(-kv_live[:, None] // page_size)  # [n, P]
    null = used & (pt_live == 0)
    if null.any():
        s, j = (int(x) for x in np.argwhere(null)[0])
        raise ValueError(f"page_indices[{s}, {j}] is the null page 0 but holds KV of sequence {s}")


# ------------------------------------------------------------------------------------ reference


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, ps, D]
    v_pages: jax.Array,  # [Hkv, N, ps, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, ps] with int8 k/v_pages
    v_scale: jax.Array | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
) -> jax.Array:  # [T, Hq, D], q.dtype
    """Plain-jnp ragged paged attention, computed in f32. Jittable (all shapes static).
    int8 K/V pages (with k_scale / v_scale) are dequantized as value * scale. `sinks` add one
    zero-value logit per q head to each softmax.

    Each query row gathers its own sequence's pages: vmapped over all rows when that is small,
    else lax.map over batches of rows so memory stays O(256 MiB), not O(T * P * ps * Hkv * D).
    """
    validate_static(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    kv_span = pages_per_seq * page_size
    n = num_seqs[0]

    live = jnp.arange(max_seqs) < n  # [S]
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [S], non-decreasing
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    seq_of_row = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # [T]
    seq = jnp.minimum(seq_of_row, max_seqs - 1)  # [T]
    row_live = (seq_of_row < n) & (rows >= cu_q_lens[seq])  # [T]

    def one_row(args):
        qr, s, t, ok = args  # [Hq, D], (), (), ()
        kv_len = kv_lens[s]
        q_start = cu_q_lens[s]
        pos = kv_len - (cu_q_lens[s + 1] - q_start) + (t - q_start)
        pages = page_indices[s]  # [P]
        k = k_pages[:, pages].reshape(num_kv_heads, kv_span, head_dim).astype(jnp.float32)  # [Hkv, L, D]
        v = v_pages[:, pages].reshape(num_kv_heads, kv_span, head_dim).astype(jnp.float32)
        if k_scale is not None:
            k = k * k_scale[:, pages].reshape(num_kv_heads, kv_span, 1)
            v = v * v_scale[:, pages].reshape(num_kv_heads, kv_span, 1)
        j = jnp.arange(kv_span)  # [L]
        stored = j < kv_len  # [L]
        mask = stored & (j <= pos) & ok  # [L]
        if sliding_window is not None:
            mask &= pos - j < sliding_window
        v = jnp.where(stored[None, :, None], v, 0.0)  # never let unused slots (NaN) reach p @ v
        qg = qr.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)  # [Hkv, G, D]
        scores = jnp.einsum("hgd,hld->hgl", qg, k, precision=lax.Precision.HIGHEST) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask, scores, -jnp.inf)  # [Hkv, G, L]
        mx = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), MASK_FLOOR)  # [Hkv, G, 1]
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)  # [Hkv, G, 1]
            mx = jnp.maximum(mx, sink)
        p = jnp.where(mask, jnp.exp(scores - mx), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        if sinks is not None:
            denom += jnp.exp(sink - mx)
        out = jnp.einsum("hgl,hld->hgd", p, v, precision=lax.Precision.HIGHEST)
        out = out / jnp.where(denom > 0, denom, 1.0)
        return out.reshape(num_q_heads, head_dim)  # [Hq, D]

    # vmap over rows when the per-row gathered K/V is small; else lax.map in batches (bounded memory)
    gathered = num_tokens * 2 * num_kv_heads * kv_span * head_dim * 4  # bytes of f32 K and V
    if gathered <= (256 << 20):
        out = jax.vmap(one_row)((q, seq, rows, row_live))  # [T, Hq, D]
    else:
        batch = max(1, min(num_tokens, (256 << 20) * num_tokens // gathered))
        out = lax.map(one_row, (q, seq, rows, row_live), batch_size=batch)
    return jnp.where(row_live[:, None, None], out, 0.0).astype(q.dtype)


# ------------------------------------------------------------------------------------- dispatch


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, ps, D]
    v_pages: jax.Array,  # [Hkv, N, ps, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    platform: str | None = None,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
    **block_options: Any,
) -> jax.Array:  # [T, Hq, D]
    """Run the Pallas kernel of `platform` ("tpu" Mosaic | "gpu" Triton).
    int8 K/V: pass int8 k/v_pages with both k_scale and v_scale (f32[Hkv, N, ps]).
    sinks: f32[Hq] attention-sink logits (gpt-oss), or None.

    platform None: the current default backend's kernel ("tpu" under interpret on CPU).
    block_options: TPU `block_q`, `pages_per_block`, `vmem_limit_bytes`;
                   GPU `block_q`, `pages_per_block`, `num_warps`, `num_stages`.
    """
    if platform is None:
        backend = jax.default_backend()
        if backend == "tpu":
            platform = "tpu"
        elif backend in ("gpu", "cuda", "rocm"):
            platform = "gpu"
        elif interpret:
            platform = "tpu"
        else:
            raise ValueError(
                "no Pallas kernel runs natively on CPU: pass interpret=True (with platform 'tpu' "
                "or 'gpu') or use ragged_paged_attention_reference / the XLA path"
            )
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
    validate_static(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                    platform=platform, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if platform == "tpu":
        from jaxinfer.pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu as kernel
    else:
        from jaxinfer.pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu as kernel
    return kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=float(sm_scale),
                  sliding_window=None if sliding_window is None else int(sliding_window),
                  soft_cap=None if soft_cap is None else float(soft_cap),
                  interpret=interpret, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                  **block_options)
