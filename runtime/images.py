"""The engine's image side: the vision encoder run on the images a step needs, its outputs kept
in the encoder cache, and a step's given-input rows built from them.

`Images(vision, ecfg)` belongs to an engine serving a vision model (checkpoints/hf_vision.py's
VisionModel; its `kind` picks a KINDS row: the door's ImageSpec and the encoder). The encoder
runs where the tower's weights are: split over a mesh (tensor parallel) or on one device.
`step_inputs(plan, hidden)` -> {"mm_embeds": f32 [T, D], "mm_mask": bool [T] (+ "mm_deep": f32
[K, T, D], Qwen3-VL's deepstack inputs)} for a plan with image rows (plan.mm_items): every image
of the step not in the encoder cache is encoded first, then its outputs go on its rows. An
encoder output is f32 [1 + K, N, D]: the image tokens' inputs, then K deepstack features.
`runs` / `encoded` count encoder calls and images encoded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from jaxinfer.runtime.host.encoder_cache import EncoderCache
from jaxinfer.runtime.host.image_prompt import ImageSpec

# Images one Gemma 3 encoder call takes at most: a SigLIP tower's attention scores are ~1 GiB
# an image at Gemma 3's size (16 heads x 4096 x 4096 f32 per layer)
MAX_IMAGES_PER_CALL = 4


def _gemma3_spec(c) -> ImageSpec:
    return ImageSpec(kind="gemma3", mark="<start_of_image>", mark_id=c.boi_token_id,
                     image_id=c.image_token_id, after=(c.eoi_token_id,), around="\n\n",
                     prep=(("size", c.image_size), ("mean", tuple(c.image_mean)),
                           ("std", tuple(c.image_std)), ("tokens", c.tokens_per_image)),
                     bidirectional=True)


def _qwen3_vl_spec(c) -> ImageSpec:
    return ImageSpec(kind="qwen3_vl", mark="<|image_pad|>", mark_id=c.image_token_id,
                     image_id=c.image_token_id,
                     prep=(("patch_size", c.patch_size),
                           ("temporal_patch_size", c.temporal_patch_size),
                           ("merge_size", c.spatial_merge_size), ("mean", tuple(c.image_mean)),
                           ("std", tuple(c.image_std)), ("min_pixels", c.min_pixels),
                           ("max_pixels", c.max_pixels)),
                     mrope_merge=c.spatial_merge_size)


def _placer(params) -> Callable:
    """Host pixels -> the encoder's input, where the tower's weights are: replicated over their
    mesh when they are split over one (build.py _vision_form), else on their device."""
    where = jax.tree.leaves(params)[0].sharding
    if isinstance(where, jax.sharding.NamedSharding):
        where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
    return lambda x: jax.device_put(np.asarray(x), where)


def _gemma3_encoder(vision) -> Callable:
    """[ImageSpan] (distinct images) -> [f32 [1, N, D]]: batches of MAX_IMAGES_PER_CALL,
    padded to a power of two of images (few programs)."""
    from jaxinfer.runtime.device.vision import encode_images

    fn, put = jax.jit(functools.partial(encode_images, cfg=vision.cfg)), _placer(vision.params)

    def run(spans):
        out = []
        for i in range(0, len(spans), MAX_IMAGES_PER_CALL):
            part = spans[i:i + MAX_IMAGES_PER_CALL]
            n = 1 << (len(part) - 1).bit_length()
            px = np.stack([s.pixels for s in part] + [part[0].pixels] * (n - len(part)))
            emb = np.asarray(jax.device_get(fn(vision.params, put(px))), np.float32)
            out += [e[None] for e in emb[:len(part)]]  # [1, N, D] each
        return out, -(-len(spans) // MAX_IMAGES_PER_CALL)

    run.programs = fn._cache_size
    return run


def _qwen3_vl_encoder(vision) -> Callable:
    """[ImageSpan] -> [f32 [1 + K, N, D]]: one call an image, its patches padded to their
    bucket (qwen3_vl_vision.patch_bucket): a program a bucket, not one per image size."""
    from jaxinfer.runtime.device.qwen3_vl_vision import (encode_image_bucketed,
                                                          merge_order_coords, patch_bucket)

    cfg = vision.cfg
    fn = jax.jit(functools.partial(encode_image_bucketed, cfg=cfg))  # this engine's programs
    put = _placer(vision.params)

    def run(spans):
        out = []
        for s in spans:
            t, h, w = s.grid
            if t != 1:
                raise ValueError(f"an image's grid has one frame, got {s.grid}")
            n, b = h * w, patch_bucket(cfg, h * w)
            rows, cols = (np.asarray(a, np.int32) for a in
                          merge_order_coords(h, w, cfg.spatial_merge_size))
            pad = b - n
            emb, deep = fn(vision.params,
                           put(np.concatenate([s.pixels, np.zeros((pad, cfg.patch_dim),
                                                                  np.float32)])),
                           put(np.pad(rows, (0, pad))), put(np.pad(cols, (0, pad))),
                           put(np.arange(b) < n), put(np.array([h, w], np.int32)))
            k = n // cfg.merge_unit
            out.append(np.concatenate([np.asarray(emb, np.float32)[None, :k],
                                       np.asarray(deep, np.float32)[:, :k]]))
        return out, len(spans)

    run.programs = fn._cache_size
    return run


@dataclass(frozen=True)
class Kind:
    spec: Callable  # vision cfg -> ImageSpec
    # VisionModel -> run([ImageSpan]) -> ([f32 [1 + K, N, D]], calls); run.programs() -> the
    # encoder programs compiled
    encoder: Callable


KINDS = {"gemma3": Kind(_gemma3_spec, _gemma3_encoder),
         "qwen3_vl": Kind(_qwen3_vl_spec, _qwen3_vl_encoder)}


def image_spec(vision) -> ImageSpec:
    """The door's view of a checkpoints.hf_vision.VisionModel."""
    return KINDS[vision.kind].spec(vision.cfg)


class Images:
    def __init__(self, vision, ecfg):
        kind = KINDS[vision.kind]
        self.spec = kind.spec(vision.cfg)
        self.cache = EncoderCache(int(ecfg.mm_cache_gb * (1 << 30)))
        self._encode = kind.encoder(vision)
        self.runs = 0  # encoder calls
        self.encoded = 0  # images encoded

    def outputs(self, spans) -> dict[bytes, np.ndarray]:
        """{digest: f32 [1 + K, N, D]} of the spans' images, encoding those the cache lacks."""
        out, todo = {}, {}
        for im in spans:
            if im.key in out or im.key in todo:
                continue
            got = self.cache.get(im.key)
            if got is None:
                todo[im.key] = im
            else:
                out[im.key] = got
        if todo:
            got, calls = self._encode(list(todo.values()))
            self.runs += calls
            self.encoded += len(todo)
            for k, e in zip(todo, got):
                out[k] = e
                self.cache.put(k, e)
        return out

    def step_inputs(self, plan, hidden: int) -> dict[str, np.ndarray]:
        """The given-input rows of a plan with image rows (plan.mm_items)."""
        t = plan.token_ids.shape[0]
        outs = self.outputs([im for _, im, _, _ in plan.mm_items])
        depth = next(iter(outs.values())).shape[0]  # 1 + K
        given = np.zeros((depth, t, hidden), np.float32)
        mask = np.zeros(t, bool)
        for row, im, first, k in plan.mm_items:
            given[:, row:row + k] = outs[im.key][:, first:first + k]
            mask[row:row + k] = True
        arrays = {"mm_embeds": given[0], "mm_mask": mask}
        if depth > 1:
            arrays["mm_deep"] = given[1:]
        return arrays

    def stats(self) -> dict:
        return dict(encoder_runs=self.runs, images_encoded=self.encoded,
                    encoder_cache_entries=len(self.cache), encoder_cache_bytes=self.cache.bytes,
                    **{f"encoder_cache_{k}": v for k, v in self.cache.stats.items()})
