"""Load llama.cpp's `mmproj` GGUF — the vision tower + projector of a vision-language model that
llama.cpp users keep beside the text model's GGUF (its `clip` format) — as a VisionModel.

`load_gguf_mmproj(path, token_ids, dtype)` -> VisionModel(kind "gemma3") for a file whose
projector type is one of SUPPORTED_PROJECTORS. The image token ids are not in the file: the text
model's tokenizer supplies them (TOKEN_PIECES).

Facts about the format this relies on (llama.cpp's convert_hf_to_gguf.py, MmprojModel and
Gemma3VisionModel, and tools/mtmd: clip.cpp's hparams, models/siglip.cpp's gemma3 graph; checked
numerically against HF transformers in tests/checkpoints/test_gguf_mmproj.py):
- general.architecture "clip"; clip.has_vision_encoder true; the projector type in
  clip.projector_type (clip.vision.projector_type in files with several encoders).
- The tower's sizes under clip.vision.*: image_size, patch_size, embedding_length (Dv),
  feed_forward_length (F), block_count, attention.head_count, attention.layer_norm_epsilon (the
  SigLIP LayerNorms' and the projector RMSNorm's eps), image_mean / image_std, projection_dim
  (the text width); clip.use_gelu true (SigLIP's tanh GELU).
- Every tensor is HF's, unchanged, in numpy (reversed-ne) shape = torch's: linear weights
  [out, in], the patch conv [Dv, 3, P, P], position embeddings [T, Dv];
  mm.input_projection.weight is HF's mm_input_projection_weight, already [in, out] = [Dv, D]
  (clip.cpp transposes it before its matmul); mm.soft_emb_norm.weight holds Gemma's `1 + w`
  (the converter adds the 1): the effective multiplier, as VisionParams.mm_norm.
- Gemma 3's soft tokens: the patch grid average-pooled in n_merge x n_merge windows, n_merge = 4
  (clip.cpp's fixed value for gemma3: 896 / 14 = 64 patches a side -> 16 -> 256 tokens) unless
  clip.vision.projector.scale_factor says otherwise (the converter writes it only when it is not
  4: tiny test models).
- The converter stores the projection as F16 whatever the output type, the patch and position
  embeddings and every 1-D tensor as F32, the rest in the output type (F32 / F16 / BF16 / Q8_0):
  every type the gguf package dequantizes is read, to `dtype`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.gguf import _dequantize, _f32_decimal, _Meta, open_gguf
from jaxinfer.checkpoints.hf_vision import VisionModel, gemma3_params
from jaxinfer.runtime.device.vision import VisionConfig

SUPPORTED_PROJECTORS = ("gemma3",)
# token_ids key -> the text model's token (Gemma 3's vocabulary)
TOKEN_PIECES = {"image": "<image_soft_token>", "boi": "<start_of_image>",
                "eoi": "<end_of_image>"}
GEMMA3_MERGE = 4  # clip.cpp: gemma3's pooling window per side unless the file says otherwise

_CLIP_ARCH = "clip"
_V = "clip.vision."


def load_gguf_mmproj(path: str | os.PathLike, token_ids: dict, dtype=jnp.float32) -> VisionModel:
    """The vision tower + projector in llama.cpp's mmproj GGUF `path`, in `dtype`. `token_ids`:
    {"image", "boi", "eoi"} -> the text model's ids of TOKEN_PIECES. CheckpointError naming the
    file for anything it cannot load (not a GGUF, not an mmproj, another projector type, missing
    keys or tensors, shapes that disagree with the metadata)."""
    path = Path(path)
    source = str(path)
    reader = open_gguf(path)
    m = _Meta(reader, source)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(m, tensors, _ids(token_ids))
    plan = _plan(cfg)
    unexpected = sorted(set(tensors) - set(plan))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) for projector type 'gemma3': "
                              f"{unexpected[:5]}")
    missing = [name for name in plan if name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: the mmproj file lacks {len(missing)} tensor(s) its "
                              f"metadata calls for, e.g. {missing[:3]}")
    got = {}
    for name, (target, shape, fn) in plan.items():
        t = tensors[name]
        stored = tuple(int(x) for x in reversed(t.shape.tolist()))
        if stored != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {stored} (numpy order), "
                                  f"the metadata implies {shape}")
        got[target] = jnp.asarray(fn(_dequantize(t, source)), dtype)
        reader.release(t)
    return VisionModel(cfg=cfg, params=gemma3_params(cfg, got), kind="gemma3")


def _ids(token_ids: dict) -> dict:
    missing = [k for k in TOKEN_PIECES if not isinstance(token_ids.get(k), int)]
    if missing:
        raise ValueError(f"token_ids needs integer ids for {missing} "
                         f"({', '.join(TOKEN_PIECES[k] for k in missing)})")
    return {f"{k}_token_id": int(token_ids[k]) for k in TOKEN_PIECES}


def _config(m: _Meta, tensors: dict, ids: dict) -> VisionConfig:
    src = m.source
    arch = m.get("general.architecture")
    if arch != _CLIP_ARCH:
        raise CheckpointError(f"{src}: no clip metadata (general.architecture {arch!r}, expected "
                              f"{_CLIP_ARCH!r}): not a llama.cpp mmproj file")
    if not m.boolean("clip.has_vision_encoder", False):
        raise CheckpointError(f"{src}: the mmproj file holds no vision encoder "
                              "(clip.has_vision_encoder is not true)")
    proj = m.get(_V + "projector_type", m.get("clip.projector_type"))
    if proj is None:
        raise CheckpointError(f"{src}: GGUF metadata key 'clip.projector_type' is missing")
    if proj not in SUPPORTED_PROJECTORS:
        raise CheckpointError(f"{src}: projector type {proj!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_PROJECTORS)})")
    if not m.boolean("clip.use_gelu") or m.boolean("clip.use_silu", False):
        raise CheckpointError(f"{src}: the tower's activation must be GELU (clip.use_gelu true, "
                              "clip.use_silu not true)")
    size = m.integer(_V + "image_size", least=1)
    patch = m.integer(_V + "patch_size", least=1)
    merge = m.integer(_V + "projector.scale_factor", GEMMA3_MERGE, least=1)
    eps = m.number(_V + "attention.layer_norm_epsilon")
    per_side = size // patch
    if size % patch or per_side % merge:
        raise CheckpointError(f"{src}: image_size {size} / patch_size {patch} patches a side do "
                              f"not pool evenly in windows of {merge} (projector.scale_factor)")
    proj_w = tensors.get("mm.input_projection.weight")
    if proj_w is None:
        raise CheckpointError(f"{src}: the mmproj file lacks 'mm.input_projection.weight'")
    if len(proj_w.shape) != 2:
        raise CheckpointError(f"{src}: tensor 'mm.input_projection.weight' has ne "
                              f"{proj_w.shape.tolist()}, expected 2 dims [text width, Dv]")
    text = int(proj_w.shape[0])  # numpy [Dv, D]: ne [D, Dv]
    dim = m.integer(_V + "projection_dim", text)
    if dim != text:
        raise CheckpointError(f"{src}: clip.vision.projection_dim {dim} disagrees with "
                              f"mm.input_projection.weight's text width {text}")
    try:
        return VisionConfig(
            image_size=size, patch_size=patch,
            hidden_size=m.integer(_V + "embedding_length", least=1),
            num_layers=m.integer(_V + "block_count", least=1),
            num_heads=m.integer(_V + "attention.head_count", least=1),
            intermediate_size=m.integer(_V + "feed_forward_length", least=1),
            layer_norm_eps=eps, tokens_per_image=(per_side // merge) ** 2,
            text_hidden_size=text, mm_norm_eps=eps,  # clip.cpp: the RMSNorm's eps is hparams.eps
            image_mean=_three(m, "image_mean"), image_std=_three(m, "image_std"), **ids)
    except ValueError as e:  # sizes that do not divide (heads)
        raise CheckpointError(f"{src}: {e}") from None


def _three(m: _Meta, field: str) -> tuple[float, float, float]:
    v = m.get(_V + field, [0.5, 0.5, 0.5])  # Gemma 3's processor's values where it is absent
    ok = (isinstance(v, list) and len(v) == 3
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))
    if not ok or (field == "image_std" and min(v) <= 0):
        raise CheckpointError(f"{m.source}: GGUF metadata key {_V + field!r} must hold 3 numbers "
                              f"(std > 0), got {v!r}")
    return tuple(_f32_decimal(float(x)) for x in v)


def _plan(cfg: VisionConfig) -> dict[str, tuple[str, tuple, Callable]]:
    """GGUF name -> (VisionParams path, the stored numpy shape, stored -> our layout)."""
    d, h, dh, p, f = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.patch_size,
                      cfg.intermediate_size)
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731  [out, in] -> [in, out]
    heads_in = lambda w: w.T.reshape(d, h, dh)  # noqa: E731  [H*Dh, Dv] -> [Dv, H, Dh]
    heads_b = lambda b: b.reshape(h, dh)  # noqa: E731
    vec = (d,)
    plan = {
        # conv [Dv, C, py, px] -> [py, px, C, Dv] -> [P*P*3, Dv] (patchify's order)
        "v.patch_embd.weight": ("patch_w", (d, 3, p, p),
                                lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * 3, d)),
        "v.patch_embd.bias": ("patch_b", vec, same),
        "v.position_embd.weight": ("pos", (cfg.num_patches, d), same),
        "v.post_ln.weight": ("post_ln_w", vec, same),
        "v.post_ln.bias": ("post_ln_b", vec, same),
        "mm.soft_emb_norm.weight": ("mm_norm", vec, same),  # stored as 1 + w
        "mm.input_projection.weight": ("mm_proj", (d, cfg.text_hidden_size), same),  # [in, out]
    }
    for i in range(cfg.num_layers):
        b, to = f"v.blk.{i}.", f"layers.{i}."
        plan |= {
            b + "ln1.weight": (to + "ln1_w", vec, same),
            b + "ln1.bias": (to + "ln1_b", vec, same),
            b + "ln2.weight": (to + "ln2_w", vec, same),
            b + "ln2.bias": (to + "ln2_b", vec, same),
            b + "attn_q.weight": (to + "wq", (d, d), heads_in),
            b + "attn_q.bias": (to + "bq", vec, heads_b),
            b + "attn_k.weight": (to + "wk", (d, d), heads_in),
            b + "attn_k.bias": (to + "bk", vec, heads_b),
            b + "attn_v.weight": (to + "wv", (d, d), heads_in),
            b + "attn_v.bias": (to + "bv", vec, heads_b),
            b + "attn_out.weight": (to + "wo", (d, d), lambda w: w.T.reshape(h, dh, d)),
            b + "attn_out.bias": (to + "bo", vec, same),
            b + "ffn_up.weight": (to + "fc1", (f, d), t),
            b + "ffn_up.bias": (to + "fc1_b", (f,), same),
            b + "ffn_down.weight": (to + "fc2", (d, f), t),
            b + "ffn_down.bias": (to + "fc2_b", vec, same),
        }
    return plan

