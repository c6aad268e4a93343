"""The engine's image side: the vision encoder run on the images a step needs, its outputs kept
in the encoder cache, and a step's given-input rows built from them.

`Images(vision, ecfg)` belongs to an engine serving a vision model (checkpoints/hf_vision.py).
`step_inputs(plan)` -> {"mm_embeds": f32 [T, D], "mm_mask": bool [T]} for a plan with image
rows (plan.mm_items): every image of the step not in the encoder cache is encoded first, all of
them in encoder calls of at most MAX_IMAGES_PER_CALL (padded to a power of two of images: few
programs), then its
embeddings go on its rows. `runs` / `encoded` count encoder calls and images encoded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.host.encoder_cache import EncoderCache
from jaxinfer.runtime.host.image_prompt import ImageSpec


# Images one encoder call takes at most: a SigLIP tower's attention scores are ~1 GiB an image
# at Gemma 3's size (16 heads x 4096 x 4096 f32 per layer)
MAX_IMAGES_PER_CALL = 4


def image_spec(vcfg) -> ImageSpec:
    """The door's view of a runtime.device.vision.VisionConfig."""
    return ImageSpec(boi_id=vcfg.boi_token_id, eoi_id=vcfg.eoi_token_id,
                     image_id=vcfg.image_token_id, tokens_per_image=vcfg.tokens_per_image,
                     image_size=vcfg.image_size, mean=tuple(vcfg.image_mean),
                     std=tuple(vcfg.image_std))


class Images:
    def __init__(self, vision, ecfg):
        from jaxinfer.runtime.device.vision import encode_images

        self.cfg, self.params = vision.cfg, vision.params
        self.spec = image_spec(vision.cfg)
        self.cache = EncoderCache(int(ecfg.mm_cache_gb * (1 << 30)))
        self._encode = jax.jit(functools.partial(encode_images, cfg=vision.cfg))
        self.runs = 0  # encoder calls
        self.encoded = 0  # images encoded

    def embeddings(self, spans) -> dict[bytes, np.ndarray]:
        """{digest: f32 [N, D]} of the spans' images, encoding those the cache lacks."""
        out, todo = {}, {}
        for im in spans:
            if im.key in out or im.key in todo:
                continue
            got = self.cache.get(im.key)
            if got is None:
                todo[im.key] = im.pixels
            else:
                out[im.key] = got
        todo_keys = list(todo)
        for i in range(0, len(todo_keys), MAX_IMAGES_PER_CALL):
            keys = todo_keys[i:i + MAX_IMAGES_PER_CALL]
            n = 1 << (len(keys) - 1).bit_length()  # a power of two of images
            pixels = np.stack([todo[k] for k in keys] + [todo[keys[0]]] * (n - len(keys)))
            emb = np.asarray(jax.device_get(self._encode(self.params, jnp.asarray(pixels))),
                             np.float32)  # [n, N, D]
            self.runs += 1
            self.encoded += len(keys)
            for k, e in zip(keys, emb):
                out[k] = e
                self.cache.put(k, e)
        return out

    def step_inputs(self, plan, hidden: int) -> dict[str, np.ndarray]:
        """The given-input rows of a plan with image rows (plan.mm_items)."""
        t = plan.token_ids.shape[0]
        embeds = np.zeros((t, hidden), np.float32)
        mask = np.zeros(t, bool)
        emb = self.embeddings([im for _, im, _, _ in plan.mm_items])
        for row, im, first, k in plan.mm_items:
            embeds[row:row + k] = emb[im.key][first:first + k]
            mask[row:row + k] = True
        return {"mm_embeds": embeds, "mm_mask": mask}

    def stats(self) -> dict:
        return dict(encoder_runs=self.runs, images_encoded=self.encoded,
                    encoder_cache_entries=len(self.cache), encoder_cache_bytes=self.cache.bytes,
                    **{f"encoder_cache_{k}": v for k, v in self.cache.stats.items()})
