"""Ragged paged attention as a Mosaic-TPU Pallas kernel.

Grid (Hkv, T_pad / block_q), both parallel. One program takes one kv head and block_q query rows
(all G q heads of that kv head: a [G * block_q, D] tile, row r = g * block_q + i). The page table,
lengths and cu_q_lens are scalar-prefetched into SMEM. Inside the program a loop visits every live
sequence whose rows overlap the block; for each, a loop walks its KV in blocks of
`pages_per_block` pages, copying pages HBM -> VMEM with double-buffered async DMAs (block b + 1 is
in flight while block b is computed), and keeps the online softmax (m, l, acc) in VMEM scratch.
Rows of the block that belong to the sequence are written at the end of that sequence.

Only pages holding positions the block's rows may attend are fetched; V of slots at or past
kv_len is zeroed so unused pages (any contents, NaN included) never reach the output.

int8 / fp8 KV: the int8 or float8_e4m3fn pages and their per-token scales f32[Hkv, N, ps] are DMA'd per page into
double-buffered VMEM (the scales as one [1, ps] row per page, on the page's semaphore). K and V are
widened to q's dtype in VMEM; the scales are applied as rows over the block's KV columns:
scores[:, l] *= k_scale[l] and p[:, l] *= v_scale[l] before p @ V. The [PB, ps] scale tile is
turned into that [1, BK] row on the MXU (a 0/1 expand matmul at fp32 precision, then a masked
sublane sum), which avoids a sublane->lane reshape. Scales of slots past kv_end (unused or not
fetched: NaN allowed) are replaced by 0 with a select before the expand matmul; fp8 V there is
zeroed like float V (e4m3 has NaN codes, int8 has none).

Sinks: f32[Hq] whole in SMEM; each program selects its tile rows' sinks into an [R, 1] column
(row g * BQ + i: sinks[h * G + g]), and a sequence's rows end as out = acc / (l + exp(sink - m)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.pallas_kernels.masking import MASK_FLOOR

LANES = 128


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # i32[S]
    page_table_ref,  # i32[S * P]  (flattened: 2-D SMEM arrays pad badly)
    cu_q_lens_ref,  # i32[S + 1]
    num_seqs_ref,  # i32[1]
    # inputs
    q_ref,  # [G, BQ, D]
    k_hbm_ref,  # [Hkv, N, ps, D] (HBM; int8 or float8_e4m3fn when quantized)
    v_hbm_ref,  # [Hkv, N, ps, D] (HBM)
    *refs,  # quantized: k/v_scale (HBM) f32[Hkv, N, ps]; sinks: sinks_ref; then o_ref, scratch
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
    has_sinks: bool,
):
    ks_hbm_ref, vs_hbm_ref = refs[:2] if quantized else (None, None)
    sinks_ref = refs[2 * quantized] if has_sinks else None  # f32[Hq] (SMEM)
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref, *scale_bufs = refs[2 * quantized + has_sinks:]
    ks_buf, vs_buf = scale_bufs if quantized else (None, None)
    # o_ref   [G, BQ, D]        output tile
    # k/v_buf [2, PB, ps, D]    page blocks (slot, page, row, lane), k_pages dtype
    # sems    DMA [2, 2]        (buffer slot, k|v); a page's scale copy shares its page's semaphore
    # m_ref   f32[G * BQ, LANES]  running max, lane-replicated
    # l_ref   f32[G * BQ, LANES]  running denominator, lane-replicated
    # acc_ref f32[G * BQ, D]
    # ks/vs_buf f32[2, PB, ps]  per-token scales of the buffered pages (quantized only)
    head = pl.program_id(0)
    q_blk = pl.program_id(1)
    group, block_q, head_dim = q_ref.shape
    _, pages_per_block, page_size, _ = k_buf.shape
    block_kv = pages_per_block * page_size
    rows = group * block_q
    blk_start = q_blk * block_q
    blk_end = blk_start + block_q
    num_seqs = num_seqs_ref[0]

    o_ref[...] = jnp.zeros_like(o_ref)
    q = q_ref[...].reshape(rows, head_dim)  # [R, D]
    # token row of each tile row; block_q is a power of two
    row_tok = blk_start + (lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (block_q - 1))  # [R, 1]
    if has_sinks:  # [R, 1]: row g * BQ + i takes sinks[head * G + g]
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        sink = jnp.full((rows, 1), sinks_ref[head * group], jnp.float32)
        for g in range(1, group):
            sink = jnp.where(row >= g * block_q, sinks_ref[head * group + g], sink)

    def page_copies(seq, kv_blk, slot, num_pages_needed):
        """(condition, [copies]) for each page of KV block `kv_blk` of `seq`."""
        out = []
        for j in range(pages_per_block):
            page = kv_blk * pages_per_block + j
            needed = page < num_pages_needed
            page_id = page_table_ref[seq * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)]
            page_id = jnp.where(needed, page_id, 0)
            copies = [
                pltpu.make_async_copy(k_hbm_ref.at[head, page_id], k_buf.at[slot, j], sems.at[slot, 0]),
                pltpu.make_async_copy(v_hbm_ref.at[head, page_id], v_buf.at[slot, j], sems.at[slot, 1]),
            ]
            if quantized:  # this page's [1, ps] scale rows, on the same semaphores
                copies += [
                    pltpu.make_async_copy(ks_hbm_ref.at[head, pl.ds(page_id, 1)],
                                          ks_buf.at[slot, pl.ds(j, 1)], sems.at[slot, 0]),
                    pltpu.make_async_copy(vs_hbm_ref.at[head, pl.ds(page_id, 1)],
                                          vs_buf.at[slot, pl.ds(j, 1)], sems.at[slot, 1]),
                ]
            out.append((needed, copies))
        return out

    def start(page_list):
        for needed, copies in page_list:
            @pl.when(needed)
            def _():
                for c in copies:
                    c.start()

    def wait(page_list):
        for needed, copies in page_list:
            @pl.when(needed)
            def _():
                for c in copies:
                    c.wait()

    def scale_rows(slot, kv_base, kv_end):
        """f32[1, BK] K and V scale rows over the block's KV columns (column c = page c // ps,
        slot c % ps); 0 for slots at or past kv_end (unused or not fetched: NaN included)."""
        pos = (kv_base + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 0) * page_size
               + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1))  # [PB, ps]
        col = lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)  # [1, BK]
        col_page = jnp.zeros_like(col)  # col // ps, without a vector division
        for j in range(1, pages_per_block):
            col_page += (col >= j * page_size).astype(jnp.int32)
        col_slot = col - col_page * page_size  # [1, BK]
        expand = (lax.broadcasted_iota(jnp.int32, (page_size, block_kv), 0) == col_slot)  # [ps, BK]
        expand = expand.astype(jnp.float32)
        own = lax.broadcasted_iota(jnp.int32, (pages_per_block, block_kv), 0) == col_page  # [PB, BK]

        def row(buf):
            tile = jnp.where(pos < kv_end, buf[slot], 0.0)  # [PB, ps]; a select: NaN * 0 is NaN
            # wide[j, c] = tile[j, c % ps]: exact at fp32 contract precision (a 0/1 matrix)
            wide = jnp.dot(tile, expand, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)  # [PB, BK]
            return jnp.sum(jnp.where(own, wide, 0.0), axis=0, keepdims=True)  # [1, BK]

        return row(ks_buf), row(vs_buf)

    def attend_seq(seq):
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        q_len = q_end - q_start
        # positions of the first/last rows of this block owned by `seq`
        first_pos = kv_len - q_len + (jnp.maximum(q_start, blk_start) - q_start)
        last_pos = kv_len - q_len + (jnp.minimum(q_end, blk_end) - 1 - q_start)
        kv_end = jnp.minimum(last_pos + 1, kv_len)  # exclusive
        kv_begin = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        kv_blk_lo = lax.div(kv_begin, block_kv)  # non-negative: truncation == floor, no sign op
        kv_blk_hi = lax.div(kv_end + block_kv - 1, block_kv)
        num_pages_needed = lax.div(kv_end + page_size - 1, page_size)

        row_pos = kv_len - q_len + (row_tok - q_start)  # [R, 1]
        row_owned = (row_tok >= q_start) & (row_tok < q_end)  # [R, 1]

        m_ref[...] = jnp.full_like(m_ref, MASK_FLOOR)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(kv_blk_lo < kv_blk_hi)
        def _():
            start(page_copies(seq, kv_blk_lo, 0, num_pages_needed))

        def kv_step(kv_blk, carry):
            slot = (kv_blk - kv_blk_lo) & 1

            @pl.when(kv_blk + 1 < kv_blk_hi)
            def _():
                start(page_copies(seq, kv_blk + 1, 1 - slot, num_pages_needed))

            wait(page_copies(seq, kv_blk, slot, num_pages_needed))
            # widen before the reshape: int8 sublane tiles are 32 rows, pages may be 16
            k = k_buf[slot].astype(q.dtype).reshape(block_kv, head_dim)  # [BK, D]
            v = v_buf[slot].astype(q.dtype).reshape(block_kv, head_dim)  # [BK, D]
            kv_base = kv_blk * block_kv
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [R, BK]
            if quantized:
                k_row, v_row = scale_rows(slot, kv_base, kv_end)  # [1, BK] each
                s = s * (k_row * sm_scale)  # x = value * scale
            else:
                s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            col = kv_base + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)  # [R, BK]
            mask = row_owned & (col <= row_pos) & (col < kv_len)
            if sliding_window is not None:
                mask &= row_pos - col < sliding_window
            s = jnp.where(mask, s, -jnp.inf)
            m_prev = m_ref[:, :1]  # [R, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)  # [R, BK]
            alpha = jnp.exp(m_prev - m_next)  # [R, 1]
            l_ref[...] = jnp.broadcast_to(
                alpha * l_ref[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
            m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
            p_v = p * v_row if quantized else p  # [R, BK]
            if not quantized or jnp.issubdtype(v_buf.dtype, jnp.floating):
                # slots past kv_end were not fetched (stale VMEM) or are unused: keep them out of
                # p @ v (int8 V is always finite and p is 0 there: only float V needs this)
                stored = kv_base + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) < kv_end  # [BK, 1]
                v = jnp.where(stored, v, jnp.zeros_like(v))
            pv = jnp.dot(p_v.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
            acc_ref[...] = alpha * acc_ref[...] + pv
            return carry

        lax.fori_loop(kv_blk_lo, kv_blk_hi, kv_step, 0)

        l = l_ref[:, :1]  # [R, 1]
        if has_sinks:  # the sink's zero-value logit, relative to the running max
            l = l + jnp.exp(sink - m_ref[:, :1])
        out = acc_ref[...] / jnp.where(l > 0, l, 1.0)  # [R, D]
        prev = o_ref[...].reshape(rows, head_dim)
        o_ref[...] = jnp.where(row_owned, out.astype(o_ref.dtype), prev).reshape(
            group, block_q, head_dim)

    def seq_step(seq, carry):
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]

        @pl.when((q_start < q_end) & (q_start < blk_end) & (q_end > blk_start))
        def _():
            attend_seq(seq)

        return carry

    lax.fori_loop(0, num_seqs, seq_step, 0)


def _default_block_q(num_tokens: int, dtype) -> int:
    min_rows = 8 * (4 // jnp.dtype(dtype).itemsize)  # sublane tile: 8 (f32) / 16 (bf16)
    return max(min_rows, min(32, pl.next_power_of_2(num_tokens)))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_q",
                     "pages_per_block", "vmem_limit_bytes"),
)
def ragged_paged_attention_tpu(
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
    vmem_limit_bytes: int | None = None,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, ps] with int8 / fp8 k/v_pages (x = value * scale)
    v_scale: jax.Array | None = None,  # f32[Hkv, N, ps]
    sinks: jax.Array | None = None,  # f32[Hq]
) -> jax.Array:  # [T, Hq, D]
    """Mosaic-TPU ragged paged attention. Call through `ragged_paged_attention` (validates)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    min_rows = 8 * (4 // jnp.dtype(q.dtype).itemsize)
    if block_q is None:
        block_q = _default_block_q(num_tokens, q.dtype)
    if not (block_q & (block_q - 1) == 0 and block_q % min_rows == 0):
        raise ValueError(f"TPU kernel: block_q {block_q} must be a power of two and a multiple of {min_rows}")
    if pages_per_block is None:
        pages_per_block = max(1, min(pages_per_seq, 128 // page_size))
    if not 0 < pages_per_block <= pages_per_seq:
        raise ValueError(f"TPU kernel: pages_per_block {pages_per_block} must be in [1, {pages_per_seq}]")

    num_q_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_q_blocks * block_q
    # [T, Hq, D] -> [Hkv, G, T_pad, D]: one kv head's G q heads form a [G, BQ, D] tile
    qk = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, padded - num_tokens), (0, 0)))

    quantized = k_scale is not None
    has_sinks = sinks is not None
    kernel = functools.partial(
        _kernel, pages_per_seq=pages_per_seq, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized,
        has_sinks=has_sinks)
    tile = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i, *_: (h, 0, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    rows = group * block_q
    scratch = [
        pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype),
        pltpu.VMEM((2, pages_per_block, page_size, head_dim), v_pages.dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.VMEM((rows, LANES), jnp.float32),
        pltpu.VMEM((rows, LANES), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]
    operands = [qk, k_pages, v_pages]
    in_specs = [tile, hbm, hbm]
    if quantized:  # scales stay in HBM in the pool's page indexing; DMA'd per page with the pages
        scratch += [pltpu.VMEM((2, pages_per_block, page_size), jnp.float32)] * 2
        operands += [k_scale, v_scale]
        in_specs += [hbm, hbm]
    if has_sinks:  # f32[Hq], read as scalars
        operands.append(sinks.astype(jnp.float32))
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_kv_heads, num_q_blocks),
            in_specs=in_specs,
            out_specs=tile,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qk.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, page_indices.reshape(-1), cu_q_lens, num_seqs, *operands)
    # [Hkv, G, T_pad, D] -> [T, Hq, D]
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
