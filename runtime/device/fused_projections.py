"""Fused projections: one weight for Q, K and V and one for the MLP's gate and up, split after
the product (fewer, wider matmuls: one dot where there were three, or two).

    wq [D, Hq, Dh], wk / wv [D, Hkv, Dh] -> wqkv [D, Hkv, G + 2, Dh]   (G = Hq / Hkv)
        kv head j's G query heads, then its key, then its value: a tensor-parallel shard of the
        Hkv axis holds whole heads, and query head j * G + g stays query head j * G + g.
    w_gate / w_up [D, F] -> w_gate_up [D, F, 2]
        each gate column beside its up column: a shard of F holds matching halves.

Checkpoints keep the separate weights (every loader, quantizer and smoother works on those);
`fuse_projections` joins them once when the engine is built. Quantized weights join when their
scales are per output channel or per group of the input (values, scales and offsets concatenate
along the same output axis); any other layout stays separate, which the model runs as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.runtime.device.quantization import QuantizedArray


def split_qkv(y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """y [T, Hkv, G + 2, Dh] (the wqkv product) -> q [T, Hq, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh]."""
    t, hkv, g2, dh = y.shape
    return y[:, :, :-2].reshape(t, hkv * (g2 - 2), dh), y[:, :, -2], y[:, :, -1]


def _joinable(ws: list, out_shapes: list[tuple[int, ...]]) -> bool:
    """Weights of one kind whose leaves all have the logical output axes after axis 0 (the
    contracted D), so reshaping and concatenating those axes keeps each scale on its weights."""
    if all(isinstance(w, jax.Array) for w in ws):
        return len({w.dtype for w in ws}) == 1
    if not all(isinstance(w, QuantizedArray) for w in ws):
        return False
    meta = {(w.fmt, w.mode, w.reduce_axes, w.group_size, w.group_axis, w.dtype,
             w.offsets is None) for w in ws}
    if len(meta) != 1 or ws[0].reduce_axes != (0,) or ws[0].group_axis not in (None, 0):
        return False
    return all(tuple(a.shape[1:]) == s for w, s in zip(ws, out_shapes)
               for a in (w.values, w.scales, w.offsets) if a is not None)


def _join(ws: list, shapes: list[tuple[int, ...]], axis: int):
    """Each weight reshaped to (its axis 0,) + shapes[i], concatenated on `axis`."""
    def cat(leaves):
        return jnp.concatenate([a.reshape(a.shape[:1] + s) for a, s in zip(leaves, shapes)],
                               axis)

    if isinstance(ws[0], jax.Array):
        return cat(ws)
    offsets = None if ws[0].offsets is None else cat([w.offsets for w in ws])
    return ws[0].replace(values=cat([w.values for w in ws]), scales=cat([w.scales for w in ws]),
                         offsets=offsets)


def fuse_layer(lp, tensor_parallel: int = 1):
    """LayerParams with wqkv / w_gate_up in place of the separate weights, where they join
    (a layer already fused stays as it is)."""
    upd = {}
    # K/V heads that do not split over the devices replicate while Q shards: kept apart
    if lp.wk is not None and lp.wk.shape[1] % tensor_parallel == 0:  # (latent: no wk)
        hq, dh = lp.wq.shape[1:]
        hkv = lp.wk.shape[1]
        g = hq // hkv
        shapes = [(hkv, g, dh), (hkv, 1, dh), (hkv, 1, dh)]
        qkv = [lp.wq, lp.wk, lp.wv]
        if _joinable(qkv, [(hq, dh), (hkv, dh), (hkv, dh)]):
            upd.update(wqkv=_join(qkv, shapes, 2), wq=None, wk=None, wv=None)
    if lp.w_gate is not None:
        f = lp.w_gate.shape[1]
        gu = [lp.w_gate, lp.w_up]
        if _joinable(gu, [(f,), (f,)]):
            upd.update(w_gate_up=_join(gu, [(f, 1), (f, 1)], 2), w_gate=None, w_up=None)
    return lp.replace(**upd)


def fuse_projections(params, tensor_parallel: int = 1):
    """Params with every layer's projections fused where they join (see the module doc)."""
    return params.replace(layers=tuple(fuse_layer(lp, tensor_parallel) for lp in params.layers))
