"""The CPU quantized-matmul kernels (runtime/device/cpu_matmul.cc through cpu_matmul.py) against
an independent reference: numpy's float64 einsum of x and `QuantizedArray.dequantize()`.

Covered: every kernel kind (int8 / fp8 per channel, int4 with and without offsets, the GGUF block
types as checkpoints/gguf.py keeps them), the few-row and many-row tilings (below / from 16 rows)
with odd output widths and several K, every einsum spec the model writes, NaN / inf activations,
batch invariance (bit-identical rows whatever the other rows, and whatever the thread count),
`pack` -> `logical()` / `take_rows` round trips, the weights `pack` must refuse, bad shapes
refused by the kernel itself, and jit with a PackedWeight argument.

Stated tolerance: max |kernel - reference| <= 1e-5 * max |reference| (f32 accumulation of the
same widened weights, K <= 640; the float64 reference has no rounding of its own to speak of).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints import gguf_blocks
from jaxinfer.checkpoints.gguf import KeptBlocks
from jaxinfer.runtime.device import cpu_kernels
from jaxinfer.runtime.device.cpu_matmul import PackedWeight, kernel_kind, pack, qmatmul
from jaxinfer.runtime.device.quantization import QuantizedArray, quantize, quantize_int4

if cpu_kernels.load() is None:
    pytest.skip("the CPU matmul kernels are not available here (no C++ compiler, a failed "
                "build, or JAXINFER_CPU_KERNELS=0)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
GGUF_KINDS = tuple(gguf_blocks.GROUP_SIZES)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K MXFP4
OUR_KINDS = ("int8", "fp8", "int4", "int4_sym")
KINDS = OUR_KINDS + GGUF_KINDS
# the kernel kind each weight kind must get
KERNEL_KIND = {"int8": "i8", "fp8": "e4m3", "int4": "u4", "int4_sym": "s4", "Q4_0": "s4",
               "Q4_1": "u4", "Q5_0": "i8", "Q5_1": "i8", "Q8_0": "i8", "Q4_K": "u4",
               "Q5_K": "i8", "Q6_K": "i8", "MXFP4": "i8"}  # MXFP4: int8 2 * e2m1, group scales
# ... and the layout `pack` stores: int8 values that fit 5 bits take 5 (MXFP4's -12..12 too)
PACKED_KIND = {**KERNEL_KIND, "Q5_0": "s5", "Q5_1": "u5", "Q5_K": "u5", "MXFP4": "s5"}
ROWS = (1, 2, 7, 16, 33, 256)  # both sides of the 16-row switch, every row-tile remainder


# ------------------------------------------------------------------------------ weights


def _gguf_raw(kind: str, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """Random raw blocks for an [n_out, n_in] tensor, the f16 d (and dmin / m) fields set to
    small finite values: everything else (nibbles, high bits, 6-bit sub-block scales) random.
    MXFP4: its E8M0 byte e set to 118..124 (scales 2**(e - 128), the other kinds' magnitudes;
    never 255, whose 2**127 scale overflows f32 products, nor a subnormal scale)."""
    per, nbytes = gguf_blocks._BLOCK[kind]
    assert n_in % per == 0
    rng = np.random.default_rng(seed)
    blk = rng.integers(0, 256, (n_out * n_in // per, nbytes), dtype=np.uint8)
    if kind == "MXFP4":
        blk[:, 0] = rng.integers(118, 125, blk.shape[0], dtype=np.uint8)
        return blk.reshape(-1)
    fields = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2)}.get(kind, (0,))
    for at in fields:
        h = rng.uniform(0.002, 0.05, blk.shape[0]).astype("<f2")
        blk[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    return blk.reshape(-1)


def _gguf(kind: str, n_out: int, n_in: int, fn, target: str, seed: int, dtype=jnp.float32
          ) -> QuantizedArray:
    """The weight checkpoints/gguf.py makes from a tensor of these blocks (kept quantized)."""
    q, s, o = gguf_blocks.decode(_gguf_raw(kind, n_out, n_in, seed), kind, (n_out, n_in))
    kept = KeptBlocks("blk.0.x", kind, q, s, o, keep=True)
    w = kept.layout(fn, target, dtype, jnp.float32)
    assert isinstance(w, QuantizedArray) and w.fmt == "gguf" and w.mode == "weight_only"
    assert w.group_size == gguf_blocks.GROUP_SIZES[kind]
    assert w.packed == (kind in gguf_blocks.PACKED_KINDS)
    # the layout is the plain [out, in] tensor rearranged: its dequantization is gguf's
    np.testing.assert_array_equal(np.asarray(_dequantize(w)), fn(kept.dense()))
    return w


def _ours(kind: str, shape, reduce_axes, seed: int, dtype=jnp.float32) -> QuantizedArray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape))  # uneven magnitudes
    a = jnp.asarray(a, jnp.float32)
    if kind in ("int8", "fp8"):
        return quantize(a, kind, reduce_axes, mode="weight_only", dtype=dtype)
    return quantize(a, "int4", reduce_axes, group_size=32, zero_point=kind == "int4",
                    dtype=dtype)


# (spec, contracted axes, target param name): the einsums runtime/device/model.py writes
LAYOUTS = {
    "ffn": ("td,df->tf", (0,), "layers.0.w_gate"),  # w [K, N]
    "qkv": ("td,dhk->thk", (0,), "layers.0.wq"),  # w [K, H, Dh]
    "wo": ("thk,hkd->td", (0, 1), "layers.0.wo"),  # w [H, Dh, N]
    "table": ("nd,vd->nv", (1,), "embed"),  # w [V, K]
}


def _weight(kind: str, layout: str = "ffn", k: int = 96, n: int = 40, seed: int = 0,
            dtype=jnp.float32) -> QuantizedArray:
    """A weight of `kind` contracting k inputs into n outputs, in `layout`. GGUF kinds round k up
    to whole blocks (256 for the K types)."""
    if kind in GGUF_KINDS:
        per = gguf_blocks._BLOCK[kind][0]
        k = -(-k // per) * per
    heads = 4 if layout == "wo" else 3
    if layout == "qkv":
        assert n % heads == 0
    if kind in GGUF_KINDS:
        fn = {"ffn": lambda a: a.T,
              "qkv": lambda a: a.T.reshape(a.shape[1], heads, -1),
              "wo": lambda a: a.T.reshape(heads, -1, a.shape[0]),
              "table": lambda a: a}[layout]
        return _gguf(kind, n, k, fn, LAYOUTS[layout][2], seed, dtype)
    shape = {"ffn": (k, n), "qkv": (k, heads, n // heads), "wo": (heads, k // heads, n),
             "table": (n, k)}[layout]
    return _ours(kind, shape, LAYOUTS[layout][1], seed, dtype)


def _x(shape, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _x_shape(layout: str, m: int, w: QuantizedArray):
    s = w.shape
    return {"ffn": (m, s[0]), "qkv": (m, s[0]), "wo": (m, s[0], s[1]), "table": (m, s[1])}[layout]


@functools.partial(jax.jit, static_argnums=0)
def _ein(spec: str, pw: PackedWeight, x: jax.Array) -> jax.Array:
    """`pw.einsum(spec, x)` as one program (as the model runs it; one compile per shape)."""
    return pw.einsum(spec, x)


# pack as one program: the same arrays as calling it eagerly (data movement, scales x 1 or 2^8),
# compiled once per weight structure rather than op by op (the round trips call it eagerly)
_pack = pack  # eager: scales that are f16 values are packed as f16 (a traced pack cannot know)


@jax.jit
def _dequantize(w: QuantizedArray) -> jax.Array:
    return w.dequantize(jnp.float32)


@jax.jit
def _take(w, ids):
    return w.take_rows(ids)


def _reference(spec: str, x, w: QuantizedArray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.einsum(spec, np.asarray(x, np.float64),
                         np.asarray(_dequantize(w), np.float64))


def _assert_close(got, ref, what=""):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err, top = np.max(np.abs(got - ref)), np.max(np.abs(ref))
    assert top > 0 and err <= RTOL * top, f"{what}: max error {err:.3g} vs max |ref| {top:.3g}"


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_same_qarray(got: QuantizedArray, want: QuantizedArray):
    assert isinstance(got, QuantizedArray)
    # the static fields (fmt, mode, reduce_axes, group_size, group_axis, dtype) and which leaves
    # are None live in the tree structure
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for name in ("values", "scales", "offsets"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype)
            assert _same_bits(g, w), f"{name} differ"


# -------------------------------------------------------------------- every kind, every path


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_every_row_count(kind):
    """The kernel each format gets, and its product for row counts on both sides of the 16-row
    switch, with an odd output width (88: one group of 4 panels plus a tail, the last panel
    padded)."""
    k = 512 if kind.endswith("_K") else 96
    w = _weight(kind, "ffn", k=k, n=88, seed=3)
    assert kernel_kind(w) == KERNEL_KIND[kind]
    pw = pack(w, (0,))
    assert isinstance(pw, PackedWeight) and pw.kind == PACKED_KIND[kind]
    assert pw.shape == w.shape and pw.n == 88
    x = _x((256, w.shape[0]), seed=4)
    for m in ROWS:
        got = _ein("td,df->tf", pw, x[:m])
        assert got.dtype == jnp.float32
        _assert_close(got, _reference("td,df->tf", x[:m], w), f"{kind} M={m}")


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "int4_sym"])
@pytest.mark.parametrize("n,k", [(8, 64), (24, 640), (40, 96), (200, 64), (136, 640)])
def test_shapes(kind, n, k):
    """Output widths below 16 and not a multiple of it (tail panels, padded channels; 200 and
    136: groups of 4 panels plus tails), several K, every row count."""
    w = _weight(kind, "ffn", k=k, n=n, seed=k + n)
    pw = _pack(w, (0,))
    x = _x((256, k), seed=n)
    for m in ROWS:
        _assert_close(_ein("td,df->tf", pw, x[:m]), _reference("td,df->tf", x[:m], w),
                      f"{kind} M={m} K={k} N={n}")


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "int4_sym", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_specs(kind, layout):
    """Every einsum the model writes (a [V, K] table both ways round), few and many rows, and
    activations of more than one free axis; bf16 activations give the f32 result in bf16."""
    spec, contracted, _ = LAYOUTS[layout]
    w = _weight(kind, layout, k=128, n=24, seed=7)
    pw = _pack(w, contracted)
    assert pw is not None and pw.shape == w.shape and pw.ndim == w.ndim
    specs = [spec, "nd,vd->vn"] if layout == "table" else [spec]
    for s in specs:
        for m in (3, 20):
            x = _x(_x_shape(layout, m, w), seed=m)
            _assert_close(_ein(s, pw, x), _reference(s, x, w), f"{kind} {s} M={m}")
        if layout not in ("ffn", "table"):
            continue
        x = _x(_x_shape(layout, 5, w), seed=9)
        xb = x.astype(jnp.bfloat16)
        got = _ein(s, pw, xb)
        assert got.dtype == jnp.bfloat16
        assert _same_bits(got, _ein(s, pw, xb.astype(jnp.float32)).astype(jnp.bfloat16))
    if layout == "ffn":  # leading batch axes of x are rows too
        x = _x((2, 3, w.shape[0]), seed=11)
        _assert_close(_ein("btd,df->btf", pw, x), _reference("btd,df->btf", x, w), kind)


def test_einsum_refuses_what_is_not_a_plain_product():
    w = _weight("int8", "ffn", k=64, n=24)
    pw = _pack(w, (0,))
    with pytest.raises(ValueError, match="not a plain product"):
        pw.einsum("td,df->tdf", _x((3, 64)))  # a contracted axis kept in the output


# ------------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "int4_sym", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [7, 33])
def test_nonfinite_activations(kind, m):
    """A NaN in a row makes that row NaN; an inf gives +-inf (NaN where its weight is 0, and
    where infs of both signs meet) as the reference does; the other rows stay finite and equal,
    bit for bit, to the product without the bad rows."""
    w = _weight(kind, "ffn", k=256, n=40, seed=5)
    pw = _pack(w, (0,))
    x = np.asarray(_x((m, 256), seed=6)).copy()
    x[1, 3] = np.nan
    x[4, 10] = np.inf
    x[5, 0] = -np.inf
    x[6, 7], x[6, 8] = np.inf, -np.inf
    got = np.asarray(pw.einsum("td,df->tf", jnp.asarray(x)))
    ref = _reference("td,df->tf", x, w)
    assert np.isnan(got[1]).all()
    good = [r for r in range(m) if r not in (1, 4, 5, 6)]
    for r in (4, 5, 6):
        np.testing.assert_array_equal(np.isnan(got[r]), np.isnan(ref[r]), err_msg=f"row {r}")
        np.testing.assert_array_equal(got[r][np.isinf(ref[r])], ref[r][np.isinf(ref[r])])
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(ref[r]))
        fin = np.isfinite(ref[r])
        np.testing.assert_allclose(got[r][fin], ref[r][fin], rtol=0,
                                   atol=RTOL * np.max(np.abs(ref[good][:, fin])) if fin.any()
                                   else 0)
    assert np.isinf(got[4]).sum() > 0
    assert np.isfinite(got[good]).all()
    _assert_close(got[good], ref[good], f"{kind} finite rows")
    clean = np.asarray(pw.einsum("td,df->tf", jnp.asarray(x[good])))
    assert _same_bits(got[good], clean)


# -------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("kind", KINDS)
def test_batch_invariant(kind):
    """Each row's output is the same bits whatever else is in the product: the first rows of
    products of 1..256 rows (both tilings), and rows at other places in their tiles."""
    w = _weight(kind, "ffn", k=256, n=40, seed=12)
    pw = _pack(w, (0,))
    x = _x((256, 256), seed=13)
    full = np.asarray(_ein("td,df->tf", pw, x))
    for m in ROWS[:-1]:
        part = np.asarray(_ein("td,df->tf", pw, x[:m]))
        assert _same_bits(part, full[:m]), f"{kind}: rows of {m} vs the same rows of 256"
    for rows in ([3], [100, 200, 5], list(range(10, 27)), list(range(255, 200, -2))):
        part = np.asarray(_ein("td,df->tf", pw, x[np.array(rows)]))
        assert _same_bits(part, full[rows]), f"{kind}: rows {rows[:4]}..."


@pytest.mark.parametrize("kind", ["int8", "int4", "Q4_K", "Q5_0"])
def test_batch_invariant_threaded(kind):
    """Products big enough to be split over threads (weight bytes + 4 M N K >= 2^20): rows are
    the same bits alone and among others, and right."""
    w = _weight(kind, "ffn", k=512, n=4096, seed=14)
    pw = _pack(w, (0,))
    x = _x((40, 512), seed=15)
    full = np.asarray(pw.einsum("td,df->tf", x))
    _assert_close(full, _reference("td,df->tf", x, w), kind)
    for m in (1, 2, 7, 16, 17):
        assert _same_bits(pw.einsum("td,df->tf", x[:m]), full[:m]), f"{kind} M={m}"


_THREADS_SCRIPT = r"""
import os, sys
import numpy as np, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
from tests.runtime.test_cpu_matmul import _ein, _pack, _weight, _x
out = sys.argv[1]
np.save(os.path.join(out, "cpus.npy"), np.array(len(os.sched_getaffinity(0))))
for kind in ("int8", "fp8", "int4_sym", "Q4_K", "Q5_0"):
    pw = _pack(_weight(kind, "ffn", k=640, n=4096, seed=21), (0,))
    x = _x((40, pw.shape[0]), seed=22)
    for m in (1, 33):
        np.save(os.path.join(out, f"{kind}-{m}.npy"), np.asarray(_ein("td,df->tf", pw, x[:m])))
"""


@pytest.mark.skipif(shutil.which("taskset") is None or (os.cpu_count() or 1) < 2,
                    reason="needs taskset and at least 2 CPUs")
def test_same_bits_whatever_the_thread_count(tmp_path):
    """The same threaded products in a process on every CPU and in one pinned to a single CPU
    (XLA's intra-op pool sized to it): the same bytes."""
    outs, procs = [], []
    for pin in ([], ["taskset", "-c", "0"]):  # both at once: the results cannot depend on it
        out = tmp_path / ("one" if pin else "all")
        out.mkdir()
        procs.append(subprocess.Popen(
            pin + [sys.executable, "-c", _THREADS_SCRIPT, str(out), str(REPO)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
        outs.append(out)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    assert int(np.load(outs[0] / "cpus.npy")) >= 2 and int(np.load(outs[1] / "cpus.npy")) == 1
    files = sorted(p.name for p in outs[0].glob("*-*.npy"))
    assert len(files) == 10
    for name in files:
        a, b = np.load(outs[0] / name), np.load(outs[1] / name)
        assert a.shape[1] == 4096 and _same_bits(a, b), name


# ------------------------------------------------------------------------------- round trips


# every kind in the [K, N] layout; the other layouts with a kind of each kernel path (per
# channel i8 / e4m3, grouped u4 / s4 with and without offsets, grouped i8 with and without)
ROUND_TRIPS = [(kind, "ffn") for kind in KINDS] + [
    (kind, layout) for kind in ("int8", "fp8", "int4", "int4_sym", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
    for layout in ("qkv", "wo", "table")]


@pytest.mark.parametrize("kind,layout", ROUND_TRIPS)
def test_logical_round_trip(kind, layout):
    """pack(w).logical() is w: every leaf's bytes and dtype, and the static fields; and its
    dequantization is w's."""
    dtype = jnp.bfloat16 if layout == "table" else jnp.float32
    w = _weight(kind, layout, k=128, n=24, seed=17, dtype=dtype)
    pw = pack(w, LAYOUTS[layout][1])
    assert pw is not None
    back = pw.logical()
    _assert_same_qarray(back, w)
    # packed under jit (values unknown): f32 scales, int8 values a byte; the same weight
    jitted = jax.jit(pack, static_argnums=1)(w, LAYOUTS[layout][1])
    assert jitted.scale.dtype == jnp.float32 and jitted.kind == KERNEL_KIND[kind]
    _assert_same_qarray(jitted.logical(), w)
    if jitted.kind == pw.kind:
        assert all(_same_bits(a, b.astype(a.dtype))
                   for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(pw)))
    if layout == "ffn":
        assert _same_bits(pw.dequantize(), w.dequantize())
        # and under jit, as get_weights reads it
        _assert_same_qarray(jax.jit(lambda p: p.logical())(pw), w)


@pytest.mark.parametrize("kind", KINDS)
def test_take_rows(kind):
    """Rows of a [V, K] table packed for "nd,vd->nv" equal QuantizedArray.take_rows: values,
    dtype and shape (ids of any shape, repeated, the last row, rows in the padded last panel)."""
    dtype = jnp.bfloat16 if kind in ("int4", "Q4_K", "Q8_0") else jnp.float32
    w = _weight(kind, "table", k=64, n=40, seed=19, dtype=dtype)
    pw = _pack(w, (1,))
    for ids in (jnp.array([0, 39, 17, 17, 32, 7]), jnp.array([[5, 1, 38], [16, 15, 0]])):
        got = _take(pw, ids)
        want = _take(w, ids)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert _same_bits(got, want), f"{kind} ids {ids}"


def test_take_rows_needs_a_table():
    pw = pack(_weight("int8", "qkv", k=64, n=24), (0,))
    with pytest.raises(ValueError, match="take_rows needs"):
        pw.take_rows(jnp.array([0]))


# ---------------------------------------------------------------------- what pack refuses


def test_pack_refuses_what_the_kernel_cannot_take():
    rng = np.random.default_rng(0)
    w2 = jnp.asarray(rng.standard_normal((64, 40)), jnp.float32)
    # W8A8 quantizes activations: XLA's int8 dot does that
    w8a8 = quantize(w2, "int8", (0,), mode="w8a8")
    assert kernel_kind(w8a8) is None and pack(w8a8, (0,)) is None
    # per-channel scales that vary along the contracted axis (reduce axes not the contracted ones)
    assert pack(quantize(w2, "int8", (0,), mode="weight_only"), (1,)) is None
    assert pack(quantize(w2, "fp8", (1,), mode="weight_only"), (0,)) is None
    w3 = jnp.asarray(rng.standard_normal((4, 16, 24)), jnp.float32)
    assert pack(quantize(w3, "int8", (0, 1), mode="weight_only"), (0,)) is None
    assert pack(quantize(w3, "int8", (0,), mode="weight_only"), (0, 1)) is None
    # groups not along the last contracted axis: K would not run group by group
    g0 = quantize_int4(w3, 0, group_size=2)
    assert g0.group_axis == 0 and pack(g0, (0, 1)) is None
    assert pack(quantize_int4(w2, 0, group_size=32), (1,)) is None
    # ...which the same weights grouped along the last contracted axis are not
    assert pack(quantize_int4(w3, 1, group_size=8), (0, 1)) is not None
    assert pack(quantize(w3, "int8", (0, 1), mode="weight_only"), (0, 1)) is not None
    # a value dtype with no kernel
    odd = QuantizedArray(values=jnp.zeros((64, 40), jnp.int16), scales=jnp.ones((1, 40)),
                         mode="weight_only")
    assert kernel_kind(odd) is None and pack(odd, (0,)) is None


# ------------------------------------------------------------------------- bad kernel input


def _int4_packed():
    w = _weight("int4", "ffn", k=64, n=40, seed=23)
    return _pack(w, (0,))


def test_qmatmul_direct():
    """The raw call: [M, 16 P] out, the padded channels 0, the rest the reference's."""
    w = _weight("int4", "ffn", k=64, n=40, seed=23)
    pw = _pack(w, (0,))
    assert pw.q.shape == (3, 32 * 16) and pw.scale.shape == (3, 2 * 16) and pw.group == 32
    x = _x((5, 64))
    y = np.asarray(qmatmul(x, pw.q, pw.scale, pw.offset, "u4", 32))
    assert y.shape == (5, 48)
    assert (y[:, 40:] == 0).all()
    _assert_close(y[:, :40], _reference("td,df->tf", x, w))
    # no rows: an empty product, no error
    assert np.asarray(qmatmul(x[:0], pw.q, pw.scale, pw.offset, "u4", 32)).shape == (0, 48)


BAD_CALLS = {
    "scale with the wrong number of groups": (
        lambda p, x: (x, p.q, p.scale[:, :16], p.offset[:, :16], "u4", 32), "weight shapes"),
    "scale of too few panels": (
        lambda p, x: (x, p.q, p.scale[:2], p.offset[:2], "u4", 32), "weight shapes"),
    "x with the wrong K": (
        lambda p, x: (x[:, :32], p.q, p.scale, p.offset, "u4", 32), "weight shapes"),
    "offsets not like the scales": (
        lambda p, x: (x, p.q, p.scale, p.offset[:, :16], "u4", 32), "offsets must match"),
    "a group that does not divide K": (
        lambda p, x: (x, p.q, p.scale, p.offset, "u4", 48), "group must divide K"),
    "an odd 4-bit group": (
        lambda p, x: (x, p.q, p.scale, p.offset, "u4", 1), "group must divide K"),
    "a group of 0": (
        lambda p, x: (x, p.q, p.scale, p.offset, "u4", 0), "group must divide K"),
    "int8 kind on 4-bit bytes": (
        lambda p, x: (x, p.q, p.scale, p.offset, "i8", 32), "weight shapes"),
    "1-D x": (
        lambda p, x: (x[0], p.q, p.scale, p.offset, "u4", 32), "must be 2-D"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_qmatmul_bad_input_raises(case):
    """Mismatched shapes are the kernel's InvalidArgument, eager and under jit, never a
    product read from the wrong bytes."""
    make, msg = BAD_CALLS[case]
    p, x = _int4_packed(), _x((3, 64))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"jaxinfer_qmatmul: .*{msg}"):
        np.asarray(qmatmul(*make(p, x)))
    args = make(p, x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="jaxinfer_qmatmul"):
        np.asarray(jax.jit(lambda x, q, s, o: qmatmul(x, q, s, o, *args[4:]))(*args[:4]))


# --------------------------------------------------------------------------------- jit


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "int4_sym", "Q4_0", "Q5_K"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jit_with_packed_weight_argument(kind, layout):
    """A PackedWeight is a pytree (q, scale, offset leaves; the rest static): passed to a jitted
    function it gives the eager result, bit for bit."""
    spec, contracted, _ = LAYOUTS[layout]
    w = _weight(kind, layout, k=128, n=24, seed=25)
    pw = _pack(w, contracted)
    leaves = jax.tree.leaves(pw)
    assert len(leaves) == (3 if w.offsets is not None else 2)
    f = jax.jit(lambda p, x: p.einsum(spec, x))
    for m in (1, 20):
        x = _x(_x_shape(layout, m, w), seed=m + 1)
        eager = pw.einsum(spec, x)
        assert _same_bits(f(pw, x), eager), f"{kind} {layout} M={m}"
    # another weight of the same structure: the same program, its own values
    pw2 = _pack(_weight(kind, layout, k=128, n=24, seed=26), contracted)
    assert _same_bits(f(pw2, x), pw2.einsum(spec, x))


# ------------------------------------------------------------- edge cases


def test_fp8_nan_weight_propagates():
    """e4m3fn's NaN bytes (0x7F / 0xFF) widen to NaN, as the reference's dequantize does."""
    w = _weight("fp8", "ffn", k=64, n=40, seed=27)
    v = np.asarray(w.values).copy()
    v[3, 5] = np.nan
    w = w.replace(values=jnp.asarray(v))
    got = np.asarray(pack(w, (0,)).einsum("td,df->tf", _x((2, 64))))
    assert np.isnan(got[:, 5]).all()


def test_einsum_no_rows():
    w = _weight("int8", "ffn", k=64, n=40)
    got = pack(w, (0,)).einsum("td,df->tf", jnp.zeros((0, 64), jnp.float32))
    assert got.shape == (0, 40)


def test_take_rows_negative_id():
    w = _weight("int8", "table", k=64, n=40, seed=29)
    ids = jnp.array([-1, 39])
    assert _same_bits(pack(w, (1,)).take_rows(ids), w.take_rows(ids))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "int8"])
def test_scales_that_are_f16_values_are_kept_as_f16(kind):
    """GGUF's d (and m) are f16 in the file: packed as f16 (fewer bytes a step), the products
    bit for bit those of the same weight packed with f32 scales (the widening is exact); a
    scale that is no f16 value (int8 per channel, from f32 maxima) stays f32."""
    w = _weight(kind, "ffn", k=256, n=48, seed=23)
    pw = pack(w, (0,))
    f32 = jax.jit(pack, static_argnums=1)(w, (0,))  # traced: values unknown, f32
    assert f32.scale.dtype == jnp.float32
    assert pw.scale.dtype == (jnp.float32 if kind == "int8" else jnp.float16)
    assert pw.nbytes < f32.nbytes or kind == "int8"
    for m in (1, 7, 33):
        x = _x((m, 256), seed=m)
        assert _same_bits(pw.einsum("td,df->tf", x), f32.einsum("td,df->tf", x))
    _assert_close(pw.einsum("td,df->tf", _x((5, 256))), _reference("td,df->tf", _x((5, 256)), w))
