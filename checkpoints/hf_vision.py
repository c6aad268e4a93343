"""Load the image side of an HF vision-language checkpoint (config.json's `vision_config`: the
vision tower and the projector into the text model) as VisionParams.

`load_hf_vision(path)` -> VisionModel, or None for a text-only checkpoint. The text model is
loaded apart (checkpoints/hf.py skips these tensors). Supported vision configs, by the
checkpoint's model_type: `_FAMILIES`.

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
from jaxinfer.runtime.device.vision import (VisionConfig, VisionLayerParams, VisionParams,
                                            init_vision_params)


@dataclass(frozen=True)
class VisionModel:
    cfg: VisionConfig
    params: VisionParams


@dataclass(frozen=True)
class _Family:
    tower: str  # vision_config's model_type (the default where it names none, as HF's)
    config: Callable[[dict, str, tuple, tuple], VisionConfig]  # (hf, source, mean, std)
    name: Callable[[str], str | None]  # checkpoint name -> plan key (None: not ours)
    plan: Callable[[VisionConfig], dict[str, tuple[str, Callable]]]  # key -> (target, fn)


# --------------------------------------------------------------------------- Gemma 3


# HF's defaults where a config.json leaves a field out (SiglipVisionConfig, Gemma3TextConfig)
_SIGLIP_DEFAULTS = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, intermediate_size=3072, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh", num_channels=3)


def _gemma3_config(hf: dict, source: str, mean: tuple, std: tuple) -> VisionConfig:
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


# model_type of config.json -> how its vision side loads (its tower's model_type must match)
_FAMILIES: dict[str, _Family] = {
    "gemma3": _Family(tower="siglip_vision_model", config=_gemma3_config, name=_gemma3_name,
                      plan=_gemma3_plan),
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
    if family is None or tower != family.tower:
        known = ", ".join(f"{k} ({f.tower})" for k, f in sorted(_FAMILIES.items()))
        raise CheckpointError(
            f"{source}: unsupported vision model: model_type {hf.get('model_type')!r} with "
            f"vision_config.model_type {tower!r} (supported: {known})")
    mean, std = _mean_std(path)
    try:
        cfg = family.config(hf, source, mean, std)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:  # a field of the wrong type; sizes that do not fit
        raise CheckpointError(f"{source}: vision_config: {e}") from None
    params = _assemble(cfg, family, _tensors(safetensor_files(path), family), dtype, path)
    return VisionModel(cfg=cfg, params=params)


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


def _assemble(cfg: VisionConfig, family: _Family, tensors, dtype, path: Path) -> VisionParams:
    plan = family.plan(cfg)
    got: dict[str, jax.Array] = {}
    for key, name, arr, src in tensors:
        if key not in plan:
            if key.startswith("vision_tower.head."):  # SigLIP's pooling head: unused
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
    fields = VisionLayerParams.__dataclass_fields__
    layers = tuple(VisionLayerParams(**{f: got.pop(f"layers.{i}.{f}") for f in fields})
                   for i in range(cfg.num_layers))
    params = VisionParams(layers=layers, **got)
    _check_shapes(cfg, params, path)
    return params


def _check_shapes(cfg: VisionConfig, params: VisionParams, path: Path) -> None:
    want = jax.eval_shape(lambda: init_vision_params(cfg, jax.random.key(0)))
    for (kp, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree_util.tree_flatten_with_path(want)[0]):
        if tuple(a.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: vision tensor {jax.tree_util.keystr(kp)} has shape {tuple(a.shape)}, "
                f"config.json implies {tuple(b.shape)}")


def _mean_std(path: Path) -> tuple[tuple, tuple]:
    """image_mean / image_std of preprocessor_config.json (or processor_config.json's
    image_processor) when the dir has one, else 0.5s."""
    default = (0.5, 0.5, 0.5)
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
        return (_three(obj.get("image_mean", default), f, "image_mean"),
                _three(obj.get("image_std", default), f, "image_std"))
    return default, default


def _three(v, f: Path, field: str) -> tuple[float, float, float]:
    vals = [v] * 3 if isinstance(v, (int, float)) else v
    try:
        out = tuple(float(x) for x in vals)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or (field == "image_std" and min(out) <= 0):
        raise CheckpointError(f"{f}: {field} must be 3 numbers (std > 0), got {v!r}")
    return out

