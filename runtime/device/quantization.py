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
Per-group scales (`group_size` > 0): one scale, and optionally one offset, per `group_size`
consecutive weights along `group_axis` (a contracted axis): w = values * scales + offsets.
  fmt "gguf"  the blocks of a GGUF file kept as they are (checkpoints/gguf_blocks.py), values
              int8, one per weight; the 4-bit types (Q4_0, Q4_1, Q4_K) packed as below.
  fmt "mxfp4" an MXFP4 checkpoint's tensors (gpt-oss's experts, checkpoints/mxfp4.py): values
              int8 = 2 * e2m1 in [-12, 12], one per weight, f32 scales 2**(e - 128) per group
              of 32, no offsets; exact (values * scales = the decoded weight). 1.125 bytes a
              weight: 0.56x bf16 (the checkpoint's nibbles + E8M0 bytes are 0.53 bytes; the
              values do not fit signed nibbles).
  fmt "int4"  4-bit values, two per byte (values uint8 means packed, whatever the fmt):
              uint8 [.., n/2 on group_axis, ..], element 2i in the low nibble, 2i+1 in the high. Signed (-8..7) without offsets (symmetric),
              unsigned (0..15) with them (asymmetric: offset = the group's minimum, or -zero *
              scale for AWQ/GPTQ zero points). Scales/offsets are f16 from our quantizer (f32
              from 4-bit checkpoints, exact there) and are widened in the matmul.
              Nibbles, not jnp.int4: XLA:CPU stores an int4 array one element per byte and
              widens it 2.4x slower than the shift-and-mask unpack (measured at 640 x 2048).
The matmul widens the weight to the compute dtype and contracts it densely: on TPU/GPU XLA fuses
the widening into the dot's operand read; XLA:CPU writes the widened weight out first.

Which weights are quantized, and quantizing them as a checkpoint loads: checkpoints/quantize.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.runtime.config import FORMATS, MODES

_QMAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}  # 448
STORAGE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}
# default int4 group along the contracted axis (capped at the axis' length): with f16 scales and
# offsets, 0.5 + 4/64 bytes a weight = 0.28x bf16
INT4_GROUP = 64


class QuantizationError(ValueError):
    """A quantization format / mode / platform combination that cannot run."""


# ------------------------------------------------------------------------------ the type


@struct.dataclass
class QuantizedArray:
    values: jax.Array  # int8 | float8_e4m3fn, the dense weight's shape; int4: uint8 nibble pairs
    # the weight's rank: size 1 on reduce_axes (per channel), or (per group) the weight's shape
    # with group_axis divided by group_size
    scales: jax.Array
    offsets: jax.Array | None = None  # like scales (per group only): w = values*scales + offsets
    # "int8" | "fp8" | "gguf" | "int4" | "mxfp4"
    fmt: str = struct.field(pytree_node=False, default="int8")
    mode: str = struct.field(pytree_node=False, default="weight_only")  # "w8a8" | "weight_only"
    reduce_axes: tuple[int, ...] = struct.field(pytree_node=False, default=(0,))
    group_size: int | None = struct.field(pytree_node=False, default=None)
    group_axis: int | None = struct.field(pytree_node=False, default=None)
    dtype: str = struct.field(pytree_node=False, default="float32")  # compute dtype of take_rows

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape."""
        s = tuple(self.values.shape)
        if not self.packed:
            return s
        ax = self.group_axis
        return s[:ax] + (2 * s[ax],) + s[ax + 1:]

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else int(self.offsets.nbytes)
        return int(self.values.nbytes) + int(self.scales.nbytes) + extra

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _widen(self._ints(self.values), self.scales, self.offsets, self.group_size,
                      self.group_axis).astype(dtype)

    @property
    def packed(self) -> bool:
        """Two 4-bit values a byte (uint8 values: int4, and GGUF's 4-bit block types)."""
        return self.values.dtype == jnp.uint8

    def _ints(self, values: jax.Array) -> jax.Array:
        """The integer values, one per weight (4-bit: the nibbles unpacked)."""
        if not self.packed:
            return values
        return unpack_nibbles(values, self.group_axis, signed=self.offsets is None)

    def take_rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` of a [V, D] table quantized per row, in the compute dtype."""
        if self.reduce_axes != (1,) or self.ndim != 2:
            raise QuantizationError(
                f"take_rows needs a [V, D] table quantized per row (reduce_axes (1,)), "
                f"got shape {self.shape} reduce_axes {self.reduce_axes}"
            )
        flat = ids.reshape(-1)  # the groups' axis stays axis 1 whatever ids' rank

        def take(a):
            return None if a is None else jnp.take(a, flat, axis=0)

        rows = _widen(self._ints(take(self.values)), take(self.scales), take(self.offsets),
                      self.group_size, self.group_axis)
        return rows.reshape(ids.shape + rows.shape[1:]).astype(self.dtype)

    def take(self, idx: jax.Array) -> QuantizedArray:
        """Slices `idx` (int, any shape S) of axis 0, e.g. experts of a stacked [E, ...] weight:
        shape S + shape[1:]. Axis 0 must be neither reduced nor grouped."""
        if 0 in self.reduce_axes or self.group_axis == 0:
            raise QuantizationError(f"take slices axis 0, which this weight reduces "
                                    f"(reduce_axes {self.reduce_axes})")
        shift = idx.ndim - 1

        def take(a):
            return None if a is None else jnp.take(a, idx, axis=0)

        return self.replace(
            values=take(self.values), scales=take(self.scales), offsets=take(self.offsets),
            reduce_axes=tuple(a + shift for a in self.reduce_axes),
            group_axis=None if self.group_axis is None else self.group_axis + shift)

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, x, w)` for this weight; returns x.dtype (f32 accumulation)."""
        xs, ws, out = parse_einsum(spec, x.ndim, self.ndim)
        w_contracted = tuple(i for i, c in enumerate(ws) if c in xs and c not in out)
        if self.group_size or not set(w_contracted) <= set(self.reduce_axes):
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


def _widen(values, scales, offsets, group_size, group_axis) -> jax.Array:
    """f32 weights: values * scales (+ offsets), the scales per channel or per group."""
    if not group_size:
        return values.astype(jnp.float32) * scales
    ax, shape = group_axis, values.shape
    split = shape[:ax] + (shape[ax] // group_size, group_size) + shape[ax + 1:]
    w = values.reshape(split).astype(jnp.float32) * jnp.expand_dims(scales.astype(jnp.float32),
                                                                    ax + 1)
    if offsets is not None:
        w = w + jnp.expand_dims(offsets.astype(jnp.float32), ax + 1)
    return w.reshape(shape)


def pack_nibbles(q, axis: int):
    """Integers in [-8, 7] or [0, 15] (numpy or jax), even length on `axis` -> uint8 with half
    that length: element 2i in the low nibble, 2i + 1 in the high one."""
    xp = np if isinstance(q, np.ndarray) else jnp
    q = q.astype(xp.uint8) & 0xF  # two's complement nibbles for negative values
    n = q.shape[axis]
    lo = xp.take(q, xp.arange(0, n, 2), axis=axis)
    hi = xp.take(q, xp.arange(1, n, 2), axis=axis)
    return (lo | (hi << 4)).astype(xp.uint8)


def unpack_nibbles(p: jax.Array, axis: int, signed: bool) -> jax.Array:
    """uint8 [.., n, ..] -> int8 [.., 2n, ..] on `axis` (inverse of pack_nibbles)."""
    if signed:  # sign-extend each nibble by arithmetic shifts
        b = p.astype(jnp.int8)
        lo, hi = jnp.right_shift(jnp.left_shift(b, 4), 4), jnp.right_shift(b, 4)
    else:
        lo, hi = (p & 0xF).astype(jnp.int8), jnp.right_shift(p, 4).astype(jnp.int8)
    both = jnp.stack([lo, hi], axis=axis + 1)  # [.., n, 2, ..]
    shape = p.shape[:axis] + (2 * p.shape[axis],) + p.shape[axis + 1:]
    return both.reshape(shape)


def int4_group_size(shape: tuple[int, ...], axis: int, group_size: int, name: str = "weight"
                    ) -> int:
    """The group along `axis`: `group_size` capped at the axis' length (a group never spans two
    axes). The axis must split into whole, even-sized groups."""
    n = shape[axis]
    g = min(group_size, n)
    if g % 2 or n % g:
        raise QuantizationError(
            f"{name}: int4 group size {g} does not divide its contracted axis {axis} of length "
            f"{n} into whole groups of an even size (shape {tuple(shape)})")
    return g


def quantize_int4(w, axis: int, group_size: int = INT4_GROUP, *, zero_point: bool = True,
                  dtype=jnp.float32, name: str = "weight") -> QuantizedArray:
    """Round-to-nearest 4-bit, one scale (and with `zero_point` one offset, the group's
    minimum) per `group_size` weights along `axis` (a contracted axis): asymmetric
    w ~ q * s + min with q in [0, 15], s = (max - min) / 15; symmetric w ~ q * s with q in
    [-7, 7], s = max|w| / 7."""
    w = jnp.asarray(w)
    axis %= w.ndim
    g = int4_group_size(w.shape, axis, group_size, name)
    values, scales, offsets = _int4_jit(w, axis, g, zero_point)
    return QuantizedArray(values=values, scales=scales, offsets=offsets, fmt="int4",
                          mode="weight_only", reduce_axes=(axis,), group_size=g, group_axis=axis,
                          dtype=jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "zero_point"))
def _int4_jit(w, axis: int, group_size: int, zero_point: bool):
    q, scales, offsets = int4_round(w.astype(jnp.float32), axis, group_size, zero_point)
    return pack_nibbles(q, axis), scales, offsets


def int4_round(w: jax.Array, axis: int, group_size: int, zero_point: bool):
    """(q int8 [w's shape], scales f16 [per group], offsets f16 | None) of round-to-nearest,
    rounded against the f16 scale and offset it stores (the scale rounded up, so the group's
    range still fits in 16 steps)."""
    shape = w.shape
    split = shape[:axis] + (shape[axis] // group_size, group_size) + shape[axis + 1:]
    wg = w.reshape(split)
    up = 1.0 + 2.0 ** -10  # f16 rounds to within 2^-11 relative: this keeps s16 >= s
    if zero_point:
        lo, hi = jnp.min(wg, axis + 1, keepdims=True), jnp.max(wg, axis + 1, keepdims=True)
        s = jnp.where(hi > lo, (hi - lo) / 15.0 * up, 1.0).astype(jnp.float16)
        lo = lo.astype(jnp.float16)
        q = jnp.clip(jnp.round((wg - lo.astype(jnp.float32)) / s.astype(jnp.float32)), 0, 15)
        offsets = jnp.squeeze(lo, axis + 1)
    else:
        amax = jnp.max(jnp.abs(wg), axis + 1, keepdims=True)
        s = jnp.where(amax > 0, amax / 7.0 * up, 1.0).astype(jnp.float16)
        q = jnp.clip(jnp.round(wg / s.astype(jnp.float32)), -7, 7)
        offsets = None
    return q.astype(jnp.int8).reshape(shape), jnp.squeeze(s, axis + 1), offsets


def int4_fake(w: jax.Array, axis: int, group_size: int, zero_point: bool) -> jax.Array:
    """w rounded to int4 and back (f32): the error a search over scalings measures."""
    q, s, o = int4_round(w, axis, group_size, zero_point)
    return _widen(q, s, o, group_size, axis)


def parse_einsum(spec: str, x_ndim: int, w_ndim: int) -> tuple[str, str, str]:
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
             dtype=jnp.float32, group_size: int = INT4_GROUP, zero_point: bool = True,
             name: str = "weight") -> QuantizedArray:
    """int8 / fp8: symmetric quantization of `w` with one f32 scale per slice over
    `reduce_axes` (the axes the weight's matmul contracts: one scale per output channel).
    int4: groups along the last of `reduce_axes` (quantize_int4)."""
    fmt = check_format(fmt)
    mode = mode or default_mode(fmt)
    check_mode(fmt, mode)
    w = jnp.asarray(w)
    reduce_axes = tuple(sorted(a % w.ndim for a in reduce_axes))
    if fmt == "int4":
        return quantize_int4(w, reduce_axes[-1], group_size, zero_point=zero_point, dtype=dtype,
                             name=name)
    values, scales = _quantize_jit(w, fmt, reduce_axes)
    return QuantizedArray(values=values, scales=scales, fmt=fmt, mode=mode,
                          reduce_axes=reduce_axes,
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
    return v.astype(STORAGE_DTYPES[fmt]), scales


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    return w.dequantize(dtype) if isinstance(w, QuantizedArray) else jnp.asarray(w, dtype)


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise QuantizationError(f"quantization must be one of {FORMATS} (or None), got {fmt!r}")
    return fmt


def default_mode(fmt: str, platform: str | None = None) -> str:
    """int8 on CPU: weight-only where the CPU kernels load (runtime/device/cpu_matmul.py: the
    int8 values widened in registers, no activation rounding), else W8A8 (XLA:CPU's int8 dots
    are its fastest matmul); otherwise weight-only (int4 and fp8 always)."""
    platform = platform or jax.default_backend()
    if fmt != "int8" or platform != "cpu":
        return "weight_only"
    from jaxinfer.runtime.device import cpu_kernels

    return "weight_only" if cpu_kernels.available(platform) else "w8a8"


def keeps_gguf_blocks(platform: str | None = None) -> bool:
    """Whether quantization=None keeps a GGUF file's quantized blocks (and a 4-bit checkpoint's
    int4 weights). TPU/GPU: yes (XLA fuses the widening into the dot's operand read). CPU: when
    the CPU kernels load (runtime/device/cpu_matmul.py: Gemma 3 270M's GGUF decodes 2.5x faster
    kept than dequantized to f32); without them the weights are dequantized at load (XLA:CPU
    writes every widened weight out on every step: 5x slower than f32)."""
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return True
    from jaxinfer.runtime.device import cpu_kernels

    return cpu_kernels.available(platform)


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
    if fmt in ("gguf", "mxfp4") and mode != "weight_only":
        kept = "GGUF blocks" if fmt == "gguf" else "MXFP4 weights"
        raise QuantizationError(
            f"{kept} kept quantized run weight-only (per-group scales); got mode {mode!r}: "
            "use quant_mode='weight_only', or quantization='int8' to re-quantize per channel")
    if fmt == "int4" and mode != "weight_only":
        raise QuantizationError(
            f"int4 weights run weight-only (per-group scales, widened inside the matmul); got "
            f"mode {mode!r}: use quant_mode='weight_only' (or None), or quantization='int8'")


def check_compute_dtype(fmt: str, dtype) -> None:
    """fp8 weights are widened to the compute dtype inside the matmul: it must hold e4m3 values
    exactly (f32 / bf16 do; f16 loses the e4m3 subnormal range)."""
    d = jnp.dtype(dtype)
    if fmt == "fp8" and d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise QuantizationError(f"fp8 weights need float32 or bfloat16 compute, got {d}")


# --------------------------------------------------------------------------------- params


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
