"""Load an HF checkpoint directory (config.json + *.safetensors, sharded or not) into Params.

Tensors stream one at a time from the safetensors files into their final layout and dtype, so
peak host memory stays near one copy of the weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoints.errors import CheckpointError, read_json_object
from jaxinfer.checkpoints.hf_config import from_hf_config
from jaxinfer.checkpoints.hf_int4 import group_linears, scheme_of
from jaxinfer.checkpoints.mxfp4 import MXFP4Weight
from jaxinfer.runtime.config import ConfigError, ModelConfig
from jaxinfer.runtime.device.model import LayerParams, Params

# Prefixes of multimodal / wrapped checkpoints around the text model.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def read_hf_json(path: Path) -> dict:
    return read_json_object(path / "config.json", "an HF checkpoint dir")


def _translate(path: Path, hf: dict) -> ModelConfig:
    try:
        return from_hf_config(hf, source=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, object, Path]]:
    """Yield (name, array, file) one tensor at a time (jax arrays keep bf16 exact)."""
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name), f
        except SafetensorError as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read ({e})") from None


def _strip(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def hf_tensor_plan(cfg: ModelConfig) -> dict[str, tuple[str, Callable] | list]:
    """HF tensor name (prefix stripped) -> (our param path, transform to our layout), or a list
    of them where one tensor holds several params (gpt-oss's interleaved gate_up)."""
    if cfg.family == "gemma4":
        return _gemma4_plan(cfg)
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gemma = cfg.family == "gemma3"
    norm = (lambda w: w + 1.0) if gemma else (lambda w: w)  # Gemma stores w, applies (1 + w)
    plan = {
        "embed_tokens.weight": ("embed", lambda w: w),
        "norm.weight": ("final_norm", norm),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = ("lm_head", lambda w: w)
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        layer = {
            "self_attn.q_proj.weight": ("wq", lambda w: w.T.reshape(d, hq, dh)),
            "self_attn.k_proj.weight": ("wk", lambda w: w.T.reshape(d, hkv, dh)),
            "self_attn.v_proj.weight": ("wv", lambda w: w.T.reshape(d, hkv, dh)),
            "self_attn.o_proj.weight": ("wo", lambda w: w.T.reshape(hq, dh, d)),
            "input_layernorm.weight": ("attn_norm", norm),
        } if not cfg.latent_attention else _latent_plan(cfg)
        layer |= _expert_plan(cfg) if cfg.layer_has_experts(i) else _mlp_plan("mlp.")
        if gemma:
            layer |= {
                "post_attention_layernorm.weight": ("post_attn_norm", norm),
                "pre_feedforward_layernorm.weight": ("mlp_norm", norm),
                "post_feedforward_layernorm.weight": ("post_mlp_norm", norm),
            }
        else:
            layer["post_attention_layernorm.weight"] = ("mlp_norm", norm)
        if cfg.qk_norm:
            layer |= {
                "self_attn.q_norm.weight": ("q_norm", norm),
                "self_attn.k_norm.weight": ("k_norm", norm),
            }
        if cfg.qkv_bias:
            layer |= {
                "self_attn.q_proj.bias": ("bq", lambda b: b.reshape(hq, dh)),
                "self_attn.k_proj.bias": ("bk", lambda b: b.reshape(hkv, dh)),
                "self_attn.v_proj.bias": ("bv", lambda b: b.reshape(hkv, dh)),
            }
        if cfg.attn_out_bias:
            layer["self_attn.o_proj.bias"] = ("bo", lambda b: b)
        if cfg.attn_sinks:
            layer["self_attn.sinks"] = ("sinks", lambda b: b)
        for k, v in layer.items():
            plan[pre + k] = ([(pre + f, fn) for f, fn in v] if isinstance(v, list)
                             else (pre + v[0], v[1]))
    return plan


def _gemma4_plan(cfg: ModelConfig) -> dict[str, tuple[str, Callable] | list]:
    """Gemma 4 (text): norms store their multiplier (not Gemma 3's w - 1); each layer's head
    dims and KV heads its type's; layers reading another's KV have no K / V / k_norm; global
    layers with attention_k_eq_v no V; the experts stacked [E, 2F, D] (gate rows then up
    rows) and [E, D, F]."""
    d, hq = cfg.hidden_size, cfg.num_heads
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    plan = {"embed_tokens.weight": ("embed", same), "norm.weight": ("final_norm", same)}
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = ("lm_head", same)
    if cfg.per_layer_input_size:
        plan |= {"embed_tokens_per_layer.weight": ("embed_per_layer", same),
                 "per_layer_model_projection.weight": ("ple_model_proj", t),
                 "per_layer_projection_norm.weight": ("ple_proj_norm", same)}
    f_e = cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        dh, hkv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        layer = {
            "input_layernorm.weight": ("attn_norm", same),
            "self_attn.q_proj.weight": ("wq", lambda w, dh=dh: w.T.reshape(d, hq, dh)),
            "self_attn.q_norm.weight": ("q_norm", same),
            "self_attn.o_proj.weight": ("wo", lambda w, dh=dh: w.T.reshape(hq, dh, d)),
            "post_attention_layernorm.weight": ("post_attn_norm", same),
            "pre_feedforward_layernorm.weight": ("mlp_norm", same),
            "post_feedforward_layernorm.weight": ("post_mlp_norm", same),
            "layer_scalar": ("scalar", same),
            **_mlp_plan("mlp."),
        }
        if cfg.layer_kv_source(i) == i:
            kv = lambda w, dh=dh, hkv=hkv: w.T.reshape(d, hkv, dh)  # noqa: E731
            layer |= {"self_attn.k_proj.weight": ("wk", kv),
                      "self_attn.k_norm.weight": ("k_norm", same)}
            if not cfg.layer_k_eq_v(i):
                layer["self_attn.v_proj.weight"] = ("wv", kv)
        if cfg.per_layer_input_size:
            layer |= {"per_layer_input_gate.weight": ("ple_gate", t),
                      "per_layer_projection.weight": ("ple_proj", t),
                      "post_per_layer_input_norm.weight": ("ple_norm", same)}
        if cfg.moe_block:
            layer |= {
                "router.proj.weight": ("router", t),
                "router.scale": ("router_scale", same),
                "router.per_expert_scale": ("expert_scale", same),
                "experts.gate_up_proj": [
                    ("we_gate", lambda w: w[:, :f_e].transpose(0, 2, 1)),
                    ("we_up", lambda w: w[:, f_e:].transpose(0, 2, 1))],
                "experts.down_proj": ("we_down", lambda w: w.transpose(0, 2, 1)),
                "post_feedforward_layernorm_1.weight": ("mlp_out_norm", same),
                "pre_feedforward_layernorm_2.weight": ("expert_in_norm", same),
                "post_feedforward_layernorm_2.weight": ("expert_out_norm", same),
            }
        for k, v in layer.items():
            plan[f"layers.{i}.{k}"] = ([(f"layers.{i}.{f}", fn) for f, fn in v]
                                       if isinstance(v, list) else (f"layers.{i}.{v[0]}", v[1]))
    return plan


def _latent_plan(cfg: ModelConfig) -> dict[str, tuple[str, Callable] | list]:
    """DeepSeek-V3's latent attention (runtime/device/mla.py). Its rope dims come interleaved
    ((x0, x1), (x2, x3) rotated by one frequency each): reordered here to evens then odds, which
    is the rotate-half layout of the same rotation (q and k alike, so their products hold)."""
    d, h, c, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])

    def q_out(w):  # [..., H * (N + R)] -> [..., H, N + R], rope dims reordered
        w = w.reshape(*w.shape[:-1], h, n + r)
        return jnp.concatenate([w[..., :n], w[..., n:][..., perm]], axis=-1)

    def kv_b(w):  # [H * (N + V), C] -> [H, N + V, C]
        return w.reshape(h, n + v, c)

    plan = {
        "self_attn.kv_a_proj_with_mqa.weight": (
            "wkv_a", lambda w: jnp.concatenate([w.T[:, :c], w.T[:, c:][:, perm]], axis=1)),
        "self_attn.kv_a_layernorm.weight": ("kv_a_norm", lambda w: w),
        "self_attn.kv_b_proj.weight": [("w_uk", lambda w: kv_b(w)[:, :n]),
                                       ("w_uv", lambda w: kv_b(w)[:, n:].transpose(0, 2, 1))],
        "self_attn.o_proj.weight": ("wo", lambda w: w.T.reshape(h, v, d)),
        "input_layernorm.weight": ("attn_norm", lambda w: w),
    }
    if cfg.q_lora_rank:
        return plan | {
            "self_attn.q_a_proj.weight": ("wq_a", lambda w: w.T),
            "self_attn.q_a_layernorm.weight": ("q_a_norm", lambda w: w),
            "self_attn.q_b_proj.weight": ("wq_b", lambda w: q_out(w.T)),
        }
    return plan | {"self_attn.q_proj.weight": ("wq", lambda w: q_out(w.T))}


def _mlp_plan(pre: str) -> dict[str, tuple[str, Callable]]:
    """A gated MLP's [out, in] projections -> w_gate / w_up [D, F], w_down [F, D]."""
    return {f"{pre}{name}_proj.weight": (field, lambda w: w.T)
            for name, field in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down"))}


def _expert_plan(cfg: ModelConfig) -> dict[str, tuple[str, Callable]]:
    """A mixture-of-experts layer's tensors: the router [E, D] and each expert's [out, in]
    projections, stacked by expert (`field#e`: row e of the [E, ...] param); Qwen2-MoE's
    shared expert and its [1, D] gate."""
    t = lambda w: w.T  # noqa: E731
    if cfg.expert_bias:  # gpt-oss
        return _gpt_oss_expert_plan()
    if cfg.architecture.startswith("Mixtral"):  # w1 gate, w3 up, w2 down
        pre, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:  # Qwen2-MoE, Qwen3-MoE
        pre, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    plan = {f"{pre}gate.weight": ("router", t)}
    for e in range(cfg.num_experts):
        for name, field in zip(names, ("we_gate", "we_up", "we_down")):
            plan[f"{pre}experts.{e}.{name}.weight"] = (f"{field}#{e}", t)
    deepseek = cfg.router_scoring == "sigmoid"
    if deepseek:
        plan[f"{pre}gate.e_score_correction_bias"] = ("router_choice_b", lambda b: b)
    if cfg.shared_expert_size:
        plan |= _mlp_plan(f"{pre}shared_experts." if deepseek else f"{pre}shared_expert.")
    if cfg.shared_expert_gate:
        plan[f"{pre}shared_expert_gate.weight"] = ("shared_gate", lambda w: w[0])
    return plan


def _gpt_oss_expert_plan() -> dict[str, tuple[str, Callable] | list]:
    """gpt-oss's MoE block: the router [E, D] + bias [E], and every expert stacked in one tensor:
    gate_up_proj [E, D, 2F] (gate at even columns, up at odd), down_proj [E, F, D], with their
    biases [E, 2F] / [E, D]. MXFP4 checkpoints (`_blocks` + `_scales`) arrive under these names
    in this orientation (`group_mxfp4`, checkpoints/mxfp4.py MXFP4Weight), kept or decoded."""
    even, odd = (lambda w: w[..., 0::2]), (lambda w: w[..., 1::2])
    pre = "mlp.experts."
    return {
        "mlp.router.weight": ("router", lambda w: w.T),
        "mlp.router.bias": ("router_b", lambda b: b),
        pre + "gate_up_proj": [("we_gate", even), ("we_up", odd)],
        pre + "gate_up_proj_bias": [("we_gate_b", even), ("we_up_b", odd)],
        pre + "down_proj": ("we_down", lambda w: w),
        pre + "down_proj_bias": ("we_down_b", lambda b: b),
    }


def _targets(entry) -> list[tuple[str, Callable]]:
    return entry if isinstance(entry, list) else [entry]


def assemble_params(
    cfg: ModelConfig,
    tensors: Iterator[tuple[str, object, object]],
    plan: dict[str, tuple[str, Callable]],
    dtype,
    place: Callable | None = None,
) -> Params:
    """Place streamed (name, array, source) tensors into Params via `plan`. Unknown names are
    ignored only when they are known extras (rotary caches); missing ones are an error.
    `place(path, f32_array)`, if given, makes each leaf (e.g. quantizes it as it streams in);
    GGUF blocks, 4-bit HF linears and MXFP4 tensors (objects with `layout` and `dense`) arrive
    as a QuantizedArray when kept, else as the f32 weight."""
    got: dict[str, object] = {}
    for name, arr, src in tensors:
        key = _strip(name)
        if key not in plan:
            if re.search(r"rotary_emb|vision|visual|multi_modal|mm_", key):
                continue
            raise CheckpointError(f"{src}: unexpected tensor {name!r} for {cfg.architecture}")
        for target, fn in _targets(plan[key]):
            _assemble_one(got, target, fn, arr, dtype, place)
    missing = [name for name, entry in plan.items()
               if any(target not in got for target, _ in _targets(entry))]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) for {cfg.architecture}, e.g. "
            f"{missing[:3]}"
        )
    _stack_experts(got, place)
    layers = []
    fields = LayerParams.__dataclass_fields__
    for i in range(cfg.num_layers):
        kw = {f: got.pop(f"layers.{i}.{f}") for f in fields if f"layers.{i}.{f}" in got}
        layers.append(LayerParams(**(dict(wq=None, wk=None, wv=None) | kw)))  # (latent: no k / v)
    return Params(
        embed=got["embed"], layers=tuple(layers), final_norm=got["final_norm"],
        lm_head=got.get("lm_head"),
        **{k: got[k] for k in ("embed_per_layer", "ple_model_proj", "ple_proj_norm") if k in got},
    )


def _assemble_one(got: dict, target: str, fn: Callable, arr, dtype, place) -> None:
    if hasattr(arr, "layout"):  # gguf.KeptBlocks, hf_int4.Int4Linear, mxfp4.MXFP4Weight
        value = arr.layout(fn, target, dtype, jnp.float32 if place else dtype)
        if value is not None:
            got[target] = place(target, value) if place else value
            return
        arr = arr.dense()  # its groups do not fit the param's layout: dequantized
    value = fn(jnp.asarray(arr, jnp.float32))
    if "#" in target:  # one expert's slice of a stacked [E, ...] weight
        got[target] = value if place else jnp.asarray(value, dtype)
        return
    got[target] = place(target, value) if place else jnp.asarray(value, dtype)


def _stack_experts(got: dict, place: Callable | None) -> None:
    """Replace the `field#e` slices in `got` by the stacked `field` [E, ...] (placed whole)."""
    parts: dict[str, dict[int, object]] = {}
    for key in [k for k in got if "#" in k]:
        base, e = key.split("#")
        parts.setdefault(base, {})[int(e)] = got.pop(key)
    for base, by_e in parts.items():
        stacked = jnp.stack([by_e[e] for e in range(len(by_e))])
        got[base] = place(base, stacked) if place else stacked


def group_mxfp4(tensors: Iterator[tuple[str, object, object]], keep: bool = True
                ) -> Iterator[tuple[str, object, object]]:
    """The tensor stream with each MXFP4 tensor's `<name>_blocks` and `<name>_scales` replaced
    by one (`<name>`, MXFP4Weight, source) as soon as both have passed: the name of the dense
    tensor it stands for (gpt-oss's `mlp.experts.gate_up_proj`, `down_proj`). `keep` False:
    dequantized as they are placed."""
    pending: dict[str, dict[str, object]] = {}
    sources: dict[str, object] = {}
    for name, arr, src in tensors:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales"):
            yield name, arr, src
            continue
        got = pending.setdefault(base, {})
        got[part] = np.asarray(arr)
        sources[base] = src
        if len(got) == 2:
            del pending[base]
            try:
                w = MXFP4Weight(base, got["blocks"], got["scales"], keep)
            except ValueError as e:
                raise CheckpointError(f"{src}: MXFP4 tensor {base!r}: {e}") from None
            yield base, w, src
    for base, got in pending.items():
        (have,) = got
        lacks = "scales" if have == "blocks" else "blocks"
        raise CheckpointError(f"{sources[base]}: MXFP4 tensor {base!r}: {base}_{have} without "
                              f"{base}_{lacks}")


def load_hf(path: str | Path, dtype=jnp.float32, place: Callable | None = None,
            keep_int4: bool = True, keep_mxfp4: bool = True) -> tuple[ModelConfig, Params]:
    """`keep_int4`: a 4-bit checkpoint's linears (checkpoints/hf_int4.py) stay int4
    QuantizedArrays where their groups fit the param's layout; False: dequantized to f32.
    `keep_mxfp4`: an MXFP4 checkpoint's tensors (quant_method "mxfp4", gpt-oss's experts) stay
    QuantizedArrays of fmt "mxfp4" (int8 values, f32 scales: exact); False: dequantized to
    `dtype`. (quantization_config's other fields, e.g. modules_to_not_convert, are not read:
    which tensors are MXFP4 is told by their `_blocks` / `_scales` names.)"""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    hf = read_hf_json(path)
    cfg = _translate(path, hf)
    qc = hf.get("quantization_config")
    mxfp4 = isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"
    scheme = None if mxfp4 else scheme_of(hf, str(path / "config.json"))
    files = safetensor_files(path)
    tensors = iter_tensors(files)
    if mxfp4:
        tensors = group_mxfp4(tensors, keep=keep_mxfp4)
    if scheme is not None:
        tensors = group_linears(tensors, scheme, keep=keep_int4)
    params = assemble_params(cfg, tensors, hf_tensor_plan(cfg), dtype, place)
    _check_shapes(cfg, params, path)
    return cfg, params


def _is_quantized(a) -> bool:  # a runtime.device.quantization.QuantizedArray counts as one leaf
    return hasattr(a, "dequantize")


def _check_shapes(cfg: ModelConfig, params: Params, path: Path) -> None:
    from jaxinfer.runtime.device.model import init_params
    import jax

    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    for (kp, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0],
        jax.tree_util.tree_flatten_with_path(want)[0],
    ):
        if tuple(a.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: tensor {jax.tree_util.keystr(kp)} has shape {tuple(a.shape)}, "
                f"config.json implies {tuple(b.shape)}"
            )

