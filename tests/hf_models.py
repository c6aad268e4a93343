"""Random-init HF models made in fixtures: the oracle for the Llama family."""

from __future__ import annotations

from pathlib import Path

import torch

_GEMMA4 = dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
    num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
    use_double_wide_mlp=True, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
    sliding_window=8, final_logit_softcapping=30.0, tie_word_embeddings=True,
    layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="eager",
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                        "partial_rotary_factor": 0.25}})

FAMILIES = {
    "llama": dict(
        cls="LlamaForCausalLM", cfg="LlamaConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama3_rope": dict(
        cls="LlamaForCausalLM", cfg="LlamaConfig",
        kw=dict(
            num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=64),
            tie_word_embeddings=False,
        ),
    ),
    "mistral": dict(
        cls="MistralForCausalLM", cfg="MistralConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                tie_word_embeddings=False),
    ),
    "qwen2": dict(
        cls="Qwen2ForCausalLM", cfg="Qwen2Config",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3": dict(  # per-head q/k RMSNorm, head_dim set apart from hidden / heads
        cls="Qwen3ForCausalLM", cfg="Qwen3Config",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                tie_word_embeddings=False),
    ),
    "qwen3_moe": dict(  # 16 experts, top 4, weights not renormalised
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=False,
                tie_word_embeddings=False),
    ),
    "qwen2_moe": dict(  # 8 experts, top 2, a gated shared expert; layer 1 a dense MLP, qkv bias
        cls="Qwen2MoeForCausalLM", cfg="Qwen2MoeConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=48,
                shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False,
                tie_word_embeddings=False),
    ),
    "mixtral": dict(  # 8 experts, top 2, renormalised
        cls="MixtralForCausalLM", cfg="MixtralConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    ),
    # 8 experts, top 2, biased router and experts, a clamp that bites (limit 0.3), attention
    # sinks, sliding (window 8) and full layers alternating, YaRN rope
    "gpt_oss": dict(
        cls="GptOssForCausalLM", cfg="GptOssConfig",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.3,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                     beta_fast=8.0, beta_slow=1.0, truncate=False,
                                     original_max_position_embeddings=64),
                tie_word_embeddings=False, attn_implementation="eager"),
    ),
    # latent attention (q compressed, rope dims interleaved, YaRN with mscale), 8 routed experts
    # in 4 groups (best 2 kept), top 2 by sigmoid score + bias, x2.5, a shared expert, layer 0
    # dense
    "deepseek_v3": dict(
        cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config", router_scale=5.0,
        kw=dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=48, q_lora_rank=40,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, n_group=4,
                topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                     mscale=1.0, mscale_all_dim=0.8, beta_fast=8.0,
                                     beta_slow=1.0, original_max_position_embeddings=64),
                tie_word_embeddings=False),
    ),
    # Gemma 4: 4 layers (sliding, global, then two reading their KV), global layers with their
    # own head_dim 64 / 1 KV head, V from K and proportional RoPE (a quarter rotated); the
    # shared layers' MLP twice as wide, per-layer inputs of 16, a final soft cap
    "gemma4": dict(cls="Gemma4ForCausalLM", cfg="Gemma4TextConfig", layers=4, kw=_GEMMA4),
    "gemma4_moe": dict(  # ... and 8 experts (top 2) beside every layer's MLP
        cls="Gemma4ForCausalLM", cfg="Gemma4TextConfig", layers=4, router_scale=5.0,
        kw=dict(_GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=48)),
}


def make_hf_model(family: str, out: Path, *, seed: int = 0, hidden=128, layers=2, vocab=512,
                  dtype=torch.float32, **overrides):
    """A random-init HF model of `family` saved in `out`; `overrides`: config fields over the
    family's."""
    import transformers

    spec = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, spec["cfg"])(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=spec.get("layers", layers), max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **(spec["kw"] | overrides),
    )
    model = getattr(transformers, spec["cls"])(cfg).eval()
    # random-init norms/biases/scales are 1/0: perturb them so a mapping error cannot hide
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks", "scale")) or (
                    "norm" in name and name.endswith(".weight")):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                              "mlp.router.weight", "router.proj.weight")):
                # routers far from uniform: no near-ties in the top-k choice
                p.mul_(spec.get("router_scale", 50.0))
            if name.endswith("sinks"):
                p.mul_(20.0)  # sinks near the scores' scale: they take a real share
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "layer_scalar")):
                b.add_(0.1 * torch.randn_like(b))
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return model
