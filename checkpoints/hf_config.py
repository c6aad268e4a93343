"""An HF `config.json` dict -> ModelConfig: the supported model types and how their fields map."""

from __future__ import annotations

import math
from typing import Any

from jaxinfer.runtime.config import ConfigError, ModelConfig, RopeScaling

# HF `model_type` -> our family name. Families share one forward; differences are config fields.
_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_vl_text": "llama",
    "qwen3_vl": "llama",
    "qwen3_moe": "llama",
    "qwen2_moe": "llama",
    "mixtral": "llama",
    "gpt_oss": "llama",
    "deepseek_v3": "llama",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
}


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build from an HF `config.json` dict. Raises ConfigError naming `source` on anything
    we cannot serve."""
    if "text_config" in hf and hf.get("model_type") in ("gemma3", "gemma4", "qwen3_vl"):
        tie = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
        hf = {**hf["text_config"], **tie, "model_type": hf["model_type"] + "_text"}
    model_type = hf.get("model_type")
    family = _FAMILIES.get(model_type or "")
    if family is None:
        arch = hf.get("architectures") or [model_type]
        raise ConfigError(
            f"{source}: unsupported architecture {arch[0]!r} (model_type {model_type!r}); "
            f"supported model_types: {sorted(_FAMILIES)}"
        )
    try:
        return _from_hf(hf, family, model_type)
    except KeyError as e:
        raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a field of the wrong type: a list or null for a number
        raise ConfigError(f"{source}: bad field value ({e})") from None


def _eos_ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "yarn":
        af = rs.get("attention_factor")
        if af is None and rs.get("mscale") and rs.get("mscale_all_dim"):
            af = (_yarn_mscale(float(rs["factor"]), float(rs["mscale"]))
                  / _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"])))
        return RopeScaling(
            kind="yarn", factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
            truncate=_bool(rs.get("truncate", True), "rope_scaling.truncate"),
            attention_factor=None if af is None else float(af))
    raise ConfigError(f"unsupported rope_scaling type {kind!r}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _bool(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r}")
    return v


def _rope_theta(hf: dict[str, Any], default: float) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
        if "full_attention" in rp:  # gemma3 style: per layer-type parameters
            return float(rp["full_attention"].get("rope_theta", default))
    return default


def _from_hf(hf: dict[str, Any], family: str, model_type: str) -> ModelConfig:
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    latent = _latent(hf) if model_type == "deepseek_v3" else {}
    common = dict(
        family=family,
        architecture=(hf.get("architectures") or [model_type])[0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    ) | latent
    if family == "llama":
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_vl_text") and not (
                hf.get("use_sliding_window", False)):
            window = None
        return ModelConfig(
            **common,
            rope_theta=_rope_theta(hf, 10000.0),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(hf, model_type),
            # per-head RMSNorm of q, k before RoPE
            qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text"),
            mrope_section=_mrope_section(hf, model_type, head_dim),
            activation=_activation(hf.get("hidden_act", "silu")),
            sliding_window=window,
            layer_types=_layer_types(hf, model_type, common["num_layers"]) if window else (),
            **_experts(hf, model_type, common["num_layers"]),
            **(_gpt_oss(hf) if model_type == "gpt_oss" else {}),
            **(_deepseek_routing(hf) if model_type == "deepseek_v3" else {}),
        )
    if family == "gemma4":
        return _gemma4(hf, common)
    # gemma3
    n = common["num_layers"]
    layer_types = hf.get("layer_types")
    if layer_types:
        layer_types = tuple("local" if t == "sliding_attention" else "global" for t in layer_types)
    else:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = tuple("global" if (i + 1) % pattern == 0 else "local" for i in range(n))
    rp = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    local_theta = hf.get("rope_local_base_freq") or (rp.get("sliding_attention") or {}).get(
        "rope_theta", 10000.0
    )
    return ModelConfig(
        **common,
        rope_theta=_rope_theta(hf, 1_000_000.0),
        rope_scaling=_rope_scaling(
            {"rope_scaling": hf.get("rope_scaling") or rp.get("full_attention")}
        ),
        rope_local_theta=float(local_theta),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        activation=_activation(hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", head_dim)),
        sliding_window=int(hf.get("sliding_window", 4096)),
        layer_types=layer_types,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
    )


def _mrope_section(hf: dict[str, Any], model_type: str, head_dim: int) -> tuple[int, ...]:
    """Qwen3-VL's multimodal RoPE sections (t, h, w frequencies; HF's default [24, 20, 20])."""
    if model_type != "qwen3_vl_text":
        return ()
    rp = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    sec = tuple(int(x) for x in rp.get("mrope_section", (24, 20, 20)))
    if len(sec) != 3 or sum(sec) != head_dim // 2:
        raise ConfigError(f"mrope_section {list(sec)} must be 3 sections summing to head_dim / 2 "
                          f"({head_dim // 2})")
    return sec


def _layer_types(hf: dict[str, Any], model_type: str, n: int) -> tuple[str, ...]:
    """Per layer "local" (sliding window) or "global": HF's `layer_types` where given (gpt-oss
    alternates them; Qwen2 windows the layers from max_window_layers), else every layer local
    (Mistral, whose HF model ignores layer_types)."""
    types = hf.get("layer_types")
    if types is None or model_type == "mistral":
        return ("local",) * n
    names = {"sliding_attention": "local", "full_attention": "global"}
    if not isinstance(types, list) or len(types) != n or any(t not in names for t in types):
        raise ConfigError(f"layer_types must list {n} of {sorted(names)}, got {types!r}")
    return tuple(names[t] for t in types)


def _gpt_oss(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: attention sinks, q/k/v/o biases, a biased router whose top-k logits are
    softmaxed (= softmax, top k, renormalised), biased experts with the clamped GLU."""
    if not _bool(hf.get("attention_bias", True), "attention_bias"):
        raise ConfigError("gpt_oss without attention_bias is not supported")
    return dict(attn_sinks=True, attn_out_bias=True, router_bias=True, expert_bias=True,
                norm_topk_prob=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _gemma4(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma 4 (text): Gemma 3's sandwich norms and soft-capped head, plus per-layer-type head
    dims and KV heads (`per_layer_config` on the global layers), proportional RoPE there, V from
    K on global layers (`attention_k_eq_v`), KV shared by the last layers, per-layer input
    embeddings, experts beside the MLP, a softmax scale of 1 (q and k are RMS-normed)."""
    n = common["num_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                      for i in range(n)]
    layer_types = _layer_types({"layer_types": types}, "gemma4", n)
    glob = [i for i, t in enumerate(layer_types) if t == "global"]
    per_layer = hf.get("per_layer_config") or {}
    if not isinstance(per_layer, dict):
        raise ConfigError(f"per_layer_config must be an object, got {per_layer!r}")
    over = {}
    for key, val in per_layer.items():
        i = int(key)
        if not 0 <= i < n or layer_types[i] != "global" or not isinstance(val, dict):
            raise ConfigError(f"per_layer_config[{key!r}]: only global layers' head_dim / "
                              f"num_key_value_heads may differ")
        over[i] = (int(val.get("head_dim", common["head_dim"])),
                   int(val.get("num_key_value_heads", common["num_kv_heads"])))
    if over and (set(over) != set(glob) or len(set(over.values())) != 1):
        raise ConfigError(f"per_layer_config {per_layer}: every global layer must take the same "
                          f"head_dim / num_key_value_heads")
    if over:
        g_dim, g_kv = next(iter(over.values()))
    else:  # as transformers builds per_layer_config when a config has none: global layers
        # take global_head_dim (512 unset) and, with attention_k_eq_v, num_global_key_value_heads
        g_dim = int(hf.get("global_head_dim") or 512)
        g_kv = int(hf.get("num_global_key_value_heads") or 0) if hf.get(
            "attention_k_eq_v", False) else 0
    rp = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"sliding layers' rope_type {local.get('rope_type')!r}: only default")
    scaling = None
    if full.get("rope_type", "default") == "proportional":
        scaling = RopeScaling(kind="proportional", factor=float(full.get("factor", 1.0)),
                              partial_rotary_factor=float(full.get("partial_rotary_factor", 1.0)))
    elif full.get("rope_type", "default") != "default":
        raise ConfigError(f"global layers' rope_type {full.get('rope_type')!r}: default or "
                          f"proportional")
    moe = _bool(hf.get("enable_moe_block", False), "enable_moe_block")
    experts = {} if not moe else dict(
        num_experts=int(hf["num_experts"]), experts_per_token=int(hf["top_k_experts"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True)
    ple = int(hf.get("hidden_size_per_layer_input") or 0)
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported")
    if _bool(hf.get("attention_bias", False), "attention_bias"):
        raise ConfigError("gemma4 with attention_bias is not supported")
    return ModelConfig(
        **common, rope_theta=float(full.get("rope_theta", 1_000_000.0)), rope_scaling=scaling,
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        tie_word_embeddings=_bool(hf.get("tie_word_embeddings", True), "tie_word_embeddings"),
        activation=_activation(hf.get("hidden_activation") or "gelu_pytorch_tanh"),
        qk_norm=True, sandwich_norms=True, embed_scale=math.sqrt(common["hidden_size"]),
        query_pre_attn_scalar=1.0, sliding_window=int(hf.get("sliding_window", 512)),
        layer_types=layer_types, final_logit_softcap=hf.get("final_logit_softcapping"),
        global_head_dim=g_dim, global_kv_heads=g_kv,
        global_k_eq_v=_bool(hf.get("attention_k_eq_v", False), "attention_k_eq_v"),
        v_norm=True, kv_shared_layers=int(hf.get("num_kv_shared_layers") or 0),
        double_wide_shared_mlp=_bool(hf.get("use_double_wide_mlp", False),
                                     "use_double_wide_mlp"),
        per_layer_input_size=ple,
        per_layer_vocab=int(hf.get("vocab_size_per_layer_input") or 0) if ple else 0,
        moe_block=moe, layer_scalar=True, **experts)


def _latent(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: the cache's one head is the latent + the rope
    dims; the softmax scale is (nope + rope)^-0.5, times YaRN's mscale(mscale_all_dim)^2."""
    if _bool(hf.get("attention_bias", False), "attention_bias"):
        raise ConfigError("deepseek_v3 with attention_bias is not supported")
    c, r = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"])
    nope, v = int(hf["qk_nope_head_dim"]), int(hf["v_head_dim"])
    scalar = float(nope + r)
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        scalar /= _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"])) ** 4
    if c < 1 or r < 1 or r % 2:
        raise ConfigError(f"kv_lora_rank {c} must be >= 1 and qk_rope_head_dim {r} even >= 2")
    return dict(num_kv_heads=1, head_dim=c + r, kv_lora_rank=c,
                q_lora_rank=int(hf.get("q_lora_rank") or 0), qk_nope_head_dim=nope,
                qk_rope_head_dim=r, v_head_dim=v, query_pre_attn_scalar=scalar)


def _deepseek_routing(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's MoE: sigmoid scores chosen with a bias among the best groups, a shared
    expert of n_shared_experts x moe_intermediate_size, the first layers dense."""
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"deepseek_v3 routing {scoring!r} / {hf.get('topk_method')!r} is not "
                          f"supported (sigmoid / noaux_tc)")
    n, f = int(hf["n_routed_experts"]), int(hf["moe_intermediate_size"])
    layers = int(hf["num_hidden_layers"])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense <= layers:
        raise ConfigError(f"first_k_dense_replace {first_dense} outside 0..{layers}")
    return dict(num_experts=n, experts_per_token=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=f, norm_topk_prob=_bool(hf.get("norm_topk_prob", True),
                                                              "norm_topk_prob"),
                shared_expert_size=f * int(hf.get("n_shared_experts") or 0),
                dense_layers=tuple(range(first_dense)), router_scoring="sigmoid",
                router_groups=int(hf.get("n_group") or 1),
                router_topk_groups=int(hf.get("topk_group") or 1),
                routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))


def _qkv_bias(hf: dict[str, Any], model_type: str) -> bool:
    if model_type == "qwen2_moe":  # its config says qkv_bias (default on)
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", model_type in ("qwen2", "gpt_oss")))


def _experts(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields (none for a dense model): Qwen3-MoE / Qwen2-MoE
    (`num_experts`, `moe_intermediate_size`, `norm_topk_prob`; dense layers from
    `decoder_sparse_step` and `mlp_only_layers`; Qwen2-MoE's gated shared expert) and Mixtral
    (`num_local_experts`, experts of `intermediate_size`, weights always renormalised)."""
    if model_type == "gpt_oss":  # experts of intermediate_size, in every layer
        return dict(num_experts=int(hf["num_local_experts"]),
                    experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]))
    if model_type == "mixtral":
        return dict(num_experts=int(hf["num_local_experts"]),
                    experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if model_type not in ("qwen3_moe", "qwen2_moe"):
        return {}
    # Qwen's own configs say num_experts; transformers 5 writes num_local_experts
    n = int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"])
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ConfigError(f"decoder_sparse_step {step} must be >= 1")
    # as HF builds the layers: experts where i is not MLP-only and (i + 1) % step == 0
    dense = {int(i) for i in hf.get("mlp_only_layers") or []}
    dense |= {i for i in range(num_layers) if n == 0 or (i + 1) % step}
    shared = 0
    if model_type == "qwen2_moe":
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
    return dict(num_experts=n, experts_per_token=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_size=shared, shared_expert_gate=bool(shared),
                dense_layers=tuple(sorted(i for i in dense if 0 <= i < num_layers)))


def _activation(name: str) -> str:
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        return "gelu_tanh"
    raise ConfigError(f"unsupported activation {name!r}")
