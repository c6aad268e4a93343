"""Images from outside: the one door. No JAX (numpy + PIL).

  load_image(value, field)   a request's image -> an RGB PIL image, fully decoded, or a
                             RequestError naming `field`
  pixel_values(img, size, mean, std)   -> f32 [S, S, 3], the encoder's input (HF's Gemma 3
                             image processor with its defaults: bilinear resize to S x S,
                             x / 255, (x - mean) / std; no pan-and-scan)
  image_digest(img)          a content hash: equal pixels, equal digest, however they came

What `load_image` takes: a PIL image; a numpy array (H x W, H x W x 1/3/4; uint8 or another
integer type in 0..255, or floats in [0, 1]); encoded bytes; a `data:image/...;base64,...` URL;
a plain base64 string. Encoded images must be one of `FORMATS` (PIL's other decoders, e.g. EPS
through Ghostscript, are not reached). Remote URLs are refused: fetching them from the server
would let a request make it reach any address it can (server-side request forgery).

Decompression bombs: an encoded image's width x height is read from its header (PIL's open is
lazy) and checked against `max_pixels` before its pixels are decoded; PIL's own bomb guard
(Image.MAX_IMAGE_PIXELS, ~89M) is turned into the same RequestError.

Transparency is composited onto white, and EXIF orientation applied, before anything else (as
HF's processor and image loader do), so the pixels hashed are the pixels the model sees.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from jaxinfer.runtime.host.errors import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

_DATA_URL = re.compile(r"^data:([^,;]*)((?:;[^,;]*)*),(.*)$", re.IGNORECASE | re.DOTALL)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def load_image(value, field: str, *, max_pixels: int = 50_000_000) -> Image.Image:
    """`value` as an RGB image, fully loaded; RequestError(field, ...) for anything else."""
    if isinstance(value, Image.Image):
        img = value
        _check_size(img.size, field, max_pixels)
        try:
            img.load()
            img = ImageOps.exif_transpose(img)
        except (OSError, ValueError, SyntaxError) as e:
            raise RequestError(field, f"image cannot be decoded ({e})") from None
    elif isinstance(value, np.ndarray):
        img = _from_array(value, field, max_pixels)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        img = _decode(bytes(value), field, max_pixels)
    elif isinstance(value, str):
        img = _decode(_bytes_of_string(value, field), field, max_pixels)
    else:
        raise RequestError(field, f"an image must be encoded bytes, a data: URL, base64, a "
                                  f"numpy array or a PIL image, not {type(value).__name__}")
    return _to_rgb(img)


def pixel_values(img: Image.Image, size: int, mean, std) -> np.ndarray:
    """f32 [size, size, 3]: `img` resized (bilinear, aspect ratio not kept), scaled to [0, 1],
    normalized per channel: (x / 255 - mean) / std."""
    img = _to_rgb(img)
    resized = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR))  # [S, S, 3] u8
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def image_digest(img: Image.Image) -> bytes:
    """32-byte blake2b of the mode, size and raw pixel bytes."""
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.digest()


# --------------------------------------------------------------------------- decoding


def _bytes_of_string(s: str, field: str) -> bytes:
    s = s.strip()
    m = _DATA_URL.match(s)
    if m is not None:
        media, params, payload = m[1].strip().lower(), m[2].lower(), m[3]
        if not media.startswith("image/"):
            raise RequestError(field, f"data URL of media type {media or 'text/plain'!r}: "
                                      "an image/... type is needed")
        if ";base64" not in params:
            raise RequestError(field, "data URL is not base64-encoded (';base64,' expected)")
        return _b64(payload, field)
    if _SCHEME.match(s):
        scheme = s.split(":", 1)[0].lower()
        if scheme in ("http", "https"):
            raise RequestError(field, "remote image URLs are disabled (fetching them from the "
                                      "server is a server-side request forgery risk); send the "
                                      "image inline as a data:image/...;base64 URL")
        raise RequestError(field, f"{scheme}: URLs are not accepted; send the image inline as "
                                  "a data:image/...;base64 URL")
    return _b64(s, field)


def _b64(s: str, field: str) -> bytes:
    try:
        data = base64.b64decode(re.sub(r"\s+", "", s), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(field, "not valid base64 (expected a data:image/...;base64 URL or "
                                  "base64-encoded image bytes)") from None
    if not data:
        raise RequestError(field, "empty image data")
    return data


def _decode(data: bytes, field: str, max_pixels: int) -> Image.Image:
    if not data:
        raise RequestError(field, "empty image data")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # lazy: the header only
            _check_size(img.size, field, max_pixels)
            img.load()
            img = ImageOps.exif_transpose(img)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise RequestError(field, f"image too large (over {max_pixels} pixels, or PIL's "
                                      "decompression bomb limit)") from None
        except UnidentifiedImageError:
            raise RequestError(field, "not a decodable image (accepted formats: "
                                      f"{', '.join(FORMATS)})") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise RequestError(field, f"image cannot be decoded ({e})") from None
    return img


def _check_size(size: tuple[int, int], field: str, max_pixels: int) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise RequestError(field, f"image is empty ({w} x {h} pixels)")
    if w * h > max_pixels:
        raise RequestError(field, f"image too large: {w} x {h} = {w * h} pixels, over the "
                                  f"limit of {max_pixels}")


def _from_array(a: np.ndarray, field: str, max_pixels: int) -> Image.Image:
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))):
        raise RequestError(field, f"an image array must be H x W or H x W x 3 / 4, got shape "
                                  f"{a.shape}")
    _check_size((a.shape[1], a.shape[0]), field, max_pixels)
    if np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
            raise RequestError(field, "a float image array must hold values in [0, 1]")
        a = np.round(a.astype(np.float64) * 255)
    elif np.issubdtype(a.dtype, np.integer):
        if a.dtype != np.uint8 and (a.min() < 0 or a.max() > 255):
            raise RequestError(field, f"an integer image array must hold values in 0..255, "
                                      f"got {a.min()}..{a.max()}")
    else:
        raise RequestError(field, f"image array of dtype {a.dtype} (uint8 or float expected)")
    return Image.fromarray(np.ascontiguousarray(a, dtype=np.uint8))  # L, RGB or RGBA


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB; transparency composited onto white."""
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
