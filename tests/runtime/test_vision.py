"""Gemma 3's image side against HF transformers: the SigLIP tower + projector
(runtime/device/vision.py) loaded by checkpoints/hf_vision.py vs Gemma3Model.get_image_features;
the preprocessing (runtime/host/images.py) vs HF's PIL image processor; the image door's
refusals.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf_vision import load_hf_vision
from jaxinfer.runtime.device.vision import VisionConfig, encode_images, init_vision_params
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.images import image_digest, load_image, pixel_values
from tests import vision_models as vm

FIELD = "messages[0].content[1].image_url"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

encode = jax.jit(encode_images, static_argnums=2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision")
    hf = vm.make_gemma3_vision(path)
    return path, hf, load_hf_vision(path)


def hf_image_features(hf, pixels: np.ndarray) -> np.ndarray:  # [N, S, S, 3] -> [N, t, D]
    with torch.no_grad():
        out = hf.model.get_image_features(torch.from_numpy(pixels).permute(0, 3, 1, 2))
    return out.pooler_output.numpy()


def random_pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, vm.IMAGE_SIZE, vm.IMAGE_SIZE, 3)
                                               ).astype(np.float32)


# --------------------------------------------------------------------------- the encoder


def test_config_from_checkpoint(gemma3):
    _, _, model = gemma3
    cfg = model.cfg
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (
        vm.IMAGE_TOKEN_ID, vm.BOI_TOKEN_ID, vm.EOI_TOKEN_ID)
    assert cfg.tokens_per_image == vm.MM_TOKENS_PER_IMAGE and cfg.tokens_per_side == 4
    assert cfg.patches_per_side == 8 and cfg.pool == 2 and cfg.num_layers == vm.VISION_LAYERS
    assert cfg.text_hidden_size == vm.TEXT_HIDDEN and cfg.image_mean == vm.IMAGE_MEAN
    hash(cfg)  # a static jit argument


@pytest.mark.parametrize("n", [1, 2])
def test_encode_images_matches_hf(gemma3, n):
    _, hf, model = gemma3
    x = random_pixels(n, seed=n)
    ref = hf_image_features(hf, x)
    ours = np.asarray(encode(model.params, jnp.asarray(x), model.cfg))
    assert ours.shape == (n, vm.MM_TOKENS_PER_IMAGE, vm.TEXT_HIDDEN) and ours.dtype == np.float32
    assert np.abs(ref).max() > 0.5  # not a degenerate oracle
    assert np.abs(ours - ref).max() <= 1e-4
    if n == 2:  # images do not leak into each other
        one = np.asarray(encode(model.params, jnp.asarray(x[1:]), model.cfg))
        assert np.abs(one[0] - ours[1]).max() <= 1e-5
        assert np.abs(ours[0] - ours[1]).max() > 0.1


def test_query_chunks_change_nothing(gemma3, monkeypatch):
    """Attention over 64 patches in query chunks of 24 (the last one 16) equals it whole."""
    from jaxinfer.runtime.device import vision

    _, _, model = gemma3
    x = jnp.asarray(random_pixels(2, seed=3))
    whole = np.asarray(vision.encode_images(model.params, x, model.cfg))
    monkeypatch.setattr(vision, "Q_CHUNK", 24)
    chunked = np.asarray(vision.encode_images(model.params, x, model.cfg))
    np.testing.assert_allclose(chunked, whole, atol=1e-6, rtol=0)


def test_pixel_values_into_encoder_match_hf_pipeline(gemma3):
    """HF's processor -> get_image_features against load_image -> pixel_values -> ours."""
    from transformers import Gemma3ImageProcessorPil

    _, hf, model = gemma3
    proc = Gemma3ImageProcessorPil.from_pretrained(gemma3[0])
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (45, 90, 3), np.uint8))
    ref = hf_image_features(
        hf, proc(images=img, return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1))
    cfg = model.cfg
    x = pixel_values(load_image(img, FIELD), cfg.image_size, cfg.image_mean, cfg.image_std)
    ours = np.asarray(encode(model.params, jnp.asarray(x[None]), cfg))
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("rename", [
    lambda k: k.replace("vision_tower.", "vision_tower.vision_model.").replace(
        "model.language_model.", "language_model.model."),  # the hub's Gemma 3 checkpoints
    lambda k: "model." + k,  # transformers 4.52+ saves
])
def test_checkpoint_name_forms(gemma3, tmp_path, rename):
    path, _, model = gemma3
    tensors = load_file(path / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    other = load_hf_vision(tmp_path)
    assert other.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_weights_close_to_f32(gemma3):
    path, _, model = gemma3
    bf = load_hf_vision(path, dtype=jnp.bfloat16)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(bf.params))
    x = jnp.asarray(random_pixels(1, seed=7))
    ref = np.asarray(encode(model.params, x, model.cfg))
    got = np.asarray(encode(bf.params, x, bf.cfg))
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


def test_missing_tensor_is_named(gemma3, tmp_path):
    path, _, _ = gemma3
    tensors = load_file(path / "model.safetensors")
    gone = "vision_tower.encoder.layers.1.mlp.fc2.bias"
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="layers.1.mlp.fc2.bias"):
        load_hf_vision(tmp_path)


@pytest.mark.parametrize("field,value", [("intermediate_size", 48), ("num_attention_heads", 3)])
def test_config_disagreeing_with_tensors_refused(gemma3, tmp_path, field, value):
    path, _, _ = gemma3
    hf = json.loads((path / "config.json").read_text())
    hf["vision_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="config.json|shape"):
        load_hf_vision(tmp_path)


def test_text_only_checkpoint_has_no_vision(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2}))
    assert load_hf_vision(tmp_path) is None  # (no weights read: there are none)


def test_unknown_vision_model_refused(gemma3, tmp_path):
    hf = json.loads((gemma3[0] / "config.json").read_text())
    hf["vision_config"]["model_type"] = "unknown_vit"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json.*unknown_vit"):
        load_hf_vision(tmp_path)
    hf["model_type"] = "some_vlm"
    hf["vision_config"]["model_type"] = "siglip_vision_model"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json.*some_vlm"):
        load_hf_vision(tmp_path)


def test_mean_std_from_preprocessor_config(gemma3, tmp_path):
    path, _, _ = gemma3
    shutil.copy(path / "config.json", tmp_path / "config.json")
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    assert load_hf_vision(tmp_path).cfg.image_mean == (0.5, 0.5, 0.5)  # no file: 0.5s
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}))
    cfg = load_hf_vision(tmp_path).cfg
    assert cfg.image_mean == CLIP_MEAN and cfg.image_std == CLIP_STD


def test_vision_config_checks_its_geometry():
    kw = dict(image_size=64, patch_size=8, hidden_size=32, num_layers=1, num_heads=2,
              intermediate_size=64, layer_norm_eps=1e-6, tokens_per_image=16,
              text_hidden_size=64, mm_norm_eps=1e-6, image_token_id=3, boi_token_id=4,
              eoi_token_id=5)
    cfg = VisionConfig(**kw)
    params = init_vision_params(cfg, jax.random.key(0))
    assert encode(params, jnp.zeros((1, 64, 64, 3)), cfg).shape == (1, 16, 64)
    for bad in (dict(tokens_per_image=15), dict(tokens_per_image=9), dict(patch_size=7)):
        with pytest.raises(ValueError):
            VisionConfig(**(kw | bad))


# --------------------------------------------------------------------------- preprocessing


def _random_image(w: int, h: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, (h, w, bands), np.uint8)
    if mode == "RGBA":  # some fully transparent, some opaque, the rest in between
        a[: h // 3, :, 3] = 0
        a[h // 3: 2 * h // 3, :, 3] = 255
    return Image.fromarray(a[..., 0] if bands == 1 else a)


@pytest.mark.parametrize("w,h,mode", [(37, 53, "RGB"), (200, 120, "RGBA"), (53, 37, "L"),
                                      (64, 64, "RGB"), (5, 300, "RGBA")])
@pytest.mark.parametrize("mean,std", [(vm.IMAGE_MEAN, vm.IMAGE_STD), (CLIP_MEAN, CLIP_STD)])
def test_pixel_values_match_hf_processor(w, h, mode, mean, std):
    from transformers import Gemma3ImageProcessorPil

    img = _random_image(w, h, mode, seed=w * h)
    proc = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=list(mean),
                                   image_std=list(std))
    ref = proc(images=img, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    ours = pixel_values(load_image(img, FIELD), 64, mean, std)
    assert ours.shape == (64, 64, 3) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= 1e-5


# --------------------------------------------------------------------------- the image door


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h RGB pixels, with a few bytes of (invalid) image data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 8))
            + chunk(b"IEND", b""))


def test_every_form_of_an_image_gives_its_pixels():
    a = np.random.default_rng(0).integers(0, 256, (17, 23, 3), np.uint8)
    png = _png(a)
    b64 = base64.b64encode(png).decode()
    forms = [png, bytearray(png), f"data:image/png;base64,{b64}", b64,
             f"  DATA:image/png;BASE64,{b64[:40]}\n{b64[40:]}  ", a, Image.fromarray(a),
             a.astype(np.float32) / 255, a.astype(np.int64)]
    for form in forms:
        img = load_image(form, FIELD)
        assert img.mode == "RGB" and img.size == (23, 17)
        np.testing.assert_array_equal(np.asarray(img), a)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=95)
    jpg = load_image(buf.getvalue(), FIELD)
    assert jpg.mode == "RGB" and jpg.size == (23, 17)


def test_transparency_composited_onto_white():
    a = np.zeros((2, 2, 4), np.uint8)
    a[0, 0] = (10, 20, 30, 255)  # opaque: kept
    a[0, 1] = (10, 20, 30, 0)  # transparent: white
    a[1, 0] = (0, 0, 0, 128)  # half: mid grey
    for form in (a, _png(a), Image.fromarray(a)):
        got = np.asarray(load_image(form, FIELD))
        assert tuple(got[0, 0]) == (10, 20, 30) and tuple(got[0, 1]) == (255, 255, 255)
        assert all(abs(int(c) - 127) <= 1 for c in got[1, 0])
    gray = load_image(np.full((3, 4), 77, np.uint8), FIELD)
    assert gray.mode == "RGB" and np.all(np.asarray(gray) == 77)


def test_image_digest_is_of_the_pixels():
    a = np.random.default_rng(1).integers(0, 256, (9, 11, 3), np.uint8)
    d = image_digest(load_image(a, FIELD))
    assert d == image_digest(load_image(_png(a), FIELD))
    opaque = np.concatenate([a, np.full((9, 11, 1), 255, np.uint8)], axis=-1)
    assert d == image_digest(load_image(_png(opaque), FIELD))
    b = a.copy()
    b[4, 5, 2] ^= 1
    assert d != image_digest(load_image(b, FIELD))
    assert d != image_digest(load_image(a[:, :10], FIELD))
    assert len(d) == 32


@pytest.mark.parametrize("value,kw,words", [
    (b"not an image at all", {}, "not a decodable image"),
    (b"", {}, "empty"),
    ("@@@ not base64 @@@", {}, "base64"),
    ("data:image/png;base64,!!!", {}, "base64"),
    ("data:text/plain;base64,aGVsbG8=", {}, "image/"),
    ("data:image/png,rawbytes", {}, "base64"),
    ("http://169.254.169.254/latest/meta-data", {}, "remote image URLs are disabled"),
    ("HTTPS://example.com/cat.png", {}, "remote image URLs are disabled"),
    ("file:///etc/passwd", {}, "file: URLs are not accepted"),
    (np.zeros((0, 5, 3), np.uint8), {}, "empty"),
    (np.zeros((4, 5, 2), np.uint8), {}, "shape"),
    (np.full((4, 5, 3), 1.5, np.float32), {}, "[0, 1]"),
    (np.full((4, 5, 3), 300, np.int32), {}, "0..255"),
    (Image.new("RGB", (0, 0)), {}, "empty"),
    (12345, {}, "int"),
    (_png_header_only(100_000, 100_000), {}, "too large"),  # PIL's own bomb error
    (_png_header_only(10_000, 10_000), dict(max_pixels=200_000_000), "too large"),  # its warning
    (_png_header_only(8_000, 8_000), {}, "limit of 50000000"),  # refused before decoding
    (_png(np.zeros((100, 100, 3), np.uint8)), dict(max_pixels=5_000), "limit of 5000"),
    (np.zeros((100, 100, 3), np.uint8), dict(max_pixels=5_000), "limit of 5000"),
    (_png(np.zeros((40, 40, 3), np.uint8))[:60], {}, "decod"),  # truncated
])
def test_bad_images_refused_naming_the_field(value, kw, words):
    with pytest.raises(RequestError) as e:
        load_image(value, FIELD, **kw)
    assert e.value.field == FIELD and FIELD in str(e.value)
    assert words in e.value.reason
