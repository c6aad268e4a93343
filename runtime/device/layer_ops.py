"""Row-local building blocks of a layer: RMSNorm and RoPE (inverse frequencies with llama3,
linear, YaRN and proportional scaling; the rotate-half rotation)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.config import RopeScaling


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """Over the last axis; w None: no weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if w is None else xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[Dh/2] f32 inverse frequencies (HF convention: computed in f32)."""
    freqs = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    inv = (1.0 / freqs).astype(np.float32)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(freqs, head_dim, theta, scaling)
    if scaling.kind == "proportional":  # [rotated | 0 ...]: a 0 frequency leaves its pair be
        n = int(scaling.partial_rotary_factor * head_dim // 2)
        inv = np.where(np.arange(head_dim // 2) < n, inv, np.float32(0))
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate between
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(freqs: np.ndarray, dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: dims rotating fewer than beta_slow times over the original context are
    interpolated (/ factor), more than beta_fast times kept, a linear ramp between."""
    def dim_of(rotations):  # the dim that rotates `rotations` times over the original context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low or 0.001), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (the original frequency)
    inv_extra = (1.0 / freqs).astype(np.float32)
    inv_inter = (1.0 / (np.float32(s.factor) * freqs)).astype(np.float32)
    return (inv_inter * (1 - keep) + inv_extra * keep).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def mrope_axes(section: tuple[int, ...], half: int) -> np.ndarray:
    """[Dh/2] which of a token's (t, h, w) positions turns each frequency under multimodal RoPE
    (interleaved: j % 3 == 1 below 3 * section[1] -> h, j % 3 == 2 below 3 * section[2] -> w)."""
    j = np.arange(half)
    axes = np.zeros(half, np.int32)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               factor: float = 1.0, mrope: tuple[int, ...] = ()) -> jax.Array:
    """x [T, H, Dh] rotated by position (rotate-half layout: pairs (i, i + Dh/2)); cos and sin
    scaled by `factor` (rope_attention_factor). positions [T], or [T, 3] (t, h, w) with `mrope`
    the multimodal sections (ModelConfig.mrope_section)."""
    pos = positions.astype(jnp.float32)
    if pos.ndim == 2:  # [T, 3]: each frequency turns with its axis' position
        pos = pos[:, mrope_axes(mrope, len(inv_freq))]  # [T, Dh/2]
    else:
        pos = pos[:, None]
    angles = pos * jnp.asarray(inv_freq)[None, :]  # [T, Dh/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
