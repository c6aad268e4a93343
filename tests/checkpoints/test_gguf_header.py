"""checkpoints/gguf_header.py against the `gguf` package's own reader (the oracle): every
metadata value type, plain and quantized tensors, a custom alignment; and damaged headers."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.gguf import open_gguf
from jaxinfer.checkpoints.gguf_header import GGUFFile


def _write(path, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.strs", ["a", "", "<0x0A>", "▁the", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3e-8])
    w.add_array("t.bools", [True, False])
    w.add_key_value("t.nested", [[1, 2], [3]], VT.ARRAY)
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=QT.Q8_0)
    q4 = np.frombuffer(rng.bytes(3 * 144), np.uint8).reshape(3, 144)  # 3 Q4_K super-blocks
    w.add_tensor("q4k", q4, raw_dtype=QT.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_matches_the_gguf_package_reader(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    stored = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its pseudo-keys
    assert list(ours.fields) == list(stored) and ours.version == ref.fields["GGUF.version"].contents()
    for key, f in stored.items():
        if key == "t.nested":  # the package reader flattens nested arrays; the bytes say [[1,2],[3]]
            assert ours.fields[key].contents() == [[1, 2], [3]]
            continue
        assert ours.fields[key].contents() == f.contents(), key
    assert ours.fields["t.u64"].contents() == 2**63 + 5  # hand-checked against what was written
    assert ours.fields["t.strs"].contents()[-1] == "日本"
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        np.testing.assert_array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data)
    assert ours.data_offset % (alignment or 32) == 0


def _header_only(n_fields_bytes: bytes, n_tensors=0, n_fields=1) -> bytes:
    return (b"GGUF" + (3).to_bytes(4, "little") + n_tensors.to_bytes(8, "little")
            + n_fields.to_bytes(8, "little") + n_fields_bytes)


@pytest.mark.parametrize("body, match", [
    # a key whose length runs past the end of the file
    ((10**12).to_bytes(8, "little"), "truncated GGUF header"),
    # key "k", value type 99
    ((1).to_bytes(8, "little") + b"k" + (99).to_bytes(4, "little"), "unknown GGUF value type 99"),
    # key "k", a string value that is not UTF-8
    ((1).to_bytes(8, "little") + b"k" + (8).to_bytes(4, "little") + (2).to_bytes(8, "little")
     + b"\xff\xfe", "'k': text is not UTF-8"),
    # key "k", arrays of arrays nested 10 000 deep
    ((1).to_bytes(8, "little") + b"k" + (9).to_bytes(4, "little")
     + ((9).to_bytes(4, "little") + (1).to_bytes(8, "little")) * 10_000, "deeper than 8"),
], ids=["key-past-end", "unknown-type", "not-utf8", "nested-10000"])
def test_damaged_headers_name_what_is_wrong(tmp_path, body, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_header_only(body))
    with pytest.raises(CheckpointError, match=match) as e:
        open_gguf(path)
    assert str(path) in str(e.value)


def test_version_and_tensor_extent(tmp_path):
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(CheckpointError, match="unsupported GGUF version 9"):
        open_gguf(v9)
    good = _write(tmp_path / "g.gguf")
    last = gguf.GGUFReader(good).tensors[-1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: last.data_offset + last.n_bytes - 1])  # one byte short
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor 'q4k'"):
        open_gguf(cut)


def test_tensor_dims_whose_product_wraps_name_the_tensor(tmp_path):
    """2**32 x 2**32 elements wrap a uint64 product to 0; the extent check must still see them."""
    name = (1).to_bytes(8, "little") + b"t"
    info = (name + (2).to_bytes(4, "little") + (2**32).to_bytes(8, "little") * 2
            + (0).to_bytes(4, "little") + (0).to_bytes(8, "little"))  # F32 at offset 0
    path = tmp_path / "wrap.gguf"
    path.write_bytes(_header_only(info, n_tensors=1, n_fields=0) + bytes(64))
    with pytest.raises(CheckpointError, match=r"tensor 't' needs bytes up to"):
        open_gguf(path)
