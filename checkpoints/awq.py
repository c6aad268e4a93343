"""Activation-aware scaling for int4 weights (after AWQ, Lin et al. 2024), folded into what
precedes each weight.

Group-wise round-to-nearest int4 gives every input channel of a group the same step. The
channels that carry large activations matter most to the product: for y = x W and any
per-input-channel s > 0, y = (x / s) (diag(s) W), and quantizing diag(s) W with s_j > 1 on those
channels shrinks their share of the rounding error. Following AWQ,

    s = mean|X_j|^alpha, normalised to geometric mean 1 (max * min = 1),

with alpha searched on a grid per group of weights that read one input, minimising
sum_w ||X W - (X / s) Q(diag(s) W)||^2 over calibration activations X. alpha = 0 is plain
round-to-nearest, so the scaling chosen is never worse than it on the calibration text.

The division by s is folded where it is free:
  attn_norm -> wq, wk, wv      the norm's weight becomes g / s (as in checkpoints/smoothing.py)
  mlp_norm  -> w_gate, w_up
  w_up      -> w_down          act(x w_gate) * (x w_up): the product is linear in up's output,
                               so up's output column j is divided by s_j
(wo is left to round-to-nearest: its input is the attention output, with no linear op of its own
in front under GQA.) X comes from one forward pass of the float weights over the calibration
text (checkpoints/calibration.py), at most MAX_TOKENS tokens.

Then, as AWQ's second step, each scaled weight's range is clipped per group and output channel:
[lo, hi] -> [lo r, hi r] with r from CLIP_RATIOS minimising that group's own output error
||X_g (W_g - Q(clip(W_g)))||^2 (r = 1 is no clipping, so again never worse on the calibration
text); trading the rare largest weights' error for a finer step on all the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoints.smoothing import calibration_tokens, record_inputs
from jaxinfer.runtime.device.quantization import int4_fake

# (what divides by s, its kind, the weights whose rows multiply by s)
FOLDS = (("attn_norm", "norm", ("wq", "wk", "wv")),
         ("mlp_norm", "norm", ("w_gate", "w_up")),
         ("w_up", "columns", ("w_down",)))
SCALED_WEIGHTS = tuple(w for _, _, ws in FOLDS for w in ws)
ALPHAS = tuple(np.linspace(0.0, 1.0, 11))
CLIP_RATIOS = tuple(np.linspace(1.0, 0.5, 11))
MAX_TOKENS = 512


def activation_scales(x: np.ndarray, weights: list, group_size: int, zero_point: bool
                      ) -> tuple[np.ndarray, dict[float, float]]:
    """The AWQ scale s [Din] for the float `weights` ([Din, ...] each) that read activations
    `x` [N, Din], and the calibration error at each alpha tried."""
    x = jnp.asarray(x, jnp.float32)
    ws = [jnp.asarray(w, jnp.float32).reshape(w.shape[0], -1) for w in weights]
    mean = np.asarray(jnp.mean(jnp.abs(x), axis=0), np.float64)
    live = mean > 0
    errors, best = {}, (np.inf, np.ones_like(mean, np.float32))
    for alpha in ALPHAS:
        s = np.where(live, np.power(np.where(live, mean, 1.0), alpha), 1.0)
        s = s / np.sqrt(s[live].max() * s[live].min()) if live.any() else s
        s = np.where(live, s, 1.0).astype(np.float32)
        err = float(sum(_scaled_error(x, w, jnp.asarray(s), group_size, zero_point)
                        for w in ws))
        errors[float(alpha)] = err
        if err < best[0]:
            best = (err, s)
    return best[1], errors


@functools.partial(jax.jit, static_argnames=("group_size", "zero_point"))
def _scaled_error(x, w, s, group_size: int, zero_point: bool):
    """||x w - (x / s) Q(diag(s) w)||^2, w [Din, Dout] (groups along Din)."""
    g = min(group_size, w.shape[0])
    q = int4_fake(w * s[:, None], 0, g, zero_point)
    ref = x @ w
    out = (x / s) @ q
    return jnp.sum(jnp.square(ref - out))


def scale_layers(params, cfg, tokenizer, weights: dict[str, jax.Array],
                 make: Callable[[str, jax.Array], object], group_size: int, zero_point: bool):
    """Params whose int4 weights in FOLDS are re-made (`make(path, f32)`) from their float copies
    `weights` (by path) scaled by the searched s, with 1/s folded into the norms and w_up's
    columns. MoE layers (the router and experts read mlp_norm too) are left as they are.
    The calibration pass runs over `params` with the float copies in place."""
    def with_floats(lp, i):
        return lp.replace(**{w: weights[f"layers.{i}.{w}"] for w in SCALED_WEIGHTS
                             if f"layers.{i}.{w}" in weights})

    floats = params.replace(layers=tuple(with_floats(lp, i) for i, lp in enumerate(params.layers)))
    tokens = calibration_tokens(tokenizer, MAX_TOKENS)
    inputs = record_inputs(floats, cfg, tokens, {"wq": "wq", "w_gate": "w_gate",
                                                 "w_down": "w_down"}, "rows")
    del floats
    layers = []
    for i, lp in enumerate(params.layers):
        paths = {w: f"layers.{i}.{w}" for w in SCALED_WEIGHTS}
        if lp.router is not None or not all(p in weights for p in paths.values()):
            layers.append(lp)
            continue
        f32 = {w: jnp.asarray(weights[p], jnp.float32) for w, p in paths.items()}
        new, folded = {}, {}
        for target, kind, consumers in FOLDS:
            x = inputs[f"layers.{i}.{consumers[0]}"]
            s, _ = activation_scales(x, [f32[w] for w in consumers], group_size, zero_point)
            s = folded[target] = jnp.asarray(s)
            for w in consumers:
                f32[w] = f32[w] * s.reshape((-1,) + (1,) * (f32[w].ndim - 1))
            if kind == "norm":
                g = getattr(lp, target)
                new[target] = (g.astype(jnp.float32) / s).astype(g.dtype)
            else:  # w_up [D, F]: output column j / s_j
                f32[target] = f32[target] / s
        for target, _, consumers in FOLDS:  # the clipping search, on the scaled weights
            x = inputs[f"layers.{i}.{consumers[0]}"] / np.asarray(folded[target])
            for w in consumers:
                f32[w] = clip_search(x, f32[w], group_size, zero_point)
        for w, p in paths.items():
            new[w] = make(p, f32[w])
        layers.append(lp.replace(**new))
    return params.replace(layers=tuple(layers))


def clip_search(x, w, group_size: int, zero_point: bool):
    """`w` [Din, ...] with each group's range (per output channel) clipped by the ratio in
    CLIP_RATIOS that minimises that group's share of ||x w - x Q(w)||^2 over `x` [N, Din]."""
    shape = w.shape
    w2 = jnp.asarray(w, jnp.float32).reshape(shape[0], -1)
    g = min(group_size, shape[0])
    best = _clip_best(jnp.asarray(x, jnp.float32), w2, jnp.asarray(CLIP_RATIOS, jnp.float32),
                      g, zero_point)
    return best.reshape(shape)


@functools.partial(jax.jit, static_argnames=("group_size", "zero_point"))
def _clip_best(x, w, ratios, group_size: int, zero_point: bool):
    din, dout = w.shape
    n_groups = din // group_size
    xg = x.reshape(x.shape[0], n_groups, group_size)  # [N, G, g]
    wg = w.reshape(n_groups, group_size, dout)  # [G, g, O]
    lo, hi = jnp.min(wg, 1, keepdims=True), jnp.max(wg, 1, keepdims=True)

    def clipped(r):
        if zero_point:
            return jnp.clip(wg, lo * r, hi * r)
        amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi)) * r
        return jnp.clip(wg, -amax, amax)

    def error(r):  # [G, O]: each group's own output error
        q = int4_fake(clipped(r).reshape(din, dout), 0, group_size, zero_point)
        d = wg - q.reshape(n_groups, group_size, dout)
        return jnp.sum(jnp.square(jnp.einsum("ngk,gko->ngo", xg, d)), axis=0)

    errs = jax.lax.map(error, ratios)  # [R, G, O]
    pick = jnp.argmin(errs, axis=0)  # [G, O]; ratio 1 (index 0) wins ties
    r = ratios[pick][:, None, :]
    return clipped(r).reshape(din, dout)
