"""Ragged paged attention as a Pallas (Triton) GPU kernel.

Grid (T_pad / block_q, Hkv). One program takes block_q query rows of one kv head with all of its
q heads, as a [block_q * Gp, D] tile (row r = token r // Gp, q head r % Gp; G is padded to the
power of two Gp for Triton). It finds the live sequences overlapping its rows from a vector load of
cu_q_lens, and for each walks that sequence's KV in blocks of `pages_per_block` pages (gather-loads
of the page ids), keeping the online softmax (m, l, acc) in registers. Rows are merged into the
output tile as each sequence finishes; the tile is stored once.

Only page-table entries covering positions the rows may attend are followed (others read the null
page); V of slots at or past kv_len is zeroed so unused pages (NaN included) never leak.

int8 / fp8 KV: the int8 or float8_e4m3fn pages are gather-loaded (a quarter of f32's bytes, half of
bf16's) and widened to
q's dtype in registers; the per-token scales f32[Hkv, N, ps] are gather-loaded with the same page
ids as a [BK] row and applied as scores[:, l] *= k_scale[l] and p[:, l] *= v_scale[l] before
p @ V. Scales of slots at or past kv_end (NaN allowed) are replaced by 0 with a select; so is fp8
V there (e4m3 has NaN codes, int8 has none).

Sinks: the wrapper lays sinks[Hq] out as one f32 per tile row, [Hkv, BQ * Gp]; a sequence's rows
end as out = acc / (l + exp(sink - m)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels.masking import MASK_FLOOR


def _kernel(
    q_ref,  # [R, D], R = BQ * Gp
    k_ref,  # [N, ps, D] (this kv head's pool; int8 or float8_e4m3fn when quantized)
    v_ref,  # [N, ps, D]
    kv_lens_ref,  # i32[S]
    page_table_ref,  # i32[S, P_pad]
    cu_q_lens_ref,  # i32[C], C = pow2 >= S + 1
    num_seqs_ref,  # i32[1]
    *refs,  # quantized: ks_ref, vs_ref f32[N, ps] (this kv head's scales); sinks: sinks_ref
    # f32[R] (this kv head's sink per row); then o_ref [R, D]
    quantized: bool,
    has_sinks: bool,
    block_q: int,
    group_pad: int,
    pages_per_block: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    sinks_ref = refs[2 * quantized] if has_sinks else None
    o_ref = refs[-1]
    q_blk = pl.program_id(0)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_kv = pages_per_block * page_size
    blk_start = q_blk * block_q
    blk_end = blk_start + block_q
    num_seqs = num_seqs_ref[0]

    q = q_ref[...]  # [R, D]
    row_tok = blk_start + lax.broadcasted_iota(jnp.int32, (rows,), 0) // group_pad  # [R]

    # live sequences overlapping [blk_start, blk_end): seq_lo <= s < seq_hi
    cu = cu_q_lens_ref[...]  # [C]
    idx = lax.broadcasted_iota(jnp.int32, cu.shape, 0)
    seq_lo = jnp.sum(((idx >= 1) & (idx <= num_seqs) & (cu <= blk_start)).astype(jnp.int32))
    seq_hi = jnp.sum(((idx < num_seqs) & (cu < blk_end)).astype(jnp.int32))

    def attend_seq(seq, out):  # out: f32[R, D]
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        q_len = q_end - q_start
        first_pos = kv_len - q_len + (jnp.maximum(q_start, blk_start) - q_start)
        last_pos = kv_len - q_len + (jnp.minimum(q_end, blk_end) - 1 - q_start)
        kv_end = jnp.minimum(last_pos + 1, kv_len)  # exclusive
        kv_begin = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        kv_blk_lo = kv_begin // block_kv
        kv_blk_hi = (kv_end + block_kv - 1) // block_kv
        num_pages_needed = (kv_end + page_size - 1) // page_size

        row_pos = kv_len - q_len + (row_tok - q_start)  # [R]
        row_owned = (row_tok >= q_start) & (row_tok < q_end)  # [R]

        def kv_step(kv_blk, carry):
            acc, m_prev, l_prev = carry  # [R, D], [R], [R]
            page0 = kv_blk * pages_per_block
            pages = page0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)  # [PB]
            page_ids = page_table_ref[seq, pl.ds(page0, pages_per_block)]  # [PB]
            page_ids = jnp.where(pages < num_pages_needed, page_ids, 0)
            k = k_ref[page_ids].reshape(block_kv, head_dim).astype(q.dtype)  # [BK, D]
            v = v_ref[page_ids].reshape(block_kv, head_dim).astype(q.dtype)  # [BK, D]
            kv_base = kv_blk * block_kv
            col = kv_base + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)  # [BK]
            s = plgpu.dot(q, k, trans_b=True, allow_tf32=False).astype(jnp.float32)  # [R, BK]
            if quantized:  # x = value * scale; unused slots' scales may be NaN: select, not multiply
                k_sc = jnp.where(col < kv_end, ks_ref[page_ids].reshape(block_kv), 0.0)  # [BK]
                s = s * (k_sc * sm_scale)[None, :]
            else:
                s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = row_owned[:, None] & (col[None, :] <= row_pos[:, None]) & (col[None, :] < kv_len)
            if sliding_window is not None:
                mask &= row_pos[:, None] - col[None, :] < sliding_window
            s = jnp.where(mask, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [R]
            p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # [R, BK]
            alpha = jnp.exp(m_prev - m_next)  # [R]
            l_next = alpha * l_prev + jnp.sum(p, axis=1)
            if quantized:
                v_sc = jnp.where(col < kv_end, vs_ref[page_ids].reshape(block_kv), 0.0)  # [BK]
                p_v = p * v_sc[None, :]
            else:
                p_v = p
            if not quantized or jnp.issubdtype(v_ref.dtype, jnp.floating):
                # slots past kv_end were not fetched (null page) or are unused: keep them out of
                # p @ v (int8 V is always finite and p is 0 there: only float V needs this)
                v = jnp.where((col < kv_end)[:, None], v, jnp.zeros_like(v))
            pv = plgpu.dot(p_v.astype(v.dtype), v, allow_tf32=False).astype(jnp.float32)  # [R, D]
            return alpha[:, None] * acc + pv, m_next, l_next

        acc0 = jnp.zeros((rows, head_dim), jnp.float32)
        m0 = jnp.full((rows,), MASK_FLOOR, jnp.float32)
        l0 = jnp.zeros((rows,), jnp.float32)
        acc, m, l = lax.fori_loop(kv_blk_lo, kv_blk_hi, kv_step, (acc0, m0, l0))
        if has_sinks:  # the sink's zero-value logit, relative to the running max
            l = l + jnp.exp(sinks_ref[...] - m)
        res = acc / jnp.where(l > 0, l, 1.0)[:, None]
        return jnp.where(row_owned[:, None], res, out)

    def seq_step(seq, out):
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        overlaps = (q_start < q_end) & (q_start < blk_end) & (q_end > blk_start)
        return lax.cond(overlaps, attend_seq, lambda _, o: o, seq, out)

    out = lax.fori_loop(seq_lo, seq_hi, seq_step, jnp.zeros((rows, head_dim), jnp.float32))
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_q",
                     "pages_per_block", "num_warps", "num_stages"),
)
def ragged_paged_attention_gpu(
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
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, ps] with int8 / fp8 k/v_pages (x = value * scale)
    v_scale: jax.Array | None = None,  # f32[Hkv, N, ps]
    sinks: jax.Array | None = None,  # f32[Hq]
) -> jax.Array:  # [T, Hq, D]
    """Triton ragged paged attention. Call through `ragged_paged_attention` (validates)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    if block_q is None:
        block_q = max(1, 16 // group_pad)  # >= 16 rows: the smallest Triton dot tile
    if block_q & (block_q - 1) or block_q * group_pad < 16:
        raise ValueError(
            f"GPU kernel: block_q {block_q} must be a power of two with block_q * {group_pad} >= 16")
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    if pages_per_block & (pages_per_block - 1) or pages_per_block * page_size < 16:
        raise ValueError(
            f"GPU kernel: pages_per_block {pages_per_block} must be a power of two with "
            f"pages_per_block * page_size {page_size} >= 16")

    num_q_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_q_blocks * block_q
    # [T, Hq, D] -> [Hkv, T_pad * Gp, D]: row t * Gp + g is token t, q head g of the kv head
    qk = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qk = jnp.pad(qk, ((0, 0), (0, padded - num_tokens), (0, group_pad - group), (0, 0)))
    qk = qk.reshape(num_kv_heads, padded * group_pad, head_dim)
    # pad the page table to whole blocks (entries read as null page) and cu_q_lens to a power of 2
    pt = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % pages_per_block)))
    cu = jnp.pad(cu_q_lens, (0, pl.next_power_of_2(max_seqs + 1) - (max_seqs + 1)), mode="edge")

    rows = block_q * group_pad
    quantized = k_scale is not None
    has_sinks = sinks is not None
    kernel = functools.partial(
        _kernel, quantized=quantized, has_sinks=has_sinks, block_q=block_q, group_pad=group_pad,
        pages_per_block=pages_per_block, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap)
    tile = pl.BlockSpec((None, rows, head_dim), lambda i, h: (h, i, 0))
    pool = pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, h: (h, 0, 0, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, h: (0,) * a.ndim)  # noqa: E731
    operands = [qk, k_pages, v_pages, kv_lens, pt, cu, num_seqs]
    in_specs = [tile, pool, pool, whole(kv_lens), whole(pt), whole(cu), whole(num_seqs)]
    if quantized:  # this kv head's scales, gathered with the same page ids as its pages
        operands += [k_scale, v_scale]
        in_specs += [pl.BlockSpec((None, *k_scale.shape[1:]), lambda i, h: (h, 0, 0))] * 2
    if has_sinks:  # [Hq] -> [Hkv, BQ * Gp]: row t * Gp + g holds sinks[h * G + g] (0 for g >= G)
        sink_rows = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group),
                            ((0, 0), (0, 0), (0, group_pad - group)))
        operands.append(jnp.tile(sink_rows, (1, block_q, 1)).reshape(num_kv_heads, rows))
        in_specs.append(pl.BlockSpec((None, rows), lambda i, h: (h, 0)))
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads),
        in_specs=in_specs,
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(qk.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*operands)
    # [Hkv, T_pad * Gp, D] -> [T, Hq, D]
    out = out.reshape(num_kv_heads, padded, group_pad, head_dim)[:, :num_tokens, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
