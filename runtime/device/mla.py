"""Multi-head latent attention (DeepSeek-V3): keys and values come from one compressed latent per
token, so the cache keeps that latent (C = kv_lora_rank dims) and a decoupled rotated part
(R = qk_rope_head_dim dims), one "head" of C + R that serves as both K and V, instead of H heads of
K and V. The up-projections are absorbed into the query and the output (H heads, N = nope dims,
V = v dims):

    c, k_r = split(h @ wkv_a)                       # [T, C], [T, R]
    c, k_r = rms_norm(c, kv_a_norm), rope(k_r)      # the cached head: [c, k_r]    [T, 1, C + R]
    q      = h @ wq  |  rms_norm(h @ wq_a) @ wq_b   # [T, H, N + R]
    q      = [q[..., :N] @ w_uk, rope(q[..., N:])]  # "thn,hnc->thc": [T, H, C + R]
    o      = attention(q, K = V = cache)            # MQA over the latent head: [T, H, C + R]
    out    = o[..., :C] @ w_uv                      # "thc,hcv->thv": [T, H, V], then wo

q . [c, k_r] = q_nope . (w_uk c) + q_r . k_r: exactly the expanded attention's scores, and
o[..., :C] @ w_uv its values' weighted sum. The same absorbed form runs prefill and decode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.layer_ops import (apply_rope, rms_norm, rope_attention_factor,
                                               rope_inv_freq)
from jaxinfer.runtime.device.quantization import einsum


def latent_qkv(lp, h: jax.Array, positions: jax.Array, cfg: ModelConfig, i: int):
    """Normed rows h [T, D] -> (q [T, H, C + R], the cached head [T, 1, C + R])."""
    c_dim, n = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    scaling = cfg.layer_rope_scaling(i)
    inv_freq = rope_inv_freq(cfg.rope_dim, cfg.layer_rope_theta(i), scaling)
    f = rope_attention_factor(scaling)
    rope = lambda x: apply_rope(x, positions, inv_freq, f)  # noqa: E731
    if lp.wq_a is not None:
        q = einsum("tr,rhk->thk", rms_norm(einsum("td,dr->tr", h, lp.wq_a), lp.q_a_norm,
                                           cfg.rms_norm_eps), lp.wq_b)
    else:
        q = einsum("td,dhk->thk", h, lp.wq)  # [T, H, N + R]
    q_lat = _per_head("thn,hnc->thc", q[..., :n], lp.w_uk)  # [T, H, C]
    q = jnp.concatenate([q_lat, rope(q[..., n:])], axis=-1)
    kv = einsum("td,dc->tc", h, lp.wkv_a)  # [T, C + R]
    c = rms_norm(kv[:, :c_dim], lp.kv_a_norm, cfg.rms_norm_eps)
    k_r = rope(kv[:, None, c_dim:])[:, 0]
    return q, jnp.concatenate([c, k_r], axis=-1)[:, None, :]


def latent_out(lp, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention over the latent head o [T, H, C + R] -> the heads' values [T, H, V]."""
    return _per_head("thc,hcv->thv", o[..., :cfg.kv_lora_rank], lp.w_uv)


def _per_head(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A product per head (h a batch axis of both). XLA:CPU has no batched bf16 dot with f32
    accumulation (its prefill programs fail to run); there it runs in f32."""
    if jax.default_backend() == "cpu" and x.dtype != jnp.float32:
        return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32)).astype(x.dtype)
    return einsum(spec, x, w)


def expanded_attention(lp, q: jax.Array, cached: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The reference, and the form to weigh at long prefill: one causal sequence whose cached
    latent heads are expanded to per-head K and V before ordinary attention. q [T, H, N + R]
    (projected and rotated, before absorption), cached [S, C + R] the sequence's cached heads,
    the T queries at its last T positions -> [T, H, V].

        k_nope = c @ w_uk^T  [S, H, N]      v = c @ w_uv  [S, H, V]
        scores = q_nope . k_nope + q_r . k_r

    Work: S * H * C * (N + V) to expand, T * S * H * (N + R + V) to attend; the absorbed form
    spends T * S * H * (2C + R) and nothing to expand."""
    c_dim, n = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    t, s = q.shape[0], cached.shape[0]
    c, k_r = cached[:, :c_dim], cached[:, c_dim:]
    k_nope = jnp.einsum("sc,hnc->shn", c, lp.w_uk)  # [S, H, N]
    v = jnp.einsum("sc,hcv->shv", c, lp.w_uv)  # [S, H, V]
    scores = (jnp.einsum("thn,shn->hts", q[..., :n], k_nope)
              + jnp.einsum("thr,sr->hts", q[..., n:], k_r)) * cfg.sm_scale
    causal = jnp.arange(s)[None, :] <= (s - t + jnp.arange(t))[:, None]  # [T, S]
    p = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("hts,shv->thv", p, v)


def absorbed_attention(lp, q: jax.Array, cached: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The engine's form on one causal sequence, dense: q [T, H, N + R] as expanded_attention
    takes it, absorbed here (q_nope @ w_uk), cached [S, C + R] -> [T, H, V] (what the paged
    attention and latent_out give)."""
    n = cfg.qk_nope_head_dim
    t, s = q.shape[0], cached.shape[0]
    q = jnp.concatenate([jnp.einsum("thn,hnc->thc", q[..., :n], lp.w_uk), q[..., n:]], -1)
    scores = jnp.einsum("thc,sc->hts", q, cached) * cfg.sm_scale
    causal = jnp.arange(s)[None, :] <= (s - t + jnp.arange(t))[:, None]
    p = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
    return latent_out(lp, jnp.einsum("hts,sc->thc", p, cached), cfg)
