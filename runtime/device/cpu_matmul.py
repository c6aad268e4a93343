"""Quantized weights multiplied on CPU without widening them in memory: XLA FFI kernels.

XLA:CPU cannot fuse a weight's unpacking and widening into its dot: it writes every widened
weight out on every step, and runs each small product on one core. `cpu_matmul.cc` (beside this
file) reads the narrow values in registers and splits each product over the host's cores
(XLA's own intra-op threads). Its reference is `QuantizedArray.dequantize` followed by a dot.

Built and loaded by runtime/device/cpu_kernels.py (compiled on first use for the host).

`PackedWeight` is a weight in the kernel's layout: output channels in panels of 16, each panel
input by input (one 16-byte load = one input of 16 channels), with one scale (and offset)
per channel and group of G inputs along the contracted axes, in f16 where every one of them is
an f16 value (GGUF's d and m: the bytes a step reads shrink, the values do not change), else
f32:
    kind  q [P, ...]                                    from
    i8    int8 [K, 16]                                  int8 per channel, GGUF Q8_0 / Q5_x / Q6_K
    u4    uint8 [K / 2, 16]: input 2t low nibble,       int4 / GGUF Q4_K, Q4_1 (with offsets)
          2t + 1 high
    s4    as u4, the value minus 8                      symmetric int4, GGUF Q4_0
    u5    uint8 [K / 2, 20]: u4's 16 bytes of low four   values that fit 5 bits: GGUF Q5_1,
          bits, then a 32-bit word of fifth bits        Q5_K (with offsets)
          (bit c: input 2t, bit 16 + c: input 2t + 1)
    s5    as u5, the value minus 16                     GGUF Q5_0
    e4m3  fp8 bytes [K, 16] (scales x 2^8, see the .cc) fp8 per channel
Its `einsum` takes the spec model code writes ("td,dhk->thk"); `logical()` gives back the
QuantizedArray it was made from, value for value (get_weights, update_weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.runtime.device.cpu_kernels import TARGET, load
from jaxinfer.runtime.device.quantization import QuantizedArray, pack_nibbles, parse_einsum

KINDS = {"i8": 0, "u4": 1, "s4": 2, "e4m3": 3, "u5": 4, "s5": 5}
_PAIRED = ("u4", "s4", "u5", "s5")  # two inputs a load (4 or 5 bits a value)
_BIAS = {"s4": 8, "s5": 16}  # stored value = value + bias
_E4M3_SCALE = 256.0  # e4m3 bits read as f16 are the value / 2^8 (cpu_matmul.cc)


def qmatmul(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None, kind: str,
            group: int) -> jax.Array:
    """x f32 [M, K] . w^T -> f32 [M, 16 P] for w in panels (module doc: q [P, ...], scale and
    offset [P, K / group * 16])."""
    if load() is None:
        raise RuntimeError("the CPU matmul kernels are not available (see the log)")
    off = jnp.zeros((0,), jnp.float32) if offset is None else offset
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], 16 * q.shape[0]),
                                                         jnp.float32))
    return call(x.astype(jnp.float32), q, scale, off, kind=np.int32(KINDS[kind]),
                group=np.int64(group))


# --------------------------------------------------------------------------- the weight type


@struct.dataclass
class PackedWeight:
    q: jax.Array  # [P, K * 16] int8 | uint8 (e4m3 bits); [P, K / 2 * 16] uint8 (4-bit)
    scale: jax.Array  # f32 | f16 [P, K / group * 16]
    offset: jax.Array | None  # like scale
    kind: str = struct.field(pytree_node=False)
    group: int = struct.field(pytree_node=False)
    order: tuple[int, ...] = struct.field(pytree_node=False)  # logical axis of each stored axis
    dims: tuple[int, ...] = struct.field(pytree_node=False)  # stored (logical-axis) sizes
    n_out: int = struct.field(pytree_node=False)  # output axes lead `order`
    like: tuple = struct.field(pytree_node=False)  # the QuantizedArray's statics (logical())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dims[self.order.index(i)] for i in range(len(self.order)))

    @property
    def ndim(self) -> int:
        return len(self.order)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.offset) if a is not None)

    @property
    def n(self) -> int:
        return int(np.prod(self.dims[:self.n_out], dtype=np.int64))

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, x, w)` with w's logical axes; returns x.dtype (f32 accumulation)."""
        xs, ws, out = parse_einsum(spec, x.ndim, self.ndim)
        stored = "".join(ws[i] for i in self.order)
        w_out, w_con = stored[:self.n_out], stored[self.n_out:]
        free = "".join(c for c in xs if c not in w_con)
        if (set(w_out) & set(xs)) or not set(w_con) <= set(xs) or set(w_con) & set(out):
            raise ValueError(f"PackedWeight.einsum: {spec!r} is not a plain product of its "
                             f"contracted axes {w_con!r}")
        xt = jnp.transpose(x, [xs.index(c) for c in free + w_con])
        m = int(np.prod(xt.shape[:len(free)], dtype=np.int64))
        k = int(np.prod(self.dims[self.n_out:], dtype=np.int64))
        y = qmatmul(xt.reshape(m, k), self.q, self.scale, self.offset, self.kind, self.group)
        y = y[:, :self.n].reshape(xt.shape[:len(free)] + self.dims[:self.n_out])
        return jnp.transpose(y, [(free + w_out).index(c) for c in out]).astype(x.dtype)

    def _channels(self, a: jax.Array, ids) -> jax.Array:
        """Panel-layout leaf [P, L * 16] -> [len(ids), L] (channels `ids`, all channels if None)."""
        a = a.reshape(a.shape[0], -1, 16)
        if ids is None:
            return jnp.swapaxes(a, 1, 2).reshape(-1, a.shape[1])
        return a[ids // 16, :, ids % 16]

    def _values(self, ids) -> jax.Array:
        """Integer kinds: the values [n, K] (int8) of channels `ids` (all if None)."""
        if self.kind in ("u5", "s5"):
            b = self.q.reshape(self.q.shape[0], -1, 20)  # [P, K / 2, 20]
            if ids is None:  # every channel: [P, K / 2, 16] -> [P * 16, K / 2]
                nib = jnp.swapaxes(b[..., :16], 1, 2).reshape(-1, b.shape[1])
                lane = jnp.tile(jnp.arange(16, dtype=jnp.uint32), b.shape[0])
                panel = jnp.repeat(jnp.arange(b.shape[0]), 16)
            else:  # only the panels of `ids` (an embedding lookup reads a few rows)
                b = b[ids // 16]  # [n, K / 2, 20]
                nib = jnp.take_along_axis(b[..., :16], (ids % 16)[:, None, None], axis=2)[..., 0]
                lane, panel = (ids % 16).astype(jnp.uint32), jnp.arange(b.shape[0])
            word = jnp.sum(b[..., 16:].astype(jnp.uint32) << (8 * jnp.arange(4, dtype=jnp.uint32)),
                           axis=-1, dtype=jnp.uint32)[panel]  # [n, K / 2] the fifth bits' words
            fifth = lambda shift: ((word >> (lane[:, None] + shift)) & 1).astype(jnp.uint8)  # noqa: E731
            v = jnp.stack([(nib & 0xF) | (fifth(0) << 4), (nib >> 4) | (fifth(16) << 4)], -1)
            v = v.reshape(v.shape[0], -1)  # [n, K]: input 2t, then 2t + 1
        else:
            v = self._channels(self.q, ids)
            if self.kind in ("u4", "s4"):
                v = jnp.stack([v & 0xF, v >> 4], axis=-1).reshape(v.shape[0], -1)
        v = v.astype(jnp.int8) if self.kind == "i8" else v.astype(jnp.int16)
        return (v - _BIAS.get(self.kind, 0)).astype(jnp.int8)

    def _widened(self, ids=None) -> jax.Array:
        """f32 weights [n, K] of channels `ids` (stored order), as the kernel widens them."""
        scale = self._channels(self.scale, ids).astype(jnp.float32)
        if self.kind == "e4m3":
            v = jax.lax.bitcast_convert_type(self._channels(self.q, ids), jnp.float8_e4m3fn)
            v = v.astype(jnp.float32)
            scale = scale / _E4M3_SCALE
        else:
            v = self._values(ids).astype(jnp.float32)
        w = v.reshape(v.shape[0], scale.shape[1], -1) * scale[..., None]
        if self.offset is not None:
            w = w + self._channels(self.offset, ids).astype(jnp.float32)[..., None]
        return w.reshape(v.shape)

    def take_rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` of a [V, D] table (embedding lookup) in the compute dtype."""
        if self.ndim != 2 or self.order != (0, 1):
            raise ValueError("take_rows needs a [V, D] table with its rows as output channels")
        ids = jnp.where(ids < 0, ids + self.dims[0], ids)  # as jnp.take wraps negative ids
        return self._widened(ids.reshape(-1)).reshape(ids.shape + (-1,)).astype(self.like[5])

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.logical().dequantize(dtype)

    def abstract(self) -> QuantizedArray:
        """`logical()`'s format and shapes, computing nothing (ShapeDtypeStruct leaves)."""
        return jax.eval_shape(self.logical)

    def logical(self) -> QuantizedArray:
        """The QuantizedArray this weight was packed from."""
        fmt, mode, reduce_axes, group_size, group_axis, dtype, values_dtype, scale_dtype, \
            offset_dtype = self.like
        inverse = [self.order.index(i) for i in range(self.ndim)]
        n = self.n
        v = self._channels(self.q, None) if self.kind == "e4m3" else self._values(None)
        v = jnp.transpose(v[:n].reshape(self.dims), inverse)
        if self.kind in ("u4", "s4"):
            v = pack_nibbles(v, group_axis)
        values = jax.lax.bitcast_convert_type(v, jnp.dtype(values_dtype)) \
            if self.kind == "e4m3" else v.astype(jnp.dtype(values_dtype))

        def back(a, dt, mult=1.0):
            if a is None:
                return None
            kept = list(self.dims)
            for ax in range(self.n_out, self.ndim):
                kept[ax] = 1 if group_size is None else kept[ax]
            if group_size is not None:
                kept[self.order.index(group_axis)] //= group_size
            a = self._channels(a, None)[:n].astype(jnp.float32) / mult
            return jnp.transpose(a.reshape(kept), inverse).astype(dt)

        return QuantizedArray(
            values=values, scales=back(self.scale, scale_dtype,
                                       _E4M3_SCALE if self.kind == "e4m3" else 1.0),
            offsets=back(self.offset, offset_dtype), fmt=fmt, mode=mode,
            reduce_axes=reduce_axes, group_size=group_size, group_axis=group_axis, dtype=dtype)


def kernel_kind(w: QuantizedArray) -> str | None:
    """The kernel that multiplies `w` (weight-only math), or None (XLA's path)."""
    if w.mode != "weight_only":
        return None  # W8A8 quantizes activations: XLA's int8 dot does that
    if w.packed:
        return "s4" if w.offsets is None else "u4"
    if w.values.dtype == jnp.int8:
        return "i8"
    if w.values.dtype == jnp.float8_e4m3fn:
        return "e4m3"
    return None


def pack(w: QuantizedArray, contracted: tuple[int, ...]) -> PackedWeight | None:
    """`w` (whose product contracts the logical axes `contracted`) in the kernel's layout, or
    None when the kernel cannot take it (a mode or dtype it has no path for, groups across
    contracted axes)."""
    kind = kernel_kind(w)
    contracted = tuple(sorted(contracted))
    if kind is None or (w.group_axis != contracted[-1] if w.group_size
                        else tuple(w.reduce_axes) != contracted):
        return None  # groups must run along the last contracted axis: K in order
    k = int(np.prod([w.shape[a] for a in contracted]))
    group = w.group_size or k
    if kind == "i8" and group % 2 == 0:
        kind = _five_bits(w) or kind
    if k % group or (kind in _PAIRED and group % 2):
        return None
    return _pack(w, contracted, kind, group)


def _five_bits(w: QuantizedArray) -> str | None:
    """"s5" / "u5" for int8 values that all fit 5 bits (-16..15 without offsets, 0..31 with:
    GGUF Q5_0 / Q5_1 / Q5_K), else None (also while tracing: values unknown)."""
    if isinstance(w.values, jax.core.Tracer):
        return None
    lo, hi = (0, 31) if w.offsets is not None else (-16, 15)
    return ("u5" if lo == 0 else "s5") if bool(_within(w.values, lo, hi)) else None


@functools.partial(jax.jit, static_argnums=(1, 2))
def _within(a: jax.Array, lo: int, hi: int) -> jax.Array:
    return jnp.all((a >= lo) & (a <= hi))


def _panels(a: jax.Array, n: int) -> jax.Array:
    """[n, L] per channel -> [P, L * 16] (channels padded with zeros to whole panels of 16)."""
    a = jnp.pad(a, [(0, -n % 16), (0, 0)])
    return jnp.swapaxes(a.reshape(-1, 16, a.shape[1]), 1, 2).reshape(a.shape[0] // 16, -1)


def _pack(w: QuantizedArray, contracted, kind: str, group: int) -> PackedWeight:
    order = tuple(i for i in range(w.ndim) if i not in contracted) + contracted
    dims = tuple(w.shape[i] for i in order)
    like = (w.fmt, w.mode, tuple(w.reduce_axes), w.group_size, w.group_axis, w.dtype,
            jnp.dtype(w.values.dtype).name, jnp.dtype(w.scales.dtype).name,
            None if w.offsets is None else jnp.dtype(w.offsets.dtype).name)
    half = kind != "e4m3" and all(_f16_exact(a) for a in (w.scales, w.offsets) if a is not None)
    q, scale, offset = _pack_arrays(w, order, w.ndim - len(contracted), kind, half)
    return PackedWeight(q=q, scale=scale, offset=offset, kind=kind, group=group, order=order,
                        dims=dims, n_out=w.ndim - len(contracted), like=like)


def _f16_exact(a: jax.Array) -> bool:
    """Whether every value of `a` is an f16 value (False while tracing: values unknown)."""
    if isinstance(a, jax.core.Tracer):
        return False
    return bool(_is_f16(a))


@jax.jit
def _is_f16(a: jax.Array) -> jax.Array:
    a = a.astype(jnp.float32)
    return jnp.all(a.astype(jnp.float16).astype(jnp.float32) == a)


@functools.partial(jax.jit, static_argnames=("order", "n_out", "kind", "half"))
def _pack_arrays(w: QuantizedArray, order, n_out: int, kind: str, half: bool = False):
    """One program per weight shape and kind (a 262k-row table packs in one pass)."""
    n = int(np.prod([w.shape[i] for i in order[:n_out]], dtype=np.int64))
    ints = w._ints(w.values)
    if kind == "e4m3":
        ints = jax.lax.bitcast_convert_type(ints, jnp.uint8)
    q = jnp.transpose(ints, order).reshape(n, -1)
    if kind in _PAIRED:
        u = (q.astype(jnp.int16) + _BIAS.get(kind, 0)).astype(jnp.uint8)
        q = (u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)  # [n, K / 2]
        if kind in ("u5", "s5"):
            return (_five_bit_panels(q, u >> 4, n), *_factors(w, order, n, kind, half))
    return (_panels(q, n), *_factors(w, order, n, kind, half))


def _five_bit_panels(nibbles: jax.Array, fifth: jax.Array, n: int) -> jax.Array:
    """Low-nibble bytes [n, K / 2] and fifth bits [n, K] -> the u5 panels [P, K / 2 * 20]."""
    nib = _panels(nibbles, n).reshape(-1, nibbles.shape[1], 16)  # [P, K / 2, 16]
    f = jnp.pad(fifth, [(0, -n % 16), (0, 0)]).astype(jnp.uint32)
    f = f.reshape(-1, 16, fifth.shape[1])  # [P, 16 channels, K]
    c = jnp.arange(16, dtype=jnp.uint32)[None, :, None]
    word = jnp.sum((f[..., 0::2] << c) | (f[..., 1::2] << (c + 16)), axis=1,
                   dtype=jnp.uint32)  # [P, K / 2] (the bits are disjoint: sum = or)
    by = ((word[..., None] >> (8 * jnp.arange(4, dtype=jnp.uint32))) & 0xFF).astype(jnp.uint8)
    return jnp.concatenate([nib, by], axis=-1).reshape(nib.shape[0], -1)


def _factors(w: QuantizedArray, order, n: int, kind: str, half: bool):
    """Scales and offsets (None) per channel in panels, f16 when `half`."""

    def per_channel(a, mult=1.0):
        if a is None:
            return None
        a = jnp.transpose(a, order).reshape(n, -1).astype(jnp.float32) * mult
        return _panels(a.astype(jnp.float16 if half else jnp.float32), n)

    return per_channel(w.scales, _E4M3_SCALE if kind == "e4m3" else 1.0), per_channel(w.offsets)
