"""Qwen-VL image preprocessing (Qwen2-VL's processor, which Qwen2.5-VL and Qwen3-VL reuse): an RGB
image -> the patch rows its vision tower takes, and its grid. No JAX (numpy + PIL).

  smart_resize(height, width, factor, min_pixels, max_pixels)   -> (height, width) to resize to
  qwen_grid(width, height, ...)      -> (t, h, w) patches, without touching pixels (to count an
                                        image's tokens: t*h*w / merge**2)
  qwen_patches(img, ...)             -> (patches f32 [t*h*w, C*T*P*P], (t, h, w))

What HF's PIL processor (Qwen2VLImageProcessorPil) does, step for step:
  1. RGB, transparency composited onto white (as runtime/host/images.py)
  2. resize (PIL bicubic) to smart_resize's sides: multiples of factor = patch * merge, the
     aspect ratio kept as closely as rounding allows, the area pulled into [min, max] pixels
  3. x / 255 (in f64, then f32), (x - mean) / std per channel in f32
  4. cut into P x P patches; rows ordered by merge block (block row, block col, row in block,
     col in block), each row (channel, frame, patch row, patch col) with the one frame
     repeated temporal_patch_size times: an image is a one-step video (t = 1).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from jaxinfer.runtime.host.images import _to_rgb  # the one compositing rule

RESAMPLE = Image.Resampling.BICUBIC  # HF's Qwen2-VL processor's default
MAX_ASPECT = 200  # HF refuses images more elongated than this


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) multiples of `factor`, near the image's, with an area in
    [min_pixels, max_pixels] where rounding allows; ValueError for an aspect ratio over 200."""
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is "
                         f"over {MAX_ASPECT}")
    h = round(height / factor) * factor  # (round half to even, as HF's)
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def qwen_grid(width: int, height: int, *, patch_size: int, merge_size: int, min_pixels: int,
              max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patches of a width x height image: (1, resized height / P, resized width / P)."""
    rh, rw = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return 1, rh // patch_size, rw // patch_size


def qwen_patches(img: Image.Image, *, patch_size: int, temporal_patch_size: int,
                 merge_size: int, mean, std, min_pixels: int, max_pixels: int,
                 resample: int = RESAMPLE) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`img` -> (patches f32 [h*w, 3*T*P*P], grid (1, h, w)), equal to HF's Qwen2-VL PIL
    processor's pixel_values / image_grid_thw for this one image. `resample`: a PIL filter
    code (preprocessor_config.json's "resample"; bicubic unless it says otherwise)."""
    img = _to_rgb(img)
    p, m = patch_size, merge_size
    grid = qwen_grid(img.width, img.height, patch_size=p, merge_size=m, min_pixels=min_pixels,
                     max_pixels=max_pixels)
    _, gh, gw = grid
    resized = np.asarray(img.resize((gw * p, gh * p), Image.Resampling(resample)))  # [H, W, 3] u8
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)  # [H, W, C] f32
    c = x.shape[-1]
    x = x.reshape(gh // m, m, p, gw // m, m, p, c)  # [by, my, py, bx, mx, px, C]
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [by, bx, my, mx, C, py, px]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal_patch_size * p * p)), grid
