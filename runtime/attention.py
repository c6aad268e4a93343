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


def default_backend(platform: str | None = None) -> str:
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"


def resolve_backend(name: str | None, platform: str | None = None) -> str:
    if name is None:
        return default_backend(platform)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "pallas" and platform == "cpu":
        raise ValueError(
            "attention_backend='pallas' needs a TPU or GPU; on CPU use 'xla' (default) or "
            "'pallas_interpret' (slow, for tests)"
        )
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
    backend: str,
) -> jax.Array:  # [T, Hq, Dh]
    args = (q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "xla":
        return xla_ragged_paged_attention(*args, **kw, max_q_len=md.max_q_len)
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    platform = jax.default_backend()
    if backend == "pallas_interpret":
        return ragged_paged_attention(*args, **kw, platform="tpu", interpret=True)
    return ragged_paged_attention(*args, **kw, platform="tpu" if platform == "tpu" else "gpu")


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
):
    """Gather each sequence's pages and run masked attention over a [S, Q] padded view of the
    ragged queries (Q = max_q_len, static). Rows of no sequence come back 0."""
    t, hq, dh = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, p = page_indices.shape
    g, L, Q = hq // hkv, p * ps, max_q_len

    k = k_pages[:, page_indices].reshape(hkv, s, L, dh)  # [Hkv, S, L, Dh]
    v = v_pages[:, page_indices].reshape(hkv, s, L, dh)
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
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    m = mask[:, None, None]  # [S, 1, 1, Q, L]
    scores = jnp.where(m, scores, -jnp.inf)
    mx = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(m, jnp.exp(scores - jnp.where(jnp.isfinite(mx), mx, 0)), 0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(denom > 0, denom, 1)
    o = jnp.einsum("shgql,hsld->sqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o.reshape(s * Q, hq, dh).astype(q.dtype)
    dest = jnp.where(q_valid, rows, t).reshape(-1)  # invalid rows dropped
    return jnp.zeros_like(q).at[dest].set(o, mode="drop")
