"""SmoothQuant-style smoothing for W8A8 int8 (Xiao et al. 2023), folded into the RMSNorm weights.

W8A8 quantizes activations per token, so one outlier channel sets the scale of the whole row and
the other channels lose resolution. For a linear layer y = x W, any per-input-channel s > 0 gives
y = (x / s) (diag(s) W): dividing the activation by s flattens its outliers, multiplying W's row j
by s_j moves the range into the weight, which is quantized per output channel. With

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

the two are balanced. The division is free wherever the activation is an RMSNorm output: the norm
weight (stored as the effective multiplier, Gemma's `1 + w` already folded in at load) becomes
w / s. That covers q/k/v (attn_norm) and gate/up (mlp_norm); all weights reading one norm share
its s. The float function is unchanged (up to rounding); only the quantized one improves.

max|X_j| comes from one forward pass of the float model over CALIBRATION_TEXT
(checkpoints/calibration.py) at quantize time: deterministic, ~1k tokens, one jitted forward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.checkpoints.calibration import CALIBRATION_TEXT
from jaxinfer.runtime.device.attention import whole_sequence_metadata
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import forward_hidden
from jaxinfer.runtime.device.quantization import QuantizedArray, einsum, parse_einsum

# norm -> the weights that read its output (their row j multiplies the norm's channel j)
NORM_CONSUMERS = {"attn_norm": ("wq", "wk", "wv"), "mlp_norm": ("w_gate", "w_up")}
SMOOTHED_WEIGHTS = tuple(w for ws in NORM_CONSUMERS.values() for w in ws)
MAX_CALIBRATION_TOKENS = 2048

_RECORDS: list[dict] = []  # the stack of open recordings (one per traced calibration forward)


@struct.dataclass
class Observed:
    """A weight that records, into the innermost open recording under `key`, either the max |x|
    per contracted input channel over every einsum it takes part in (`stat` "max"), or its 2-D
    input itself ([T, Din], `stat` "rows"); then multiplies as the wrapped weight would."""
    w: object
    key: str = struct.field(pytree_node=False, default="")
    stat: str = struct.field(pytree_node=False, default="max")

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return len(self.w.shape)

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        rec = _RECORDS[-1]
        if self.stat == "rows":
            rec[self.key] = x.astype(jnp.float32)
        else:
            xs, ws, out = parse_einsum(spec, x.ndim, self.ndim)
            kept = tuple(i for i, c in enumerate(xs) if c not in ws or c in out)  # not contracted
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=kept)
            rec[self.key] = jnp.maximum(rec[self.key], amax) if self.key in rec else amax
        return einsum(spec, x, self.w)


def calibration_tokens(tokenizer, max_tokens: int = MAX_CALIBRATION_TOKENS) -> list[int]:
    """BOS (when the tokenizer has one) + CALIBRATION_TEXT's ids, at most max_tokens."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return (bos + list(tokenizer.encode(CALIBRATION_TEXT)))[:max_tokens]


def norm_input_maxima(params, cfg, tokens: list[int]) -> dict[str, np.ndarray]:
    """{"layers.i.attn_norm" | "layers.i.mlp_norm": max |norm output| per channel [D]} over one
    forward pass of `tokens` (one sequence) through `params` (dense or weight-only weights)."""
    return record_inputs(params, cfg, tokens, {"wq": "attn_norm", "w_gate": "mlp_norm"}, "max")


def record_inputs(params, cfg, tokens: list[int], weights: dict[str, str], stat: str
                  ) -> dict[str, np.ndarray]:
    """{"layers.i.<label>": statistic of weight's input} for each {weight name: label} of every
    layer, over one forward pass of `tokens` (one sequence) through `params`; `stat` as in
    Observed ("max" per channel, or the "rows" [T, Din])."""
    layers = []
    for i, lp in enumerate(params.layers):
        layers.append(lp.replace(**{w: Observed(getattr(lp, w), f"layers.{i}.{label}", stat)
                                    for w, label in weights.items()
                                    if getattr(lp, w) is not None}))  # (None: an MoE layer)
    observed = params.replace(layers=tuple(layers))
    page_size = 16
    md, n_pages = whole_sequence_metadata(len(tokens), page_size, all_logits=False)
    dtype = jnp.dtype(params.final_norm.dtype)
    cache = init_cache(cfg, n_pages, page_size, dtype if dtype != jnp.int8 else jnp.float32)

    def run(p, toks, cache, md):
        _RECORDS.append({})
        try:
            forward_hidden(p, toks, cache, md, cfg, "xla")
        finally:
            rec = _RECORDS.pop()
        return rec

    rec = jax.jit(run)(observed, jnp.asarray(tokens, jnp.int32), cache, md)
    return {k: np.asarray(v, np.float32) for k, v in rec.items()}


def smoothing_scales(x_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = x_max_j^alpha / w_max_j^(1 - alpha); 1 where either side is 0 (a dead channel)."""
    x_max = np.asarray(x_max, np.float64)
    w_max = np.asarray(w_max, np.float64)
    ok = (x_max > 0) & (w_max > 0) & np.isfinite(x_max) & np.isfinite(w_max)
    s = np.where(ok, np.power(np.where(ok, x_max, 1.0), alpha)
                 / np.power(np.where(ok, w_max, 1.0), 1.0 - alpha), 1.0)
    return s.astype(np.float32)


def _row_max(w) -> np.ndarray:
    """max |w| over everything but axis 0 (the input channel of a [D, ...] weight)."""
    w = np.asarray(w, np.float32)
    return np.abs(w).reshape(w.shape[0], -1).max(axis=1)


def smooth_layers(params, maxima: dict[str, np.ndarray], alpha: float,
                  weights: dict[str, jax.Array] | None = None,
                  make: Callable[[str, jax.Array], object] | None = None):
    """Params with every norm in NORM_CONSUMERS divided by s and its consumers' rows multiplied
    by s. `weights`: the float consumer weights by path (default: the leaves of `params`, which
    must then be dense); `make(path, smoothed_f32)` builds each new consumer leaf (default: the
    f32 array in the leaf's dtype). Layers without maxima or float weights are left as they are."""
    layers = []
    for i, lp in enumerate(params.layers):
        new = {}
        for norm, consumers in NORM_CONSUMERS.items():
            key = f"layers.{i}.{norm}"
            paths = [f"layers.{i}.{w}" for w in consumers]
            if weights is not None:
                ws = [weights.get(p) for p in paths]
            else:
                ws = [getattr(lp, w) for w in consumers]
                ws = [None if isinstance(w, QuantizedArray) else w for w in ws]
            if key not in maxima or any(w is None for w in ws) or (
                    norm == "mlp_norm" and lp.router is not None):  # experts read it too
                continue
            w_max = np.max([_row_max(w) for w in ws], axis=0)
            s = smoothing_scales(maxima[key], w_max, alpha)
            g = getattr(lp, norm)
            new[norm] = (g.astype(jnp.float32) / jnp.asarray(s)).astype(g.dtype)
            for name, p, w in zip(consumers, paths, ws):
                col = jnp.asarray(s).reshape((-1,) + (1,) * (w.ndim - 1))
                sw = jnp.asarray(w, jnp.float32) * col
                new[name] = make(p, sw) if make else sw.astype(getattr(lp, name).dtype)
        layers.append(lp.replace(**new))
    return params.replace(layers=tuple(layers))
