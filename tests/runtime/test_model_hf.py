"""Our forward vs HF transformers on random-init Llama-family models (the oracle)."""

import numpy as np
import pytest
import torch

from jaxinfer.checkpoints.hf import load_hf
from tests.hf_models import FAMILIES, make_hf_model
from tests.model_utils import run_sequence

PROMPT = [1, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301]


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path)
    cfg, params = load_hf(path)
    return request.param, hf, cfg, params


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def test_prefill_and_decode_logits_match_hf(family_model):
    name, hf, cfg, params = family_model
    prefill, decoded, dec_logits = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=16)
    ref = hf_logits(hf, PROMPT + decoded)
    assert np.abs(prefill - ref[: len(PROMPT)]).max() <= 1e-4, name
    # decode step i saw PROMPT + decoded[: i + 1] through the cache
    ref_dec = ref[len(PROMPT): len(PROMPT) + 16]
    assert np.abs(dec_logits - ref_dec).max() <= 1e-4, name


def test_greedy_32_tokens_identical_to_hf_generate(family_model):
    name, hf, cfg, params = family_model
    _, ours, _ = run_sequence(params, cfg, PROMPT, page_size=16, decode_steps=32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(PROMPT):].tolist(), name


def test_config_fields_from_hf(family_model):
    name, hf, cfg, _ = family_model
    if name.startswith("gemma4"):  # the global layers' own dims, KV shared by the last two
        assert (cfg.layer_head_dim(1), cfg.layer_kv_heads(1)) == (64, 1)
        assert (cfg.layer_head_dim(0), cfg.layer_kv_heads(0)) == (32, 2)
        assert [cfg.layer_kv_source(i) for i in range(4)] == [0, 1, 0, 1]
        assert cfg.num_experts == (8 if name == "gemma4_moe" else 0)
        return
    latent = name == "deepseek_v3"  # one cached head: the latent + rope dims
    assert cfg.num_kv_heads == (1 if latent else hf.config.num_key_value_heads)
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    assert cfg.qkv_bias == (name in ("qwen2", "qwen2_moe", "gpt_oss"))
    assert (cfg.rope_scaling is not None) == (name in ("llama3_rope", "gpt_oss", "deepseek_v3"))
    assert cfg.qk_norm == (name in ("qwen3", "qwen3_moe"))
    assert cfg.num_experts == {"qwen3_moe": 16, "qwen2_moe": 8, "mixtral": 8, "gpt_oss": 8,
                              "deepseek_v3": 8}.get(name, 0)
    assert (cfg.shared_expert_size, cfg.dense_layers) == {
        "qwen2_moe": (80, (1,)), "deepseek_v3": (32, (0,))}.get(name, (0, ()))
    assert cfg.attn_sinks == cfg.attn_out_bias == cfg.expert_bias == (name == "gpt_oss")
    if name == "gpt_oss":  # sliding and full layers alternate
        assert cfg.layer_types == ("local", "global") and cfg.layer_window(0) == 8
    c = hf.config
    if latent:
        assert (cfg.head_dim, cfg.kv_lora_rank, cfg.router_groups, cfg.routed_scaling) == (
            c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, 4, 2.5)
        return
    assert cfg.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
