"""MXFP4 (OCP Microscaling Formats spec v1.0), the weight format gpt-oss ships: numpy only.

A block is 32 elements sharing one scale. Each element is FP4 E2M1: bit 3 the sign, bits 2-1 the
exponent (bias 1), bit 0 the mantissa; exponent 0 is subnormal (0 or 0.5), so the 8 magnitudes
are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no inf, no NaN). The scale is E8M0: a biased 8-bit exponent
e, scale = 2**(e - 127), e = 255 is NaN (the spec's only special value). An element's value is
e2m1 * scale. The range reaches 6 * 2**127, past f32's largest finite value: at e = 254 the
magnitudes >= 2 decode to +-inf in f32, as they do in every f32 decoder.

Hugging Face layout (gpt-oss safetensors, transformers' integrations/mxfp4.py):
  `<name>_blocks` uint8 [..., G, 16]: a block's 32 nibbles two a byte, element 2i in the low
      nibble of byte i and element 2i + 1 in the high nibble;
  `<name>_scales` uint8 [..., G]: the E8M0 exponent of each block.
  The decoded tensor is [..., G * 32] (block g covers elements 32 g .. 32 g + 31 of the last axis).
  transformers decodes with a 16-entry E2M1 table and ldexp(v, e - 127) (its comment "128=2**7"
  notwithstanding, it subtracts 127), the same values as `decode` here bit for bit
  (tests/checkpoints/test_mxfp4.py runs its converter).

gpt-oss expert tensors (checked in transformers 5.24: integrations/mxfp4.py,
models/gpt_oss/modeling_gpt_oss.py). In the checkpoint, per layer i:
  model.layers.{i}.mlp.experts.gate_up_proj_blocks  uint8 [E, 2F, D/32, 16]
  model.layers.{i}.mlp.experts.gate_up_proj_scales  uint8 [E, 2F, D/32]
  model.layers.{i}.mlp.experts.down_proj_blocks     uint8 [E, D, F/32, 16]
  model.layers.{i}.mlp.experts.down_proj_scales     uint8 [E, D, F/32]
  (plus gate_up_proj_bias [E, 2F] and down_proj_bias [E, D], not quantized)
i.e. the stored rows are output channels and the blocks run along the contracted (input) axis:
`decode` gives gate_up [E, 2F, D] and down [E, D, F] ([out, in], like nn.Linear.weight).
transformers' convert_moe_packed_tensors then transposes the last two axes, so its dense
GptOssExperts parameters are gate_up_proj [E, D, 2F] and down_proj [E, F, D], used as
`x @ gate_up_proj[e]` and `h @ down_proj[e]`. Gate and up are interleaved along 2F in the stored
tensors (and in gate_up_proj_bias): row 2j is gate channel j, row 2j + 1 is up channel j
(modeling_gpt_oss: `gate, up = gate_up[..., ::2], gate_up[..., 1::2]`; llama.cpp's converter
splits the blocks the same way, [:, ::2] -> ffn_gate_exps, [:, 1::2] -> ffn_up_exps).

The engine's exact integer form (`as_int8`): 2 * e2m1 is an integer in [-12, 12], so
values = 2 * e2m1 (int8) and group_scales = 2**(e - 128) (f32) multiply back to `decode`'s
values exactly (f32 multiplication by a power of two, 2**-128 included, is exact here). It is
the form ggml's GGUF MXFP4 type decodes to (checkpoints/gguf_blocks.py), whose blocks store the
nibbles in another order (element j and j + 16 share byte j).

`MXFP4Weight` is one checkpoint tensor (its `_blocks` and `_scales` joined by checkpoints/hf.py
`group_mxfp4`) as the loader takes it: kept in that int8 form (QuantizedArray fmt "mxfp4",
runtime/device/quantization.py) or dequantized.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # elements per block
NAN_EXPONENT = 255  # the E8M0 code for NaN

# E2M1 code -> value; code bit 3 is the sign (codes 8..15 are the negatives of 0..7, 8 is -0.0)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# 2 * E2M1 as int8 (as_int8's values); code 8 (-0.0) becomes 0
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

# round to nearest onto the magnitudes 0 .. 6: the midpoints between neighbours
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def _checked(blocks, scales) -> tuple[np.ndarray, np.ndarray]:
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8:
        raise ValueError(f"blocks must be uint8 (two E2M1 codes a byte), got {blocks.dtype}")
    if scales.dtype != np.uint8:
        raise ValueError(f"scales must be uint8 (E8M0 exponents), got {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"blocks must be [..., G, {BLOCK // 2}] (16 bytes a 32-element block), "
                         f"got shape {blocks.shape}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales must be blocks.shape[:-1] = {blocks.shape[:-1]} (one exponent "
                         f"a block), got shape {scales.shape}")
    return blocks, scales


def unpack(blocks: np.ndarray) -> np.ndarray:
    """HF-layout bytes [..., 16] -> E2M1 codes uint8 [..., 32]: element 2i is the low nibble of
    byte i, element 2i + 1 its high nibble."""
    blocks = np.asarray(blocks, np.uint8)
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)


def pack(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes [..., 32 k] (values 0..15) -> HF-layout bytes [..., 16 k]; `unpack`'s inverse."""
    codes = np.asarray(codes, np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _exp2(scales: np.ndarray, bias: int) -> np.ndarray:
    """f32 2**(e - bias) for uint8 e, exact (subnormal f32 powers included); NaN where e = 255."""
    with np.errstate(over="ignore"):  # 2**128 (e = 255, bias 127): inf, then NaN below
        s = np.ldexp(np.float32(1.0), scales.astype(np.int32) - bias)
    return np.where(scales == NAN_EXPONENT, np.float32(np.nan), s).astype(np.float32)


def scale_values(scales: np.ndarray) -> np.ndarray:
    """E8M0 exponents uint8 -> the block scales f32 2**(e - 127), NaN at e = 255 (e = 0 gives the
    subnormal 2**-127, exact)."""
    return _exp2(np.asarray(scales, np.uint8), 127)


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF-layout MXFP4 -> f32. blocks uint8 [..., G, 16], scales uint8 [..., G] ->
    [..., G * 32], element = E2M1[code] * 2**(e - 127) (NaN blocks where e = 255)."""
    blocks, scales = _checked(blocks, scales)
    out = E2M1[unpack(blocks)]  # [..., G, 32]
    with np.errstate(over="ignore"):  # e = 254: magnitudes >= 2 overflow f32 to inf
        out *= scale_values(scales)[..., None]
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def as_int8(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF-layout MXFP4 -> (values int8 [..., G * 32] in [-12, 12], group_scales f32 [..., G]):
    values = 2 * E2M1[code], group_scales = 2**(e - 128) (NaN at e = 255), so that values times
    their group's scale equals `decode` exactly (the one difference: -0.0 comes back as +0.0)."""
    blocks, scales = _checked(blocks, scales)
    values = E2M1_X2[unpack(blocks)]
    return (values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK),
            _exp2(scales, 128))


def encode(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest MXFP4 of finite `x` in blocks of 32 along `axis` (its length a multiple of
    32), for tests: (blocks uint8 [..., G, 16], scales uint8 [..., G]) in HF's layout, `axis`
    moved last (the other axes keep their order).

    The block scale is the spec's: e = floor(log2(amax)) - 2 (2 = E2M1's largest exponent), so
    amax / scale is in [4, 8); each x / scale is rounded to the nearest E2M1 magnitude (ties to
    the even code) and clamped to 6. e is clamped to [0, 254]; an all-zero block gets e = 127.
    decode(encode(x)) == x bit for bit whenever x is exactly representable in MXFP4 (the spec's
    scale is the smallest that holds the block's largest element, and any E2M1 value times a
    power of two that stays <= 6 is an E2M1 value)."""
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim or x.shape[axis] % BLOCK:
        raise ValueError(f"x: axis {axis} must be a multiple of {BLOCK} long, got shape "
                         f"{x.shape}")
    x = np.moveaxis(x, axis, -1)
    if not np.isfinite(x).all():
        raise ValueError("x must be finite (MXFP4 elements hold no inf or NaN)")
    x = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = np.abs(x).max(axis=-1)
    _, exp = np.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    e = np.where(amax > 0, np.clip(exp - 1 - 2 + 127, 0, 254), 127).astype(np.uint8)
    a = np.abs(x) / scale_values(e)[..., None]  # exact: a power of two, no overflow
    idx = np.searchsorted(_MIDPOINTS, a, side="left")  # the nearest magnitude (clamps at 7)
    tie = (idx < len(_MIDPOINTS)) & (a == _MIDPOINTS[np.minimum(idx, len(_MIDPOINTS) - 1)])
    idx = idx + (tie & (idx % 2 == 1))  # a tie sits between codes idx, idx + 1: take the even
    codes = idx.astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 3)
    # C order: e keeps the moved axes' strides, which safetensors.numpy would write as they lie
    return pack(codes), np.ascontiguousarray(e)


@dataclass
class MXFP4Weight:
    """One HF-layout MXFP4 tensor read as the dense parameter transformers makes of it: decoded
    [..., out, in] with the last two axes swapped, [..., in, out] (gpt-oss's gate_up_proj
    [E, D, 2F], down_proj [E, F, D]); the blocks run along `in`, the contracted axis."""

    name: str
    blocks: np.ndarray  # uint8 [..., out, G, 16]
    scales: np.ndarray  # uint8 [..., out, G]
    keep: bool = True  # False: `layout` widens the values on the device

    def __post_init__(self):
        self.blocks, self.scales = _checked(self.blocks, self.scales)

    @functools.cached_property
    def _int8(self) -> tuple[np.ndarray, np.ndarray]:  # once for every param cut from it
        return as_int8(self.blocks, self.scales)

    def dense(self) -> np.ndarray:
        """f32 [..., in, out]."""
        return np.swapaxes(decode(self.blocks, self.scales), -1, -2)

    def layout(self, fn: Callable, target: str, dtype, widen_to):
        """The weight of param `target`: `fn` (the plan's [..., in, out] -> param transform, e.g.
        gpt-oss's gate columns w[..., 0::2]) applied alike to the int8 values [..., in, out] and
        their group scales [..., G, out], as a QuantizedArray (fmt "mxfp4", groups of 32 along
        the param's contracted axis; `dtype` its compute dtype) if kept, else widened on the
        device to `widen_to`. None when `fn` moves or cuts the groups (the loader then takes
        `dense`)."""
        import jax.numpy as jnp

        from jaxinfer.checkpoints.quantize import WEIGHT_REDUCE_AXES, weight_name
        from jaxinfer.runtime.device.quantization import QuantizedArray

        values, group_scales = self._int8
        q = fn(np.swapaxes(values, -1, -2))
        try:
            scale = fn(np.swapaxes(group_scales, -1, -2))
        except ValueError:
            return None
        axes = [i for i, (a, b) in enumerate(zip(q.shape, scale.shape)) if a != b]
        reduce_axes = WEIGHT_REDUCE_AXES.get(weight_name(target), ())
        if (q.ndim != scale.ndim or len(axes) != 1 or axes[0] not in reduce_axes
                or q.shape[axes[0]] != values.shape[-1]
                or scale.shape[axes[0]] != group_scales.shape[-1]):
            return None
        w = QuantizedArray(values=jnp.asarray(q), scales=jnp.asarray(scale), fmt="mxfp4",
                           mode="weight_only", reduce_axes=reduce_axes, group_size=BLOCK,
                           group_axis=axes[0], dtype=jnp.dtype(dtype).name)
        return w if self.keep else w.dequantize(jnp.dtype(widen_to))
