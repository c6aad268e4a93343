"""Session fixtures and helpers for Gemma 3 / GGUF tests.

- `tiny_gemma3_hf(dir)`: a random-init HF Gemma 3 (both local and global layers, window 8).
- `write_gguf_like_llama_cpp(...)`: writes an HF model's weights as a GGUF file the way
  llama.cpp's converter lays them out (names, +1 on Gemma norms, q/k row permutation for the
  "llama" architecture, experts stacked per projection, Qwen2-MoE's shared expert and its gate),
  optionally quantized, so loader details can be tested on tiny models.
The real Gemma 3 270M session fixtures (`gemma_gguf_path`, `gemma_ours`, `gemma_hf`, ...) live
in tests/conftest.py, so the model is loaded once per session however many modules use it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY_GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                          "sliding_attention", "sliding_attention", "full_attention"]


def tiny_gemma3_hf(out: Path, *, seed: int = 0, vocab: int = 512, **overrides):
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=24, layer_types=TINY_GEMMA_LAYER_TYPES,
        max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    kw.update(overrides)
    cfg = transformers.Gemma3TextConfig(**kw)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # zero-init Gemma norms would hide a missing "+1"
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return model


# --------------------------------------------------------------------------- GGUF writing

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # its [1, D] gate, written unchanged
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half pairs -> interleaved pairs), per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_name(hf_name: str, arch: str) -> str:
    n = hf_name.removeprefix("model.")
    if n == "embed_tokens.weight":
        return "token_embd.weight"
    if n == "norm.weight":
        return "output_norm.weight"
    if n == "lm_head.weight":
        return "output.weight"
    _, i, rest = n.split(".", 2)
    mod, kind = rest.rsplit(".", 1)
    if mod == "post_attention_layernorm":
        g = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
    elif mod == "pre_feedforward_layernorm":
        g = "ffn_norm"
    elif mod == "post_feedforward_layernorm":
        g = "post_ffw_norm"
    else:
        g = _HF_TO_GGUF_LAYER[mod]
    return f"blk.{i}.{g}.{kind}"


def _llama_cpp_tensors(model, arch: str):
    """(GGUF name, f32 numpy array) of each weight, as llama.cpp's converter writes it."""
    c = model.config
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    for name, p in model.state_dict().items():
        if "rotary" in name or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue  # llama.cpp writes no output.weight for tied embeddings
        a = p.detach().float().numpy().copy()
        if ".mlp.experts." in name:  # HF's stacked experts: [E, 2F, D] gate then up; [E, D, F]
            blk = f"blk.{name.split('.')[2]}"
            if name.endswith("gate_up_proj"):
                gate, up = np.split(a, 2, axis=1)
                yield f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate)
                yield f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up)
            else:
                yield f"{blk}.ffn_down_exps.weight", a
            continue
        g = gguf_name(name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's effective multiplier
        if arch == "llama" and g.endswith(("attn_q.weight", "attn_q.bias")):
            a = _llama_cpp_permute(a, hq)
        if arch == "llama" and g.endswith(("attn_k.weight", "attn_k.bias")):
            a = _llama_cpp_permute(a, hkv)
        yield g, a


def write_gguf_like_llama_cpp(model, path: Path, arch: str, *, qtype=None, extra_kv=None,
                              skip=(), sp_model: Path | None = None):
    """Write `model` (HF, torch) as a GGUF file. Weights (2-D, and the [E, out, in] expert
    stacks) use `qtype` (a GGMLQuantizationType; None = F32) when their row length allows; norms,
    the experts' router and the shared expert's gate stay F32, as llama.cpp keeps them.
    `sp_model`: a sentencepiece tokenizer.model whose vocabulary goes into the metadata (as
    llama.cpp's converter writes it), so the file loads as a whole model."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_vocab_size(c.vocab_size)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rp = getattr(c, "rope_parameters", None) or {}
    theta = (rp.get("full_attention") or rp).get("rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if sp_model is not None:
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2

        proto = sp_pb2.ModelProto()
        proto.ParseFromString(Path(sp_model).read_bytes())
        w.add_tokenizer_model("llama")
        w.add_token_list([p.piece for p in proto.pieces])
        w.add_token_scores([p.score for p in proto.pieces])
        w.add_token_types([int(p.type) for p in proto.pieces])
        w.add_uint32("tokenizer.ggml.bos_token_id", c.bos_token_id)
        w.add_uint32("tokenizer.ggml.eos_token_id", c.eos_token_id)
    else:
        w.add_uint32("tokenizer.ggml.bos_token_id", 2)
        w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, int(v))
    for g, a in _llama_cpp_tensors(model, arch):
        if g in skip:
            continue
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 1
        if (qtype is not None and a.ndim >= 2 and a.shape[-1] % block == 0
                and ".ffn_gate_inp" not in g):
            if qtype == QT.F16:
                w.add_tensor(g, a.astype(np.float16))
            else:
                q = gguf.quants.quantize(a, qtype)
                w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(g, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LOAD_STATS: dict[str, float] = {}  # the session fixtures' load times (tests/conftest.py)
