"""Load the image side of an HF vision-language checkpoint (config.json's `vision_config`: the
vision tower and the projector into the text model) as VisionParams.

`load_hf_vision(path)` -> VisionModel, or None for a text-only checkpoint. The text model is
loaded apart (checkpoints/hf.py skips these tensors). Supported vision configs, by the
checkpoint's model_type: `_FAMILIES`. VisionModel.kind says which encoder the params are for:

  "gemma3"    runtime/device/vision.py           VisionConfig / VisionParams
  "qwen3_vl"  runtime/device/qwen3_vl_vision.py  Qwen3VLVisionConfig / Qwen3VLVisionParams

Gemma 3 tensor names, after an optional leading "model." (transformers >= 4.52 nests the towers
under it) and, in the tower, an optional "vision_model." (the hub's checkpoints; transformers 5
saves without it):

  vision_tower.embeddings.patch_embedding.weight [Dv, 3, P, P]   -> patch_w [P*P*3, Dv]
  vision_tower.embeddings.patch_embedding.bias / position_embedding.weight [T, Dv]
  vision_tower.encoder.layers.{i}.{layer_norm1,layer_norm2}.{weight,bias}
  vision_tower.encoder.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}   (torch [out, in])
  vision_tower.encoder.layers.{i}.mlp.{fc1,fc2}.{weight,bias}
  vision_tower.post_layernorm.{weight,bias}
  multi_modal_projector.mm_soft_emb_norm.weight [Dv]    -> mm_norm = 1 + w
  multi_modal_projector.mm_input_projection_weight [Dv, D]  (already [in, out])

Qwen3-VL tensor names, after an optional leading "model." (torch [out, in] linears):

  visual.patch_embed.proj.weight [D, C, T, P, P] (a Conv3d) -> patch_w [C*T*P*P, D]; .bias
  visual.pos_embed.weight [G*G, D]                           -> pos
  visual.blocks.{i}.norm1 / norm2.{weight,bias}              -> ln1_* / ln2_*
  visual.blocks.{i}.attn.qkv.weight [3*D, D]                 -> wqkv [D, 3, H, Dh]; .bias
  visual.blocks.{i}.attn.proj.{weight,bias}                  -> wo [H, Dh, D], bo
  visual.blocks.{i}.mlp.linear_fc1 / linear_fc2.{weight,bias}
  visual.merger.{norm,linear_fc1,linear_fc2}.{weight,bias}   -> merger (norm over D)
  visual.deepstack_merger_list.{j}.{norm,linear_fc1,linear_fc2}.{weight,bias}
                                                             -> deepstack[j] (norm over m*m*D)

The image-processing fields (image_mean / image_std; Qwen's size.shortest_edge / longest_edge
as min / max pixels, resample) come from preprocessor_config.json (or processor_config.json's
image_processor); where there is none, HF's processor defaults.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoints.errors import CheckpointError, read_json_object
from jaxinfer.checkpoints.hf import read_hf_json, safetensor_files
from jaxinfer.runtime.device.qwen3_vl_vision import (Qwen3VLBlockParams, Qwen3VLMergerParams,
                                                     Qwen3VLVisionConfig, Qwen3VLVisionParams,
                                                     init_qwen3_vl_vision_params)
from jaxinfer.runtime.device.vision import (VisionConfig, VisionLayerParams, VisionParams,
                                            init_vision_params)

_HALVES = (0.5, 0.5, 0.5)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD: HF's defaults for
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # the Qwen2-VL image processor


@dataclass(frozen=True)
class VisionModel:
    cfg: VisionConfig | Qwen3VLVisionConfig
    params: VisionParams | Qwen3VLVisionParams
    kind: str = "gemma3"  # which encoder: "gemma3" (vision.py), "qwen3_vl" (qwen3_vl_vision.py)


@dataclass(frozen=True)
class _Family:
    kind: str  # VisionModel.kind
    tower: str  # vision_config's model_type (the default where it names none, as HF's)
    # (hf, source, mean, std, image processor dict ({} without one), its file) -> config
    config: Callable[[dict, str, tuple, tuple, dict, Path | None], object]
    name: Callable[[str], str | None]  # checkpoint name -> plan key (None: not ours)
    plan: Callable[[object], dict[str, tuple[str, Callable]]]  # key -> (target, fn)
    build: Callable[[object, dict], object]  # (cfg, target -> array) -> params
    init: Callable[[object, jax.Array], object]  # (cfg, key) -> random params (shapes)
    mean_std: tuple[tuple, tuple] = (_HALVES, _HALVES)  # without a preprocessor config
    tower_aliases: tuple[str, ...] = ()  # other vision_config model_types HF maps to `tower`
    ignore: tuple[str, ...] = ()  # plan-key prefixes of tensors that are not used


# --------------------------------------------------------------------------- Gemma 3


# HF's defaults where a config.json leaves a field out (SiglipVisionConfig, Gemma3TextConfig)
_SIGLIP_DEFAULTS = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, intermediate_size=3072, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh", num_channels=3)


def _gemma3_config(hf: dict, source: str, mean: tuple, std: tuple, pre: dict,
                   pre_file: Path | None) -> VisionConfig:
    vc = _SIGLIP_DEFAULTS | hf["vision_config"]
    if vc["hidden_act"] != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: vision_config.hidden_act {vc['hidden_act']!r} is not "
                              "supported (gelu_pytorch_tanh only)")
    if int(vc["num_channels"]) != 3:
        raise CheckpointError(f"{source}: vision_config.num_channels must be 3")
    eps = float(vc["layer_norm_eps"])
    return VisionConfig(
        image_size=int(vc["image_size"]), patch_size=int(vc["patch_size"]),
        hidden_size=int(vc["hidden_size"]), num_layers=int(vc["num_hidden_layers"]),
        num_heads=int(vc["num_attention_heads"]), intermediate_size=int(vc["intermediate_size"]),
        layer_norm_eps=eps,
        tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        text_hidden_size=int((hf.get("text_config") or {}).get("hidden_size", 2304)),
        mm_norm_eps=eps,  # HF builds mm_soft_emb_norm with vision_config.layer_norm_eps
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262_144))),
        boi_token_id=int(hf.get("boi_token_index", hf.get("boi_token_id", 255_999))),
        eoi_token_id=int(hf.get("eoi_token_index", hf.get("eoi_token_id", 256_000))),
        image_mean=mean, image_std=std,
    )


_GEMMA3_NAME = re.compile(
    r"^(?:model\.)?(?:(vision_tower)\.(?:vision_model\.)?|(multi_modal_projector)\.)(.+)$")


def _gemma3_name(name: str) -> str | None:
    m = _GEMMA3_NAME.match(name)
    return None if m is None else f"{m[1] or m[2]}.{m[3]}"


def _gemma3_plan(cfg: VisionConfig) -> dict[str, tuple[str, Callable]]:
    d, h, dh, p = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.patch_size
    same = lambda w: w  # noqa: E731
    heads_in = lambda w: w.T.reshape(d, h, dh)  # noqa: E731  [H*Dh, Dv] -> [Dv, H, Dh]
    heads_b = lambda b: b.reshape(h, dh)  # noqa: E731
    plan = {
        # [Dv, C, py, px] -> [py, px, C, Dv] -> [P*P*3, Dv] (patchify's order)
        "vision_tower.embeddings.patch_embedding.weight":
            ("patch_w", lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * 3, d)),
        "vision_tower.embeddings.patch_embedding.bias": ("patch_b", same),
        "vision_tower.embeddings.position_embedding.weight": ("pos", same),
        "vision_tower.post_layernorm.weight": ("post_ln_w", same),
        "vision_tower.post_layernorm.bias": ("post_ln_b", same),
        "multi_modal_projector.mm_soft_emb_norm.weight": ("mm_norm", lambda w: 1.0 + w),
        "multi_modal_projector.mm_input_projection_weight": ("mm_proj", same),
    }
    for i in range(cfg.num_layers):
        pre, to = f"vision_tower.encoder.layers.{i}.", f"layers.{i}."
        plan |= {
            pre + "layer_norm1.weight": (to + "ln1_w", same),
            pre + "layer_norm1.bias": (to + "ln1_b", same),
            pre + "layer_norm2.weight": (to + "ln2_w", same),
            pre + "layer_norm2.bias": (to + "ln2_b", same),
            pre + "self_attn.q_proj.weight": (to + "wq", heads_in),
            pre + "self_attn.q_proj.bias": (to + "bq", heads_b),
            pre + "self_attn.k_proj.weight": (to + "wk", heads_in),
            pre + "self_attn.k_proj.bias": (to + "bk", heads_b),
            pre + "self_attn.v_proj.weight": (to + "wv", heads_in),
            pre + "self_attn.v_proj.bias": (to + "bv", heads_b),
            # [Dv, H*Dh] -> [H, Dh, Dv]
            pre + "self_attn.out_proj.weight": (to + "wo", lambda w: w.T.reshape(h, dh, d)),
            pre + "self_attn.out_proj.bias": (to + "bo", same),
            pre + "mlp.fc1.weight": (to + "fc1", lambda w: w.T),
            pre + "mlp.fc1.bias": (to + "fc1_b", same),
            pre + "mlp.fc2.weight": (to + "fc2", lambda w: w.T),
            pre + "mlp.fc2.bias": (to + "fc2_b", same),
        }
    return plan


def gemma3_params(cfg: VisionConfig, got: dict) -> VisionParams:
    """VisionParams from {our param path: array} (the HF and mmproj loaders' plans' targets)."""
    fields = VisionLayerParams.__dataclass_fields__
    layers = tuple(VisionLayerParams(**{f: got.pop(f"layers.{i}.{f}") for f in fields})
                   for i in range(cfg.num_layers))
    return VisionParams(layers=layers, **got)


# --------------------------------------------------------------------------- Qwen3-VL


# HF's defaults where a config.json leaves a field out (Qwen3VLVisionConfig, Qwen3VLConfig)
_QWEN3_VL_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                          intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                          num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
_QWEN3_VL_IDS = dict(image_token_id=151_655, video_token_id=151_656,
                     vision_start_token_id=151_652, vision_end_token_id=151_653)
_QWEN_MIN_PIXELS, _QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2-VL processor's defaults


def _qwen3_vl_config(hf: dict, source: str, mean: tuple, std: tuple, pre: dict,
                     pre_file: Path | None) -> Qwen3VLVisionConfig:
    vc = _QWEN3_VL_DEFAULTS | hf["vision_config"]
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise CheckpointError(f"{source}: vision_config.rope_parameters.rope_type "
                              f"{rope['rope_type']!r} is not supported (axial only)")
    for field, ours in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                        ("temporal_patch_size", "temporal_patch_size")):
        if field in pre and int(pre[field]) != int(vc[ours]):
            raise CheckpointError(f"{pre_file}: {field} {pre[field]} disagrees with "
                                  f"{source}'s vision_config.{ours} {vc[ours]}")
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    # HF: min_pixels / max_pixels given beside `size` override its shortest / longest_edge
    min_px = pre.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
    max_px = pre.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
    ids = {k: int(hf.get(k, v)) for k, v in _QWEN3_VL_IDS.items()}
    return Qwen3VLVisionConfig(
        depth=int(vc["depth"]), hidden_size=int(vc["hidden_size"]),
        num_heads=int(vc["num_heads"]), intermediate_size=int(vc["intermediate_size"]),
        patch_size=int(vc["patch_size"]), temporal_patch_size=int(vc["temporal_patch_size"]),
        spatial_merge_size=int(vc["spatial_merge_size"]), in_channels=int(vc["in_channels"]),
        out_hidden_size=int(vc["out_hidden_size"]),
        num_position_embeddings=int(vc["num_position_embeddings"]),
        deepstack_visual_indexes=tuple(int(i) for i in vc["deepstack_visual_indexes"]),
        hidden_act=str(vc["hidden_act"]),
        rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", 10_000.0))),
        image_mean=mean, image_std=std,
        min_pixels=int(_QWEN_MIN_PIXELS if min_px is None else min_px),
        max_pixels=int(_QWEN_MAX_PIXELS if max_px is None else max_px),
        resample=int(pre.get("resample", 3)), **ids,
    )


_QWEN3_VL_NAME = re.compile(r"^(?:model\.)?visual\.(.+)$")


def _qwen3_vl_name(name: str) -> str | None:
    m = _QWEN3_VL_NAME.match(name)
    return None if m is None else m[1]


def _qwen3_vl_plan(cfg: Qwen3VLVisionConfig) -> dict[str, tuple[str, Callable]]:
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731  torch [out, in] -> [in, out]
    plan = {
        # Conv3d [D, C, T, P, P] -> [C*T*P*P, D]: rows in the processor's (C, T, py, px) order
        "patch_embed.proj.weight": ("patch_w", lambda w: w.reshape(d, -1).T),
        "patch_embed.proj.bias": ("patch_b", same),
        "pos_embed.weight": ("pos", same),
    }
    for i in range(cfg.depth):
        pre, to = f"blocks.{i}.", f"blocks.{i}."
        plan |= {
            pre + "norm1.weight": (to + "ln1_w", same),
            pre + "norm1.bias": (to + "ln1_b", same),
            pre + "norm2.weight": (to + "ln2_w", same),
            pre + "norm2.bias": (to + "ln2_b", same),
            # [3*H*Dh, D] -> [D, 3, H, Dh] (HF reshapes qkv's output as (3, H, Dh))
            pre + "attn.qkv.weight": (to + "wqkv", lambda w: w.T.reshape(d, 3, h, dh)),
            pre + "attn.qkv.bias": (to + "bqkv", lambda b: b.reshape(3, h, dh)),
            pre + "attn.proj.weight": (to + "wo", lambda w: w.T.reshape(h, dh, d)),
            pre + "attn.proj.bias": (to + "bo", same),
            pre + "mlp.linear_fc1.weight": (to + "fc1", t),
            pre + "mlp.linear_fc1.bias": (to + "fc1_b", same),
            pre + "mlp.linear_fc2.weight": (to + "fc2", t),
            pre + "mlp.linear_fc2.bias": (to + "fc2_b", same),
        }
    mergers = [("merger.", "merger.")] + [(f"deepstack_merger_list.{j}.", f"deepstack.{j}.")
                                          for j in range(len(cfg.deepstack_visual_indexes))]
    for pre, to in mergers:
        plan |= {
            pre + "norm.weight": (to + "norm_w", same),
            pre + "norm.bias": (to + "norm_b", same),
            pre + "linear_fc1.weight": (to + "fc1", t),
            pre + "linear_fc1.bias": (to + "fc1_b", same),
            pre + "linear_fc2.weight": (to + "fc2", t),
            pre + "linear_fc2.bias": (to + "fc2_b", same),
        }
    return plan


def _qwen3_vl_build(cfg: Qwen3VLVisionConfig, got: dict) -> Qwen3VLVisionParams:
    def take(cls, prefix):
        return cls(**{f: got.pop(prefix + f) for f in cls.__dataclass_fields__})

    blocks = tuple(take(Qwen3VLBlockParams, f"blocks.{i}.") for i in range(cfg.depth))
    merger = take(Qwen3VLMergerParams, "merger.")
    deepstack = tuple(take(Qwen3VLMergerParams, f"deepstack.{j}.")
                      for j in range(len(cfg.deepstack_visual_indexes)))
    return Qwen3VLVisionParams(blocks=blocks, merger=merger, deepstack=deepstack, **got)


# model_type of config.json -> how its vision side loads (its tower's model_type must match)
_FAMILIES: dict[str, _Family] = {
    "gemma3": _Family(kind="gemma3", tower="siglip_vision_model", config=_gemma3_config,
                      name=_gemma3_name, plan=_gemma3_plan, build=gemma3_params,
                      init=init_vision_params, ignore=("vision_tower.head.",)),
    # Qwen3-VL checkpoints of transformers < 5 name the tower "qwen3_vl" (HF renames it)
    "qwen3_vl": _Family(kind="qwen3_vl", tower="qwen3_vl_vision", config=_qwen3_vl_config,
                        name=_qwen3_vl_name, plan=_qwen3_vl_plan, build=_qwen3_vl_build,
                        init=init_qwen3_vl_vision_params, mean_std=(_CLIP_MEAN, _CLIP_STD),
                        tower_aliases=("qwen3_vl",)),
}


# --------------------------------------------------------------------------- loading


def load_hf_vision(path: Path, dtype=jnp.float32) -> VisionModel | None:
    """The vision tower + projector of the HF checkpoint dir `path` in `dtype`; None when its
    config.json has no vision_config (a text-only checkpoint)."""
    path = Path(path)
    hf = read_hf_json(path)
    source = str(path / "config.json")
    if not isinstance(hf.get("vision_config"), dict):
        return None
    family = _FAMILIES.get(hf.get("model_type"))
    tower = hf["vision_config"].get("model_type", family and family.tower)
    if family is None or tower not in (family.tower, *family.tower_aliases):
        known = ", ".join(f"{k} ({f.tower})" for k, f in sorted(_FAMILIES.items()))
        raise CheckpointError(
            f"{source}: unsupported vision model: model_type {hf.get('model_type')!r} with "
            f"vision_config.model_type {tower!r} (supported: {known})")
    pre, pre_file = _image_processor(path)
    mean, std = _mean_std(pre, pre_file, family.mean_std)
    try:
        cfg = family.config(hf, source, mean, std, pre, pre_file)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:  # a field of the wrong type; sizes that do not fit
        raise CheckpointError(f"{source}: vision_config: {e}") from None
    params = _assemble(cfg, family, _tensors(safetensor_files(path), family), dtype, path)
    return VisionModel(cfg=cfg, params=params, kind=family.kind)


def _tensors(files: list[Path], family: _Family):
    """(plan key, name, array, file) for the vision tensors only, one at a time: the text
    model's are never read (checkpoints.hf.iter_tensors reads every tensor: a 27B model's 54 GB
    for a 0.8 GB tower)."""
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as st:
                for name in st.keys():
                    key = family.name(name)
                    if key is not None:
                        yield key, name, st.get_tensor(name), f
        except SafetensorError as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read ({e})") from None


def _assemble(cfg, family: _Family, tensors, dtype, path: Path):
    plan = family.plan(cfg)
    got: dict[str, jax.Array] = {}
    for key, name, arr, src in tensors:
        if key not in plan:
            if key.startswith(family.ignore):  # e.g. SigLIP's pooling head: unused
                continue
            raise CheckpointError(f"{src}: unexpected vision tensor {name!r}")
        target, fn = plan[key]
        try:
            got[target] = jnp.asarray(fn(jnp.asarray(arr, jnp.float32)), dtype)
        except (ValueError, TypeError):  # its size does not divide into the config's heads
            raise CheckpointError(f"{src}: tensor {name!r} of shape {tuple(arr.shape)} does not "
                                  f"fit {path / 'config.json'}'s vision_config") from None
    missing = [k for k, (target, _) in plan.items() if target not in got]
    if missing:
        raise CheckpointError(f"{path}: the safetensors files lack {len(missing)} vision "
                              f"tensor(s) that config.json's vision_config calls for, e.g. "
                              f"{missing[:3]}")
    params = family.build(cfg, got)
    _check_shapes(cfg, params, family.init, path)
    return params


def _check_shapes(cfg, params, init: Callable, path: Path) -> None:
    want = jax.eval_shape(lambda: init(cfg, jax.random.key(0)))
    for (kp, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree_util.tree_flatten_with_path(want)[0]):
        if tuple(a.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: vision tensor {jax.tree_util.keystr(kp)} has shape {tuple(a.shape)}, "
                f"config.json implies {tuple(b.shape)}")


def _image_processor(path: Path) -> tuple[dict, Path | None]:
    """The image processor's settings: preprocessor_config.json, or processor_config.json's
    image_processor, with the file they came from; ({}, None) when the dir has neither."""
    for fname, sub in (("preprocessor_config.json", None),
                       ("processor_config.json", "image_processor")):
        f = path / fname
        if not f.is_file():
            continue
        obj = read_json_object(f, "the image preprocessing")
        if sub is not None:
            obj = obj.get(sub)
            if not isinstance(obj, dict):
                continue
        return obj, f
    return {}, None


def _mean_std(pre: dict, f: Path | None, default: tuple[tuple, tuple]) -> tuple[tuple, tuple]:
    """image_mean / image_std of the image processor's settings; `default` (mean, std), the
    family's processor's defaults, for those it leaves out (or when the dir has none)."""
    if f is None:
        return default
    return (_three(pre.get("image_mean", default[0]), f, "image_mean"),
            _three(pre.get("image_std", default[1]), f, "image_std"))


def _three(v, f: Path, field: str) -> tuple[float, float, float]:
    vals = [v] * 3 if isinstance(v, (int, float)) else v
    try:
        out = tuple(float(x) for x in vals)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or (field == "image_std" and min(out) <= 0):
        raise CheckpointError(f"{f}: {field} must be 3 numbers (std > 0), got {v!r}")
    return out

