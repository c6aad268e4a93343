"""Attention metadata of one step and the choice of attention backend.

Backends: "xla" (gather the sequences' pages, masked attention; the CPU default), "pallas"
(the Mosaic-TPU / Triton kernel of the current platform), "pallas_interpret" (the same kernel in
Pallas interpret mode, for tests on CPU). The model calls `attend(...)` and never knows which runs.
Traced on a tensor-parallel mesh (the context mesh), the Pallas kernels run inside a `shard_map`
over its "model" axis (runtime/device/sharding.py `shard_kv_heads`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.runtime.config import ATTENTION_BACKENDS


@struct.dataclass
class AttentionMetadata:
    """The ragged layout of one step. T tokens packed sequence after sequence; S sequence rows.

    Query i of sequence s is token row cu_q_lens[s] + i, at position kv_lens[s] - q_len_s + i.
    """

    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32 flat KV slot (page * page_size + offset); padding -> 0
    cu_q_lens: jax.Array  # [S+1] int32
    kv_lens: jax.Array  # [S] int32, including this step's tokens
    page_indices: jax.Array  # [S, P] int32; unused -> 0 (null page)
    num_seqs: jax.Array  # [1] int32
    logits_indices: jax.Array  # [N] int32 token rows whose logits are wanted
    max_q_len: int = struct.field(pytree_node=False, default=1)  # static bound on q_len_s
    # [T] int32 the last position each row sees (an image's tokens see the whole image); None:
    # its own (causal). Only the XLA path reads it: steps with it run XLA attention.
    see_until: jax.Array | None = None
    # [T, 3] int32 each row's (t, h, w) RoPE positions under multimodal RoPE (Qwen3-VL); None:
    # `positions` (attention masks always read `positions`)
    rope_positions: jax.Array | None = None


def whole_sequence_metadata(
    num_tokens: int, page_size: int, *, all_logits: bool
) -> tuple[AttentionMetadata, int]:
    """Metadata for one sequence computing all of its tokens [0, T) in one step, its pages laid
    out in order after the null page 0; and the number of pages a cache for it needs (P + 1).
    all_logits: logits of every token row (teacher forcing) or of the last one only.

    positions, slot_mapping [T]; cu_q_lens [2]; kv_lens, num_seqs [1]; page_indices [1, P];
    logits_indices [T] or [1]. P = ceil(T / page_size).
    """
    md, pages = batch_metadata(1, num_tokens, page_size)
    if not all_logits:
        md = md.replace(logits_indices=jnp.asarray([num_tokens - 1], jnp.int32))
    return md, pages


def batch_metadata(batch: int, length: int, page_size: int, table_pages: int | None = None
                   ) -> tuple[AttentionMetadata, int]:
    """B sequences of L tokens each computed whole in one step, sequence b in pages
    1 + b * P .. (b + 1) * P (P = ceil(L / page_size)), every row's logits; and the pages a
    cache for them needs (B * P + 1). `table_pages` >= P: the page table's width (the rest
    point at the null page), as an engine's is."""
    p = -(-length // page_size)
    pos = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)  # [B * L]
    seq = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)  # [B * L]
    pages = 1 + jnp.arange(batch * p, dtype=jnp.int32).reshape(batch, p)  # [B, P]
    md = AttentionMetadata(
        positions=pos,
        slot_mapping=pages[seq, pos // page_size] * page_size + pos % page_size,
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * length,
        kv_lens=jnp.full((batch,), length, jnp.int32),
        page_indices=pages if table_pages is None else jnp.pad(pages, ((0, 0), (0, table_pages - p))),
        num_seqs=jnp.asarray([batch], jnp.int32),
        logits_indices=jnp.arange(batch * length, dtype=jnp.int32),
        max_q_len=length,
    )
    return md, batch * p + 1


def resolve_backend(name: str | None, platform: str | None = None) -> str:
    """EngineConfig.attention_backend -> the backend the model runs: "xla", "pallas_tpu",
    "pallas_gpu" or "pallas_interpret". None picks by platform (Pallas on TPU/GPU, XLA on CPU)."""
    platform = platform or jax.default_backend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    accel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}
    if name is None:
        return accel.get(platform, "xla")
    if name == "pallas":
        if platform not in accel:
            raise ValueError(
                "attention_backend='pallas' needs a TPU or GPU; on CPU use 'xla' (default) or "
                "'pallas_interpret' (slow, for tests)"
            )
        return accel[platform]
    return name


def attend(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [Hkv, N, ps, Dh]
    v_pages: jax.Array,  # [Hkv, N, ps, Dh]
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    backend: str,  # a resolve_backend() result
    # batch-invariant numerics: the XLA path a query row per tile; the TPU kernel a fixed
    # block_q (its default grows with the step's rows; the GPU kernel's is fixed already)
    row_tiles: bool = False,
    sinks: jax.Array | None = None,  # [Hq] a logit per q head in the softmax (gpt-oss)
) -> jax.Array:  # [T, Hq, Dh]
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if sinks is not None:
        kw.update(sinks=sinks.astype(jnp.float32))
    if hasattr(k_pages, "scales"):  # int8 KV (runtime.device.kv_cache.QuantizedPages)
        kw.update(k_scale=k_pages.scales, v_scale=v_pages.scales)
        k_pages, v_pages = k_pages.values, v_pages.values
    args = (q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    from jaxinfer.pallas_kernels.ragged_paged_attention import GPU_HEAD_DIMS
    from jaxinfer.runtime.device.sharding import shard_kv_heads

    if backend == "pallas_gpu" and q.shape[-1] not in GPU_HEAD_DIMS:
        backend = "xla"  # a head the Triton kernel cannot tile (latent attention's 576)
    if md.see_until is not None and backend not in ("xla", "xla_every_chunk"):
        backend = "xla"  # the kernels mask causally only (steps with image tokens are prefills)
    if backend in ("xla", "xla_every_chunk"):  # XLA SPMD partitions it on a mesh like any op
        xla = functools.partial(xla_ragged_paged_attention, *args, **kw, max_q_len=md.max_q_len,
                                every_chunk=backend == "xla_every_chunk",
                                row_tiles=row_tiles, see_until=md.see_until)
        if backend == "xla" and md.max_q_len == 1 and not row_tiles and md.see_until is None \
                and "k_scale" not in kw and _cpu_kernel_takes(q, k_pages):
            # the CPU kernel on decode steps (runtime/device/cpu_attention.cc: pages read in
            # place, no padded tiles); other platforms lower the XLA path
            mesh = jax.sharding.get_abstract_mesh()
            return jax.lax.platform_dependent(
                cpu=lambda: shard_kv_heads(cpu_paged_attention, mesh)(*args, **kw), default=xla)
        return xla()
    from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention

    platform = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "pallas_interpret": "tpu"}[backend]
    if row_tiles and platform == "tpu":
        kw.update(block_q=8 * (4 // jnp.dtype(q.dtype).itemsize))  # one sublane tile of rows
    kernel = functools.partial(ragged_paged_attention, platform=platform,
                               interpret=backend == "pallas_interpret")
    # traced on a mesh (the tensor-parallel steps: runtime/device/steps.py `on_mesh`), the
    # kernel runs per device on its KV heads: XLA SPMD cannot partition a Mosaic / Triton call
    return shard_kv_heads(kernel, jax.sharding.get_abstract_mesh())(*args, **kw)


_TILE_ROWS = 32  # query rows per tile when a step carries prompt chunks
_CHUNK_POSITIONS = 64  # KV positions a tile reads per loop iteration (whole pages)
_GATHER_BYTES = 64 << 20  # K+V gathered at once; more tiles than this run in sequence
_TILE_GROUPS = 8  # tiles run in up to this many groups (more when the gathers would not fit)
_GROUPED_FROM = 8  # ... when there are more tiles than this


_XLA_ONLY = contextvars.ContextVar("jaxinfer_xla_attention_only", default=False)


@contextlib.contextmanager
def xla_attention_only():
    """Trace the "xla" backend as XLA ops only, never the CPU kernel: for what reads the
    program rather than runs it (the cost model counts its FLOPs; a custom call counts none)."""
    token = _XLA_ONLY.set(True)
    try:
        yield
    finally:
        _XLA_ONLY.reset(token)


def _cpu_kernel_takes(q, k_pages) -> bool:
    """Whether the CPU decode kernel (runtime/device/cpu_attention.cc) can run this call: f32
    queries and pages, and the kernel library built for this host."""
    from jaxinfer.runtime.device import cpu_kernels

    return not _XLA_ONLY.get() and q.dtype == k_pages.dtype == jnp.float32 \
        and cpu_kernels.available("cpu")


def cpu_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                        sm_scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None, sinks=None):
    """`xla_ragged_paged_attention`'s result (f32 [T, Hq, Dh]) from the CPU kernel: K and V
    read in place from their pages, each row over its own visible positions only."""
    from jaxinfer.runtime.device.cpu_kernels import ATTENTION_TARGET, load

    if load() is None:
        raise RuntimeError("the CPU kernels are not available (see the log)")
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    sk = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return call(q, k_pages, v_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
                i32(num_seqs), sk, sm_scale=np.float32(sm_scale),
                window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))


@functools.partial(jax.named_call, name="xla_ragged_paged_attention")
def xla_ragged_paged_attention(
    q,  # [T, Hq, Dh]
    k_pages,  # [Hkv, N, ps, Dh]
    v_pages,  # [Hkv, N, ps, Dh]
    kv_lens,  # [S]
    page_indices,  # [S, P]
    cu_q_lens,  # [S+1]
    num_seqs,  # [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_q_len: int,
    k_scale=None,  # [Hkv, N, ps] f32 with int8 k/v_pages (x = value * scale)
    v_scale=None,
    every_chunk: bool = False,
    row_tiles: bool = False,
    sinks=None,  # [Hq] f32
    see_until=None,  # [T] int32 the last position each row sees; None: its own
):
    """Query tiles: each sequence's queries are cut into tiles of B rows (B = 1 on decode-only
    steps, else min(max_q_len, 32)); a tile reads only the pages its queries can see (with a
    sliding window, the window's pages, not the whole context). Tiles run in groups; a group
    reads its pages a chunk of C pages at a time (online softmax), for as many chunks as its
    longest live tile needs: work follows the sequences' lengths, not the page-table width P
    (a decode of 32 sequences of ~250 tokens in a 512-position table reads ~4 chunks, not 8),
    and a group with no live tile reads none. Rows of no sequence come back 0.
    int8 pages: the gathered int8 K/V are widened to q's dtype; the per-token scales multiply the
    scores (K) and the probabilities (V), so no dequantized page copy is made.
    every_chunk (backend "xla_every_chunk"): every group reads every chunk, a loop of static
    length, so reverse-mode differentiation goes through it (runtime/device/scoring.py); the
    chunks past a tile's last position are fully masked and change nothing.
    row_tiles (batch-invariant numerics): a tile is one query row and a group one tile, so every
    row's scores, softmax and products have the same shapes and order whatever the step holds
    (the chunks past a row's own, run for its group, are fully masked: no-ops, bit for bit).
    sinks: head h's softmax also holds the logit sinks[h] (raw: not scaled, capped or masked),
    whose value is 0; folded into each tile's (max, sum, output) after its last chunk.
    see_until: row r sees positions <= see_until[r] (>= its own: the image tokens of a prefill
    see their whole image, which the step holds); a tile then reads every page of the table
    (no sliding-window page cut) up to its rows' furthest position."""
    t, hq, dh = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, p = page_indices.shape
    g, b = hq // hkv, 1 if row_tiles else min(max_q_len, _TILE_ROWS)
    nt = s if max_q_len == 1 else min(-(-t // b) + s, s * -(-max_q_len // b))  # tiles, at most
    # pages a tile sees: all P, or under a sliding window the pages of its last
    # (window + B - 1) positions (+1 page for misalignment)
    npg = p if sliding_window is None or see_until is not None else min(
        p, -(-(sliding_window + b - 1) // ps) + 1)
    nch = -(-npg // max(1, _CHUNK_POSITIONS // ps))  # chunks covering npg pages
    cp = -(-npg // nch)  # (the last chunk padded with the null page)

    # tile -> (sequence, first query row within it)
    q_lens = jnp.where(jnp.arange(s) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    n_tiles = -(-q_lens // b)  # [S]
    ends = jnp.cumsum(n_tiles)  # [S]
    tile = jnp.arange(nt)
    seq = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), s - 1)  # [NT]
    j0 = (tile - (ends[seq] - n_tiles[seq])) * b  # [NT] first query index of the tile
    tile_live = tile < ends[-1]
    q_len, kv_len = q_lens[seq], kv_lens[seq]  # [NT]
    pos0 = kv_len - q_len + j0  # [NT] position of the tile's first query
    first_page = jnp.zeros_like(pos0)
    if npg < p:
        first_page = jnp.clip((pos0 - sliding_window + 1) // ps, 0, p - npg)
    pages = page_indices[seq[:, None], first_page[:, None] + jnp.arange(npg)]  # [NT, npg]
    pages = jnp.pad(pages, [(0, 0), (0, nch * cp - npg)])  # [NT, nch * cp]
    i = jnp.arange(b)
    rows = cu_q_lens[seq][:, None] + j0[:, None] + i  # [NT, B]
    row_ok = tile_live[:, None] & (j0[:, None] + i < q_len[:, None])  # [NT, B]
    q_tiles = q[jnp.clip(rows, 0, t - 1)]  # [NT, B, Hq, Dh]
    # each row's last visible position [NT, B]: its own, or see_until's
    q_see = pos0[:, None] + i if see_until is None else see_until[jnp.clip(rows, 0, t - 1)]
    # chunks a tile reads: up to its last visible position (exclusive: min(kv_len, pos0 + B))
    seen = jnp.minimum(kv_len, pos0 + b if see_until is None else
                       jnp.max(jnp.where(row_ok, q_see, 0), axis=1) + 1) - first_page * ps
    chunks = jnp.where(tile_live, jnp.clip(-(-seen // (cp * ps)), 0, nch), 0)  # [NT]
    n = cp * ps  # positions per chunk

    def chunk_scores(x, j):
        """One tile's masked scores [Hkv, B*G, n] and V [Hkv, n, Dh] over chunk j."""
        qt, pg, fp, p0, kvl, ok, see = x  # one tile: [B, Hq, Dh], [nch * cp], (), (), (), [B], [B]
        pg = jax.lax.dynamic_slice_in_dim(pg, j * cp, cp)  # [cp]
        k = k_pages[:, pg].reshape(hkv, n, dh)  # [Hkv, n, Dh]
        v = v_pages[:, pg].reshape(hkv, n, dh)
        local = j * n + jnp.arange(n)  # [n] position within the tile's npg pages
        kv_pos = fp * ps + local
        q_pos = p0 + i  # [B]
        kv_ok = (kv_pos < kvl) & (local < npg * ps)
        mask = (kv_pos[None, :] <= see[:, None]) & kv_ok[None, :] & ok[:, None]  # [B, n]
        if sliding_window is not None:
            mask &= q_pos[:, None] - kv_pos[None, :] < sliding_window
        v = jnp.where(kv_ok[None, :, None], v, 0)  # unused slots may hold anything (NaN)
        if k_scale is not None:
            k, v = k.astype(qt.dtype), v.astype(qt.dtype)
        qh = qt.reshape(b, hkv, g, dh).transpose(1, 0, 2, 3).reshape(hkv, b * g, dh)
        sc = jnp.einsum("hmd,hnd->hmn", qh, k, preferred_element_type=jnp.float32)
        if k_scale is not None:
            sc = sc * k_scale[:, pg].reshape(hkv, 1, n)
        sc = sc * sm_scale
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        m = jnp.repeat(mask, g, axis=0)[None]  # [1, B*G, n] (rows b-major, then g)
        sc = jnp.where(m, sc, -jnp.inf)
        if v_scale is not None:  # unused slots may hold any scale (NaN): keep their weight 0
            v_w = jnp.where(kv_ok, v_scale[:, pg].reshape(hkv, n), 0)[:, None, :]
        else:
            v_w = None
        return sc, v, v_w

    def chunk_update(x, j, carry):
        """Online softmax: fold chunk j into one tile's (max, sum, output) [Hkv, B*G, 1|Dh]."""
        mx, den, acc = carry
        sc, v, v_w = chunk_scores(x, j)
        new = jnp.maximum(mx, jnp.max(sc, axis=-1, keepdims=True))
        base = jnp.where(jnp.isfinite(new), new, 0)
        scale = jnp.exp(mx - base)  # 0 while mx is -inf
        e = jnp.exp(sc - base)  # 0 at masked scores
        den = den * scale + jnp.sum(e, axis=-1, keepdims=True)
        if v_w is not None:
            e = e * v_w
        o = jnp.einsum("hmn,hnd->hmd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new, den, acc * scale + o

    def run_group(xg, n_chunks):
        """Tiles xg (a leading axis of c) through `n_chunks` chunks -> [c, B, Hq, Dh]."""
        c = xg[0].shape[0]
        carry = (jnp.full((c, hkv, b * g, 1), -jnp.inf, jnp.float32),
                 jnp.zeros((c, hkv, b * g, 1), jnp.float32),
                 jnp.zeros((c, hkv, b * g, dh), jnp.float32))
        step = jax.vmap(chunk_update, in_axes=(0, None, 0))
        mx, den, acc = jax.lax.fori_loop(0, n_chunks, lambda j, cr: step(xg, j, cr), carry)
        if sinks is not None:  # [Hq] -> [Hkv, B*G, 1] (rows b-major, then g)
            sk = jnp.broadcast_to(sinks.reshape(hkv, 1, g), (hkv, b, g)).reshape(hkv, b * g, 1)
            new = jnp.maximum(mx, sk)
            scale = jnp.exp(mx - new)  # 0 while mx is -inf
            den, acc = den * scale + jnp.exp(sk - new), acc * scale
        o = acc / jnp.where(den > 0, den, 1)  # [c, Hkv, B*G, Dh]
        return o.reshape(c, hkv, b, g, dh).transpose(0, 2, 1, 3, 4).reshape(c, b, hq, dh)

    itemsize = jnp.dtype(k_pages.dtype).itemsize
    per_tile = 2 * n * hkv * dh * max(itemsize, jnp.dtype(q.dtype).itemsize)  # K+V of a chunk
    xs = (q_tiles, pages, first_page, pos0, kv_len, row_ok, q_see)
    # tiles per group: all of them when few, else about nt / _TILE_GROUPS (live tiles come
    # first, so groups past the live ones run no chunk), and never more than fit the budget
    c = nt if nt <= _GROUPED_FROM else -(-nt // _TILE_GROUPS)
    c = 1 if row_tiles else max(1, min(c, _GATHER_BYTES // per_tile))
    groups = -(-nt // c)
    if every_chunk:
        chunks = jnp.full_like(chunks, nch)
    if groups == 1 and not row_tiles:
        o = run_group(xs, nch if every_chunk else jnp.max(chunks)).astype(q.dtype)
    else:
        pad = lambda a: jnp.pad(a, [(0, groups * c - nt)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
        xs = jax.tree.map(lambda a: pad(a).reshape(groups, c, *a.shape[1:]), xs)
        need = jnp.max(pad(chunks).reshape(groups, c), axis=1)  # [groups]
        if every_chunk:
            o = jax.lax.map(lambda x: run_group(x, nch).astype(q.dtype), xs)
        else:
            o = jax.lax.map(lambda a: run_group(*a).astype(q.dtype), (xs, need))
        o = o.reshape(groups * c, b, hq, dh)[:nt]
    dest = jnp.where(row_ok, rows, t).reshape(-1)  # rows of no tile query dropped
    return jnp.zeros_like(q).at[dest].set(o.reshape(nt * b, hq, dh), mode="drop")
