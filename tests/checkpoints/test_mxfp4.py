"""checkpoints/mxfp4.py: the E2M1 table and E8M0 scales against hand-written values, HF's layout
bit for bit against transformers' own converter, the exact int8 form, the encoder's round trip
and rounding, and malformed arguments. (GGUF's MXFP4 blocks: tests/checkpoints/test_gguf_blocks.py.)"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.checkpoints import mxfp4

# the OCP spec's E2M1 code points, written out: code = sign << 3 | exponent << 1 | mantissa
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def hf_block(codes, e):
    """One HF-layout block: 32 codes, element 2i in the low nibble of byte i."""
    codes = np.asarray(codes, np.uint8)
    assert codes.shape == (32,)
    return (codes[0::2] | (codes[1::2] << 4))[None], np.array([e], np.uint8)


def random_mxfp4(shape, seed=0, lo=0, hi=254):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    scales = rng.integers(lo, hi + 1, shape, dtype=np.uint8)
    return blocks, scales


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_every_code_value_at_scale_one():
    codes = list(range(16)) + list(range(15, -1, -1))
    b, s = hf_block(codes, 127)
    got = mxfp4.decode(b, s)
    assert got.dtype == np.float32 and got.shape == (32,)
    want = np.array(SPEC_E2M1 + SPEC_E2M1[::-1], np.float32)
    np.testing.assert_array_equal(bits(got), bits(want))  # -0.0 included
    assert np.signbit(got[8]) and not np.signbit(got[0])
    np.testing.assert_array_equal(bits(mxfp4.E2M1), bits(SPEC_E2M1))
    # the nibble order: byte 0 = 0x21 holds element 0 (low, code 1) and element 1 (high, code 2)
    b = np.zeros((1, 16), np.uint8)
    b[0, 0] = 0x21
    np.testing.assert_array_equal(mxfp4.decode(b, np.uint8([127]))[:3], [0.5, 1.0, 0.0])


@pytest.mark.parametrize("e", [0, 1, 126, 127, 128, 254])
def test_scale_is_two_to_the_e_minus_127(e):
    b, s = hf_block([2, 1, 3, 7, 10, 0] + [0] * 26, e)  # 1, 0.5, 1.5, 6, -1, 0
    got = mxfp4.decode(b, s)
    scale = math.ldexp(1.0, e - 127)  # 2**-127 at e = 0: an f32 subnormal, exact
    assert mxfp4.scale_values(np.uint8(e)) == np.float32(scale)
    assert got[0] == np.float32(scale) and got[4] == -np.float32(scale)
    assert got[1] == np.float32(scale / 2) and got[2] == np.float32(1.5 * scale)
    if e == 254:  # 6 * 2**127 is past f32's largest value: inf, as in any f32 decoder
        assert got[3] == np.inf
    else:
        assert got[3] == np.float32(6 * scale)


def test_exponent_255_is_nan():
    b, s = hf_block(list(range(16)) * 2, 255)
    assert np.isnan(mxfp4.decode(b, s)).all()  # zero codes too
    assert np.isnan(mxfp4.scale_values(np.uint8(255)))
    values, scales = mxfp4.as_int8(b, s)
    assert np.isnan(scales).all()


def transformers_converter():
    """transformers' `_convert_moe_packed_tensors` (what convert_moe_packed_tensors calls) and
    its FP4_VALUES table, compiled from the installed transformers/integrations/mxfp4.py itself:
    importing that module imports all of transformers (~3 s). The function is pure torch; its
    one outside name, `on_device`, only selects a CUDA / XPU device and is a bare `yield` on the
    CPU, so it is given a no-op here."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("transformers is not installed")
    path = Path(spec.submodule_search_locations[0]) / "integrations" / "mxfp4.py"
    tree = ast.parse(path.read_text(), str(path))
    wanted = [n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "_convert_moe_packed_tensors"
              or isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "FP4_VALUES"
                                                    for t in n.targets)]
    assert len(wanted) == 2, f"{path}: _convert_moe_packed_tensors or FP4_VALUES moved"
    namespace = {"torch": torch, "on_device": lambda device: contextlib.nullcontext()}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return torch, namespace["_convert_moe_packed_tensors"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_equal_to_transformers_converter(dtype):
    """transformers' converter on random blocks, every exponent 0..254 (255 excluded:
    transformers computes ldexp(v, 128), finite or inf, where the spec and `decode` give NaN).
    It returns the last two axes transposed: [E, G*32, R] for blocks [E, R, G, 16]."""
    torch, convert = transformers_converter()
    blocks, scales = random_mxfp4((3, 5, 17))  # [E, R, G]: 255 exponents
    scales.reshape(-1)[:255] = np.arange(255, dtype=np.uint8)
    theirs = convert(torch.from_numpy(blocks), torch.from_numpy(scales),
                     dtype=getattr(torch, dtype))
    ours = mxfp4.decode(blocks, scales)  # [E, R, G*32]
    assert tuple(theirs.shape) == (3, 17 * 32, 5) and ours.shape == (3, 5, 17 * 32)
    ours_t = torch.from_numpy(np.ascontiguousarray(ours.transpose(0, 2, 1)))
    if dtype == "float32":
        np.testing.assert_array_equal(bits(ours_t.numpy()), bits(theirs.numpy()))
    else:  # every MXFP4 value has <= 2 significant bits: exact in bf16 (subnormals included)
        assert ours_t.to(torch.bfloat16).view(torch.int16).equal(theirs.view(torch.int16))
    assert np.isinf(ours).any() and (ours == 0).any()  # e = 254 overflow and zeros compared


def test_int8_form_is_exact():
    blocks, scales = random_mxfp4((4, 2, 64), seed=1)
    scales.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every exponent, NaN included
    values, group_scales = mxfp4.as_int8(blocks, scales)
    assert values.dtype == np.int8 and values.shape == (4, 2, 64 * 32)
    assert group_scales.dtype == np.float32 and group_scales.shape == scales.shape
    assert values.min() >= -12 and values.max() <= 12
    np.testing.assert_array_equal(mxfp4.E2M1_X2, 2 * np.asarray(SPEC_E2M1))
    nan = scales == 255
    np.testing.assert_array_equal(
        bits(group_scales[~nan]),
        bits([math.ldexp(1.0, int(e) - 128) for e in scales[~nan]]))
    with np.errstate(over="ignore"):
        product = values.reshape(4, 2, 64, 32).astype(np.float32) * group_scales[..., None]
        dense = mxfp4.decode(blocks, scales).reshape(4, 2, 64, 32)
    assert np.isnan(product[nan]).all() and np.isnan(dense[nan]).all()
    # bit for bit, once -0.0 (code 8, which the integer form cannot carry) is read as +0.0
    np.testing.assert_array_equal(bits(product[~nan]), bits(dense[~nan] + np.float32(0.0)))


def test_encode_round_trips_every_representable_tensor():
    blocks, scales = random_mxfp4((6, 40), seed=2, hi=253)  # 254 would decode to inf
    scales[0, :3] = 0  # subnormal scales
    x = mxfp4.decode(blocks, scales)
    b2, s2 = mxfp4.encode(x)
    assert b2.dtype == np.uint8 and b2.shape == blocks.shape and s2.shape == scales.shape
    np.testing.assert_array_equal(bits(mxfp4.decode(b2, s2)), bits(x))
    # blocks whose largest magnitude is 4 or 6 (codes 6, 7) already have the spec's scale:
    # encode gives back the very same bytes (wherever e stays in range)
    codes = mxfp4.unpack(blocks)
    codes[..., 5] = (codes[..., 5] & 8) | 7
    canon = mxfp4.pack(codes)
    b3, s3 = mxfp4.encode(mxfp4.decode(canon, scales))
    np.testing.assert_array_equal(b3, canon)
    np.testing.assert_array_equal(s3, scales)


def test_encode_rounds_to_nearest_and_clamps():
    # amax 7.5: e = floor(log2 7.5) - 2 = 0 -> scale 1 (e = 127); 7.5 clamps to 6;
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    # 5 -> 4; the sign survives rounding to zero (-0.1 -> -0.0)
    x = np.zeros(32, np.float32)
    x[:12] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, -0.3, -0.1, 0.26, -5.1]
    b, s = mxfp4.encode(x)
    assert s.tolist() == [127]
    want = np.zeros(32, np.float32)
    want[:12] = [0, 1, 1, 2, 2, 4, 4, 6, -0.5, -0.0, 0.5, -6]
    np.testing.assert_array_equal(bits(mxfp4.decode(b, s)), bits(want))
    # along another axis, with small and large magnitudes: within one step of the grid
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 3)) * np.exp(rng.uniform(-20, 20, (1, 3)))).astype(np.float32)
    b, s = mxfp4.encode(x, axis=0)
    assert b.shape == (3, 2, 16) and s.shape == (3, 2)
    y = mxfp4.decode(b, s).T
    step = np.repeat(mxfp4.scale_values(s).T, 32, axis=0)  # the scale of each element's block
    assert (np.abs(y - x) <= 2 * step).all()  # the widest gap (4 -> 6) or the clamp above 6
    assert (np.abs(y - x) <= 0.25 * np.abs(x).max(axis=0)).all()  # scale <= amax / 4
    b0, s0 = mxfp4.encode(np.zeros((1, 32), np.float32))
    assert not b0.any() and s0.tolist() == [[127]]


def test_bad_arguments_name_the_argument():
    b, s = random_mxfp4((2, 3))
    with pytest.raises(ValueError, match="blocks must be"):
        mxfp4.decode(b[..., :15], s)
    with pytest.raises(ValueError, match="blocks must be"):
        mxfp4.as_int8(b.reshape(2, 48), s)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        mxfp4.decode(b.astype(np.int32), s)
    with pytest.raises(ValueError, match="scales must be"):
        mxfp4.decode(b, s[:, :2])
    with pytest.raises(ValueError, match="scales must be"):
        mxfp4.as_int8(b, s.T)
    with pytest.raises(ValueError, match="scales must be uint8"):
        mxfp4.decode(b, s.astype(np.float32))
    with pytest.raises(ValueError, match="x: axis"):
        mxfp4.encode(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError, match="x: axis 2"):
        mxfp4.encode(np.zeros((2, 32), np.float32), axis=2)
    with pytest.raises(ValueError, match="x must be finite"):
        mxfp4.encode(np.full(32, np.inf, np.float32))
