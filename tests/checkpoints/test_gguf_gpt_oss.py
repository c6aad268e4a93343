"""gpt-oss GGUF files (llama.cpp's "gpt-oss" architecture, MXFP4 experts) against HF transformers.

The file is written here the way llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes one from
HF's MXFP4 checkpoint: HF's expert blocks [E, rows, D / 32, 16] + scales re-packed into ggml's
block_mxfp4 (byte e, then element j in the low and j + 16 in the high nibble of byte j), HF's
interleaved gate_up rows split (even rows -> ffn_gate_exps, odd -> ffn_up_exps, likewise the
bias), `sinks` -> attn_sinks.weight, every other tensor F32 under its llama.cpp name, q/k rows
unpermuted (NEOX rope). The HF model (random init, gpt-oss's swiglu_limit 7, the one llama.cpp
hard-codes) runs on the same MXFP4-decoded expert weights, so the comparison is exact up to
float rounding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from jaxinfer.checkpoints import mxfp4
from jaxinfer.checkpoints.errors import CheckpointError, read_json_object
from jaxinfer.checkpoints.gguf import load_gguf, load_gguf_tokenizer, open_gguf
from jaxinfer.checkpoints.hf_config import from_hf_config
from jaxinfer.runtime.config import RopeScaling
from tests.gguf_files import assert_gguf_served_equals_hf, hf_logits, write_gguf
from tests.hf_models import FAMILIES, make_hf_model
from tests.model_utils import run_sequence

PROMPT = [2, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301, 5, 6]
DECODE = 8
GATE_UP_SCALE = 60.0  # random-init experts x this: some gate / up values pass the clamp of 7


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF-layout MXFP4 (blocks [..., G, 16]: element 2i low nibble of byte i, 2i + 1 high;
    scales [..., G]) -> ggml block_mxfp4 bytes [..., G * 17]: e, then qs[j] = element j |
    element j + 16 << 4."""
    codes = mxfp4.unpack(blocks)  # [..., G, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return out.reshape(*scales.shape[:-1], -1)


def _tensors(hf) -> tuple[list, dict]:
    """(name, array, raw ggml type or None) as convert_hf_to_gguf.py writes them, after replacing
    HF's expert weights by their MXFP4 round trip; also the HF-layout blocks / scales by name."""
    out, blocks = [], {}
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    }
    for p, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        for kind in ("weight", "bias"):
            layer_names[f"self_attn.{p}_proj.{kind}"] = f"{g}.{kind}"

    def f32(a):
        return a.detach().float().numpy().copy()

    out += [("token_embd.weight", f32(sd["embed_tokens.weight"]), None),
            ("output_norm.weight", f32(sd["norm.weight"]), None),
            ("output.weight", f32(hf.lm_head.weight), None)]
    for i, layer in enumerate(hf.model.layers):
        pre = f"layers.{i}."
        for hf_name, g in layer_names.items():
            out.append((f"blk.{i}.{g}", f32(sd[pre + hf_name]), None))
        ex = layer.mlp.experts
        gub = f32(ex.gate_up_proj_bias)  # [E, 2F]: gate at even, up at odd columns
        out += [(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(gub[:, 0::2]), None),
                (f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]), None)]
        # HF's checkpoint stores rows = outputs, blocks along the inputs (checkpoints/mxfp4.py)
        gate_up = f32(ex.gate_up_proj).swapaxes(1, 2) * GATE_UP_SCALE  # [E, 2F, D]
        down = f32(ex.down_proj).swapaxes(1, 2)  # [E, D, F]
        gu_b, gu_s = mxfp4.encode(gate_up)
        dn_b, dn_s = mxfp4.encode(down)
        with torch.no_grad():  # HF runs on the decoded weights (+0.0 for -0.0, as ggml reads)
            ex.gate_up_proj.copy_(torch.from_numpy(
                mxfp4.decode(gu_b, gu_s).swapaxes(1, 2) + np.float32(0)))
            ex.down_proj.copy_(torch.from_numpy(
                mxfp4.decode(dn_b, dn_s).swapaxes(1, 2) + np.float32(0)))
        for kind, b, s in (("gate", gu_b[:, 0::2], gu_s[:, 0::2]),
                           ("up", gu_b[:, 1::2], gu_s[:, 1::2]), ("down", dn_b, dn_s)):
            name = f"blk.{i}.ffn_{kind}_exps.weight"
            blocks[name] = (np.ascontiguousarray(b), np.ascontiguousarray(s))
            out.append((name, _ggml_mxfp4(b, s), QT.MXFP4))
    return out, blocks


def _metadata(hf, sp_model: Path) -> dict:
    """key -> (GGUFWriter method, value), as convert_hf_to_gguf.py fills them for gpt-oss."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    c, a = hf.config, "gpt-oss."
    rp = c.rope_parameters
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    return {
        a + "block_count": ("add_uint32", c.num_hidden_layers),
        a + "context_length": ("add_uint32", c.max_position_embeddings),
        a + "embedding_length": ("add_uint32", c.hidden_size),
        a + "feed_forward_length": ("add_uint32", c.intermediate_size),
        a + "attention.head_count": ("add_uint32", c.num_attention_heads),
        a + "attention.head_count_kv": ("add_uint32", c.num_key_value_heads),
        a + "attention.key_length": ("add_uint32", c.head_dim),
        a + "attention.value_length": ("add_uint32", c.head_dim),
        a + "attention.layer_norm_rms_epsilon": ("add_float32", c.rms_norm_eps),
        a + "rope.freq_base": ("add_float32", rp["rope_theta"]),
        a + "expert_count": ("add_uint32", c.num_local_experts),
        a + "expert_used_count": ("add_uint32", c.num_experts_per_tok),
        a + "expert_feed_forward_length": ("add_uint32", c.intermediate_size),
        a + "attention.sliding_window": ("add_uint32", c.sliding_window),
        a + "rope.scaling.type": ("add_string", "yarn"),
        a + "rope.scaling.factor": ("add_float32", rp["factor"]),
        a + "rope.scaling.original_context_length": (
            "add_uint32", rp["original_max_position_embeddings"]),
        a + "rope.scaling.yarn_beta_fast": ("add_float32", rp["beta_fast"]),
        a + "rope.scaling.yarn_beta_slow": ("add_float32", rp["beta_slow"]),
        "tokenizer.ggml.model": ("add_string", "llama"),
        "tokenizer.ggml.tokens": ("add_array", [p.piece for p in proto.pieces]),
        "tokenizer.ggml.scores": ("add_array", [p.score for p in proto.pieces]),
        "tokenizer.ggml.token_type": ("add_array", [int(p.type) for p in proto.pieces]),
        "tokenizer.ggml.bos_token_id": ("add_uint32", c.bos_token_id),
        "tokenizer.ggml.eos_token_id": ("add_uint32", c.eos_token_id),
    }


def write_gpt_oss_gguf(path: Path, meta: dict, tensors: list, *, extra_tensors=(), **kw
                       ) -> Path:
    return write_gguf(path, "gpt-oss", meta, list(tensors) + list(extra_tensors), **kw)


@pytest.fixture(scope="module")
def gpt_oss_gguf(tiny_dir, tmp_path_factory):
    """(HF model on MXFP4-decoded experts, its config.json dict, GGUF path, metadata, tensors,
    HF-layout expert blocks)."""
    d = tmp_path_factory.mktemp("gpt_oss_gguf")
    with pytest.MonkeyPatch.context() as mp:  # llama.cpp's clamp: 7 (gpt-oss's own)
        mp.setitem(FAMILIES["gpt_oss"], "kw", FAMILIES["gpt_oss"]["kw"] | {"swiglu_limit": 7.0})
        hf = make_hf_model("gpt_oss", d / "hf", hidden=64, layers=2, vocab=2000)
    hf_json = read_json_object(d / "hf" / "config.json", "test")
    tensors, blocks = _tensors(hf)
    meta = _metadata(hf, tiny_dir / "tokenizer.model")
    path = write_gpt_oss_gguf(d / "gpt-oss.gguf", meta, tensors)
    return hf, hf_json, path, meta, tensors, blocks


def test_config_equals_the_hf_config(gpt_oss_gguf):
    hf, hf_json, path, *_ = gpt_oss_gguf
    cfg, _ = load_gguf(path)
    want = from_hf_config(hf_json)
    assert cfg.architecture == "gguf:gpt-oss"
    assert dataclasses.replace(cfg, architecture=want.architecture) == want
    # the fields that make it gpt-oss, spelled out
    assert cfg.layer_types == ("local", "global") and cfg.sliding_window == 8
    assert cfg.rope_scaling == RopeScaling(kind="yarn", factor=8.0,
                                           original_max_position_embeddings=64, beta_fast=8.0,
                                           beta_slow=1.0, truncate=False)
    assert (cfg.attn_sinks, cfg.attn_out_bias, cfg.router_bias, cfg.expert_bias, cfg.qkv_bias,
            cfg.norm_topk_prob, cfg.tie_word_embeddings) == (True,) * 6 + (False,)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (8, 2, 128)


def test_mxfp4_experts_equal_the_numpy_decoder(gpt_oss_gguf):
    """Dequantized: ours [E, in, out] = checkpoints/mxfp4.decode of HF's blocks (and the gguf
    package's dequantizer of the file's) bit for bit; kept: int8 values 2 * e2m1 in [-12, 12]
    with f32 group scales 2**(e - 128) along the input axis, widening to the same values."""
    from jaxinfer.runtime.device.quantization import QuantizedArray

    _, _, path, _, _, blocks = gpt_oss_gguf
    _, params = load_gguf(path)
    _, kept = load_gguf(path, keep_quantized=True)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for i in range(2):
        for kind in ("gate", "up", "down"):
            name = f"blk.{i}.ffn_{kind}_exps.weight"
            assert raw[name].tensor_type == QT.MXFP4
            b, s = blocks[name]
            want = (mxfp4.decode(b, s) + np.float32(0)).swapaxes(1, 2)  # [E, in, out]
            got = np.asarray(getattr(params.layers[i], f"we_{kind}"))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            pkg = gguf.quants.dequantize(raw[name].data, QT.MXFP4).swapaxes(1, 2)
            np.testing.assert_array_equal(got.view(np.uint32), pkg.view(np.uint32))
            w = getattr(kept.layers[i], f"we_{kind}")
            assert isinstance(w, QuantizedArray) and w.fmt == "gguf" and not w.packed
            assert (w.group_size, w.group_axis, w.values.dtype) == (32, 1, np.int8)
            values, scales = mxfp4.as_int8(b, s)
            np.testing.assert_array_equal(np.asarray(w.values), values.swapaxes(1, 2))
            np.testing.assert_array_equal(np.asarray(w.scales), scales.swapaxes(1, 2))
            np.testing.assert_array_equal(np.asarray(w.dequantize()), got)


def test_logits_equal_hf_over_prefill_and_decode(gpt_oss_gguf):
    """Prefill + 8 cached decode steps within 1e-4 of HF on the same decoded experts; the kept
    MXFP4 experts give the same logits; the clamp of 7 bites (without it they move)."""
    hf, _, path, *_ = gpt_oss_gguf
    cfg, params = load_gguf(path)
    prefill, decoded, dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=DECODE)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[:len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT):len(PROMPT) + DECODE]).max() <= 1e-4
    _, kept = load_gguf(path, keep_quantized=True)
    prefill_kept, decoded_kept, _ = run_sequence(kept, cfg, PROMPT, page_size=8,
                                                 decode_steps=DECODE)
    assert np.abs(prefill_kept - prefill).max() <= 1e-4 and decoded_kept == decoded
    unclamped, _, _ = run_sequence(params, dataclasses.replace(cfg, swiglu_limit=None), PROMPT,
                                   page_size=8)
    assert np.abs(unclamped - prefill).max() > 1e-2


def test_tokenizer_from_the_file(gpt_oss_gguf, tiny_dir):
    import sentencepiece as spm

    _, _, path, *_ = gpt_oss_gguf
    reader = open_gguf(path)
    tok = load_gguf_tokenizer(path, reader=reader)
    sp = spm.SentencePieceProcessor(model_file=str(tiny_dir / "tokenizer.model"))
    text = "Now is the winter of our discontent"
    assert tok.encode(text) == [1] + sp.encode(text)
    assert tok.vocab_size == 2000 and tok.eos_ids[0] == 2


BAD_METADATA = {
    # (drop, set_kv, extra tensors) -> the error
    "no expert_count": (("gpt-oss.expert_count",), None,
                        r"GGUF metadata key 'gpt-oss.expert_count' is missing"),
    "no sliding_window": (("gpt-oss.attention.sliding_window",), None,
                          r"'gpt-oss.attention.sliding_window' is missing"),
    "no expert_feed_forward_length": (("gpt-oss.expert_feed_forward_length",), None,
                                      r"'gpt-oss.expert_feed_forward_length' is missing"),
    "string window": ((), {"gpt-oss.attention.sliding_window": ("add_string", "8")},
                      r"'gpt-oss.attention.sliding_window' must be an integer, got str '8'"),
    "float expert_count": ((), {"gpt-oss.expert_count": ("add_float32", 8.0)},
                           r"'gpt-oss.expert_count' must be an integer, got float 8.0"),
    "string rms eps": ((), {"gpt-oss.attention.layer_norm_rms_epsilon": ("add_string", "x")},
                       r"'gpt-oss.attention.layer_norm_rms_epsilon' must be a number"),
    "4 experts": ((), {"gpt-oss.expert_count": ("add_uint32", 4)},
                  r"tensor 'blk.0.ffn_gate_inp.weight' has ne \[64, 8\], the metadata implies "
                  r"\[64, 4\] \(gpt-oss.expert_count 4"),
    "linear rope": ((), {"gpt-oss.rope.scaling.type": ("add_string", "linear")},
                    r"unsupported rope scaling type 'linear' for gpt-oss"),
    "no yarn factor": (("gpt-oss.rope.scaling.factor",), None,
                       r"'gpt-oss.rope.scaling.factor' is missing"),
    "no router bias": (("blk.1.ffn_gate_inp.bias",), None,
                       r"layer 1 has no expert tensor 'blk.1.ffn_gate_inp.bias'"),
    "no sinks": (("blk.0.attn_sinks.weight",), None,
                 r"missing 1 tensor\(s\).*blk\.0\.attn_sinks\.weight"),
    "no output": (("output.weight",), None, r"gpt-oss needs an 'output.weight' tensor"),
}


@pytest.mark.parametrize("case", BAD_METADATA)
def test_bad_metadata_is_a_clear_error(gpt_oss_gguf, tmp_path, case):
    _, _, _, meta, tensors, _ = gpt_oss_gguf
    drop, set_kv, pattern = BAD_METADATA[case]
    path = write_gpt_oss_gguf(tmp_path / "bad.gguf", meta, tensors, drop=drop, set_kv=set_kv)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_fused_gate_up_experts_are_refused(gpt_oss_gguf, tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps writes one ffn_gate_up_exps tensor instead."""
    _, _, _, meta, tensors, _ = gpt_oss_gguf
    gate = next(a for n, a, _ in tensors if n == "blk.0.ffn_gate_exps.weight")
    up = next(a for n, a, _ in tensors if n == "blk.0.ffn_up_exps.weight")
    path = write_gpt_oss_gguf(
        tmp_path / "fused.gguf", meta, tensors,
        extra_tensors=[("blk.0.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1),
                        QT.MXFP4)])
    with pytest.raises(CheckpointError, match=r"fused gate/up expert tensors "
                       r"\('blk.0.ffn_gate_up_exps.weight'") as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_served_greedy_equals_hf_generate(gpt_oss_gguf):
    """LLM(path) keeps the MXFP4 experts (the CPU default where the kernels load, else
    dequantized) and gives HF's greedy tokens."""
    hf, _, path, *_ = gpt_oss_gguf
    assert_gguf_served_equals_hf(path, hf)
