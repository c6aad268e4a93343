"""Quantize while loading: which weights become QuantizedArrays (and along which axes), the
loaders' `place` hook that quantizes each tensor as it is read (with SmoothQuant-style smoothing
for int8 W8A8, activation-aware scaling for int4), whole-tree quantization, and the
quantization spec saved with a converted model. The type and its matmuls live in
runtime/device/quantization.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.checkpoints import awq
from jaxinfer.checkpoints.smoothing import (SMOOTHED_WEIGHTS, calibration_tokens,
                                            norm_input_maxima, smooth_layers)
from jaxinfer.runtime.device.quantization import (INT4_GROUP, STORAGE_DTYPES, QuantizationError,
                                           QuantizedArray, check_compute_dtype, check_format,
                                           check_mode, default_mode, int4_group_size, quantize)
from jaxinfer.runtime.device.tree_paths import path_str

# Which weights are quantized, and the axes their einsum in runtime/device/model.py contracts.
# embed / lm_head: "nd,vd->nv" contracts d (axis 1); take_rows reads whole rows, also per-row.
WEIGHT_REDUCE_AXES: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # "td,dhk->thk"
    "wo": (0, 1),  # "thk,hkd->td"
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # "td,df->tf", "tf,fd->td"
    "embed": (1,), "lm_head": (1,),
    # stacked experts [E, D, F] / [E, F, D] (runtime/device/moe.py): per expert and output channel.
    # The expert forms widen the experts they read whatever the mode (weight-only math).
    "we_gate": (1,), "we_up": (1,), "we_down": (1,),
    # latent attention's down / up projections of q and the latent (runtime/device/mla.py):
    # "td,dr->tr", "tr,rhk->thk", "td,dc->tc". Its per-head w_uk / w_uv (a batch axis in
    # their products) stay in the compute dtype.
    "wq_a": (0,), "wq_b": (0,), "wkv_a": (0,),
}
EMBEDDING_WEIGHTS = ("embed", "lm_head")
# The vision encoders' layer products (runtime/device/vision.py, qwen3_vl_vision.py):
# "ntd,dhk->nthk" / "nthk,hkd->ntd", "ntd,df->ntf" / "ntf,fd->ntd" (Qwen3-VL's fused wqkv, the
# patch embedding and the projector stay in the compute dtype)
VISION_REDUCE_AXES: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "fc1": (0,), "fc2": (0,)}
# An int4 model's embedding / lm_head tables are int8 per row, as 4-bit checkpoints keep theirs
# wider (llama.cpp's Q4_K_M: Q6_K / Q8_0; AWQ, GPTQ: f16). Gemma 3 270M (tied, 262k rows):
# perplexity +32 % with int4 tables vs +20 % with float ones (bench quality), and the int8 W8A8
# head is the fastest vocabulary projection on CPU.
INT4_EMBEDDINGS = "int8"


def quantize_vision(params, fmt: str, dtype, mode: str | None = None):
    """A vision encoder's params with its layers' products (VISION_REDUCE_AXES) quantized to
    `fmt` by round to nearest (no calibration reaches an encoder); int4 runs them as int8
    (their widths, e.g. SigLIP's 4304, need not divide a group)."""
    if fmt == "int4":
        fmt, mode = "int8", None
    mode = mode or default_mode(fmt)

    def one(kp, a):
        path = path_str(kp)
        axes = VISION_REDUCE_AXES.get(weight_name(path))
        if axes is None or not hasattr(a, "ndim") or isinstance(a, QuantizedArray):
            return a
        return quantize(a, fmt, axes, mode=mode, dtype=dtype, name=path)

    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda a: isinstance(a, QuantizedArray))


def weight_name(path: str) -> str:
    """'layers.3.wq' -> 'wq'; 'embed' -> 'embed'."""
    return path.rsplit(".", 1)[-1]


def should_quantize(path: str, quantize_embeddings: bool = True) -> bool:
    name = weight_name(path)
    if name not in WEIGHT_REDUCE_AXES:
        return False
    return quantize_embeddings or name not in EMBEDDING_WEIGHTS


# SmoothQuant-style smoothing (checkpoints/smoothing.py) of int8 W8A8 weights at quantize time:
# the migration strength alpha, None to switch it off. Only the W8A8 path quantizes activations,
# so only it is smoothed.
SMOOTH_ALPHA: float | None = 0.5
# Activation-aware scaling (checkpoints/awq.py) of int4 weights at quantize time; False = plain
# round-to-nearest.
AWQ_SCALING: bool = True


class Placer:
    """The loaders' `place(path, f32_array)` hook: each weight is quantized the moment it is read,
    everything else cast to `dtype`. With a calibration-time transform (smoothing for int8 W8A8,
    activation-aware scaling for int4), the float copies of the weights it rescales are also
    kept until `finish(cfg, params, tokenizer)`, which calibrates on a fixed text, folds the
    scales into the norms (and w_up) and re-quantizes those weights from their float copies
    (then drops them). Without `finish` the params are a plain round-to-nearest model, so a
    wrapper that does not forward `finish` stays correct."""

    def __init__(self, fmt: str, dtype, *, mode: str | None = None,
                 quantize_embeddings: bool = True, smooth_alpha: float | None | str = "default",
                 activation_aware: bool = True, group_size: int = INT4_GROUP,
                 zero_point: bool = True):
        self.fmt = check_format(fmt)
        self.mode = mode or default_mode(fmt)
        check_mode(self.fmt, self.mode)
        check_compute_dtype(self.fmt, dtype)
        self.dtype = dtype
        self.quantize_embeddings = quantize_embeddings
        if smooth_alpha == "default":
            smooth_alpha = SMOOTH_ALPHA if (self.fmt, self.mode) == ("int8", "w8a8") else None
        self.smooth_alpha = smooth_alpha if activation_aware else None
        self.awq = activation_aware and AWQ_SCALING and self.fmt == "int4"
        self.group_size, self.zero_point = group_size, zero_point
        self.pending: dict[str, jax.Array] = {}  # float copies of the weights to rescale

    def quantize(self, path: str, arr) -> QuantizedArray:
        fmt, mode = self.fmt, self.mode
        if fmt == "int4" and weight_name(path) in EMBEDDING_WEIGHTS:
            fmt, mode = INT4_EMBEDDINGS, default_mode(INT4_EMBEDDINGS)
        q = quantize(arr, fmt, WEIGHT_REDUCE_AXES[weight_name(path)], mode=mode,
                     dtype=self.dtype, group_size=self.group_size, zero_point=self.zero_point,
                     name=path)
        return jax.block_until_ready(q)

    def _rescaled(self, path: str) -> bool:
        if self.awq:
            return weight_name(path) in awq.SCALED_WEIGHTS
        return self.smooth_alpha is not None and weight_name(path) in SMOOTHED_WEIGHTS

    def __call__(self, path: str, arr):
        if isinstance(arr, QuantizedArray):  # quantized in the checkpoint: kept as it is
            return arr
        if should_quantize(path, self.quantize_embeddings):
            if self._rescaled(path):
                self.pending[path] = jnp.asarray(arr, jnp.float32)
            return self.quantize(path, arr)
        return jnp.asarray(arr, self.dtype)

    def finish(self, cfg, params, tokenizer):
        """Rescale and re-quantize the weights kept by __call__ (no-op when none were)."""
        if not self.pending:
            return params
        pending, self.pending = self.pending, {}
        if self.awq:
            return awq.scale_layers(params, cfg, tokenizer, pending, self.quantize,
                                    self.group_size, self.zero_point)
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
           smooth_alpha: float | None | str = "default", activation_aware: bool = True,
           group_size: int = INT4_GROUP, zero_point: bool = True) -> Placer:
    """A `place(path, f32_array)` hook for the checkpoint loaders (see Placer); the loaders call
    its `finish` once all tensors are in. `smooth_alpha`: "default" = SMOOTH_ALPHA for int8
    W8A8 and no smoothing otherwise; None = off. `activation_aware` False: no calibration-time
    transform at all (plain round-to-nearest). `group_size` / `zero_point`: int4 groups."""
    return Placer(fmt, dtype, mode=mode, quantize_embeddings=quantize_embeddings,
                  smooth_alpha=smooth_alpha, activation_aware=activation_aware,
                  group_size=group_size, zero_point=zero_point)


def quantize_params(params, fmt: str, dtype=jnp.float32, *, mode: str | None = None,
                    quantize_embeddings: bool = True, cfg=None, tokenizer=None,
                    smooth_alpha: float | None | str = "default", activation_aware: bool = True,
                    group_size: int = INT4_GROUP, zero_point: bool = True):
    """Quantize a loaded Params tree (weights per WEIGHT_REDUCE_AXES); other leaves -> dtype.
    Smoothing (int8 W8A8) and activation-aware scaling (int4) need the model's `cfg` and
    `tokenizer` for their calibration pass; without them the weights are quantized as they
    are."""
    calibrate = cfg is not None and tokenizer is not None
    place = placer(fmt, dtype, mode=mode, quantize_embeddings=quantize_embeddings,
                   smooth_alpha=smooth_alpha if calibrate else None,
                   activation_aware=activation_aware and calibrate, group_size=group_size,
                   zero_point=zero_point)

    def one(kp, a):
        if isinstance(a, QuantizedArray):
            return a
        return place(path_str(kp), a)

    out = jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    return place.finish(cfg, out, tokenizer) if place.pending else out


def quantization_spec(params) -> dict | None:
    """What is quantized in a Params tree: {"fmt", "mode", "weights": [paths]} or None; int4
    adds {"group_size": the largest group, "zero_point": bool, "scale_dtypes": {path: dtype}}
    and, when its embedding tables are int8 (INT4_EMBEDDINGS), {"embeddings": {"fmt",
    "mode"}}."""
    found = []

    def visit(kp, a):
        if hasattr(a, "abstract"):  # a weight in a kernel's layout (cpu_matmul.PackedWeight)
            a = a.abstract()
        if isinstance(a, QuantizedArray):
            found.append((path_str(kp), a))
        return a

    jax.tree_util.tree_map_with_path(
        visit, params, is_leaf=lambda a: isinstance(a, QuantizedArray) or hasattr(a, "abstract"))
    if not found:
        return None
    tables = [(p, a) for p, a in found if weight_name(p) in EMBEDDING_WEIGHTS]
    extra = {}
    if any(a.fmt == "int4" for _, a in found) and tables and all(
            a.fmt == INT4_EMBEDDINGS for _, a in tables):
        extra["embeddings"] = {"fmt": INT4_EMBEDDINGS, "mode": tables[0][1].mode}
        rest = [(p, a) for p, a in found if weight_name(p) not in EMBEDDING_WEIGHTS]
    else:
        rest = found
    fmts = {a.fmt for _, a in rest}
    modes = {a.mode for _, a in rest}
    if len(fmts) != 1 or len(modes) != 1:
        raise QuantizationError(f"mixed quantization formats/modes {fmts} {modes} in one model")
    spec = {"fmt": fmts.pop(), "mode": modes.pop(), "weights": [p for p, _ in found], **extra}
    if spec["fmt"] == "int4":
        zps = {a.offsets is not None for _, a in rest}
        if len(zps) != 1:
            raise QuantizationError("int4 weights with and without zero points in one model")
        spec.update(group_size=max(a.group_size for _, a in rest), zero_point=zps.pop(),
                    # f16 from our quantizer, f32 from a 4-bit checkpoint (exact there)
                    scale_dtypes={p: a.scales.dtype.name for p, a in rest})
    return spec


def with_mode(params, mode: str):
    """The same quantized values under another matmul mode (no re-quantization); int4 weights
    run weight-only whatever the mode."""
    def one(a):
        if isinstance(a, QuantizedArray) and a.fmt != "int4":
            check_mode(a.fmt, mode)
            return a.replace(mode=mode)
        return a

    return jax.tree.map(one, params, is_leaf=lambda a: isinstance(a, QuantizedArray))


def abstract_quantized(path: str, leaf, fmt: str, mode: str, dtype, *,
                       group_size: int | None = None, zero_point: bool = True,
                       embeddings: dict | None = None, scale_dtype: str = "float16"
                       ) -> QuantizedArray:
    """The ShapeDtypeStruct form of the QuantizedArray that `placer` makes for weight `path`
    from a leaf of shape `leaf.shape` (an orbax restore target; nothing is computed)."""
    axes = WEIGHT_REDUCE_AXES[weight_name(path)]
    if fmt == "int4" and weight_name(path) in EMBEDDING_WEIGHTS and embeddings:
        fmt, mode = embeddings["fmt"], embeddings["mode"]
    if fmt == "int4":
        ax, shape = axes[-1], tuple(leaf.shape)
        g = int4_group_size(shape, ax, group_size or INT4_GROUP, path)
        packed = shape[:ax] + (shape[ax] // 2,) + shape[ax + 1:]
        grouped = jax.ShapeDtypeStruct(shape[:ax] + (shape[ax] // g,) + shape[ax + 1:],
                                       jnp.dtype(scale_dtype))
        return QuantizedArray(
            values=jax.ShapeDtypeStruct(packed, jnp.uint8), scales=grouped,
            offsets=grouped if zero_point else None, fmt=fmt, mode=mode, reduce_axes=(ax,),
            group_size=g, group_axis=ax, dtype=jnp.dtype(dtype).name)
    scale_shape = tuple(1 if i in axes else n for i, n in enumerate(leaf.shape))
    return QuantizedArray(
        values=jax.ShapeDtypeStruct(tuple(leaf.shape), STORAGE_DTYPES[fmt]),
        scales=jax.ShapeDtypeStruct(scale_shape, jnp.float32),
        fmt=fmt, mode=mode, reduce_axes=axes, dtype=jnp.dtype(dtype).name)
