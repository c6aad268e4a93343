"""Transformer families (Llama / Mistral / Qwen2 / Qwen3 and their MoE forms, Mixtral, Gemma 3,
Gemma 4, gpt-oss, DeepSeek-V3) as one pure forward.

`forward(params, tokens, cache, md, cfg, backend) -> (logits, cache)`: no hidden state; params and
cache are pytrees (flax struct dataclasses). Family differences are ModelConfig fields, never
branches on a family name. Norm weights are stored as the effective multiplier (Gemma's `1 + w`
is folded in at load time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.runtime.device.attention import AttentionMetadata, attend
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.fixed_sums import gathered_head, row_parallel_einsum
from jaxinfer.runtime.device.fused_projections import split_qkv
from jaxinfer.runtime.device import lora as lora_ops
from jaxinfer.runtime.device.kv_cache import KVCache, write_pages
from jaxinfer.runtime.device.layer_ops import (apply_rope, rms_norm, rope_attention_factor,
                                               rope_inv_freq)
from jaxinfer.runtime.device.mla import latent_out, latent_qkv
from jaxinfer.runtime.device.moe import moe_mlp, routing_of
from jaxinfer.runtime.device.quantization import einsum, take_rows


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [D]
    # [D, Hq, Dh], [D, Hkv, Dh], [D, Hkv, Dh]; None when joined in wqkv
    wq: jax.Array | None
    wk: jax.Array | None
    wv: jax.Array | None
    wo: jax.Array  # [Hq, Dh, D]
    mlp_norm: jax.Array  # [D]
    # the fused forms the engine builds (runtime/device/fused_projections.py)
    wqkv: jax.Array | None = None  # [D, Hkv, G + 2, Dh]
    w_gate_up: jax.Array | None = None  # [D, F, 2]
    w_gate: jax.Array | None = None  # [D, F] (dense MLP; None in a mixture-of-experts layer)
    w_up: jax.Array | None = None  # [D, F]
    w_down: jax.Array | None = None  # [F, D]
    router: jax.Array | None = None  # [D, E] (mixture of experts: runtime/device/moe.py)
    we_gate: jax.Array | None = None  # [E, D, Fe]
    we_up: jax.Array | None = None  # [E, D, Fe]
    we_down: jax.Array | None = None  # [E, Fe, D]
    shared_gate: jax.Array | None = None  # [D]: the shared expert's (w_gate/w_up/w_down) gate
    bq: jax.Array | None = None  # [Hq, Dh]
    bk: jax.Array | None = None  # [Hkv, Dh]
    bv: jax.Array | None = None  # [Hkv, Dh]
    q_norm: jax.Array | None = None  # [Dh]
    k_norm: jax.Array | None = None  # [Dh]
    post_attn_norm: jax.Array | None = None  # [D]
    post_mlp_norm: jax.Array | None = None  # [D]
    # gpt-oss (ModelConfig.attn_sinks, attn_out_bias, router_bias, expert_bias)
    sinks: jax.Array | None = None  # [Hq] a logit per q head in the softmax, its value 0
    bo: jax.Array | None = None  # [D]
    router_b: jax.Array | None = None  # [E]
    we_gate_b: jax.Array | None = None  # [E, Fe]
    we_up_b: jax.Array | None = None  # [E, Fe]
    we_down_b: jax.Array | None = None  # [E, D]
    router_choice_b: jax.Array | None = None  # [E] DeepSeek-V3: added to the scores to choose
    # latent attention (runtime/device/mla.py; wq [D, H, N + R] when q is not compressed)
    wq_a: jax.Array | None = None  # [D, Cq]
    q_a_norm: jax.Array | None = None  # [Cq]
    wq_b: jax.Array | None = None  # [Cq, H, N + R]
    wkv_a: jax.Array | None = None  # [D, C + R]
    kv_a_norm: jax.Array | None = None  # [C]
    w_uk: jax.Array | None = None  # [H, N, C]
    w_uv: jax.Array | None = None  # [H, C, V]
    # Gemma 4: the experts beside the dense MLP (moe_block): the dense output's norm, the
    # experts' input and output norms, the router's input scale and per-expert weight scale
    mlp_out_norm: jax.Array | None = None  # [D]
    expert_in_norm: jax.Array | None = None  # [D]
    expert_out_norm: jax.Array | None = None  # [D]
    router_scale: jax.Array | None = None  # [D]
    expert_scale: jax.Array | None = None  # [E]
    # ... the per-layer input: gate, projection, norm; the output's scalar
    ple_gate: jax.Array | None = None  # [D, P]
    ple_proj: jax.Array | None = None  # [P, D]
    ple_norm: jax.Array | None = None  # [D]
    scalar: jax.Array | None = None  # [1]


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [V, D]; None when tied to embed
    # LoRA adapter slots (runtime/device/lora.py), per layer; None: the engine serves no adapters
    lora: tuple[lora_ops.LoraLayer, ...] | None = None
    # Gemma 4's per-layer inputs (ModelConfig.per_layer_input_size P): a token table and a
    # projection of the embedding, L * P wide, and the projection's norm
    embed_per_layer: jax.Array | None = None  # [Vp, L * P]
    ple_model_proj: jax.Array | None = None  # [D, L * P]
    ple_proj_norm: jax.Array | None = None  # [P]


def _activation(name: str):
    return {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}[name]


def layer_kind(cfg: ModelConfig, i: int) -> int:
    """The first layer index whose static behaviour (window, RoPE, head_dim, whether it stores
    its own KV) equals layer i's: `layer`
    traced with either index builds the same program, so a layer-by-layer run compiles one
    program per kind (Gemma 3: sliding and global), not one per layer."""
    key = lambda j: (cfg.layer_window(j), cfg.layer_rope_theta(j), cfg.layer_rope_scaling(j),  # noqa: E731
                     cfg.layer_head_dim(j), cfg.layer_kv_source(j) == j)
    return next(j for j in range(i + 1) if key(j) == key(i))


def layer(
    lp: LayerParams,
    x: jax.Array,  # [T, D]
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    cfg: ModelConfig,
    i: int,
    backend: str,
    lora: lora_ops.LoraLayer | None = None,
    lora_mask: jax.Array | None = None,  # [T, L] each row's adapter slot, one-hot
    ple: jax.Array | None = None,  # [T, P] the rows' per-layer input (Gemma 4)
):
    """One layer over rows x; its pages are those of cfg.layer_kv_source(i) (a layer reading
    another's KV writes none). -> (x, k_pages, v_pages)."""
    # batch-invariant: the step's live token rows (they come first); every row where the loop
    # must be static (a differentiated forward)
    live = (md.cu_q_lens[md.num_seqs[0]]
            if cfg.batch_invariant and backend != "xla_every_chunk" else None)
    rope_pos = md.positions if md.rope_positions is None else md.rope_positions  # [T] | [T, 3]
    q, k, v = by_rows(lambda x_, pos, m: _qkv(lp, x_, pos, cfg, i, lora, m), cfg,
                      x, rope_pos, lora_mask, live=live)  # [T, Hq | Hkv | Hkv, Dh]
    if k is not None:  # (None: the layer reads another layer's KV)
        k_pages = write_pages(k_pages, k, md.slot_mapping)
    if v is not None:  # (latent attention: V is K, stored once)
        v_pages = write_pages(v_pages, v, md.slot_mapping)
    o = attend(
        q, k_pages, k_pages if v_pages is None else v_pages, md,
        sm_scale=cfg.sm_scale,
        sliding_window=cfg.layer_window(i),
        soft_cap=cfg.attn_logit_softcap,
        sinks=lp.sinks,
        backend=backend,
        row_tiles=cfg.batch_invariant,
    )  # [T, Hq, Dh]
    x = by_rows(lambda x_, o_, m, p: _out_and_mlp(lp, x_, o_, cfg, lora, m, p), cfg, x, o,
                lora_mask, ple, live=live)
    return x, k_pages, v_pages


def _qkv(lp: LayerParams, x, positions, cfg: ModelConfig, i: int, lora, lora_mask):
    """Rows x [T, D] -> their q [T, Hq, Dh], k, v [T, Hkv, Dh] (normed, projected, rotated);
    latent attention: q and the cached head, v None."""
    eps = cfg.rms_norm_eps
    ad = lambda y, x_, t: lora_ops.add(y, x_, lora, t, lora_mask)  # noqa: E731
    h = rms_norm(x, lp.attn_norm, eps)
    if cfg.latent_attention:
        return (*latent_qkv(lp, h, positions, cfg, i), None)
    scaling = cfg.layer_rope_scaling(i)
    inv_freq = rope_inv_freq(cfg.layer_head_dim(i), cfg.layer_rope_theta(i), scaling)
    rope = lambda y: apply_rope(y, positions, inv_freq, rope_attention_factor(scaling),  # noqa: E731
                                cfg.mrope_section)
    if cfg.layer_kv_source(i) != i:  # K and V are another layer's: q alone
        q = ad(einsum("td,dhk->thk", h, lp.wq), h, "q")
        return rope(q if lp.q_norm is None else rms_norm(q, lp.q_norm, eps)), None, None
    if lp.wqkv is not None:
        q, k, v = split_qkv(einsum("td,dhgk->thgk", h, lp.wqkv))
    else:
        q, k = (einsum("td,dhk->thk", h, w) for w in (lp.wq, lp.wk))
        v = None if lp.wv is None else einsum("td,dhk->thk", h, lp.wv)
    q, k = ad(q, h, "q"), ad(k, h, "k")  # [T, Hq | Hkv, Dh]
    v = k if v is None else ad(v, h, "v")  # (Gemma 4's global layers: V is the K projection)
    if lp.bq is not None:
        q, k, v = q + lp.bq.astype(q.dtype), k + lp.bk.astype(k.dtype), v + lp.bv.astype(v.dtype)
    if lp.q_norm is not None:
        q, k = rms_norm(q, lp.q_norm, eps), rms_norm(k, lp.k_norm, eps)
    if cfg.v_norm:
        v = rms_norm(v, None, eps)
    return rope(q), rope(k), v


def _out_and_mlp(lp: LayerParams, x, o, cfg: ModelConfig, lora, lora_mask, ple=None):
    """Rows x [T, D] and their attention output o [T, Hq, Dh] (and per-layer input ple [T, P])
    -> the layer's output [T, D]."""
    eps = cfg.rms_norm_eps
    ad = lambda y, x_, t: lora_ops.add(y, x_, lora, t, lora_mask)  # noqa: E731
    if cfg.latent_attention:
        o = latent_out(lp, o, cfg)  # [T, H, V]
    o = ad(row_parallel_einsum("thk,hkd->td", o, lp.wo, cfg.batch_invariant), o, "o")  # [T, D]
    if lp.bo is not None:
        o = o + lp.bo.astype(o.dtype)
    if lp.post_attn_norm is not None:
        o = rms_norm(o, lp.post_attn_norm, eps)
    x = x + o

    h = rms_norm(x, lp.mlp_norm, eps)
    act = _activation(cfg.activation)
    glu = lambda g, u: act(g) * u  # noqa: E731
    m = None
    if lp.w_down is not None:  # the dense MLP, or an MoE layer's shared expert
        if lp.w_gate_up is not None:
            gu = einsum("td,dfc->tfc", h, lp.w_gate_up)  # [T, F, 2]
            gate, up = gu[..., 0], gu[..., 1]
        else:
            gate, up = einsum("td,df->tf", h, lp.w_gate), einsum("td,df->tf", h, lp.w_up)
        m = glu(ad(gate, h, "gate"), ad(up, h, "up"))  # [T, F]
        m = ad(row_parallel_einsum("tf,fd->td", m, lp.w_down, cfg.batch_invariant), m,
               "down")  # [T, D]
        if lp.shared_gate is not None:
            gate = jnp.einsum("td,d->t", h.astype(jnp.float32), lp.shared_gate.astype(jnp.float32))
            m = (m * jax.nn.sigmoid(gate)[:, None]).astype(h.dtype)
    if lp.router is not None:  # routed experts (runtime/device/moe.py)
        biases = None if lp.we_gate_b is None else (lp.we_gate_b, lp.we_up_b, lp.we_down_b)
        kw = dict(k=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob,
                  glu=_expert_glu(cfg, glu), router_bias=lp.router_b, biases=biases,
                  routing=routing_of(cfg), choice_bias=lp.router_choice_b,
                  expert_scale=lp.expert_scale, fixed_blocks=cfg.batch_invariant)
        if lp.expert_in_norm is None:
            e = moe_mlp(h, lp.router, lp.we_gate, lp.we_up, lp.we_down, **kw)  # [T, D]
            m = e if m is None else m + e
        else:  # Gemma 4: beside the dense MLP, routed on the residual, each side normed
            r = rms_norm(x, None, eps) * (lp.router_scale.astype(jnp.float32)
                                          * cfg.hidden_size ** -0.5).astype(x.dtype)
            e = moe_mlp(rms_norm(x, lp.expert_in_norm, eps), lp.router, lp.we_gate, lp.we_up,
                        lp.we_down, route_input=r, **kw)
            m = rms_norm(m, lp.mlp_out_norm, eps) + rms_norm(e, lp.expert_out_norm, eps)
    if lp.post_mlp_norm is not None:
        m = rms_norm(m, lp.post_mlp_norm, eps)
    x = x + m
    if lp.ple_gate is not None:  # Gemma 4's per-layer input
        g = act(einsum("td,dp->tp", x, lp.ple_gate)) * ple.astype(x.dtype)  # [T, P]
        x = x + rms_norm(einsum("tp,pd->td", g, lp.ple_proj), lp.ple_norm, eps)
    if lp.scalar is not None:
        x = x * lp.scalar.astype(x.dtype)
    return x


def _expert_glu(cfg: ModelConfig, glu):
    """The experts' gate-and-up: act(gate) * up, or gpt-oss's clamped form."""
    if cfg.swiglu_limit is None:
        return glu
    lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def clamped(g, u):
        g = jnp.minimum(g, lim)
        return (jnp.clip(u, -lim, lim) + 1) * (g * jax.nn.sigmoid(alpha * g))

    return clamped


# Rows per block under cfg.batch_invariant (by_rows)
INVARIANT_ROWS = 8


def by_rows(fn, cfg: ModelConfig, *xs, live: jax.Array | None = None):
    """fn(*xs), xs pytrees of row-major arrays [T, ...] (None entries pass through). Under
    cfg.batch_invariant in blocks of INVARIANT_ROWS rows, one block at a time: every product and
    reduction then has one shape whatever the step's row count, so a row's result never
    depends on its neighbours (XLA:CPU rounds a 1-row dot unlike a 2-row one, and fused row
    reductions by row count). `live` (int32 scalar): only the blocks holding the first `live`
    rows run (a loop of dynamic length; the rows after come back 0); None: every block (a
    loop of static length, which reverse-mode differentiation goes through)."""
    if not cfg.batch_invariant:
        return fn(*xs)
    r = INVARIANT_ROWS
    t = jax.tree.leaves(xs)[0].shape[0]
    pad = -t % r

    def blocks(a):  # [T, ...] -> [T / r, r, ...]
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, r, *a.shape[1:])

    xb = jax.tree.map(blocks, xs)
    if live is None:
        out = jax.lax.map(lambda b: fn(*b), xb)
    else:
        one = lambda i: fn(*jax.tree.map(lambda a: a[i], xb))  # noqa: E731
        out = jax.tree.map(lambda y: jnp.zeros(((t + pad) // r,) + y.shape, y.dtype),
                           jax.eval_shape(one, 0))
        out = jax.lax.fori_loop(0, (live + r - 1) // r, lambda i, acc: jax.tree.map(
            lambda a, y: a.at[i].set(y), acc, one(i)), out)
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:t], out)


def forward(
    params: Params,
    tokens: jax.Array,  # [T] int32
    cache: KVCache,
    md: AttentionMetadata,
    cfg: ModelConfig,
    backend: str = "xla",
    lora_ids: jax.Array | None = None,
    mm: tuple | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run T ragged tokens through the model, writing their K/V into the cache.
    Returns f32 logits [N, V] for the rows in md.logits_indices, and the new cache.
    lora_ids [T] int32: each row's adapter slot in params.lora (0: none). `mm`: the rows whose
    input is given (forward_hidden)."""
    h, cache = forward_hidden(params, tokens, cache, md, cfg, backend, lora_ids, mm)
    return compute_logits(params, h, cfg), cache


def forward_hidden(params: Params, tokens: jax.Array, cache: KVCache, md: AttentionMetadata,
                   cfg: ModelConfig, backend: str = "xla", lora_ids: jax.Array | None = None,
                   mm: tuple | None = None) -> tuple[jax.Array, KVCache]:
    """The transformer body: final-normed hidden states [N, D] of the md.logits_indices rows.
    `mm` (embeds [T, D], mask [T] bool, deepstack [K, T, D] or None): rows whose input is given
    (image tokens)."""
    x, mask, ple = embed_tokens(params, tokens, cfg, lora_ids, mm)  # [T, D]
    ks, vs = list(cache.k), list(cache.v)
    for i, lp in enumerate(params.layers):
        j = cfg.layer_kv_source(i)
        x, ks[j], vs[j] = layer(lp, x, ks[j], vs[j], md, cfg, i, backend,
                                None if mask is None else params.lora[i], mask,
                                None if ple is None else ple[:, i])
        x = deepstack(x, mm, i)
    return final_rows(params, x, md.logits_indices, cfg), KVCache(k=tuple(ks), v=tuple(vs))


def deepstack(x: jax.Array, mm: tuple | None, i: int) -> jax.Array:
    """x [T, D] after layer i, plus layer i's deepstack input on the image rows (Qwen3-VL: the
    vision encoder's intermediate features, added after each of the first K layers)."""
    if mm is None or mm[2] is None or i >= mm[2].shape[0]:
        return x
    return x + jnp.where(mm[1][:, None], mm[2][i].astype(x.dtype), 0)


def embed_tokens(params: Params, tokens: jax.Array, cfg: ModelConfig,
                 lora_ids: jax.Array | None = None, mm: tuple | None = None):
    """tokens [T] -> (x [T, D] scaled embeddings, the rows' one-hot adapter mask [T, L] or None
    when the params carry no adapters or lora_ids is None, Gemma 4's per-layer inputs
    [T, L, P] or None). `mm` (embeds [T, D], mask [T] bool, ...): rows taking a given input (an
    image's soft tokens from the vision encoder) in place of their token's, unscaled."""
    x = take_rows(params.embed, tokens)  # [T, D]
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, dtype=x.dtype)
    if mm is not None:
        x = jnp.where(mm[1][:, None], mm[0].astype(x.dtype), x)
    mask = None
    if params.lora is not None and lora_ids is not None:
        mask = lora_ops.slot_mask(lora_ids, params.lora[0].a["q"].shape[0], x.dtype)  # [T, L]
    return x, mask, _per_layer_inputs(params, tokens, x, cfg)


def _per_layer_inputs(params: Params, tokens: jax.Array, x: jax.Array, cfg: ModelConfig):
    """Gemma 4: ([T] tokens' rows of the per-layer table x sqrt(P) + the RMS-normed projection
    of x / sqrt(D)) / sqrt(2), as [T, L, P]; None without."""
    p = cfg.per_layer_input_size
    if not p:
        return None
    t, n = tokens.shape[0], cfg.num_layers
    own = take_rows(params.embed_per_layer, tokens).reshape(t, n, p) * jnp.asarray(
        p ** 0.5, x.dtype)
    proj = einsum("td,dq->tq", x, params.ple_model_proj) * jnp.asarray(
        cfg.hidden_size ** -0.5, x.dtype)
    proj = rms_norm(proj.reshape(t, n, p), params.ple_proj_norm, cfg.rms_norm_eps)
    return (proj + own) * jnp.asarray(2 ** -0.5, x.dtype)


def final_rows(params: Params, x: jax.Array, rows: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [T, D] after the last layer -> the final-normed rows [N, D] (rows [N] int32)."""
    return by_rows(lambda y: rms_norm(y, params.final_norm, cfg.rms_norm_eps), cfg, x[rows])


# Up to this many rows the head's product is taken as [V, N]; above it as [N, V]. Gemma 3 270M
# (V 262144, D 640) greedy decode on 2 cores, tok/s with the cut at 32 vs 4: batch 16 136-140 vs
# 154-159, batch 8 92-98 vs 96-101, batch 1 equal (~21.5).
_VOCAB_MAJOR_ROWS = 4


def compute_logits(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """h [N, D] -> f32 logits [N, V] (tied or separate head, optional final soft cap)."""
    head = params.embed if params.lm_head is None else params.lm_head

    def product(h, head):
        if h.shape[0] <= _VOCAB_MAJOR_ROWS and jax.default_backend() == "cpu":
            # a few rows: XLA:CPU runs the [V, N] product faster than [N, V]; the barrier keeps
            # that layout for the dot, the transpose of the small result is cheap
            return jax.lax.optimization_barrier(einsum("nd,vd->vn", h, head)).T  # [N, V]
        return einsum("nd,vd->nv", h, head)  # [N, V]

    def rows(h):
        logits = gathered_head(product, h, head, cfg.batch_invariant).astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            c = cfg.final_logit_softcap
            logits = c * jnp.tanh(logits / c)
        return logits

    return by_rows(rows, cfg, h)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters (tests, benchmarks). Norm weights near 1."""
    d, hq, v = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    keys = iter(jax.random.split(key, 48 * cfg.num_layers + 8))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm(n):
        return (1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)

    layers = []
    ne, fe, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
    for i in range(cfg.num_layers):
        f, dh, hkv = cfg.layer_intermediate(i), cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        own = cfg.layer_kv_source(i) == i
        mlp = dict(w_gate=w(d, f), w_up=w(d, f), w_down=w(f, d))
        if cfg.layer_has_experts(i):
            experts = dict(router=w(d, ne), we_gate=w(ne, d, fe), we_up=w(ne, d, fe),
                           we_down=w(ne, fe, d))
            mlp = mlp | experts if cfg.moe_block else experts
            if cfg.router_bias:
                mlp |= dict(router_b=w(ne))
            if cfg.router_scoring == "sigmoid":
                mlp |= dict(router_choice_b=w(ne))
            if cfg.expert_bias:
                mlp |= dict(we_gate_b=w(ne, fe), we_up_b=w(ne, fe), we_down_b=w(ne, d))
            if cfg.moe_block:
                mlp |= dict(mlp_out_norm=norm(d), expert_in_norm=norm(d),
                            expert_out_norm=norm(d), router_scale=norm(d), expert_scale=norm(ne))
            if fs:
                mlp |= dict(w_gate=w(d, fs), w_up=w(d, fs), w_down=w(fs, d),
                            shared_gate=w(d) if cfg.shared_expert_gate else None)
        attn = dict(wq=w(d, hq, dh), wk=w(d, hkv, dh) if own else None,
                    wv=w(d, hkv, dh) if own and not cfg.layer_k_eq_v(i) else None,
                    wo=w(hq, dh, d))
        if cfg.latent_attention:
            c, cq, nr = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim + cfg.rope_dim
            attn = dict(wq=None if cq else w(d, hq, nr), wk=None, wv=None,
                        wo=w(hq, cfg.v_head_dim, d), wkv_a=w(d, c + cfg.rope_dim),
                        kv_a_norm=norm(c), w_uk=w(hq, cfg.qk_nope_head_dim, c),
                        w_uv=w(hq, c, cfg.v_head_dim))
            if cq:
                attn |= dict(wq_a=w(d, cq), q_a_norm=norm(cq), wq_b=w(cq, hq, nr))
        p = cfg.per_layer_input_size
        if p:
            attn |= dict(ple_gate=w(d, p), ple_proj=w(p, d), ple_norm=norm(d))
        layers.append(
            LayerParams(
                attn_norm=norm(d), **attn, mlp_norm=norm(d), **mlp,
                bq=w(hq, dh) if cfg.qkv_bias else None,
                bk=w(hkv, dh) if cfg.qkv_bias else None,
                bv=w(hkv, dh) if cfg.qkv_bias else None,
                q_norm=norm(dh) if cfg.qk_norm else None,
                k_norm=norm(dh) if cfg.qk_norm and own else None,
                post_attn_norm=norm(d) if cfg.sandwich_norms else None,
                post_mlp_norm=norm(d) if cfg.sandwich_norms else None,
                sinks=w(hq) if cfg.attn_sinks else None,
                bo=w(d) if cfg.attn_out_bias else None,
                scalar=norm(1) if cfg.layer_scalar else None,
            )
        )
    p, n = cfg.per_layer_input_size, cfg.num_layers
    extra = {} if not p else dict(embed_per_layer=w(cfg.per_layer_vocab, n * p),
                                  ple_model_proj=w(d, n * p), ple_proj_norm=norm(p))
    return Params(
        embed=w(v, d),
        layers=tuple(layers),
        final_norm=norm(d),
        lm_head=None if cfg.tie_word_embeddings else w(v, d),
        **extra,
    )
