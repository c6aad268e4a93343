"""Attention metadata of one step and the choice of attention backend.

Backends: "xla" (gather the sequences' pages, masked attention; the CPU default), "pallas"
(the Mosaic-TPU / Triton kernel of the current platform), "pallas_interpret" (the same kernel in
Pallas interpret mode, for tests on CPU). The model calls `attend(...)` and never knows which runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

BACKENDS = ("xla", "pallas", "pallas_interpret")


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


def resolve_backend(name: str | None, platform: str | None = None) -> str:
    """EngineConfig.attention_backend -> the backend the model runs: "xla", "pallas_tpu",
    "pallas_gpu" or "pallas_interpret". None picks by platform (Pallas on TPU/GPU, XLA on CPU)."""
    platform = platform or jax.default_backend()
    if name not in (None,) + BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
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
) -> jax.Array:  # [T, Hq, Dh]
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if hasattr(k_pages, "scales"):  # int8 KV (runtime.kv_cache.QuantizedPages)
        if backend != "xla":
            raise ValueError(
                f"int8 KV cache (kv_cache_dtype='int8') is supported by the 'xla' attention "
                f"backend only, not {backend!r}: the Pallas kernels do not read int8 pages yet"
            )
        kw.update(k_scale=k_pages.scales, v_scale=v_pages.scales)
        k_pages, v_pages = k_pages.values, v_pages.values
    args = (q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    if backend == "xla":
        return xla_ragged_paged_attention(*args, **kw, max_q_len=md.max_q_len)
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    if backend == "pallas_interpret":
        return ragged_paged_attention(*args, **kw, platform="tpu", interpret=True)
    platform = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}[backend]
    return ragged_paged_attention(*args, **kw, platform=platform)


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
):
    """Gather each sequence's pages and run masked attention over a [S, Q] padded view of the
    ragged queries (Q = max_q_len, static). Rows of no sequence come back 0.
    int8 pages: the gathered int8 K/V are widened to q's dtype; the per-token scales multiply the
    scores (K) and the probabilities (V), so no dequantized page copy is made."""
    t, hq, dh = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, p = page_indices.shape
    g, L, Q = hq // hkv, p * ps, max_q_len

    k = k_pages[:, page_indices].reshape(hkv, s, L, dh)  # [Hkv, S, L, Dh]
    v = v_pages[:, page_indices].reshape(hkv, s, L, dh)
    quantized = k_scale is not None
    if quantized:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        ks = k_scale[:, page_indices].reshape(hkv, s, L).transpose(1, 0, 2)  # [S, Hkv, L]
        vs = v_scale[:, page_indices].reshape(hkv, s, L).transpose(1, 0, 2)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    seq_live = jnp.arange(s) < num_seqs[0]  # [S]
    j = jnp.arange(Q)
    rows = cu_q_lens[:-1, None] + j[None, :]  # [S, Q]
    q_valid = (j[None, :] < q_lens[:, None]) & seq_live[:, None]  # [S, Q]
    qs = q[jnp.clip(rows, 0, t - 1)].reshape(s, Q, hkv, g, dh)  # [S, Q, Hkv, G, Dh]

    q_pos = (kv_lens - q_lens)[:, None] + j[None, :]  # [S, Q]
    kv_pos = jnp.arange(L)
    kv_valid = kv_pos[None, :] < kv_lens[:, None]  # [S, L]
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :] & q_valid[..., None]
    if sliding_window is not None:
        mask &= q_pos[:, :, None] - kv_pos[None, None, :] < sliding_window  # [S, Q, L]
    v = jnp.where(kv_valid[None, :, :, None], v, 0)  # unused pages may hold anything (NaN)

    scores = jnp.einsum("sqhgd,hsld->shgql", qs, k, preferred_element_type=jnp.float32)
    if quantized:
        scores = scores * ks[:, :, None, None, :]
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    m = mask[:, None, None]  # [S, 1, 1, Q, L]
    scores = jnp.where(m, scores, -jnp.inf)
    mx = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(m, jnp.exp(scores - jnp.where(jnp.isfinite(mx), mx, 0)), 0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(denom > 0, denom, 1)
    if quantized:  # unused slots may hold any scale (NaN): their probability is 0, keep it 0
        probs = probs * jnp.where(kv_valid[:, None, :], vs, 0)[:, :, None, None, :]
    o = jnp.einsum("shgql,hsld->sqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o.reshape(s * Q, hq, dh).astype(q.dtype)
    dest = jnp.where(q_valid, rows, t).reshape(-1)  # invalid rows dropped
    return jnp.zeros_like(q).at[dest].set(o, mode="drop")
