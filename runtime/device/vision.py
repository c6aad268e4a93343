"""The image side of a vision-language model (Gemma 3): pixels -> the soft tokens that stand in
for an image's tokens in the prompt. One pure function, `encode_images(params, pixels, cfg)`.

Gemma 3 = a SigLIP vision tower + a projector:

  pixels [N, S, S, 3] -> P x P patches, row-major [N, T = (S/P)^2, P*P*3] -> @ patch_w + pos
  -> layers: x += attn(LN1(x)) (bidirectional, biased, Dh^-0.5);  x += fc2(gelu_tanh(fc1(LN2(x))))
  -> post LN -> grid [N, S/P, S/P, Dv] average-pooled in k x k windows -> [N, t*t, Dv]
  -> RMSNorm * (1 + w) -> @ proj [Dv, D_text] = [N, tokens_per_image, D_text]

Everything is computed in f32 (bf16 weights are upcast). Norm weights: LayerNorm's as stored,
the projector's RMSNorm as the effective multiplier (Gemma's `1 + w` folded at load, as in
runtime/device/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

F32 = jnp.float32


@dataclass(frozen=True)
class VisionConfig:
    image_size: int  # S: pixels per side of the encoder's square input
    patch_size: int  # P
    hidden_size: int  # Dv
    num_layers: int
    num_heads: int
    intermediate_size: int  # F
    layer_norm_eps: float
    tokens_per_image: int  # soft tokens per image (Gemma 3's mm_tokens_per_image: 256)
    text_hidden_size: int  # D: the language model's width
    mm_norm_eps: float  # the projector's RMSNorm eps (HF: vision_config.layer_norm_eps)
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        t = self.tokens_per_side
        if t * t != self.tokens_per_image or self.patches_per_side % t:
            raise ValueError(f"tokens_per_image {self.tokens_per_image} is not a square whose "
                             f"side divides the {self.patches_per_side} patches per side")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return round(self.tokens_per_image ** 0.5)

    @property
    def pool(self) -> int:  # k: patches per side of one token's pooling window
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@struct.dataclass
class VisionLayerParams:
    ln1_w: jax.Array  # [Dv]
    ln1_b: jax.Array  # [Dv]
    wq: jax.Array  # [Dv, H, Dh]
    bq: jax.Array  # [H, Dh]
    wk: jax.Array  # [Dv, H, Dh]
    bk: jax.Array  # [H, Dh]
    wv: jax.Array  # [Dv, H, Dh]
    bv: jax.Array  # [H, Dh]
    wo: jax.Array  # [H, Dh, Dv]
    bo: jax.Array  # [Dv]
    ln2_w: jax.Array  # [Dv]
    ln2_b: jax.Array  # [Dv]
    fc1: jax.Array  # [Dv, F]
    fc1_b: jax.Array  # [F]
    fc2: jax.Array  # [F, Dv]
    fc2_b: jax.Array  # [Dv]


@struct.dataclass
class VisionParams:
    patch_w: jax.Array  # [P*P*3, Dv] rows in (patch row, patch col, channel) order
    patch_b: jax.Array  # [Dv]
    pos: jax.Array  # [T, Dv] T = patches, row-major over the grid
    layers: tuple[VisionLayerParams, ...]
    post_ln_w: jax.Array  # [Dv]
    post_ln_b: jax.Array  # [Dv]
    mm_norm: jax.Array  # [Dv] the effective multiplier 1 + w
    mm_proj: jax.Array  # [Dv, D]


def _f32(a: jax.Array) -> jax.Array:
    return a.astype(F32)


def _ein(spec: str, x: jax.Array, w) -> jax.Array:
    """A product in the weight's dtype (bf16 weights: the matrix units' rate), accumulated and
    returned in f32; a quantized weight (a QuantizedArray: the engine's quantization option)
    multiplies through its own einsum."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x).astype(F32)
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=F32)


# Query rows an attention product takes at once: the scores of a chunk are [N, H, 1024, T] f32
# (Gemma 3's T = 4096: a quarter of the whole [N, H, T, T])
Q_CHUNK = 1024


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """Over the last axis, biased variance (torch.nn.LayerNorm)."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * _f32(w) + _f32(b)


def patchify(pixels: jax.Array, p: int) -> jax.Array:
    """[N, S, S, C] -> [N, (S/p)^2, p*p*C]: non-overlapping p x p patches, row-major over the
    grid, each flattened (row, col, channel)."""
    n, s, _, c = pixels.shape
    g = s // p
    x = pixels.reshape(n, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5)  # [N, gy, gx, py, px, C]
    return x.reshape(n, g * g, p * p * c)


def _attention(lp: VisionLayerParams, x: jax.Array, cfg: VisionConfig) -> jax.Array:
    """Bidirectional multi-head attention over x [N, T, Dv], Q_CHUNK query rows at a time
    (softmax in f32; q, k, v and the probabilities in the weights' dtype)."""
    dt = lp.ln1_w.dtype  # the weights' float dtype (a norm's: never quantized)
    q = (_ein("ntd,dhk->nthk", x, lp.wq) + _f32(lp.bq)).astype(dt)  # [N, T, H, Dh]
    k = (_ein("ntd,dhk->nthk", x, lp.wk) + _f32(lp.bk)).astype(dt)
    v = (_ein("ntd,dhk->nthk", x, lp.wv) + _f32(lp.bv)).astype(dt)
    dh = q.shape[-1]

    def chunk(qi):  # [N, c, H, Dh] -> [N, c, H, Dh] f32
        s = jnp.einsum("nqhk,nshk->nhqs", qi, k, preferred_element_type=F32) * dh ** -0.5
        a = jax.nn.softmax(s, axis=-1).astype(dt)  # [N, H, c, T]
        return jnp.einsum("nhqs,nshk->nqhk", a, v, preferred_element_type=F32)

    # unrolled (a few chunks): each is its own product in the program, counted as such
    o = jnp.concatenate([chunk(q[:, i:i + Q_CHUNK]) for i in range(0, q.shape[1], Q_CHUNK)],
                        axis=1)  # [N, T, H, Dh]
    return _ein("nthk,hkd->ntd", o, lp.wo) + _f32(lp.bo)


def _mlp(lp: VisionLayerParams, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(_ein("ntd,df->ntf", x, lp.fc1) + _f32(lp.fc1_b), approximate=True)
    return _ein("ntf,fd->ntd", h, lp.fc2) + _f32(lp.fc2_b)


def encoder_layer(lp: VisionLayerParams, x: jax.Array, cfg: VisionConfig) -> jax.Array:
    """One pre-LayerNorm SigLIP layer over x [N, T, Dv] f32."""
    eps = cfg.layer_norm_eps
    x = x + _attention(lp, layer_norm(x, lp.ln1_w, lp.ln1_b, eps), cfg)
    return x + _mlp(lp, layer_norm(x, lp.ln2_w, lp.ln2_b, eps))


def vision_tower(params: VisionParams, pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """SigLIP: pixels [N, S, S, 3] -> post-LayerNorm patch states [N, T, Dv] f32."""
    x = _ein("ntk,kd->ntd", patchify(_f32(pixels), cfg.patch_size), params.patch_w)
    x = x + _f32(params.patch_b) + _f32(params.pos)
    for lp in params.layers:
        x = encoder_layer(lp, x, cfg)
    return layer_norm(x, params.post_ln_w, params.post_ln_b, cfg.layer_norm_eps)


def project(params: VisionParams, x: jax.Array, cfg: VisionConfig) -> jax.Array:
    """Gemma 3's projector: patch states [N, T, Dv] -> soft tokens [N, t*t, D] f32."""
    n, t, k = x.shape[0], cfg.tokens_per_side, cfg.pool
    grid = x.reshape(n, t, k, t, k, cfg.hidden_size)  # [N, ty, ky, tx, kx, Dv]
    pooled = jnp.mean(grid, axis=(2, 4)).reshape(n, t * t, cfg.hidden_size)
    normed = pooled * jax.lax.rsqrt(jnp.mean(jnp.square(pooled), axis=-1, keepdims=True)
                                    + cfg.mm_norm_eps) * _f32(params.mm_norm)
    return _ein("ntd,de->nte", normed, params.mm_proj)


def encode_images(params: VisionParams, pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """pixels [N, S, S, 3] f32, normalized ((x/255 - mean) / std) -> the images' soft tokens
    [N, tokens_per_image, text_hidden_size] f32 (HF: Gemma3Model.get_image_features(...)
    .pooler_output). Attention scores are [N, H, T, T] f32 per layer: encode few images per
    call at Gemma 3's T = 4096 (queries go Q_CHUNK rows at a time)."""
    return project(params, vision_tower(params, pixels, cfg), cfg)


def init_vision_params(cfg: VisionConfig, key: jax.Array, dtype=jnp.float32,
                       scale: float = 0.02) -> VisionParams:
    """Random parameters (tests, benchmarks). Norm weights near 1, biases near 0."""
    d, h, dh, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    keys = iter(jax.random.split(key, 16 * cfg.num_layers + 8))

    def w(*shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, F32)).astype(dtype)

    def norm(n):
        return (1.0 + w(n, s=0.1).astype(F32)).astype(dtype)

    layers = tuple(
        VisionLayerParams(
            ln1_w=norm(d), ln1_b=w(d), wq=w(d, h, dh), bq=w(h, dh), wk=w(d, h, dh),
            bk=w(h, dh), wv=w(d, h, dh), bv=w(h, dh), wo=w(h, dh, d), bo=w(d),
            ln2_w=norm(d), ln2_b=w(d), fc1=w(d, f), fc1_b=w(f), fc2=w(f, d), fc2_b=w(d))
        for _ in range(cfg.num_layers))
    p = cfg.patch_size
    return VisionParams(
        patch_w=w(p * p * 3, d), patch_b=w(d), pos=w(cfg.num_patches, d), layers=layers,
        post_ln_w=norm(d), post_ln_b=w(d), mm_norm=norm(d),
        mm_proj=w(d, cfg.text_hidden_size, s=d ** -0.5))
