"""LoRA adapters served in one batch: L device slots of stacked low-rank weights, a slot per row.

Each adapted projection y = x W gains s * (x A) B (PEFT's convention; the scale s = alpha / r, or
alpha / sqrt(r) with rsLoRA, is folded into B at load). An engine keeps, per layer and target,
  a [L, Din, R]   b [L, R, Dout]   (R = max_lora_rank; a rank-r adapter is zero past r),
with Din / Dout the projection's flattened input / output (q: D -> Hq*Dh, o: Hq*Dh -> D, ...).
Token row t of a step uses slot lora_ids[t] (1..L; 0 = the base model). One program serves any
mix of adapters: every row's x A is computed for all L slots and masked to its own, which costs
T*L*R*(Din + Dout) per target, ~L*R/Dout of the base matmul (4 slots of rank 16 over a
2048-wide projection: 3 %), with no gather of per-row weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.runtime.config import ModelConfig

# target -> (LayerParams weight, PEFT module name)
TARGETS = {"q": ("wq", "q_proj"), "k": ("wk", "k_proj"), "v": ("wv", "v_proj"),
           "o": ("wo", "o_proj"), "gate": ("w_gate", "gate_proj"), "up": ("w_up", "up_proj"),
           "down": ("w_down", "down_proj")}


def target_dims(cfg: ModelConfig, i: int = 0) -> dict[str, tuple[int, int]]:
    """target -> (Din, Dout) of layer i's flattened projection (layers differ in Gemma 4)."""
    dh = cfg.layer_head_dim(i)
    d, q, kv, f = (cfg.hidden_size, cfg.num_heads * dh, cfg.layer_kv_heads(i) * dh,
                   cfg.layer_intermediate(i))
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f),
            "down": (f, d)}


@struct.dataclass
class LoraLayer:
    a: dict[str, jax.Array]  # target -> [L, Din, R]
    b: dict[str, jax.Array]  # target -> [L, R, Dout], scale folded in


def init_lora(cfg: ModelConfig, max_loras: int, rank: int, dtype=jnp.float32
              ) -> tuple[LoraLayer, ...]:
    """Zero slots (every adapter slot empty) for every layer and target."""
    if cfg.num_experts:
        raise ValueError("LoRA on mixture-of-experts layers is not supported")
    if cfg.latent_attention:
        raise ValueError("LoRA on latent-attention layers is not supported")
    dims = [target_dims(cfg, i) for i in range(cfg.num_layers)]
    return tuple(LoraLayer(a={t: jnp.zeros((max_loras, i, rank), dtype) for t, (i, _) in d.items()},
                           b={t: jnp.zeros((max_loras, rank, o), dtype) for t, (_, o) in d.items()})
                 for d in dims)


def slot_mask(lora_ids: jax.Array, max_loras: int, dtype) -> jax.Array:
    """lora_ids [T] (0 = base, 1..L) -> one-hot [T, L] (all zero for the base)."""
    return (lora_ids[:, None] == jnp.arange(1, max_loras + 1)[None, :]).astype(dtype)


def delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [T, ...Din] -> s * (x A) B [T, Dout] with each row's own slot (mask [T, L])."""
    x2 = x.reshape(x.shape[0], -1).astype(a.dtype)  # [T, Din]
    xa = jnp.einsum("ti,lir->tlr", x2, a) * mask[:, :, None]  # [T, L, R]
    return jnp.einsum("tlr,lro->to", xa, b)  # [T, Dout]


def add(y: jax.Array, x: jax.Array, layer: LoraLayer | None, target: str,
        mask: jax.Array | None) -> jax.Array:
    """y [T, ...Dout] (the base projection of x) plus the rows' adapters, if any."""
    if layer is None or mask is None:
        return y
    d = delta(x, layer.a[target], layer.b[target], mask)
    return y + d.reshape(y.shape).astype(y.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_slot(stack: tuple[LoraLayer, ...], slot: jax.Array, weights: tuple[LoraLayer, ...]
               ) -> tuple[LoraLayer, ...]:
    """stack with adapter slot `slot` (1..L, as in lora_ids) replaced by `weights` (per layer,
    a [Din, R], b [R, Dout]); zero weights empty the slot."""
    return jax.tree.map(lambda s, w: s.at[slot - 1].set(w.astype(s.dtype)), stack, weights)


def padded_weights(cfg: ModelConfig, rank: int, tensors: dict[tuple[int, str], tuple],
                   ) -> tuple[LoraLayer, ...]:
    """Host arrays of one adapter ({(layer, target): (A [Din, r], B [r, Dout])}, scale in B)
    zero-padded to `rank`, every target present (absent ones zero): write_slot's `weights`."""
    out = []
    for i in range(cfg.num_layers):
        a, b = {}, {}
        for t, (din, dout) in target_dims(cfg, i).items():
            aa, bb = np.zeros((din, rank), np.float32), np.zeros((rank, dout), np.float32)
            if (i, t) in tensors:
                ta, tb = tensors[(i, t)]
                aa[:, :ta.shape[1]], bb[:tb.shape[0]] = ta, tb
            a[t], b[t] = aa, bb
        out.append(LoraLayer(a=a, b=b))
    return tuple(out)
