"""Mixture-of-experts feed-forward: a softmax router picks k of E experts per token, each a gated
MLP, and the token's output is their routing-weighted sum (Qwen3-MoE, Mixtral).

`moe_mlp` is the serving path. Each (token, expert) pair meets only its own expert's weights and
no token is dropped: up to E pairs (decode) gather the chosen experts' weights per pair; more
pairs (prefill) are sorted by expert and the expert weights applied with `jax.lax.ragged_dot`
over contiguous groups. `moe_mlp_dense` computes every expert for every
token and masks: E/k times the work, kept as the test reference.

    logits = h @ router                        # [T, E], f32
    w, e = top_k(softmax(logits), k)           # [T, k] (renormalised to sum 1 if norm_topk)
    out[t] = sum_j w[t, j] * down_e(act(gate_e(h[t])) * up_e(h[t]))   with e = e[t, j]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(h: jax.Array, router: jax.Array, k: int, norm_topk: bool):
    """h [T, D], router [D, E] -> (weights [T, k] f32, experts [T, k] int32)."""
    logits = jnp.einsum("td,de->te", h.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    w, e = jax.lax.top_k(probs, k)
    if norm_topk:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, e.astype(jnp.int32)


def moe_mlp(h: jax.Array, router, we_gate, we_up, we_down, *, k: int, norm_topk: bool,
            act) -> jax.Array:
    """h [T, D]; we_gate / we_up [E, D, F], we_down [E, F, D] -> [T, D]. At most E pairs (a
    decode step): each pair gathers its expert's weights (`_gathered`); more: grouped by expert
    through ragged_dot (`_grouped`). Both read only the chosen experts."""
    w, e = route(h, router, k, norm_topk)
    fn = _gathered if h.shape[0] * k <= we_gate.shape[0] else _grouped
    return fn(h, w, e, we_gate, we_up, we_down, act)


def _gathered(h, w, e, we_gate, we_up, we_down, act) -> jax.Array:
    """Pair (t, j) multiplies h[t] by expert e[t, j]'s own weights, gathered: [T, k, D, F]."""
    x = h.astype(jnp.float32)
    g = jnp.einsum("td,tkdf->tkf", x, we_gate[e].astype(jnp.float32))
    u = jnp.einsum("td,tkdf->tkf", x, we_up[e].astype(jnp.float32))
    y = jnp.einsum("tkf,tkfd->tkd", act(g) * u, we_down[e].astype(jnp.float32))  # [T, k, D]
    return jnp.einsum("tkd,tk->td", y, w).astype(h.dtype)


def _grouped(h, w, e, we_gate, we_up, we_down, act) -> jax.Array:
    """The pairs sorted by expert, each group multiplied by its expert with ragged_dot."""
    t, _ = h.shape
    k, e_count = e.shape[1], we_gate.shape[0]
    flat_e = e.reshape(-1)  # [T*k] expert of pair p = t * k + j
    order = jnp.argsort(flat_e, stable=True)  # pairs grouped by expert
    tok = order // k  # [T*k] token of each sorted pair
    sizes = jnp.bincount(flat_e, length=e_count).astype(jnp.int32)  # [E] pairs per expert
    x = h[tok]  # [T*k, D]
    g = jax.lax.ragged_dot(x, we_gate.astype(h.dtype), sizes)  # [T*k, F]
    u = jax.lax.ragged_dot(x, we_up.astype(h.dtype), sizes)
    y = jax.lax.ragged_dot(act(g) * u, we_down.astype(h.dtype), sizes)  # [T*k, D]
    y = y.astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((t, h.shape[1]), jnp.float32).at[tok].add(y).astype(h.dtype)


def moe_mlp_dense(h: jax.Array, router, we_gate, we_up, we_down, *, k: int, norm_topk: bool,
                  act) -> jax.Array:
    """The reference: every expert on every token, weighted by the (sparse) routing weights."""
    w, e = route(h, router, k, norm_topk)
    dense_w = jnp.zeros((h.shape[0], we_gate.shape[0]), jnp.float32)
    dense_w = dense_w.at[jnp.arange(h.shape[0])[:, None], e].set(w)  # [T, E]
    hf = h.astype(jnp.float32)
    g = jnp.einsum("td,edf->tef", hf, we_gate.astype(jnp.float32))
    u = jnp.einsum("td,edf->tef", hf, we_up.astype(jnp.float32))
    y = jnp.einsum("tef,efd->ted", act(g) * u, we_down.astype(jnp.float32))  # [T, E, D]
    return jnp.einsum("ted,te->td", y, dense_w).astype(h.dtype)
