"""The image side of Qwen3-VL: one image's patches -> the embeddings that stand in for its image
tokens, plus the DeepStack features added to the first text layers' hidden states at those
tokens. One pure function, `encode_image(params, patches, cfg, grid)`.

An image of grid (t, h, w) patches arrives as HF's processor flattens it (runtime/host/
qwen_images.py): N = t*h*w rows of C*T*P*P values, frame-major, and within a frame in 2 x 2
merge-block order (block row, block col, row in block, col in block), so the m*m patches of one
output token are consecutive rows:

  patches [N, C*T*P*P] @ patch_w + patch_b                    (the Conv3d, stride = kernel)
  + pos: the learned [G*G, D] table bilinearly resampled (align_corners) to the h x w grid,
         read in the same merge-block order, the same for every frame
  -> blocks: x += proj(attn(LN1(x)));  x += fc2(act(fc1(LN2(x))))
        attn: fused qkv (biased), 2-D rotary on q and k (head dims [h-angles | w-angles] twice:
        rotate_half pairs d with d + Dh/2), bidirectional over the h*w patches of one frame
     after block i in deepstack_visual_indexes: deepstack merger -> one [N/m^2, D_out] feature
  -> merger: LN over D, m*m consecutive rows concatenated [N/m^2, m^2*D] -> fc1 -> gelu (erf)
     -> fc2 = embeds [N/m^2, D_out]
  deepstack mergers: rows concatenated first, then LN over m^2*D ("postshuffle"), same MLP.

Everything is computed in f32 (bf16 weights are upcast). LayerNorm eps is 1e-6 throughout (HF
hard-codes it: the vision config has no eps field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

F32 = jnp.float32

# vision_config.hidden_act -> the MLP's activation (HF's ACT2FN names)
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}

_Q_CHUNK = 1024  # attention queries per step: scores are [H, chunk, h*w] f32 at a time


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    depth: int  # vision blocks
    hidden_size: int  # D
    num_heads: int  # H
    intermediate_size: int  # F
    patch_size: int  # P
    temporal_patch_size: int  # T: frames per patch (an image is its frame repeated T times)
    spatial_merge_size: int  # m: output tokens are m x m patches
    in_channels: int  # C
    out_hidden_size: int  # D_out: the text model's width
    num_position_embeddings: int  # G*G: the learned position table, a square grid
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output feeds a deepstack merger
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int = 151_656
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0  # vision_config.rope_parameters.rope_theta
    layer_norm_eps: float = 1e-6  # HF's constant, not a config field
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    min_pixels: int = 56 * 56  # preprocessor size.shortest_edge (HF Qwen2-VL processor default)
    max_pixels: int = 28 * 28 * 1280  # preprocessor size.longest_edge
    resample: int = 3  # the preprocessor's PIL resize filter (3: bicubic)

    def __post_init__(self):
        for name in ("deepstack_visual_indexes", "image_mean", "image_std"):  # hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of 4 (the 2-D rotary "
                             "splits each half between rows and columns)")
        if self.pos_side ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a "
                             "square")
        idx = tuple(self.deepstack_visual_indexes)
        if len(set(idx)) != len(idx) or any(not 0 <= i < self.depth for i in idx):
            raise ValueError(f"deepstack_visual_indexes {idx} must be distinct blocks of "
                             f"0..{self.depth - 1}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # one row of `patches`: C*T*P*P
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:  # patches per output token: m*m
        return self.spatial_merge_size ** 2

    @property
    def merged_size(self) -> int:  # m*m*D: the mergers' width
        return self.merge_unit * self.hidden_size

    @property
    def pos_side(self) -> int:  # G
        return math.isqrt(self.num_position_embeddings)

    @property
    def factor(self) -> int:  # image sides are resized to multiples of P*m
        return self.patch_size * self.spatial_merge_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_unit


@struct.dataclass
class Qwen3VLBlockParams:
    ln1_w: jax.Array  # [D]
    ln1_b: jax.Array  # [D]
    wqkv: jax.Array  # [D, 3, H, Dh] (q, k, v)
    bqkv: jax.Array  # [3, H, Dh]
    wo: jax.Array  # [H, Dh, D]
    bo: jax.Array  # [D]
    ln2_w: jax.Array  # [D]
    ln2_b: jax.Array  # [D]
    fc1: jax.Array  # [D, F]
    fc1_b: jax.Array  # [F]
    fc2: jax.Array  # [F, D]
    fc2_b: jax.Array  # [D]


@struct.dataclass
class Qwen3VLMergerParams:
    norm_w: jax.Array  # [D] (the final merger) or [m*m*D] (a deepstack merger: postshuffle)
    norm_b: jax.Array
    fc1: jax.Array  # [m*m*D, m*m*D]
    fc1_b: jax.Array  # [m*m*D]
    fc2: jax.Array  # [m*m*D, D_out]
    fc2_b: jax.Array  # [D_out]


@struct.dataclass
class Qwen3VLVisionParams:
    patch_w: jax.Array  # [C*T*P*P, D] rows in (channel, frame, patch row, patch col) order
    patch_b: jax.Array  # [D]
    pos: jax.Array  # [G*G, D] the learned table, row-major over a G x G grid
    blocks: tuple[Qwen3VLBlockParams, ...]
    merger: Qwen3VLMergerParams
    deepstack: tuple[Qwen3VLMergerParams, ...]  # one per deepstack_visual_indexes, same order


def _f32(a: jax.Array) -> jax.Array:
    return a.astype(F32)


def _ein(spec: str, x: jax.Array, w) -> jax.Array:
    """An f32 product; a quantized weight (QuantizedArray) multiplies through its own einsum."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, _f32(x)).astype(F32)
    return jnp.einsum(spec, _f32(x), _f32(w), preferred_element_type=F32)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """Over the last axis, biased variance (torch.nn.LayerNorm)."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * _f32(w) + _f32(b)


# --------------------------------------------------------------------------- positions


def merge_order_coords(h: int, w: int, m: int) -> tuple[jax.Array, jax.Array]:
    """(row, col) int32 [h*w] of each patch of an h x w grid in merge-block order: block row,
    block col, row in block, col in block (the processor's row order)."""
    rows = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[:, None], (h, w))
    cols = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None, :], (h, w))

    def order(a):  # [h, w] -> [h/m, w/m, m, m] -> [h*w]
        return a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)

    return order(rows), order(cols)


def _axis_taps(index: jax.Array, size: int, side: int) -> tuple[jax.Array, jax.Array]:
    """Bilinear taps (align_corners) of `index` [S] on an axis of `size` into a `side`-long
    table: (taps int32 [S, 2], weights f32 [S, 2])."""
    src = index.astype(F32) * (side - 1) / jnp.maximum(size - 1, 1)  # [S] in [0, side - 1]
    floor = jnp.floor(src)
    off = jnp.arange(2, dtype=F32)
    taps = jnp.clip(floor[:, None].astype(jnp.int32) + jnp.arange(2, dtype=jnp.int32), 0, side - 1)
    weights = jnp.maximum(1.0 - jnp.abs(src[:, None] - floor[:, None] - off), 0.0)
    return taps, weights


def position_embeddings(table: jax.Array, cfg: Qwen3VLVisionConfig, h: int, w: int,
                        coords: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The [G*G, D] table resampled (bilinear, align_corners) to an h x w grid, in merge-block
    order: [h*w, D] f32 (HF: Qwen3VLVisionModel's interpolated pos_embed for one frame).
    `coords` (rows, cols int32 [S]): the patches' grid coordinates instead (h, w may be
    traced): the bucketed encoder's, padding included."""
    g = cfg.pos_side
    rows, cols = merge_order_coords(h, w, cfg.spatial_merge_size) if coords is None else coords
    th, wh = _axis_taps(rows, h, g)  # [S, 2]
    tw, ww = _axis_taps(cols, w, g)
    idx = (th[:, :, None] * g + tw[:, None, :]).reshape(-1, 4)  # [S, 4] (h0w0, h0w1, h1w0, h1w1)
    wgt = (wh[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return jnp.einsum("sjd,sj->sd", _f32(table)[idx], wgt, preferred_element_type=F32)


def rotary_cos_sin(cfg: Qwen3VLVisionConfig, h: int, w: int,
                   coords: tuple[jax.Array, jax.Array] | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32 [h*w, Dh] of the vision attention's 2-D rotary, merge-block order: angles
    [row * inv_freq | col * inv_freq] (Dh/4 frequencies each, theta^(-4i/Dh)), twice over.
    `coords`: as in position_embeddings."""
    quarter = cfg.head_dim // 4
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(quarter, dtype=F32) * 2 / (2 * quarter)))
    rows, cols = merge_order_coords(h, w, cfg.spatial_merge_size) if coords is None else coords
    ang = jnp.concatenate([rows.astype(F32)[:, None] * inv_freq,
                           cols.astype(F32)[:, None] * inv_freq], axis=-1)  # [S, Dh/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [S, Dh]
    return jnp.cos(ang), jnp.sin(ang)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [F, S, H, Dh] * cos + rotate_half(x) * sin; cos, sin [S, Dh]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


# --------------------------------------------------------------------------- the tower


def _attention(bp: Qwen3VLBlockParams, x: jax.Array, cos: jax.Array, sin: jax.Array,
               cfg: Qwen3VLVisionConfig, valid: jax.Array | None = None) -> jax.Array:
    """Bidirectional attention within each frame: x [F, S, D] -> [F, S, D]; `valid` bool [S]:
    the keys that exist (a bucket's padding attends and is attended by nothing real)."""
    qkv = _ein("fsd,dchk->cfshk", x, bp.wqkv) + _f32(bp.bqkv)[:, None, None]  # [3, F, S, H, Dh]
    q, k, v = _rotate(qkv[0], cos, sin), _rotate(qkv[1], cos, sin), qkv[2]
    n_frames, s = x.shape[0], x.shape[1]
    chunk = min(s, _Q_CHUNK)
    n_chunks = -(-s // chunk)
    q = jnp.pad(q, ((0, 0), (0, n_chunks * chunk - s), (0, 0), (0, 0)))
    q = q.reshape(n_frames, n_chunks, chunk, *q.shape[2:]).swapaxes(0, 1)  # [NC, F, c, H, Dh]
    scale = cfg.head_dim ** -0.5

    def attend(qc):  # [F, c, H, Dh] -> [F, c, H, Dh]
        sc = jnp.einsum("fqhk,fshk->fhqs", qc, k, preferred_element_type=F32) * scale
        if valid is not None:
            sc = jnp.where(valid, sc, -jnp.inf)
        a = jax.nn.softmax(sc, axis=-1)  # [F, H, c, S]
        return jnp.einsum("fhqs,fshk->fqhk", a, v, preferred_element_type=F32)

    o = attend(q[0])[None] if n_chunks == 1 else jax.lax.map(attend, q)  # [NC, F, c, H, Dh]
    o = o.swapaxes(0, 1).reshape(n_frames, n_chunks * chunk, *o.shape[3:])[:, :s]
    return _ein("fshk,hkd->fsd", o, bp.wo) + _f32(bp.bo)


def _mlp(bp: Qwen3VLBlockParams, x: jax.Array, cfg: Qwen3VLVisionConfig) -> jax.Array:
    h = ACTIVATIONS[cfg.hidden_act](_ein("fsd,dk->fsk", x, bp.fc1) + _f32(bp.fc1_b))
    return _ein("fsk,kd->fsd", h, bp.fc2) + _f32(bp.fc2_b)


def vision_block(bp: Qwen3VLBlockParams, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 cfg: Qwen3VLVisionConfig, valid: jax.Array | None = None) -> jax.Array:
    """One pre-LayerNorm block over x [F, S, D] f32 (F frames of S = h*w patches)."""
    eps = cfg.layer_norm_eps
    x = x + _attention(bp, layer_norm(x, bp.ln1_w, bp.ln1_b, eps), cos, sin, cfg, valid)
    return x + _mlp(bp, layer_norm(x, bp.ln2_w, bp.ln2_b, eps), cfg)


def merge(mp: Qwen3VLMergerParams, x: jax.Array, cfg: Qwen3VLVisionConfig,
          postshuffle: bool) -> jax.Array:
    """x [N, D] patch states (merge-block order) -> [N/m^2, D_out]: the patch merger (LN per
    patch, then m*m rows joined) or, `postshuffle`, a deepstack merger (rows joined, then LN)."""
    eps = cfg.layer_norm_eps
    if not postshuffle:
        x = layer_norm(x, mp.norm_w, mp.norm_b, eps)
    x = x.reshape(-1, cfg.merged_size)  # [N/m^2, m^2*D]
    if postshuffle:
        x = layer_norm(x, mp.norm_w, mp.norm_b, eps)
    h = jax.nn.gelu(_ein("nk,kj->nj", x, mp.fc1) + _f32(mp.fc1_b), approximate=False)
    return _ein("nj,je->ne", h, mp.fc2) + _f32(mp.fc2_b)


def encode_image(params: Qwen3VLVisionParams, patches: jax.Array, cfg: Qwen3VLVisionConfig,
                 grid: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
    """One image's (or video's) patches f32 [t*h*w, C*T*P*P], HF processor order, with `grid`
    = (t, h, w) static -> (embeds f32 [n, D_out], deepstack f32 [K, n, D_out]), n = t*h*w/m^2,
    K = len(deepstack_visual_indexes), features in block order (HF: Qwen3VLModel.
    get_image_features(pixel_values, image_grid_thw): pooler_output, deepstack_features).

    jit with static_argnames=("cfg", "grid"). Attention scores are [t, H, min(h*w, 1024), h*w]
    f32 per step."""
    t, h, w = (int(v) for v in grid)
    m = cfg.spatial_merge_size
    if h % m or w % m or t < 1:
        raise ValueError(f"grid {grid} is not whole {m} x {m} merge blocks")
    if patches.shape != (t * h * w, cfg.patch_dim):
        raise ValueError(f"patches of shape {patches.shape} for grid {grid}: expected "
                         f"{(t * h * w, cfg.patch_dim)}")
    x = _ein("nk,kd->nd", patches, params.patch_w) + _f32(params.patch_b)  # [N, D]
    x = x.reshape(t, h * w, cfg.hidden_size) + position_embeddings(params.pos, cfg, h, w)
    return _tower(params, x, rotary_cos_sin(cfg, h, w), cfg)


def _tower(params: Qwen3VLVisionParams, x: jax.Array, cos_sin, cfg: Qwen3VLVisionConfig,
           valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Patch states x [F, S, D] (embedded, positions added) -> (embeds [F*S/m^2, D_out],
    deepstack [K, F*S/m^2, D_out])."""
    feats = []
    for i, bp in enumerate(params.blocks):
        x = vision_block(bp, x, *cos_sin, cfg, valid)
        if i in cfg.deepstack_visual_indexes:
            mp = params.deepstack[cfg.deepstack_visual_indexes.index(i)]
            feats.append(merge(mp, x.reshape(-1, cfg.hidden_size), cfg, postshuffle=True))
    embeds = merge(params.merger, x.reshape(-1, cfg.hidden_size), cfg, postshuffle=False)
    deepstack = (jnp.stack(feats) if feats
                 else jnp.zeros((0, embeds.shape[0], cfg.out_hidden_size), F32))
    return embeds, deepstack


def patch_bucket(cfg: Qwen3VLVisionConfig, patches: int) -> int:
    """The padded patch count an image of `patches` patches is encoded at: the next of a
    geometric series (ratio sqrt 2) of whole merge blocks, from 16 blocks: an image size's
    program serves every size up to its bucket, at most ~2x the real attention work."""
    unit, b = cfg.merge_unit, 16 * cfg.merge_unit
    while b < patches:
        b = -(-int(b * 1.4142135) // unit) * unit
    return b


def encode_image_bucketed(params: Qwen3VLVisionParams, patches: jax.Array, rows: jax.Array,
                          cols: jax.Array, valid: jax.Array, hw: jax.Array,
                          cfg: Qwen3VLVisionConfig) -> tuple[jax.Array, jax.Array]:
    """encode_image for one image (t = 1) padded to a bucket of B patches (patch_bucket): one
    program for every image size of the bucket. patches f32 [B, C*T*P*P], rows / cols int32
    [B] (merge-block order, merge_order_coords; padding anything), valid bool [B] (the real
    patches first), hw int32 [2] the grid's (h, w) -> (embeds [B/m^2, D_out], deepstack
    [K, B/m^2, D_out]); the first h*w/m^2 rows are the image's (equal to encode_image's up to
    float rounding), the rest padding. jit with static_argnames=("cfg",)."""
    x = _ein("nk,kd->nd", patches, params.patch_w) + _f32(params.patch_b)  # [B, D]
    x = x + position_embeddings(params.pos, cfg, hw[0], hw[1], (rows, cols))
    cos_sin = rotary_cos_sin(cfg, hw[0], hw[1], (rows, cols))
    return _tower(params, x[None], cos_sin, cfg, valid)


def init_qwen3_vl_vision_params(cfg: Qwen3VLVisionConfig, key: jax.Array, dtype=jnp.float32,
                                scale: float = 0.02) -> Qwen3VLVisionParams:
    """Random parameters (tests, benchmarks). Norm weights near 1, biases near 0."""
    d, h, dh, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    dm, do = cfg.merged_size, cfg.out_hidden_size
    n_mergers = 1 + len(cfg.deepstack_visual_indexes)
    keys = iter(jax.random.split(key, 12 * cfg.depth + 6 * n_mergers + 4))

    def w(*shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, F32)).astype(dtype)

    def norm(n):
        return (1.0 + w(n, s=0.1).astype(F32)).astype(dtype)

    def merger(n_norm):
        return Qwen3VLMergerParams(norm_w=norm(n_norm), norm_b=w(n_norm), fc1=w(dm, dm),
                                   fc1_b=w(dm), fc2=w(dm, do), fc2_b=w(do))

    blocks = tuple(
        Qwen3VLBlockParams(
            ln1_w=norm(d), ln1_b=w(d), wqkv=w(d, 3, h, dh), bqkv=w(3, h, dh), wo=w(h, dh, d),
            bo=w(d), ln2_w=norm(d), ln2_b=w(d), fc1=w(d, f), fc1_b=w(f), fc2=w(f, d),
            fc2_b=w(d))
        for _ in range(cfg.depth))
    return Qwen3VLVisionParams(
        patch_w=w(cfg.patch_dim, d), patch_b=w(d), pos=w(cfg.num_position_embeddings, d),
        blocks=blocks, merger=merger(d),
        deepstack=tuple(merger(dm) for _ in cfg.deepstack_visual_indexes))
