"""Qwen3-VL's image side against HF transformers: the vision tower + mergers
(runtime/device/qwen3_vl_vision.py) loaded by checkpoints/hf_vision.py vs
Qwen3VLModel.get_image_features (pooler_output and deepstack_features); the preprocessing
(runtime/host/qwen_images.py) vs HF's PIL Qwen2-VL image processor.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf_vision import load_hf_vision
from jaxinfer.runtime.device import qwen3_vl_vision as qv
from jaxinfer.runtime.device.qwen3_vl_vision import (Qwen3VLVisionConfig, encode_image,
                                                     init_qwen3_vl_vision_params)
from jaxinfer.runtime.host.qwen_images import qwen_grid, qwen_patches, smart_resize
from tests import vision_models as vm

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

encode = jax.jit(encode_image, static_argnames=("cfg", "grid"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    hf = vm.make_qwen3_vl(path)
    return path, hf, load_hf_vision(path)


@pytest.fixture(scope="module")
def processor(qwen):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(qwen[0])


def _image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, (h, w, bands), np.uint8)
    if mode == "RGBA":  # fully transparent, opaque and in-between rows
        a[: h // 3, :, 3] = 0
        a[h // 3: 2 * h // 3, :, 3] = 255
    return Image.fromarray(a[..., 0] if mode == "L" else a, mode)


def _patches(img: Image.Image, cfg: Qwen3VLVisionConfig, **kw):
    args = dict(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                merge_size=cfg.spatial_merge_size, mean=cfg.image_mean, std=cfg.image_std,
                min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels) | kw
    return qwen_patches(img, **args)


def hf_features(hf, pixel_values: np.ndarray, grids: list) -> tuple[list, list]:
    """-> per image: embeds [n, D_out], deepstack [K, n, D_out] (numpy)."""
    with torch.no_grad():
        out = hf.model.get_image_features(torch.from_numpy(pixel_values),
                                          torch.tensor(grids, dtype=torch.long))
    embeds = [e.numpy() for e in out.pooler_output]
    deep = [np.stack([f[i].numpy() for f in out.deepstack_features])
            for i in range(len(grids))]
    return embeds, deep


def _max_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max())


# --------------------------------------------------------------------------- the encoder


def test_config_from_checkpoint(qwen):
    _, _, model = qwen
    cfg = model.cfg
    assert model.kind == "qwen3_vl" and isinstance(cfg, Qwen3VLVisionConfig)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
            cfg.video_token_id) == (vm.QWEN_IMAGE_TOKEN_ID, vm.QWEN_VISION_START_TOKEN_ID,
                                    vm.QWEN_VISION_END_TOKEN_ID, vm.QWEN_VIDEO_TOKEN_ID)
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size,
            cfg.spatial_merge_size, cfg.temporal_patch_size) == (
        vm.QWEN_VISION_DEPTH, vm.QWEN_VISION_HIDDEN, vm.QWEN_VISION_HEADS, vm.QWEN_PATCH_SIZE,
        vm.QWEN_MERGE_SIZE, vm.QWEN_TEMPORAL_PATCH_SIZE)
    assert cfg.deepstack_visual_indexes == vm.QWEN_DEEPSTACK_INDEXES
    assert cfg.out_hidden_size == vm.QWEN_TEXT_HIDDEN and cfg.pos_side == 8
    assert (cfg.min_pixels, cfg.max_pixels) == (vm.QWEN_MIN_PIXELS, vm.QWEN_MAX_PIXELS)
    assert cfg.image_mean == vm.QWEN_IMAGE_MEAN and cfg.image_std == vm.QWEN_IMAGE_STD
    assert cfg.rope_theta == vm.QWEN_VISION_ROPE_THETA and cfg.layer_norm_eps == 1e-6
    hash(cfg)  # a static jit argument


def test_encode_image_matches_hf(qwen, processor):
    """Two images of different grids, in one HF call (so also: they do not leak)."""
    _, hf, model = qwen
    cfg = model.cfg
    imgs = [_image(50, 40, seed=1), _image(120, 70, seed=2)]
    batch = processor(images=imgs, return_tensors="np")
    grids = batch["image_grid_thw"].tolist()
    assert grids == [[1, 4, 6], [1, 8, 16]]
    ref_e, ref_d = hf_features(hf, batch["pixel_values"], grids)
    start = 0
    for img, grid, re_, rd in zip(imgs, grids, ref_e, ref_d):
        x, g = _patches(img, cfg)
        assert g == tuple(grid)
        np.testing.assert_array_equal(x, batch["pixel_values"][start: start + len(x)])
        start += len(x)
        e, d = encode(model.params, jnp.asarray(x), cfg, g)
        n = grid[1] * grid[2] // 4
        assert e.shape == (n, vm.QWEN_TEXT_HIDDEN) and e.dtype == jnp.float32
        assert d.shape == (2, n, vm.QWEN_TEXT_HIDDEN) and d.dtype == jnp.float32
        assert np.abs(re_).max() > 1.0 and np.abs(rd).max() > 1.0  # not a degenerate oracle
        assert _max_err(e, re_) <= 1e-4
        for k in range(2):
            assert _max_err(d[k], rd[k]) <= 1e-4
        assert np.abs(rd[0] - rd[1]).max() > 0.1 and np.abs(rd[0] - re_).max() > 0.1


def test_the_engines_bucketed_encoder_matches_hf_with_one_program_a_bucket(qwen, processor):
    """runtime/images.py encodes each image padded to its patch bucket (patch_bucket: 64, 92,
    ... patches here): three image sizes of the first bucket (4x6, 6x4, 8x8 patches) run one
    program, a larger one (8x16) a second; every image's tokens and deepstack features equal
    HF's within 1e-4 (padding attends nothing)."""
    from jaxinfer.runtime.host.image_prompt import ImageSpan
    from jaxinfer.runtime.images import KINDS

    _, hf, model = qwen
    cfg = model.cfg
    assert [qv.patch_bucket(cfg, n) for n in (1, 64, 65, 92, 93)] == [64, 64, 92, 92, 132]
    imgs = [_image(50, 40, seed=1), _image(40, 50, seed=3), _image(64, 64, seed=4),
            _image(120, 70, seed=2)]
    run = KINDS["qwen3_vl"].encoder(model)
    spans = []
    for i, img in enumerate(imgs):
        x, g = _patches(img, cfg)
        spans.append(ImageSpan(0, g[1] * g[2] // 4, bytes([i]), x, g))
    assert [s.grid for s in spans] == [(1, 4, 6), (1, 6, 4), (1, 8, 8), (1, 8, 16)]
    got, calls = run(spans[:3])
    assert calls == 3 and run.programs() == 1
    got += run(spans[3:])[0]
    assert run.programs() == 2
    batch = processor(images=imgs, return_tensors="np")
    ref_e, ref_d = hf_features(hf, batch["pixel_values"], batch["image_grid_thw"].tolist())
    for out, span, re_, rd in zip(got, spans, ref_e, ref_d):
        assert out.shape == (3, span.length, vm.QWEN_TEXT_HIDDEN)
        assert _max_err(out[0], re_) <= 1e-4 and _max_err(out[1:], rd) <= 1e-4


def test_frames_and_query_chunks_match_hf(qwen, monkeypatch):
    """t = 2 frames (attention stays within a frame) and queries split in chunks (padded)."""
    _, hf, model = qwen
    cfg = model.cfg
    rng = np.random.default_rng(5)
    monkeypatch.setattr(qv, "_Q_CHUNK", 20)  # 24 patches a frame: a padded second chunk
    for grid in [(2, 4, 6), (1, 8, 16)]:
        x = rng.uniform(-1, 1, (np.prod(grid), cfg.patch_dim)).astype(np.float32)
        (re_,), (rd,) = hf_features(hf, x, [list(grid)])
        e, d = encode_image(model.params, jnp.asarray(x), cfg, grid)  # (not the jit cache)
        assert _max_err(e, re_) <= 1e-4 and _max_err(d, rd) <= 1e-4


def test_deepstack_order_follows_the_blocks(tmp_path):
    """Unsorted deepstack_visual_indexes: HF emits the features in block order, each through
    the merger at its index's place in the list."""
    hf = vm.make_qwen3_vl(tmp_path, seed=1, vision_config=dict(deepstack_visual_indexes=[2, 0]))
    model = load_hf_vision(tmp_path)
    assert model.cfg.deepstack_visual_indexes == (2, 0)
    x = np.random.default_rng(6).uniform(-1, 1, (24, model.cfg.patch_dim)).astype(np.float32)
    (re_,), (rd,) = hf_features(hf, x, [[1, 4, 6]])
    e, d = encode(model.params, jnp.asarray(x), model.cfg, (1, 4, 6))
    assert _max_err(e, re_) <= 1e-4 and _max_err(d, rd) <= 1e-4


def test_config_checks_its_geometry():
    kw = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=48,
              num_position_embeddings=64, deepstack_visual_indexes=[1], image_token_id=3,
              vision_start_token_id=4, vision_end_token_id=5)
    cfg = Qwen3VLVisionConfig(**kw)
    assert cfg.deepstack_visual_indexes == (1,)  # a list made a tuple: hashable
    params = init_qwen3_vl_vision_params(cfg, jax.random.key(0))
    e, d = encode(params, jnp.zeros((24, cfg.patch_dim)), cfg, (1, 4, 6))
    assert e.shape == (6, 48) and d.shape == (1, 6, 48)
    for bad in (dict(num_position_embeddings=60), dict(num_heads=3),
                dict(deepstack_visual_indexes=[2]), dict(deepstack_visual_indexes=[0, 0]),
                dict(hidden_act="relu6")):
        with pytest.raises(ValueError):
            Qwen3VLVisionConfig(**(kw | bad))
    with pytest.raises(ValueError, match="merge"):
        encode_image(params, jnp.zeros((15, cfg.patch_dim)), cfg, (1, 3, 5))


# --------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("w,h,mode", [
    (37, 53, "RGB"), (120, 70, "RGB"), (45, 33, "RGBA"), (29, 31, "L"),
    (10, 12, "RGB"),  # under min_pixels: scaled up
    (300, 200, "RGB"),  # over max_pixels: scaled down
])
def test_qwen_patches_match_hf(qwen, processor, w, h, mode):
    cfg = qwen[2].cfg
    img = _image(w, h, seed=w * h, mode=mode)
    ref = processor(images=img, return_tensors="np")
    x, grid = _patches(img, cfg)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert x.dtype == np.float32 and x.shape == ref["pixel_values"].shape
    assert _max_err(x, ref["pixel_values"]) <= 1e-5
    _, gh, gw = grid
    assert gh * cfg.patch_size * gw * cfg.patch_size <= cfg.max_pixels


def test_qwen_patches_other_settings_match_hf():
    """HF's processor defaults (patch 14, CLIP mean/std) and a bilinear resample."""
    from transformers import Qwen2VLImageProcessorPil

    img = _image(97, 61, seed=8)
    for kw, ours in [
        ({}, dict(patch_size=14, temporal_patch_size=2, merge_size=2, mean=CLIP_MEAN,
                  std=CLIP_STD, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)),
        (dict(patch_size=4, merge_size=3, temporal_patch_size=1, resample=2,
              size={"shortest_edge": 500, "longest_edge": 3000}),
         dict(patch_size=4, temporal_patch_size=1, merge_size=3, mean=CLIP_MEAN, std=CLIP_STD,
              min_pixels=500, max_pixels=3000, resample=2)),
    ]:
        ref = Qwen2VLImageProcessorPil(**kw)(images=img, return_tensors="np")
        x, grid = qwen_patches(img, **ours)
        assert [list(grid)] == ref["image_grid_thw"].tolist()
        assert _max_err(x, ref["pixel_values"]) <= 1e-5


def test_qwen_grid_counts_like_hf(processor):
    for h, w in [(40, 50), (53, 37), (1000, 10), (7, 7), (2000, 3000)]:
        _, gh, gw = qwen_grid(w, h, patch_size=vm.QWEN_PATCH_SIZE, merge_size=vm.QWEN_MERGE_SIZE,
                              min_pixels=vm.QWEN_MIN_PIXELS, max_pixels=vm.QWEN_MAX_PIXELS)
        assert gh * gw == processor.get_number_of_image_patches(h, w)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 16, 1024, 16384)


# --------------------------------------------------------------------------- loading


def test_checkpoint_name_and_tower_forms(qwen, tmp_path):
    """"visual." without "model."; the tower's model_type "qwen3_vl" (transformers 4 saves)."""
    path, _, model = qwen
    tensors = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()},
              tmp_path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["vision_config"]["model_type"] = "qwen3_vl"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shutil.copy(path / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    other = load_hf_vision(tmp_path)
    assert other.kind == "qwen3_vl" and other.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_processor_defaults_and_disagreement(qwen, tmp_path):
    path, _, _ = qwen
    shutil.copy(path / "config.json", tmp_path / "config.json")
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    cfg = load_hf_vision(tmp_path).cfg  # no preprocessor_config.json: HF's processor defaults
    assert (cfg.image_mean, cfg.image_std) == (CLIP_MEAN, CLIP_STD)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.resample) == (56 * 56, 28 * 28 * 1280, 3)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        pre | {"min_pixels": 2048, "max_pixels": 4096}))  # these override `size`
    cfg = load_hf_vision(tmp_path).cfg
    assert (cfg.min_pixels, cfg.max_pixels) == (2048, 4096)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre | {"patch_size": 14}))
    with pytest.raises(CheckpointError, match="patch_size"):
        load_hf_vision(tmp_path)


def test_missing_tensor_is_named(qwen, tmp_path):
    path, _, _ = qwen
    tensors = load_file(path / "model.safetensors")
    gone = "model.visual.deepstack_merger_list.1.norm.bias"
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="deepstack_merger_list.1.norm.bias"):
        load_hf_vision(tmp_path)


def test_bf16_weights_close_to_f32(qwen):
    path, _, model = qwen
    bf = load_hf_vision(path, dtype=jnp.bfloat16)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(bf.params))
    x = jnp.asarray(np.random.default_rng(9).uniform(-1, 1, (24, model.cfg.patch_dim)),
                    jnp.float32)
    ref, _ = encode(model.params, x, model.cfg, (1, 4, 6))
    got, _ = encode(bf.params, x, bf.cfg, (1, 4, 6))
    assert got.dtype == jnp.float32
    assert _max_err(got, np.asarray(ref)) <= 0.05 * float(jnp.abs(ref).max())
