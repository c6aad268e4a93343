"""The image paths lower for the real targets (jax.export for TPU and CUDA on this CPU machine):
a whole prefill step with image rows (given inputs, how far rows see, multimodal RoPE positions,
deepstack inputs) with the Pallas backend selected, and the vision encoders at their models'
shapes."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.runtime.device.steps import step
from tests.aot import cuda_target
from tests.runtime.test_attention_backends import GEMMA3_270M, TRITON_OK, _cfg, _step_args

sds = jax.ShapeDtypeStruct


def _export(f, platform, *args, **kw):
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        return jax.export.export(jax.jit(f), platforms=[platform],
                                 disabled_checks=TRITON_OK if platform == "cuda" else ())(
            *args, **kw)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("kind", ["bidirectional", "mrope_deepstack"])
def test_prefill_step_with_image_rows_exports(platform, kind):
    """Gemma 3's image rows see their whole image (the step takes the XLA attention for them);
    Qwen3-VL's take (t, h, w) RoPE positions and deepstack inputs (the step keeps the kernel)."""
    cfg = GEMMA3_270M if kind == "bidirectional" else _cfg(  # Qwen3-VL-like heads
        num_heads=8, num_kv_heads=2, head_dim=128, hidden_size=256, qk_norm=True,
        mrope_section=(24, 20, 20))
    t = 64
    params, cache, arrays = _step_args(cfg, jnp.bfloat16, t, s=8, p=8, fused=True)
    arrays |= {"mm_embeds": sds((t, cfg.hidden_size), jnp.float32),
               "mm_mask": sds((t,), jnp.bool_)}
    if kind == "bidirectional":
        arrays["see_until"] = sds((t,), jnp.int32)
    else:
        arrays |= {"rope_positions": sds((t, 3), jnp.int32),
                   "mm_deep": sds((3, t, cfg.hidden_size), jnp.float32)}
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=t, num_logprobs=0,
                          filtered=False)
    text = _export(f, platform, params, cache, arrays).mlir_module()
    kernel = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    assert (kernel in text) == (kind != "bidirectional")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_gemma3_4b_vision_tower_exports(platform):
    from jaxinfer.runtime.device.vision import VisionConfig, encode_images, init_vision_params

    cfg = VisionConfig(image_size=896, patch_size=14, hidden_size=1152, num_layers=27,
                       num_heads=16, intermediate_size=4304, layer_norm_eps=1e-6,
                       tokens_per_image=256, text_hidden_size=2560, mm_norm_eps=1e-6,
                       image_token_id=262144, boi_token_id=255999, eoi_token_id=256000)
    params = jax.eval_shape(lambda: init_vision_params(cfg, jax.random.key(0), jnp.bfloat16))
    exported = _export(functools.partial(encode_images, cfg=cfg), platform, params,
                       sds((4, 896, 896, 3), jnp.float32))
    assert exported.out_avals[0].shape == (4, 256, 2560)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_qwen3_vl_vision_tower_exports(platform):
    from jaxinfer.runtime.device.qwen3_vl_vision import (Qwen3VLVisionConfig, encode_image,
                                                         encode_image_bucketed,
                                                         init_qwen3_vl_vision_params,
                                                         patch_bucket)

    cfg = Qwen3VLVisionConfig(depth=4, hidden_size=1152, num_heads=16, intermediate_size=4304,
                              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                              in_channels=3, out_hidden_size=4096,
                              num_position_embeddings=2304, deepstack_visual_indexes=(1, 2, 3),
                              image_token_id=151655, vision_start_token_id=151652,
                              vision_end_token_id=151653)
    params = jax.eval_shape(lambda: init_qwen3_vl_vision_params(cfg, jax.random.key(0),
                                                                jnp.bfloat16))
    grid = (1, 32, 48)  # a 512 x 768 image
    exported = _export(functools.partial(encode_image, cfg=cfg, grid=grid), platform, params,
                       sds((32 * 48, 3 * 2 * 16 * 16), jnp.float32))
    assert [a.shape for a in exported.out_avals] == [(384, 4096), (3, 384, 4096)]
    # the engine's form: padded to the image's patch bucket, the grid's sides traced
    b = patch_bucket(cfg, 32 * 48)
    ints = sds((b,), jnp.int32)
    exported = _export(functools.partial(encode_image_bucketed, cfg=cfg), platform, params,
                       sds((b, 3 * 2 * 16 * 16), jnp.float32), ints, ints, sds((b,), jnp.bool_),
                       sds((2,), jnp.int32))
    assert [a.shape for a in exported.out_avals] == [(b // 4, 4096), (3, b // 4, 4096)]
