"""GGUF block formats kept quantized: raw ggml blocks -> (values, scales, offsets) per group.

Every format read here dequantizes as `w = q * scale + offset` over groups of `g` consecutive
weights along a row (a row = one output channel, its elements = the inputs the matmul contracts):

  type   bytes/block  weights/block  q             g   scale        offset
  Q4_0   18           32             nibble - 8    32  d            -
  Q4_1   20           32             nibble        32  d            m
  Q5_0   22           32             5 bits - 16   32  d            -
  Q5_1   24           32             5 bits        32  d            m
  Q8_0   34           32             int8          32  d            -
  Q4_K   144          256            nibble        32  d * sc[j]    -(dmin * m[j])
  Q5_K   176          256            5 bits        32  d * sc[j]    -(dmin * m[j])
  Q6_K   210          256            6 bits - 32   16  d * sc[j]    -
  MXFP4  17           32             2 * e2m1      32  2**(e - 128) -

(d, dmin, m: f16 in the block; sc[j], m[j]: 6-bit sub-block factors, 8 per K block, packed into
12 bytes; Q6_K's sc[j]: 16 int8.) The products d * sc[j] and dmin * m[j] are formed in f32 as
ggml does, so `q * scale + offset` in f32 equals the gguf package's dequantized values bit for
bit (negating the min is exact). q fits int8 in every format; 4-bit types also fit int4, except
MXFP4, whose q (ggml's kvalues_mxfp4, twice the E2M1 value of the nibble) spans -12..12.

MXFP4 (ggml type 39, gpt-oss; checkpoints/mxfp4.py has the format and HF's layout): byte 0 is
e, an E8M0 exponent, bytes 1-16 are qs, element j (j < 16) in the low nibble of qs[j] and
element j + 16 in its high nibble (the Q4_0 order). ggml's GGML_E8M0_TO_FP32_HALF gives
2**(e - 128) for every e, 255 included (2**127: ggml has no NaN scale, the spec's e = 255 NaN),
and so does this.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.checkpoints.mxfp4 import E2M1_X2

PACKED_KINDS = ("Q4_0", "Q4_1", "Q4_K")  # kept two values a byte (runtime.device.quantization)
# Every kind here is kept in its blocks by checkpoints/gguf.py (keep_quantized) and dequantized
# here rather than by the gguf package. MXFP4 is kept as int8 values (2 * e2m1, -12..12: not a
# 4-bit kind) with f32 group scales 2**(e - 128), which the CPU kernels take as their "i8" kind.
GROUP_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
               "Q4_K": 32, "Q5_K": 32, "Q6_K": 16, "MXFP4": 32}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
          "MXFP4": (32, 17)}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 (little-endian half) -> [n] f32."""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _bits(b: np.ndarray, count: int) -> np.ndarray:
    """[n, count/8] bytes -> [n, count] bits, bit j of the little-endian word at j."""
    return np.unpackbits(b, axis=-1, bitorder="little")[:, :count]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes per K block -> (sc [n, 8], m [n, 8]), 6 bits each.
    Bytes 0-3 / 4-7 hold sc[0:4] / m[0:4] in their low 6 bits and the top two bits of
    sc[4:8] / m[4:8]; bytes 8-11 hold the low four bits of sc[4:8] (low nibble) and m[4:8]."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] -> [n, 256]: each 32-byte chunk gives two sub-blocks (low, then high nibbles)."""
    c = qs.reshape(-1, 4, 32)
    return np.stack([c & 0x0F, c >> 4], axis=2).reshape(-1, 256)


def _decode(kind: str, blk: np.ndarray):
    """[n, block bytes] -> (q int8 [n, weights], scale f32 [n, groups], offset f32 | None)."""
    n = blk.shape[0]
    if kind == "Q8_0":
        return blk[:, 2:].view(np.int8), _f16(blk[:, :2])[:, None], None
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(blk[:, :2])[:, None]
        off = 4 if kind == "Q4_1" else 2
        q = _nibbles(blk[:, off:]).astype(np.int8)
        if kind == "Q4_0":
            return q - np.int8(8), d, None
        return q, d, _f16(blk[:, 2:4])[:, None]
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(blk[:, :2])[:, None]
        off = 4 if kind == "Q5_1" else 2
        q = (_nibbles(blk[:, off + 4:]) | (_bits(blk[:, off:off + 4], 32) << 4)).astype(np.int8)
        if kind == "Q5_0":
            return q - np.int8(16), d, None
        return q, d, _f16(blk[:, 2:4])[:, None]
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[:, 0:2])[:, None], _f16(blk[:, 2:4])[:, None]
        sc, m = _k_scales(blk[:, 4:16])
        q = _k_nibbles(blk[:, -128:])
        if kind == "Q5_K":  # bit j of qh byte i is the fifth bit of sub-block j, element i
            high = (blk[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (high.reshape(n, 256) << 4)
        return q.astype(np.int8), d * sc, -(dmin * m)
    if kind == "Q6_K":
        ql, qh = blk[:, :128].reshape(n, 2, 64), blk[:, 128:192].reshape(n, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [n, 2, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)  # [n, 2, 128]
        q = (low | (high << 4)).reshape(n, 256).astype(np.int8) - np.int8(32)
        sc = blk[:, 192:208].view(np.int8).astype(np.float32)
        return q, _f16(blk[:, 208:210])[:, None] * sc, None
    if kind == "MXFP4":
        e = blk[:, :1].astype(np.int32)
        return E2M1_X2[_nibbles(blk[:, 1:])], np.ldexp(np.float32(1.0), e - 128), None
    raise KeyError(kind)


def decode(data: np.ndarray, kind: str, shape: tuple[int, ...]):
    """A tensor's raw blocks (uint8, one row of blocks per output row) -> q int8 `shape`,
    scales f32 and offsets f32 | None of shape `shape[:-1] + (shape[-1] // g,)`."""
    per, nbytes = _BLOCK[kind]
    if shape[-1] % per:
        raise ValueError(f"{kind} rows of {shape[-1]} weights are not whole {per}-weight blocks")
    blocks = np.asarray(data, np.uint8).reshape(-1, nbytes)
    q, scale, offset = _decode(kind, blocks)
    g = GROUP_SIZES[kind]
    groups = shape[:-1] + (shape[-1] // g,)
    q = q.reshape(shape)
    scale = np.ascontiguousarray(scale.reshape(groups), np.float32)
    if offset is not None:
        offset = np.ascontiguousarray(offset.reshape(groups), np.float32)
    return q, scale, offset


_SLAB_ROWS_BYTES = 16 << 20  # dequantize a slab of rows at a time: small temporaries


def dequantize(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor as f32 `shape`, equal bit for bit to gguf.quants.dequantize (q*scale+offset
    in f32), written slab by slab into one preallocated array."""
    out = np.empty(shape, np.float32)
    rows_out = out.reshape(-1, shape[-1])
    rows_in = np.asarray(data, np.uint8).reshape(rows_out.shape[0], -1)
    g = GROUP_SIZES[kind]
    step = max(1, _SLAB_ROWS_BYTES // (4 * shape[-1]))
    for r in range(0, rows_out.shape[0], step):
        src = rows_in[r:r + step]
        rows_out[r:r + step] = widen(*decode(src, kind, (src.shape[0], shape[-1])), g)
    return out


def widen(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, g: int) -> np.ndarray:
    """f32 q * scale + offset over groups of `g` along the last axis (q's shape)."""
    w = q.reshape(*scale.shape, g).astype(np.float32)
    w *= scale[..., None]
    if offset is not None:
        w += offset[..., None]
    return w.reshape(q.shape)
