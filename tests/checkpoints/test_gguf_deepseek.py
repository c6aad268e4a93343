"""DeepSeek-V3 GGUF files (llama.cpp's "deepseek2" architecture: multi-head latent attention,
sigmoid routing over expert groups with a choice bias, shared experts) against HF transformers.

The file is written here the way llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model) writes one
from HF's checkpoint (read from the saved safetensors, per-expert tensors as on disk): kv_b_proj
[H * (N + V), C] split per head into `attn_k_b` (its N nope rows, transposed: [H, C, N]) and
`attn_v_b` ([H, V, C]) — or, as older converters did, kept whole as `attn_kv_b` — the experts
stacked ([E, out, in]), e_score_correction_bias as `exp_probs_b.bias`, the q_b / kv_a_mqa rows
unpermuted (llama.cpp rotates deepseek2 with its interleaved "normal" rope, as HF does), and the
metadata keys it fills: key_length C + R / value_length C (the latent head), key_length_mla
N + R / value_length_mla V, head_count_kv 1, expert_gating_func 2 (sigmoid, from HF's
scoring_func), rope.scaling.yarn_log_multiplier 0.1 * mscale_all_dim. The HF model's YaRN
mscale equals its mscale_all_dim, as in DeepSeek's released configs (llama.cpp assumes so: a GGUF
does not carry mscale).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
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
A = "deepseek2."
# DeepSeek's YaRN with mscale = mscale_all_dim (0.8 here, so the softmax's mscale is not 1)
ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, mscale=0.8, mscale_all_dim=0.8,
            beta_fast=8.0, beta_slow=1.0, original_max_position_embeddings=64)


def _tensors(sd: dict, c: dict, split: bool = True) -> list:
    """(name, numpy array) as convert_hf_to_gguf.py's DeepseekV2Model writes them (f32)."""
    h, n, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
    out = [("token_embd.weight", sd["model.embed_tokens.weight"]),
           ("output_norm.weight", sd["model.norm.weight"]),
           ("output.weight", sd["lm_head.weight"])]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "mlp.gate": "ffn_gate_inp"}
    for p in ("gate", "up", "down"):
        names[f"mlp.{p}_proj"] = f"ffn_{p}"
        names[f"mlp.shared_experts.{p}_proj"] = f"ffn_{p}_shexp"
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for hf_name, g in names.items():
            if pre + hf_name + ".weight" in sd:
                out.append((f"blk.{i}.{g}.weight", sd[pre + hf_name + ".weight"]))
        kv_b = sd[pre + "self_attn.kv_b_proj.weight"]
        if split:  # per head: the nope rows transposed [C, N], the value rows [V, C]
            kv_b = kv_b.reshape(h, n + v, -1)
            out += [(f"blk.{i}.attn_k_b.weight", kv_b[:, :n].transpose(0, 2, 1)),
                    (f"blk.{i}.attn_v_b.weight", kv_b[:, n:])]
        else:
            out.append((f"blk.{i}.attn_kv_b.weight", kv_b))
        if pre + "mlp.gate.e_score_correction_bias" in sd:
            out.append((f"blk.{i}.exp_probs_b.bias", sd[pre + "mlp.gate.e_score_correction_bias"]))
            for p in ("gate", "up", "down"):
                out.append((f"blk.{i}.ffn_{p}_exps.weight", np.stack(
                    [sd[f"{pre}mlp.experts.{e}.{p}_proj.weight"]
                     for e in range(c["n_routed_experts"])])))
    return [(name, np.ascontiguousarray(a, np.float32)) for name, a in out]


def _metadata(c: dict, sp_model: Path, split: bool = True) -> dict:
    """key -> (GGUFWriter method, value), as convert_hf_to_gguf.py fills them for DeepSeek-V3
    (HF's scoring_func "sigmoid" -> expert_gating_func 2)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    rp = c["rope_parameters"]
    nope, r, kv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    u32 = lambda v: ("add_uint32", v)  # noqa: E731
    f32 = lambda v: ("add_float32", v)  # noqa: E731
    meta = {
        A + "block_count": u32(c["num_hidden_layers"]),
        A + "context_length": u32(c["max_position_embeddings"]),
        A + "embedding_length": u32(c["hidden_size"]),
        A + "feed_forward_length": u32(c["intermediate_size"]),
        A + "attention.head_count": u32(c["num_attention_heads"]),
        A + "attention.head_count_kv": u32(1),
        A + "rope.freq_base": f32(rp["rope_theta"]),
        A + "attention.layer_norm_rms_epsilon": f32(c["rms_norm_eps"]),
        A + "expert_count": u32(c["n_routed_experts"]),
        A + "expert_used_count": u32(c["num_experts_per_tok"]),
        A + "expert_group_count": u32(c["n_group"]),
        A + "expert_group_used_count": u32(c["topk_group"]),
        A + "expert_gating_func": u32(int(gguf.ExpertGatingFuncType.SIGMOID)),
        A + "leading_dense_block_count": u32(c["first_k_dense_replace"]),
        A + "vocab_size": u32(c["vocab_size"]),
        A + "attention.q_lora_rank": u32(c["q_lora_rank"]),
        A + "attention.kv_lora_rank": u32(kv),
        A + "attention.key_length": u32(kv + r),
        A + "attention.value_length": u32(kv),
        A + "attention.key_length_mla": u32(nope + r),
        A + "attention.value_length_mla": u32(c["v_head_dim"]),
        A + "expert_feed_forward_length": u32(c["moe_intermediate_size"]),
        A + "expert_shared_count": u32(c["n_shared_experts"]),
        A + "expert_weights_scale": f32(c["routed_scaling_factor"]),
        A + "expert_weights_norm": ("add_bool", c["norm_topk_prob"]),
        A + "rope.dimension_count": u32(r),
        A + "rope.scaling.type": ("add_string", "yarn"),
        A + "rope.scaling.factor": f32(rp["factor"]),
        A + "rope.scaling.original_context_length": u32(rp["original_max_position_embeddings"]),
        A + "rope.scaling.yarn_beta_fast": f32(rp["beta_fast"]),
        A + "rope.scaling.yarn_beta_slow": f32(rp["beta_slow"]),
        A + "rope.scaling.yarn_log_multiplier": f32(0.1 * rp["mscale_all_dim"]),
        "tokenizer.ggml.model": ("add_string", "llama"),
        "tokenizer.ggml.tokens": ("add_array", [p.piece for p in proto.pieces]),
        "tokenizer.ggml.scores": ("add_array", [p.score for p in proto.pieces]),
        "tokenizer.ggml.token_type": ("add_array", [int(p.type) for p in proto.pieces]),
        "tokenizer.ggml.bos_token_id": u32(c["bos_token_id"]),
        "tokenizer.ggml.eos_token_id": u32(c["eos_token_id"]),
    }
    if not split:  # older converters: the expanded heads' lengths, no _mla keys
        meta |= {A + "attention.key_length": u32(nope + r),
                 A + "attention.value_length": u32(c["v_head_dim"]),
                 A + "attention.head_count_kv": u32(c["num_attention_heads"])}
        del meta[A + "attention.key_length_mla"], meta[A + "attention.value_length_mla"]
    return meta


def _write(path, meta, tensors, **kw):
    return write_gguf(path, "deepseek2", meta, tensors, **kw)


@pytest.fixture(scope="module")
def deepseek_gguf(tiny_dir, tmp_path_factory):
    """(HF model, its config.json dict, GGUF path, metadata, tensors, HF state dict)."""
    d = tmp_path_factory.mktemp("deepseek_gguf")
    hf = make_hf_model("deepseek_v3", d / "hf", hidden=64, layers=2, vocab=2000,
                       rope_parameters=ROPE)
    hf_json = read_json_object(d / "hf" / "config.json", "test")
    sd = load_file(d / "hf" / "model.safetensors")  # what the converter reads
    meta, tensors = _metadata(hf_json, tiny_dir / "tokenizer.model"), _tensors(sd, hf_json)
    return hf, hf_json, _write(d / "ds.gguf", meta, tensors), meta, tensors, sd


def _leaves(params):
    return jax.tree_util.tree_leaves(params)


def test_config_equals_the_hf_config(deepseek_gguf):
    _, hf_json, path, *_ = deepseek_gguf
    cfg, _ = load_gguf(path)
    want = from_hf_config(hf_json)
    assert cfg.architecture == "gguf:deepseek2"
    assert dataclasses.replace(cfg, architecture=want.architecture) == want
    # the fields that make it DeepSeek-V3, spelled out
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank,
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (1, 64, 48, 40, 32,
                                                                           16, 24)
    assert cfg.rope_scaling == RopeScaling(kind="yarn", factor=8.0,
                                           original_max_position_embeddings=64, beta_fast=8.0,
                                           beta_slow=1.0, truncate=True, attention_factor=1.0)
    mscale = 0.1 * 0.8 * np.log(8.0) + 1.0
    assert cfg.query_pre_attn_scalar == pytest.approx(48 / mscale ** 4, rel=1e-12)
    assert (cfg.router_scoring, cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling,
            cfg.norm_topk_prob) == ("sigmoid", 4, 2, 2.5, True)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size,
            cfg.shared_expert_size, cfg.dense_layers) == (8, 2, 32, 32, (0,))


def test_logits_equal_hf_over_prefill_and_decode(deepseek_gguf, tmp_path, tiny_dir):
    """Prefill + 8 cached decode steps within 1e-4 of HF; an older file (attn_kv_b whole, the
    expanded heads' key / value lengths) loads to the same config and the same weights."""
    hf, hf_json, path, _, _, sd = deepseek_gguf
    cfg, params = load_gguf(path)
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=DECODE)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[:len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT):len(PROMPT) + DECODE]).max() <= 1e-4
    # the rope dims read in the file's (interleaved) order, not reordered: other logits
    back = np.argsort(np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)]))
    q_back, kv_back = np.r_[np.arange(32), 32 + back], np.r_[np.arange(48), 48 + back]
    as_stored = params.replace(layers=tuple(
        lp.replace(wq_b=lp.wq_b[..., q_back], wkv_a=lp.wkv_a[:, kv_back]) for lp in params.layers))
    unordered, _, _ = run_sequence(as_stored, cfg, PROMPT, page_size=8)
    assert np.abs(unordered - prefill).max() > 1e-3  # > 10x the tolerance
    legacy = _write(tmp_path / "legacy.gguf",
                        _metadata(hf_json, tiny_dir / "tokenizer.model", split=False),
                        _tensors(sd, hf_json, split=False))
    cfg_old, params_old = load_gguf(legacy)
    assert cfg_old == cfg
    for a, b in zip(_leaves(params_old), _leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_q8_0_tensors_and_kept_blocks(deepseek_gguf, tmp_path):
    """Q8_0 wherever a row holds whole blocks of 32 (as llama.cpp's --outtype q8_0, norms and
    the router kept F32): the weights equal a F32 file of gguf's dequantization bit for bit, and
    the kept Q8_0 blocks give the dequantized weights' logits."""
    _, _, _, meta, tensors, _ = deepseek_gguf
    types = {name: QT.Q8_0 for name, a in tensors
             if a.ndim >= 2 and a.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name}
    assert {"blk.0.attn_k_b.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_q_a.weight",
            "blk.1.attn_kv_a_mqa.weight", "blk.1.attn_output.weight"} <= set(types)
    q8 = _write(tmp_path / "q8.gguf", meta, tensors, types=types)
    widened = [(name, gguf.quants.dequantize(gguf.quants.quantize(a, QT.Q8_0), QT.Q8_0)
                if name in types else a) for name, a in tensors]
    f32 = _write(tmp_path / "f32.gguf", meta, widened)
    cfg, params = load_gguf(q8)
    _, want = load_gguf(f32)
    for a, b in zip(_leaves(params), _leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, kept = load_gguf(q8, keep_quantized=True)
    assert hasattr(kept.layers[1].we_down, "dequantize")  # kept in its blocks
    full, decoded, _ = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=4)
    got, decoded_kept, _ = run_sequence(kept, cfg, PROMPT, page_size=8, decode_steps=4)
    assert np.abs(got - full).max() <= 1e-4 and decoded_kept == decoded


def test_served_greedy_equals_hf_generate(deepseek_gguf):
    hf, _, path, *_ = deepseek_gguf
    assert_gguf_served_equals_hf(path, hf)


BAD = {
    # case -> (drop, set_kv, the error)
    "no gating func (V2 softmax)": ((A + "expert_gating_func",), None,
                                    r"'deepseek2.expert_gating_func' is missing: llama.cpp then "
                                    r"routes with softmax"),
    "softmax gating": ((), {A + "expert_gating_func": ("add_uint32", 1)},
                       r"'deepseek2.expert_gating_func' is 1 \(softmax\); only 2 \(sigmoid"),
    "no kv_lora_rank": ((A + "attention.kv_lora_rank",), None,
                        r"'deepseek2.attention.kv_lora_rank' is missing"),
    "string q_lora_rank": ((), {A + "attention.q_lora_rank": ("add_string", "40")},
                           r"'deepseek2.attention.q_lora_rank' must be an integer, got str"),
    "no q_lora_rank": ((A + "attention.q_lora_rank",), None,
                       r"'deepseek2.attention.q_lora_rank' is missing \(the file has "
                       r"compressed-q tensors"),
    "half the _mla keys": ((A + "attention.value_length_mla",), None,
                           r"'deepseek2.attention.value_length_mla' is missing "
                           r"\(attention.key_length_mla is set\)"),
    "wrong key_length": ((), {A + "attention.key_length": ("add_uint32", 48)},
                         r"key_length 48 / value_length 48 must be kv_lora_rank \+ "
                         r"rope.dimension_count 64"),
    "no rope dims": ((A + "rope.dimension_count",), None,
                     r"'deepseek2.rope.dimension_count' is missing"),
    "no yarn log multiplier": ((A + "rope.scaling.yarn_log_multiplier",), None,
                               r"yarn_log_multiplier' is missing: DeepSeek YaRN without "
                               r"mscale_all_dim"),
    "float expert_count": ((), {A + "expert_count": ("add_float32", 8.0)},
                           r"'deepseek2.expert_count' must be an integer, got float 8.0"),
    "int weights norm": ((), {A + "expert_weights_norm": ("add_uint32", 1)},
                         r"'deepseek2.expert_weights_norm' must be a bool, got int 1"),
    "no group used count": ((A + "expert_group_used_count",), None,
                            r"'deepseek2.expert_group_used_count' is missing"),
    "no choice bias": (("blk.1.exp_probs_b.bias",), None,
                       r"layer 1 has no expert tensor 'blk.1.exp_probs_b.bias'"),
    "4 experts": ((), {A + "expert_count": ("add_uint32", 4)},
                  r"tensor 'blk.1.ffn_gate_inp.weight' has ne \[64, 8\], the metadata implies "
                  r"\[64, 4\]"),
    "no attn_v_b": (("blk.0.attn_v_b.weight",), None,
                    r"missing 1 tensor\(s\).*blk\.0\.attn_v_b\.weight"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_metadata_is_a_clear_error(deepseek_gguf, tmp_path, case):
    _, _, _, meta, tensors, _ = deepseek_gguf
    drop, set_kv, pattern = BAD[case]
    path = _write(tmp_path / "bad.gguf", meta, tensors, drop=drop, set_kv=set_kv)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_gguf(path)
    assert str(path) in str(e.value)
