"""GGUF blocks kept quantized (checkpoints/gguf_blocks.py): every format's (values, scales,
offsets) reproduce the gguf package's dequantizer bit for bit, a hand-worked block of the two
layouts the default model leans on, and QuantizedArray's grouped forms (dequantize, take_rows,
einsum) against plain numpy."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxinfer.checkpoints import gguf_blocks
from jaxinfer.runtime.device.quantization import QuantizedArray

KINDS = sorted(gguf_blocks.GROUP_SIZES)
Q_RANGE = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31),
           "Q8_0": (-128, 127), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31),
           "MXFP4": (-12, 12)}


def random_blocks(kind: str, rows: int, per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite f16 factors where each format keeps them."""
    rng = np.random.default_rng(seed)
    per, nbytes = gguf.GGML_QUANT_SIZES[QT[kind]]
    n = rows * per_row // per
    blk = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)

    def halves():
        return rng.standard_normal(n).astype(np.float16).view(np.uint8).reshape(n, 2)

    if kind == "Q6_K":
        blk[:, 208:210] = halves()
    elif kind == "MXFP4":  # an E8M0 byte: normal scales (XLA:CPU flushes subnormals to 0)
        blk[:, 0] = rng.integers(100, 150, n, dtype=np.uint8)
    else:
        blk[:, 0:2] = halves()
        if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            blk[:, 2:4] = halves()
    return blk.reshape(rows, -1)


def widen(q, scale, offset, g):
    w = q.reshape(*q.shape[:-1], -1, g).astype(np.float32) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(q.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_equals_the_gguf_dequantizer_bit_for_bit(kind):
    shape = (6, 512)
    data = random_blocks(kind, *shape)
    want = gguf.quants.dequantize(data, QT[kind]).reshape(shape)
    q, scale, offset = gguf_blocks.decode(data, kind, shape)
    g = gguf_blocks.GROUP_SIZES[kind]
    assert q.dtype == np.int8 and scale.shape == (6, 512 // g)
    lo, hi = Q_RANGE[kind]
    assert lo <= q.min() and q.max() <= hi
    np.testing.assert_array_equal(widen(q, scale, offset, g), want)
    np.testing.assert_array_equal(gguf_blocks.dequantize(data, kind, shape), want)
    # the device form: the same values from QuantizedArray.dequantize
    qa = QuantizedArray(values=jnp.asarray(q), scales=jnp.asarray(scale),
                        offsets=None if offset is None else jnp.asarray(offset), fmt="gguf",
                        mode="weight_only", reduce_axes=(1,), group_size=g, group_axis=1)
    np.testing.assert_array_equal(np.asarray(qa.dequantize()), want)


def test_hand_worked_q4_0_and_q4_k_blocks():
    # Q4_0: d = 0.5, byte i holds element i (low nibble) and element i + 16 (high nibble)
    qs = np.array([(i % 16) | ((15 - i % 16) << 4) for i in range(16)], np.uint8)
    blk = np.concatenate([np.array([0.5], "<f2").view(np.uint8), qs])[None]
    want = 0.5 * (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8)
    np.testing.assert_array_equal(gguf_blocks.dequantize(blk, "Q4_0", (1, 32))[0], want)
    # Q4_K: d = 1, dmin = 0.25; sub-block j: sc = j + 1, m = 2 j (6 bits: 4..7 use the
    # split encoding); every nibble = 3 -> w = (j + 1) * 3 - 0.25 * 2 j
    sc, m = np.arange(1, 9), 2 * np.arange(8)
    packed = np.zeros(12, np.uint8)
    packed[0:4] = sc[:4] | ((sc[4:] >> 4) << 6)
    packed[4:8] = m[:4] | ((m[4:] >> 4) << 6)
    packed[8:12] = (sc[4:] & 15) | ((m[4:] & 15) << 4)
    head = np.array([1.0, 0.25], "<f2").view(np.uint8)
    blk = np.concatenate([head, packed, np.full(128, 0x33, np.uint8)])[None]
    want = np.repeat((sc * 3 - 0.25 * m).astype(np.float32), 32)
    np.testing.assert_array_equal(gguf_blocks.dequantize(blk, "Q4_K", (1, 256))[0], want)


def test_rows_that_are_not_whole_blocks_and_w8a8_are_refused():
    from jaxinfer.runtime.device.quantization import QuantizationError, check_mode

    with pytest.raises(ValueError, match="not whole 256-weight blocks"):
        gguf_blocks.decode(np.zeros((1, 144), np.uint8), "Q4_K", (1, 200))
    with pytest.raises(QuantizationError, match="weight-only"):
        check_mode("gguf", "w8a8")
    check_mode("gguf", "weight_only")


def test_platform_default_keeps_blocks_where_they_run_fast():
    from jaxinfer.runtime.device import cpu_kernels
    from jaxinfer.runtime.device.quantization import keeps_gguf_blocks

    assert keeps_gguf_blocks("tpu") and keeps_gguf_blocks("gpu")
    # CPU: only with the kernels that multiply them narrow (runtime/device/cpu_matmul.py)
    assert keeps_gguf_blocks("cpu") == (cpu_kernels.load() is not None)


def test_grouped_einsum_and_take_rows_match_numpy():
    """A [V, D] table grouped along D (embed / tied lm_head) and a [D, F] weight grouped along
    D (the contracted axis of "td,df->tf")."""
    rng = np.random.default_rng(1)
    data = random_blocks("Q4_K", 8, 256, seed=1)
    q, scale, offset = gguf_blocks.decode(data, "Q4_K", (8, 256))
    dense = widen(q, scale, offset, 32)  # [V=8, D=256]
    table = QuantizedArray(values=jnp.asarray(q), scales=jnp.asarray(scale),
                           offsets=jnp.asarray(offset), fmt="gguf", mode="weight_only",
                           reduce_axes=(1,), group_size=32, group_axis=1)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(table.einsum("nd,vd->nv", jnp.asarray(x))),
                               x @ dense.T, rtol=1e-5, atol=1e-4)
    ids = jnp.asarray([5, 0, 5, 7])
    np.testing.assert_array_equal(np.asarray(table.take_rows(ids)), dense[[5, 0, 5, 7]])
    w = QuantizedArray(values=jnp.asarray(q.T), scales=jnp.asarray(scale.T),
                       offsets=jnp.asarray(offset.T), fmt="gguf", mode="weight_only",
                       reduce_axes=(0,), group_size=32, group_axis=0)  # [D=256, F=8]
    np.testing.assert_allclose(np.asarray(w.einsum("td,df->tf", jnp.asarray(x))), x @ dense.T,
                               rtol=1e-5, atol=1e-4)
    assert w.nbytes == q.nbytes + scale.nbytes + offset.nbytes


# ------------------------------------------------------------------------------ MXFP4


def mxfp4_gguf_blocks(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    """ggml's block_mxfp4 from E2M1 codes [n, 32] and exponents [n]: byte e, then qs[j] with
    element j in its low nibble and element j + 16 in its high nibble."""
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([e[:, None], qs], axis=1).astype(np.uint8)


def test_hand_worked_mxfp4_blocks():
    # block 0: e = 128 -> scale 2**0, qs[j] = j | (15 - j) << 4: element j is kvalue[j], element
    # j + 16 is kvalue[15 - j]; block 1: e = 125 -> 2**-3, every nibble 7 (kvalue 12) -> 1.5
    kv = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
    blk = np.stack([np.concatenate([[128], qs]), np.concatenate([[125], np.full(16, 0x77)])])
    want = np.array([kv + kv[::-1], [1.5] * 32], np.float32)
    q, scale, offset = gguf_blocks.decode(blk.astype(np.uint8).reshape(1, -1), "MXFP4", (1, 64))
    assert q.dtype == np.int8 and offset is None
    np.testing.assert_array_equal(q[0, :32], kv + kv[::-1])
    np.testing.assert_array_equal(scale, [[1.0, 0.125]])
    np.testing.assert_array_equal(gguf_blocks.dequantize(blk.astype(np.uint8), "MXFP4", (2, 32)),
                                  want)
    # ggml's half scale 2**(e - 128) at the ends: 2**-128 (subnormal) and, at e = 255, 2**127:
    # ggml has no NaN scale (the OCP spec's, and checkpoints/mxfp4.py's, NaN)
    ends = mxfp4_gguf_blocks(np.full((3, 32), 2, np.uint8), np.array([0, 1, 255]))
    _, s, _ = gguf_blocks.decode(ends, "MXFP4", (3, 32))
    assert s.ravel().tolist() == [2.0**-128, 2.0**-127, 2.0**127]


def test_mxfp4_equals_gguf_and_hf_decoders():
    """Random codes and exponents in ggml's layout: the gguf package's dequantizer bit for bit;
    re-packed into HF's layout (element 2i low, 2i + 1 high nibble): checkpoints/mxfp4.py's
    decode (up to -0.0, which ggml's integer table reads as +0.0) and its int8 form exactly."""
    from jaxinfer.checkpoints import mxfp4

    rng = np.random.default_rng(4)
    rows, cols = 6, 256
    codes = rng.integers(0, 16, (rows * cols // 32, 32), dtype=np.uint8)
    e = rng.integers(0, 253, rows * cols // 32).astype(np.uint8)  # e > 252: 12 * 2**125 = inf
    e[:3] = (0, 1, 252)
    data = mxfp4_gguf_blocks(codes, e).reshape(rows, -1)
    want = gguf.quants.dequantize(data, QT.MXFP4).reshape(rows, cols)
    got = gguf_blocks.dequantize(data, "MXFP4", (rows, cols))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    q, scale, offset = gguf_blocks.decode(data, "MXFP4", (rows, cols))
    assert q.shape == (rows, cols) and scale.shape == (rows, cols // 32) and offset is None
    assert -12 <= q.min() and q.max() <= 12

    hf_blocks = mxfp4.pack(codes).reshape(rows, cols // 32, 16)
    hf_scales = e.reshape(rows, cols // 32)
    dense = mxfp4.decode(hf_blocks, hf_scales)
    np.testing.assert_array_equal((dense + np.float32(0)).view(np.uint32), got.view(np.uint32))
    values, group_scales = mxfp4.as_int8(hf_blocks, hf_scales)
    np.testing.assert_array_equal(values, q)
    np.testing.assert_array_equal(group_scales.view(np.uint32), scale.view(np.uint32))
    # the kept form through the device's QuantizedArray: equal, except that XLA's CPU flushes
    # f32 subnormals (scales 2**-128, 2**-127 and products below 2**-126) to zero
    qa = QuantizedArray(values=jnp.asarray(q), scales=jnp.asarray(scale), offsets=None,
                        fmt="gguf", mode="weight_only", reduce_axes=(1,), group_size=32,
                        group_axis=1)
    tiny = np.finfo(np.float32).tiny
    normal = (np.abs(want) >= tiny) & np.repeat(scale >= tiny, 32, axis=1)
    np.testing.assert_array_equal(np.asarray(qa.dequantize()), np.where(normal, want, 0))


def test_mxfp4_tensor_read_from_a_gguf_file(tmp_path):
    """gguf_header's type table is the gguf package's: MXFP4 is type 39, 17 bytes a block."""
    from jaxinfer.checkpoints.gguf_header import GGUFFile

    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, (4 * 64 // 32, 32), dtype=np.uint8)
    data = mxfp4_gguf_blocks(codes, rng.integers(100, 150, 8).astype(np.uint8)).reshape(4, -1)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("blk.0.ffn_down_exps.weight", data, raw_dtype=QT.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t, = GGUFFile(tmp_path / "m.gguf").tensors
    assert int(QT.MXFP4) == 39 and t.tensor_type == QT.MXFP4
    assert t.shape.tolist() == [64, 4] and t.n_bytes == 4 * 2 * 17
    np.testing.assert_array_equal(gguf_blocks.dequantize(t.data, "MXFP4", (4, 64)),
                                  gguf.quants.dequantize(data, QT.MXFP4).reshape(4, 64))
