"""4-bit HF checkpoints (AWQ GEMM, GPTQ v1/v2 with act-order, compressed-tensors pack-quantized)
built here from known int4 values: the tiny Llama's linears replaced by packed tensors written
from each format's documented bit layout, so the expected weight is (q - zero) * scale of the
values chosen, not anything the loader computes. Kept int4 weights dequantize to it (f16
scales, f32 arithmetic: rtol 1e-6); dequantized loads equal it; bad files fail naming the
linear or the setting."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf import hf_tensor_plan, load_hf
from jaxinfer.runtime.device.quantization import QuantizedArray

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column AWQ_ORDER[p]


def _words(nib: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """Pack 4-bit values (0..15) 8 to an int32 along `axis`: nibble p <- element order[p]."""
    nib = np.moveaxis(nib.astype(np.uint32), axis, -1)
    n = nib.shape[-1]
    pad = (-n) % 8
    nib = np.concatenate([nib, np.zeros(nib.shape[:-1] + (pad,), np.uint32)], -1)
    groups = nib.reshape(nib.shape[:-1] + (-1, 8))
    word = np.zeros(groups.shape[:-1], np.uint32)
    for p in range(8):
        word |= groups[..., order[p]] << np.uint32(4 * p)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), -1, axis))


def _pack(fmt: str, q: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx=None) -> dict:
    """One linear's tensors. q [out, in] 0..15, z / s [out, groups] (z in 0..15), s f16."""
    if fmt == "awq":
        return {"qweight": _words(q.T, 1, AWQ_ORDER), "qzeros": _words(z.T, 1, AWQ_ORDER),
                "scales": s.T.copy()}
    if fmt in ("gptq", "gptq_v2"):
        stored = z.T - (1 if fmt == "gptq" else 0)  # v1 stores the zero minus one
        t = {"qweight": _words(q.T, 0), "qzeros": _words(stored, 1), "scales": s.T.copy()}
        if g_idx is not None:
            t["g_idx"] = g_idx.astype(np.int32)
        return t
    # compressed-tensors: signed values and zero points, each stored + 8
    t = {"weight_packed": _words(q, 1), "weight_scale": s,
         "weight_shape": np.asarray(q.shape, np.int64)}
    if fmt == "ct-asym":
        t["weight_zero_point"] = _words(z, 0)  # (zp_signed + 8) == z, packed along rows
    return t


def _config(fmt: str, g: int, desc_act: bool = False) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                "version": "gemm"}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": desc_act,
                "sym": False, "checkpoint_format": fmt}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": fmt == "ct-sym", "group_size": g,
                "strategy": "group", "actorder": None}, "input_activations": None}}}


def make_int4_dir(src, out, fmt: str, g: int, seed: int = 0, act_order: bool = False) -> dict:
    """Copy of the HF dir `src` with every linear in `fmt`; returns {tensor name: the expected
    f32 weight [out, in]}."""
    rng = np.random.default_rng(seed)
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = _config(fmt, g, act_order)
    (out / "config.json").write_text(json.dumps(hf))
    tensors = load_file(str(src / "model.safetensors"))
    expected = {}
    for name in [n for n in tensors if any(f"{lin}.weight" in n for lin in LINEARS)]:
        o, i = tensors.pop(name).shape
        base = name[: -len(".weight")]
        q = rng.integers(0, 16, (o, i))
        groups = i // g
        s = (rng.uniform(0.5, 2.0, (o, groups)) * 0.01).astype(np.float16)
        if fmt == "ct-sym":
            z = np.full((o, groups), 8)
        else:
            z = rng.integers(1, 16, (o, groups))  # v1 cannot store a zero of 0
        g_idx = rng.permutation(np.arange(i) // g) if act_order else None
        gi = np.arange(i) // g if g_idx is None else g_idx
        expected[name] = ((q - z[:, gi]) * s[:, gi].astype(np.float32)).astype(np.float32)
        for k, v in _pack(fmt, q, z, s, g_idx).items():
            tensors[f"{base}.{k}"] = np.ascontiguousarray(v)  # safetensors writes raw buffers
    save_file(tensors, str(out / "model.safetensors"))
    return expected


def _check(cfg, params, expected, want_kept: set[str]):
    plan = hf_tensor_plan(cfg)
    leaves = {jax.tree_util.keystr(kp): a for kp, a in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda a: isinstance(a, QuantizedArray))[0]}
    by_path = {k.replace("[", ".").replace("]", "").replace(".layers.", "layers.")
               .replace("'", "").lstrip("."): v for k, v in leaves.items()}
    kept = set()
    for name, w in expected.items():
        target, fn = plan[name.removeprefix("model.")]
        leaf = _leaf(params, target)
        if isinstance(leaf, QuantizedArray):
            kept.add(target.rsplit(".", 1)[-1])
            assert leaf.fmt == "int4" and leaf.values.dtype == jnp.uint8
            got = np.asarray(leaf.dequantize())
        else:
            got = np.asarray(leaf)
        np.testing.assert_allclose(got, np.asarray(fn(jnp.asarray(w))), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    assert kept == want_kept, by_path.keys()


def _leaf(params, target: str):
    parts = target.split(".")
    if parts[0] == "layers":
        return getattr(params.layers[int(parts[1])], parts[2])
    return getattr(params, parts[0])


ALL = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


@pytest.mark.parametrize("fmt,g,kept", [
    ("awq", 32, ALL - {"wo"}),  # o_proj: groups of 32 span heads of 16: dequantized
    ("gptq", 32, ALL - {"wo"}),
    ("gptq_v2", 16, ALL),
    ("ct-sym", 16, ALL),
    ("ct-asym", 32, ALL - {"wo"}),
])
def test_formats_load_exactly(tiny_dir, tmp_path, fmt, g, kept):
    expected = make_int4_dir(tiny_dir, tmp_path / fmt, fmt, g)
    cfg, params = load_hf(tmp_path / fmt, keep_int4=True)
    _check(cfg, params, expected, kept)
    _, dense = load_hf(tmp_path / fmt, keep_int4=False)
    _check(cfg, dense, expected, set())


def test_gptq_act_order_dequantized_exactly(tiny_dir, tmp_path):
    expected = make_int4_dir(tiny_dir, tmp_path / "ao", "gptq", 32, act_order=True)
    cfg, params = load_hf(tmp_path / "ao", keep_int4=True)
    _check(cfg, params, expected, set())  # permuted groups do not fit the runs of a group
    f = tmp_path / "ao" / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.1.self_attn.v_proj.g_idx"][3] = 2  # 64 inputs in groups of 32: 0 or 1
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=r"layers.1.self_attn.v_proj: g_idx of shape "
                                              r"\(64,\) must give each of 64 inputs a group "
                                              r"in \[0, 2\)"):
        load_hf(tmp_path / "ao")


def test_llm_keeps_a_checkpoints_int4(tiny_dir, tmp_path):
    """quantization="int4" on a 4-bit checkpoint: its own int4 weights kept (groups of 16 fit
    every param here, o_proj's heads too) on any platform, the float embedding quantized by us;
    served logits equal those of the exactly dequantized weights. (A linear whose groups do
    not fit is dequantized exactly, then handled as a float weight: with quantization="int4"
    it is quantized again by us.)"""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.checkpoints.quantize import quantization_spec
    from tests.model_utils import assert_same_logits

    expected = make_int4_dir(tiny_dir, tmp_path / "ct", "ct-asym", 16)
    llm = LLM(str(tmp_path / "ct"), quantization="int4", max_slots=2, page_size=8,
              max_model_len=64)
    params = llm.get_weights()  # the model's own layout (the engine's may be a kernel's)
    spec = quantization_spec(params)
    assert spec["fmt"] == "int4" and spec["embeddings"]["fmt"] == "int8"
    assert {"layers.0.wo", "layers.1.w_down", "embed"} <= set(spec["weights"])
    assert spec["scale_dtypes"]["layers.0.wq"] == "float32"  # the checkpoint's, exact
    plan = hf_tensor_plan(llm.model.cfg)
    dense = params
    for name, w in expected.items():
        target, fn = plan[name.removeprefix("model.")]
        i, field = int(target.split(".")[1]), target.split(".")[2]
        layers = list(dense.layers)
        layers[i] = layers[i].replace(**{field: fn(jnp.asarray(w))})
        dense = dense.replace(layers=tuple(layers))
    cfg = llm.model.cfg
    assert_same_logits(params, dense, cfg, seed=1)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["O Romeo"], sp)[0].token_ids) == 8


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc.update(bits=8), "8-bit weights are not supported"),
    (lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (lambda qc: qc.update(group_size=0), "group_size must be"),
    (lambda qc: qc.update(quant_method="bitsandbytes"), "method 'bitsandbytes' is not supported"),
    (lambda qc: qc.update(group_size=16), r"\d+ scale groups for \d+ inputs, but "
                                          r"quantization_config's group_size is 16"),
])
def test_bad_quantization_config(tiny_dir, tmp_path, edit, match):
    make_int4_dir(tiny_dir, tmp_path / "m", "gptq", 32)
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    edit(hf["quantization_config"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=match):
        load_hf(tmp_path / "m")


def test_bad_tensors_name_the_linear(tiny_dir, tmp_path):
    make_int4_dir(tiny_dir, tmp_path / "m", "awq", 32)
    f = tmp_path / "m" / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.1.mlp.up_proj.scales"] = t["model.layers.1.mlp.up_proj.scales"][:1]
    del t["model.layers.0.self_attn.k_proj.qzeros"]
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj: missing "
                                              r"\['qzeros'\]|layers.1.mlp.up_proj: awq tensors "
                                              r"disagree"):
        load_hf(tmp_path / "m")
