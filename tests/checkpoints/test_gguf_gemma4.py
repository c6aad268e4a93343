"""Gemma 4 GGUF files (llama.cpp's "gemma4" architecture) against HF transformers.

The file is written here the way llama.cpp's convert_hf_to_gguf.py (Gemma4Model) writes one from
HF's checkpoint (read from the saved safetensors): tensor names from gguf-py's own name map for
GEMMA4 (`gguf.get_tensor_name_map`), norms unshifted, q/k rows unpermuted (NEOX rope), the
converter's own renames (router.scale -> ffn_gate_inp.scale, router.per_expert_scale ->
ffn_down_exps.scale, layer_scalar -> layer_output_scale.weight, the experts' gate_up_proj ->
ffn_gate_up_exps: gate rows then up rows), the generated `rope_freqs.weight` of the
full-attention layers' proportional rope (1 for the head_dim * partial_rotary_factor / 2 rotated
pairs, 1e30 for the rest) and the metadata it fills: sliding_window_pattern (a bool a layer),
key_length / key_length_swa (the full-attention / sliding head lengths), per-layer
head_count_kv and (double-wide MLPs) feed_forward_length, shared_kv_layers,
embedding_length_per_layer_input, rope.dimension_count(_swa), rope.freq_base(_swa). The HF model
is tests/hf_models.py's "gemma4_moe" (every mechanism on: per-type head dims and KV heads, V from
K, proportional rope, two KV-sharing layers with double-wide MLPs, per-layer inputs, a soft cap,
experts beside every MLP) and "gemma4" (the same without experts).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfer.checkpoints.errors import CheckpointError, read_json_object
from jaxinfer.checkpoints.gguf import load_gguf
from jaxinfer.checkpoints.hf_config import from_hf_config
from jaxinfer.runtime.config import RopeScaling
from tests.gguf_files import assert_gguf_served_equals_hf, hf_logits, write_gguf
from tests.hf_models import make_hf_model
from tests.model_utils import run_sequence

PROMPT = [2, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301, 5, 6]
DECODE = 8
A = "gemma4."


def _tensors(sd: dict, c: dict, fused: bool = True) -> list:
    """(name, numpy array) as convert_hf_to_gguf.py's Gemma4Model writes them (f32).
    `fused` False: the experts' gate and up apart (ffn_gate_exps / ffn_up_exps, as llama.cpp
    also reads)."""
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    f_e = c.get("moe_intermediate_size")
    out = []
    for name, a in sd.items():
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            out.append((f"blk.{bid}.ffn_gate_inp.scale", a))
        elif name.endswith("router.per_expert_scale"):
            out.append((f"blk.{bid}.ffn_down_exps.scale", a))
        elif name.endswith("experts.gate_up_proj") and not fused:
            out += [(f"blk.{bid}.ffn_gate_exps.weight", a[:, :f_e]),
                    (f"blk.{bid}.ffn_up_exps.weight", a[:, f_e:])]
        else:
            if name.endswith("layer_scalar") or ".experts." in name:
                name += ".weight"
            out.append((names.get_name(name, try_suffixes=(".weight", ".bias")), a))
    full = c["rope_parameters"]["full_attention"]
    g = c["per_layer_config"][str(c["layer_types"].index("full_attention"))]["head_dim"]
    rot = int(g * full["partial_rotary_factor"] / 2)
    out.append(("rope_freqs.weight", np.array([1.0] * rot + [1e30] * (g // 2 - rot))))
    return [(name, np.ascontiguousarray(a, np.float32)) for name, a in out]


def _metadata(c: dict, sp_model: Path) -> dict:
    """key -> (GGUFWriter method, value), as convert_hf_to_gguf.py fills them for Gemma 4 (the
    full-attention layers' head_dim / KV heads: the config's global ones)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    n, rp = c["num_hidden_layers"], c["rope_parameters"]
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    glob = c["per_layer_config"][str(swa.index(False))]
    first_shared = n - c["num_kv_shared_layers"]
    u32 = lambda v: ("add_uint32", v)  # noqa: E731
    f32 = lambda v: ("add_float32", v)  # noqa: E731
    meta = {
        A + "block_count": u32(n),
        A + "context_length": u32(c["max_position_embeddings"]),
        A + "embedding_length": u32(c["hidden_size"]),
        A + "feed_forward_length": ("add_array", [
            c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and i >= first_shared else 1)
            for i in range(n)]),
        A + "attention.head_count": u32(c["num_attention_heads"]),
        A + "attention.head_count_kv": ("add_array", [
            c["num_key_value_heads"] if s else glob["num_key_value_heads"] for s in swa]),
        A + "attention.layer_norm_rms_epsilon": f32(c["rms_norm_eps"]),
        A + "attention.key_length": u32(glob["head_dim"]),
        A + "attention.value_length": u32(glob["head_dim"]),
        A + "attention.key_length_swa": u32(c["head_dim"]),
        A + "attention.value_length_swa": u32(c["head_dim"]),
        A + "rope.freq_base": f32(rp["full_attention"]["rope_theta"]),
        A + "rope.freq_base_swa": f32(rp["sliding_attention"]["rope_theta"]),
        A + "final_logit_softcapping": f32(c["final_logit_softcapping"]),
        A + "attention.sliding_window": u32(c["sliding_window"]),
        A + "attention.shared_kv_layers": u32(c["num_kv_shared_layers"]),
        A + "embedding_length_per_layer_input": u32(c["hidden_size_per_layer_input"]),
        A + "attention.sliding_window_pattern": ("add_array", swa),
        A + "rope.dimension_count": u32(glob["head_dim"]),
        A + "rope.dimension_count_swa": u32(c["head_dim"]),
        "tokenizer.ggml.model": ("add_string", "llama"),
        "tokenizer.ggml.tokens": ("add_array", [p.piece for p in proto.pieces]),
        "tokenizer.ggml.scores": ("add_array", [p.score for p in proto.pieces]),
        "tokenizer.ggml.token_type": ("add_array", [int(p.type) for p in proto.pieces]),
        "tokenizer.ggml.bos_token_id": u32(c["bos_token_id"]),
        "tokenizer.ggml.eos_token_id": u32(c["eos_token_id"]),
    }
    if c.get("enable_moe_block"):
        meta |= {A + "expert_count": u32(c["num_experts"]),
                 A + "expert_used_count": u32(c["top_k_experts"]),
                 A + "expert_feed_forward_length": u32(c["moe_intermediate_size"])}
    return meta


def _write(path, meta, tensors, **kw):
    return write_gguf(path, "gemma4", meta, tensors, **kw)


def _make(family, d: Path, sp_model: Path, **files):
    hf = make_hf_model(family, d / "hf", hidden=64, vocab=2000, vocab_size_per_layer_input=2000)
    hf_json = read_json_object(d / "hf" / "config.json", "test")
    sd = load_file(d / "hf" / "model.safetensors")  # what the converter reads
    meta, tensors = _metadata(hf_json, sp_model), _tensors(sd, hf_json)
    return hf, hf_json, _write(d / "g4.gguf", meta, tensors), meta, tensors, sd


@pytest.fixture(scope="module")
def gemma4_gguf(tiny_dir, tmp_path_factory):
    """The MoE model: (HF model, its config.json dict, GGUF path, metadata, tensors, HF state
    dict)."""
    return _make("gemma4_moe", tmp_path_factory.mktemp("gemma4_gguf"),
                 tiny_dir / "tokenizer.model")


def _check_logits(hf, path):
    cfg, params = load_gguf(path)
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=DECODE)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[:len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT):len(PROMPT) + DECODE]).max() <= 1e-4
    return cfg, params


def test_config_equals_the_hf_config(gemma4_gguf):
    _, hf_json, path, *_ = gemma4_gguf
    cfg, _ = load_gguf(path)
    want = from_hf_config(hf_json)
    assert cfg.architecture == "gguf:gemma4"
    assert dataclasses.replace(cfg, architecture=want.architecture) == want
    # the fields that make it Gemma 4, spelled out
    assert cfg.layer_types == ("local", "global") * 2 and cfg.sliding_window == 8
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.global_head_dim, cfg.global_kv_heads) == (
        32, 2, 64, 1)
    assert cfg.rope_scaling == RopeScaling(kind="proportional", factor=1.0,
                                           partial_rotary_factor=0.25)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 1.0)
    assert (cfg.global_k_eq_v, cfg.kv_shared_layers, cfg.double_wide_shared_mlp,
            cfg.per_layer_input_size, cfg.per_layer_vocab, cfg.moe_block, cfg.layer_scalar,
            cfg.v_norm) == (True, 2, True, 16, 2000, True, True, True)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.final_logit_softcap) == (8, 2, 48, True, 30.0)


def test_logits_equal_hf_over_prefill_and_decode(gemma4_gguf, tmp_path):
    """Prefill + 8 cached decode steps within 1e-4 of HF; the experts' gate and up written apart
    load to the same weights."""
    hf, hf_json, path, meta, _, sd = gemma4_gguf
    _, params = _check_logits(hf, path)
    apart = _write(tmp_path / "apart.gguf", meta, _tensors(sd, hf_json, fused=False))
    _, params_apart = load_gguf(apart)
    for a, b in zip(jax.tree_util.tree_leaves(params_apart), jax.tree_util.tree_leaves(params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dense_gemma4_equals_hf(tiny_dir, tmp_path):
    """Without experts: the same config as HF's and its logits."""
    hf, hf_json, path, *_ = _make("gemma4", tmp_path, tiny_dir / "tokenizer.model")
    cfg, _ = _check_logits(hf, path)
    assert dataclasses.replace(cfg, architecture="x") == dataclasses.replace(
        from_hf_config(hf_json), architecture="x")
    assert not cfg.moe_block and cfg.num_experts == 0


def test_served_greedy_equals_hf_generate(gemma4_gguf):
    hf, _, path, *_ = gemma4_gguf
    assert_gguf_served_equals_hf(path, hf)


BAD = {
    # case -> (drop, set_kv, replaced tensors, the error)
    "no sliding pattern": ((A + "attention.sliding_window_pattern",), None, None,
                           r"'gemma4.attention.sliding_window_pattern' is missing"),
    "short sliding pattern": ((), {A + "attention.sliding_window_pattern": (
        "add_array", [True, False])}, None,
        r"'gemma4.attention.sliding_window_pattern' must hold 4 bools"),
    "no key_length_swa": ((A + "attention.key_length_swa",), None, None,
                          r"'gemma4.attention.key_length_swa' is missing"),
    "string sliding window": ((), {A + "attention.sliding_window": ("add_string", "8")}, None,
                              r"'gemma4.attention.sliding_window' must be an integer, got str"),
    "no per-layer length": ((A + "embedding_length_per_layer_input",), None, None,
                            r"'gemma4.embedding_length_per_layer_input' is missing"),
    "mixed KV heads": ((), {A + "attention.head_count_kv": ("add_array", [2, 1, 1, 1])}, None,
                       r"attention.head_count_kv \[2, 1, 1, 1\]: each layer type must have one"),
    "3 shared layers": ((), {A + "attention.shared_kv_layers": ("add_uint32", 3)}, None,
                        r"KV-sharing layer 1 reads layer 0 in llama.cpp, not the last earlier "
                        r"layer of its type \(None\)"),
    "no expert_count": ((A + "expert_count",), None, None,
                        r"'gemma4.expert_count' is missing"),
    "no rope_freqs": (("rope_freqs.weight",), None, None,
                      r"gemma4 needs a 'rope_freqs.weight' tensor"),
    "odd rope_freqs": ((), None, {"rope_freqs.weight": np.array([1.0] * 8 + [2.0] * 24,
                                                                np.float32)},
                       r"rope_freqs.weight must hold 32 values, 1 for the rotated pairs"),
    "no router scale": (("blk.2.ffn_gate_inp.scale",), None, None,
                        r"layer 2 has a router but no 'blk.2.ffn_gate_inp.scale'"),
    "no attn_v on a sliding layer": (("blk.0.attn_v.weight",), None, None,
                                     r"layers \[0, 1\] have no attn_v \(V = K\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_metadata_is_a_clear_error(gemma4_gguf, tmp_path, case):
    _, _, _, meta, tensors, _ = gemma4_gguf
    drop, set_kv, replace, pattern = BAD[case]
    path = _write(tmp_path / "bad.gguf", meta, tensors, drop=drop, set_kv=set_kv,
                      replace=replace)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_gguf(path)
    assert str(path) in str(e.value)
