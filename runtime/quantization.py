"""Weight formats and the one einsum every weight goes through.

Model code calls `einsum(spec, x, w)` for every weight; the weight's type decides how the product
is computed (dense here; `QuantizedArray` adds its own `einsum`). Model code never asks which
format a weight has.

`QuantizedArray`: symmetric int8 or fp8 (e4m3fn) values with f32 scales. The scales keep the
weight's rank with size 1 on the *reduced* axes (the axes a matmul contracts), so there is one
scale per output channel: wq [D, Hq, Dh] -> scales [1, Hq, Dh]; embed [V, D] -> [V, 1].
Two matmul paths (a static `mode` field):
  "w8a8"         int8 only: activations are quantized per token on the fly, int8 x int8 -> int32
                 dot, rescaled by (activation scale x weight scale). The fastest path on CPU.
  "weight_only"  the weight's values are widened to the compute dtype inside the matmul and the
                 per-channel scale is applied to the output. int8 and fp8; the native path on
                 TPU/GPU (XLA fuses the convert into the dot).
Per-group scales (`group_size`) are reserved: quantize() refuses them for now.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FORMATS = ("int8", "fp8")
MODES = ("w8a8", "weight_only")
KV_CACHE_DTYPES = ("auto", "int8")
_QMAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}  # 448
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}

# Which weights are quantized, and the axes their einsum in runtime/model.py contracts.
# embed / lm_head: "nd,vd->nv" contracts d (axis 1); take_rows reads whole rows, also per-row.
WEIGHT_REDUCE_AXES: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # "td,dhk->thk"
    "wo": (0, 1),  # "thk,hkd->td"
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # "td,df->tf", "tf,fd->td"
    "embed": (1,), "lm_head": (1,),
}
EMBEDDING_WEIGHTS = ("embed", "lm_head")


class QuantizationError(ValueError):
    """A quantization format / mode / platform combination that cannot run."""


# ------------------------------------------------------------------------------ the type


@struct.dataclass
class QuantizedArray:
    values: jax.Array  # int8 | float8_e4m3fn, the dense weight's shape
    scales: jax.Array  # f32, the weight's rank, size 1 on reduce_axes
    fmt: str = struct.field(pytree_node=False, default="int8")  # "int8" | "fp8"
    mode: str = struct.field(pytree_node=False, default="weight_only")  # "w8a8" | "weight_only"
    reduce_axes: tuple[int, ...] = struct.field(pytree_node=False, default=(0,))
    group_size: int | None = struct.field(pytree_node=False, default=None)
    dtype: str = struct.field(pytree_node=False, default="float32")  # compute dtype of take_rows

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scales).astype(dtype)

    def take_rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` of a [V, D] table quantized per row, in the compute dtype."""
        if self.reduce_axes != (1,) or self.ndim != 2:
            raise QuantizationError(
                f"take_rows needs a [V, D] table quantized per row (reduce_axes (1,)), "
                f"got shape {self.shape} reduce_axes {self.reduce_axes}"
            )
        rows = jnp.take(self.values, ids, axis=0).astype(jnp.float32) * jnp.take(
            self.scales, ids, axis=0)
        return rows.astype(self.dtype)

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, x, w)` for this weight; returns x.dtype (f32 accumulation)."""
        xs, ws, out = _parse(spec, x.ndim, self.ndim)
        w_contracted = tuple(i for i, c in enumerate(ws) if c in xs and c not in out)
        if not set(w_contracted) <= set(self.reduce_axes):
            # the scale varies along a contracted axis: it cannot be factored out of the sum
            w = self.dequantize(x.dtype)
            return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if self.mode == "w8a8":
            # the int8 dot runs with x's free axes first ("nd,vd->nv", not "->vn"): XLA:CPU's
            # int8 dot with the weight's axis leading the output is ~2x slower for a few rows
            canon = "".join([c for c in out if c in xs] + [c for c in out if c not in xs])
            y = _einsum_w8a8(f"{xs},{ws}->{canon}", xs, ws, canon, x, self)
            return y if canon == out else jnp.transpose(y, [canon.index(c) for c in out])
        y = jnp.einsum(spec, x, self.values.astype(x.dtype), preferred_element_type=jnp.float32)
        ones = jnp.ones((1,) * x.ndim, jnp.float32)
        scale = jnp.einsum(spec, ones, self.scales, precision=jax.lax.Precision.HIGHEST)
        return (y * scale).astype(x.dtype)


def _parse(spec: str, x_ndim: int, w_ndim: int) -> tuple[str, str, str]:
    m = re.fullmatch(r"\s*([a-z]+)\s*,\s*([a-z]+)\s*->\s*([a-z]*)\s*", spec)
    if not m:
        raise QuantizationError(f"einsum spec {spec!r}: expected 'xs,ws->out' with letters only")
    xs, ws, out = m.groups()
    if len(xs) != x_ndim or len(ws) != w_ndim:
        raise QuantizationError(
            f"einsum spec {spec!r} does not match operand ranks x {x_ndim}, w {w_ndim}")
    return xs, ws, out


ACT_GROUP = 128  # activation quantization group along a single contracted axis
# Group only wide contractions (the MLP down projection: d_ff >> d_model), where the GeGLU/SwiGLU
# product's outlier channels live; narrower ones keep one fast per-token dot.
MIN_GROUPS = 8


def _einsum_w8a8(spec, xs, ws, out, x, w: QuantizedArray) -> jax.Array:
    """Dynamic activation quantization, int8 x int8 -> int32, then rescale.

    Activations get one scale per token and per group of ACT_GROUP contracted channels when a
    single wide axis (>= MIN_GROUPS groups) is contracted (GeGLU outputs carry outlier
    channels: a per-token scale alone costs Gemma 3 270M 3.6% perplexity), else per token. Groups run
    as an unrolled sum of plain int8 dots (XLA:CPU's batched int8 dot is several times slower)."""
    x_red = tuple(i for i, c in enumerate(xs) if c in ws and c not in out)  # contracted in x
    xf = x.astype(jnp.float32)
    # XLA:CPU runs an int8 matrix-vector product on a slow path (~25x slower than two rows):
    # pad a single token row to two.
    free = [i for i, c in enumerate(xs) if c not in ws]
    pad_axis = free[0] if free and all(xf.shape[i] == 1 for i in free) else None
    if pad_axis is not None:
        xf = jnp.pad(xf, [(0, 1 if i == pad_axis else 0) for i in range(xf.ndim)])
    n = xf.shape[x_red[0]] // ACT_GROUP if len(x_red) == 1 else 1
    if n < MIN_GROUPS or xf.shape[x_red[0]] % ACT_GROUP:
        n = 1
    ax = x_red[0]
    wax = ws.index(xs[ax]) if n > 1 else None
    keep = "".join(ch for ch in out if ch in xs)  # output axes that come from x
    y = None
    for g in range(n):  # static unroll
        xg = jax.lax.slice_in_dim(xf, g * ACT_GROUP, (g + 1) * ACT_GROUP, axis=ax) if n > 1 else xf
        wg = jax.lax.slice_in_dim(w.values, g * ACT_GROUP, (g + 1) * ACT_GROUP, axis=wax) \
            if n > 1 else w.values
        amax = jnp.max(jnp.abs(xg), axis=x_red, keepdims=True)
        sx = jnp.where(amax > 0, amax / 127.0, 1.0)  # [.., 1 on contracted axes]
        xq = jnp.clip(jnp.round(xg / sx), -127, 127).astype(jnp.int8)
        acc = jnp.einsum(spec, xq, wg, preferred_element_type=jnp.int32).astype(jnp.float32)
        sx_out = jnp.einsum(f"{xs}->{keep}", sx)  # drop the size-1 contracted axes
        sx_out = jnp.expand_dims(sx_out, [i for i, ch in enumerate(out) if ch not in xs])
        y = acc * sx_out if y is None else y + acc * sx_out
    if pad_axis is not None:
        y = jax.lax.slice_in_dim(y, 0, 1, axis=out.index(xs[pad_axis]))
    ones = jnp.ones((1,) * x.ndim, jnp.float32)
    w_scale = jnp.einsum(spec, ones, w.scales, precision=jax.lax.Precision.HIGHEST)
    return (y * w_scale).astype(x.dtype)


# ------------------------------------------------------------------------- (de)quantization


def quantize(w, fmt: str, reduce_axes: tuple[int, ...], *, mode: str | None = None,
             group_size: int | None = None, dtype=jnp.float32) -> QuantizedArray:
    """Symmetric quantization of `w` with one f32 scale per slice over `reduce_axes`
    (the axes the weight's matmul contracts: one scale per output channel)."""
    fmt = check_format(fmt)
    mode = mode or default_mode(fmt)
    check_mode(fmt, mode)
    if group_size is not None:
        raise NotImplementedError("per-group scales (group_size) are not implemented yet")
    w = jnp.asarray(w)
    reduce_axes = tuple(sorted(a % w.ndim for a in reduce_axes))
    values, scales = _quantize_jit(w, fmt, reduce_axes)
    return QuantizedArray(values=values, scales=scales, fmt=fmt, mode=mode,
                          reduce_axes=reduce_axes, group_size=group_size,
                          dtype=jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnames=("fmt", "reduce_axes"))
def _quantize_jit(w, fmt: str, reduce_axes: tuple[int, ...]):
    """One fused pass (no weight-sized f32 temporaries): values, f32 scales (keepdims)."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=reduce_axes, keepdims=True)
    scales = jnp.where(amax > 0, amax / _QMAX[fmt], 1.0).astype(jnp.float32)
    v = wf / scales
    if fmt == "int8":
        v = jnp.clip(jnp.round(v), -127, 127)
    else:
        v = jnp.clip(v, -_QMAX[fmt], _QMAX[fmt])
    return v.astype(_STORAGE[fmt]), scales


def abstract_quantized(path: str, leaf, fmt: str, mode: str, dtype) -> QuantizedArray:
    """The ShapeDtypeStruct form of the QuantizedArray that `placer` makes for weight `path`
    from a leaf of shape `leaf.shape` (an orbax restore target; nothing is computed)."""
    axes = WEIGHT_REDUCE_AXES[weight_name(path)]
    scale_shape = tuple(1 if i in axes else n for i, n in enumerate(leaf.shape))
    return QuantizedArray(
        values=jax.ShapeDtypeStruct(tuple(leaf.shape), _STORAGE[fmt]),
        scales=jax.ShapeDtypeStruct(scale_shape, jnp.float32),
        fmt=fmt, mode=mode, reduce_axes=axes, dtype=jnp.dtype(dtype).name)


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    return w.dequantize(dtype) if isinstance(w, QuantizedArray) else jnp.asarray(w, dtype)


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise QuantizationError(f"quantization must be one of {FORMATS} (or None), got {fmt!r}")
    return fmt


def default_mode(fmt: str, platform: str | None = None) -> str:
    """int8 on CPU: W8A8 (int8 dots are the fastest CPU matmul); otherwise weight-only."""
    platform = platform or jax.default_backend()
    return "w8a8" if fmt == "int8" and platform == "cpu" else "weight_only"


def check_mode(fmt: str, mode: str, platform: str | None = None) -> None:
    """Raise QuantizationError for a (format, mode, platform) that cannot run."""
    if mode not in MODES:
        raise QuantizationError(f"quantization mode must be one of {MODES}, got {mode!r}")
    if fmt == "fp8" and mode == "w8a8":
        platform = platform or jax.default_backend()
        raise QuantizationError(
            f"fp8 with mode 'w8a8' (fp8 activations, fp8 x fp8 dots) cannot run on {platform!r}: "
            "this runtime implements W8A8 for int8 only and there is no native fp8 dot on CPU; "
            "use quant_mode='weight_only' for fp8, or quantization='int8'"
        )


def check_compute_dtype(fmt: str, dtype) -> None:
    """fp8 weights are widened to the compute dtype inside the matmul: it must hold e4m3 values
    exactly (f32 / bf16 do; f16 loses the e4m3 subnormal range)."""
    d = jnp.dtype(dtype)
    if fmt == "fp8" and d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise QuantizationError(f"fp8 weights need float32 or bfloat16 compute, got {d}")


# --------------------------------------------------------------------------------- params


def weight_name(path: str) -> str:
    """'layers.3.wq' -> 'wq'; 'embed' -> 'embed'."""
    return path.rsplit(".", 1)[-1]


def should_quantize(path: str, quantize_embeddings: bool = True) -> bool:
    name = weight_name(path)
    if name not in WEIGHT_REDUCE_AXES:
        return False
    return quantize_embeddings or name not in EMBEDDING_WEIGHTS


# SmoothQuant-style smoothing (runtime/smoothing.py) of int8 W8A8 weights at quantize time:
# the migration strength alpha, None to switch it off. Only the W8A8 path quantizes activations,
# so only it is smoothed.
SMOOTH_ALPHA: float | None = 0.5


class Placer:
    """The loaders' `place(path, f32_array)` hook: each weight is quantized the moment it is read,
    everything else cast to `dtype`. With smoothing (int8 W8A8), the float copies of the weights
    that read an RMSNorm (q/k/v, gate/up) are also kept until `finish(cfg, params, tokenizer)`,
    which calibrates on a fixed text, folds the smoothing scales into the norms and re-quantizes
    those weights from their float copies (then drops them). Without `finish` the params are a
    plain (unsmoothed) int8 model, so a wrapper that does not forward `finish` stays correct."""

    def __init__(self, fmt: str, dtype, *, mode: str | None = None,
                 quantize_embeddings: bool = True, smooth_alpha: float | None | str = "default"):
        self.fmt = check_format(fmt)
        self.mode = mode or default_mode(fmt)
        check_mode(self.fmt, self.mode)
        check_compute_dtype(self.fmt, dtype)
        self.dtype = dtype
        self.quantize_embeddings = quantize_embeddings
        if smooth_alpha == "default":
            smooth_alpha = SMOOTH_ALPHA if (self.fmt, self.mode) == ("int8", "w8a8") else None
        self.smooth_alpha = smooth_alpha
        self.pending: dict[str, jax.Array] = {}  # float copies of the weights to smooth

    def quantize(self, path: str, arr) -> QuantizedArray:
        q = quantize(arr, self.fmt, WEIGHT_REDUCE_AXES[weight_name(path)], mode=self.mode,
                     dtype=self.dtype)
        return jax.block_until_ready(q)

    def __call__(self, path: str, arr):
        if should_quantize(path, self.quantize_embeddings):
            if self.smooth_alpha is not None:
                from jaxinfer.runtime.smoothing import SMOOTHED_WEIGHTS

                if weight_name(path) in SMOOTHED_WEIGHTS:
                    self.pending[path] = jnp.asarray(arr, jnp.float32)
            return self.quantize(path, arr)
        return jnp.asarray(arr, self.dtype)

    def finish(self, cfg, params, tokenizer):
        """Smooth and re-quantize the weights kept by __call__ (no-op when none were)."""
        if not self.pending:
            return params
        from jaxinfer.runtime.smoothing import calibration_tokens, norm_input_maxima, smooth_layers

        pending, self.pending = self.pending, {}
        float_params = _with_leaves(with_mode(params, "weight_only"), pending)
        maxima = norm_input_maxima(float_params, cfg, calibration_tokens(tokenizer))
        del float_params
        return smooth_layers(params, maxima, self.smooth_alpha, weights=pending,
                             make=self.quantize)


def _with_leaves(params, leaves: dict):
    """`params` with the leaves at the given paths replaced."""
    def one(kp, a):
        return leaves.get(path_str(kp), a)

    return jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda a: isinstance(a, QuantizedArray))


def placer(fmt: str, dtype, *, mode: str | None = None, quantize_embeddings: bool = True,
           smooth_alpha: float | None | str = "default") -> Placer:
    """A `place(path, f32_array)` hook for the checkpoint loaders (see Placer); the loaders call
    its `finish` once all tensors are in. `smooth_alpha`: "default" = SMOOTH_ALPHA for int8
    W8A8 and no smoothing otherwise; None = off."""
    return Placer(fmt, dtype, mode=mode, quantize_embeddings=quantize_embeddings,
                  smooth_alpha=smooth_alpha)


def quantize_params(params, fmt: str, dtype=jnp.float32, *, mode: str | None = None,
                    quantize_embeddings: bool = True, cfg=None, tokenizer=None,
                    smooth_alpha: float | None | str = "default"):
    """Quantize a loaded Params tree (weights per WEIGHT_REDUCE_AXES); other leaves -> dtype.
    Smoothing (int8 W8A8) needs the model's `cfg` and `tokenizer` for its calibration pass;
    without them the weights are quantized as they are."""
    place = placer(fmt, dtype, mode=mode, quantize_embeddings=quantize_embeddings,
                   smooth_alpha=smooth_alpha if cfg is not None and tokenizer is not None else None)

    def one(kp, a):
        if isinstance(a, QuantizedArray):
            return a
        return place(path_str(kp), a)

    out = jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    return place.finish(cfg, out, tokenizer) if place.pending else out


def path_str(kp) -> str:
    parts = []
    for k in kp:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def quantization_spec(params) -> dict | None:
    """What is quantized in a Params tree: {"fmt", "mode", "weights": [paths]} or None."""
    found = []

    def visit(kp, a):
        if isinstance(a, QuantizedArray):
            found.append((path_str(kp), a))
        return a

    jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    if not found:
        return None
    fmts = {a.fmt for _, a in found}
    modes = {a.mode for _, a in found}
    if len(fmts) != 1 or len(modes) != 1:
        raise QuantizationError(f"mixed quantization formats/modes {fmts} {modes} in one model")
    return {"fmt": fmts.pop(), "mode": modes.pop(), "weights": [p for p, _ in found]}


def with_mode(params, mode: str):
    """The same quantized values under another matmul mode (no re-quantization)."""
    def one(a):
        if isinstance(a, QuantizedArray):
            check_mode(a.fmt, mode)
            return a.replace(mode=mode)
        return a

    return jax.tree.map(one, params, is_leaf=lambda a: isinstance(a, QuantizedArray))


def param_bytes(params) -> int:
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params)))


# ------------------------------------------------------------------------------- the wrapper


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """`x` activations (compute dtype), `w` a weight (dense array or a type with `.einsum`).
    Accumulates in f32 and returns x's dtype."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x)
    out = jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def take_rows(w, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a [V, D] table (embedding lookup) in the table's compute dtype."""
    if hasattr(w, "take_rows"):
        return w.take_rows(ids)
    return jnp.take(w, ids, axis=0)
