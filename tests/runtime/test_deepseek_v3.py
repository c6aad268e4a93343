"""DeepSeek-V3 through the engine against HF transformers' DeepseekV3ForCausalLM (random init:
latent attention with a compressed q, interleaved rope dims, YaRN with mscale; sigmoid routing
over expert groups with a choice bias, a shared expert, the first layer dense). Logits over a
prefill and 16 cached decode steps: tests/runtime/test_model_hf.py (the "deepseek_v3" family)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.runtime.config import ConfigError, ModelConfig
from tests.aot import cuda_target
from tests.family_checks import (assert_pallas_interpret_equals_xla, assert_served_equals_hf,
                                 assert_tp_tokens_equal, served_dir)
from tests.model_utils import run_sequence
from tests.runtime.test_tensor_parallel import on_8_devices


@pytest.fixture(scope="module")
def deepseek(tiny_dir, tmp_path_factory):
    return served_dir("deepseek_v3", tiny_dir, tmp_path_factory.mktemp("deepseek_v3"))


def test_served_greedy_equals_hf_with_two_slots_chunks_and_prefix_hits(deepseek):
    llm = assert_served_equals_hf(*deepseek)
    # the cache: one pool a layer (V is K), one head of latent + rope dims a token
    cfg, cache = llm.engine.cfg, llm.engine.cache
    assert all(v is None for v in cache.v) and cache.k[0].shape[0] == 1
    assert cache.bytes_per_token == cfg.num_layers * (48 + 16) * 4


def test_latent_cache_compression_at_deepseek_v3s_dims():
    """Per token and layer the latent cache holds C + R = 512 + 64 values where the expanded
    attention would hold K: H * (N + R) = 128 * 192 and V: H * V = 128 * 128 (71.1x)."""
    from jaxinfer.runtime.device.kv_cache import init_cache

    cfg = DEEPSEEK_V3_ATTN
    cache = jax.eval_shape(lambda: init_cache(cfg, 4, 16, jnp.bfloat16))
    per_token = sum(np.prod(a.shape) for a in cache.k) / (4 * 16) / cfg.num_layers
    full = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert per_token == 576 and full / per_token == pytest.approx(71.11, abs=0.01)


# DeepSeek-V3's attention and routing dims (hidden width, layers and vocabulary cut: lowering
# only reads shapes)
DEEPSEEK_V3_ATTN = ModelConfig(
    family="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_layers=2,
    num_heads=128, num_kv_heads=1, head_dim=576, kv_lora_rank=512, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, query_pre_attn_scalar=192.0,
    num_experts=256, experts_per_token=8, moe_intermediate_size=256, norm_topk_prob=True,
    shared_expert_size=256, dense_layers=(0,), router_scoring="sigmoid", router_groups=8,
    router_topk_groups=4, routed_scaling=2.5,
)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_decode_step_exports(platform):
    """The whole decode step lowers for TPU (the Mosaic kernel over the 576-dim latent head)
    and CUDA (the latent head is wider than Triton's tiles: XLA's attention there)."""
    from jaxinfer.runtime.device.steps import step
    from tests.runtime.test_attention_backends import TRITON_OK, _step_args

    cfg = DEEPSEEK_V3_ATTN
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=1, num_logprobs=0,
                          filtered=False)
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        exported = jax.export.export(jax.jit(f), platforms=[platform],
                                     disabled_checks=TRITON_OK if platform == "cuda" else ())(
            *_step_args(cfg, jnp.bfloat16, 16, s=8, p=8, fused=True))
    text = exported.mlir_module()
    assert "tensor<1x64x16x576xbf16>" in text  # the latent pool: 1 head of 576
    assert ("tpu_custom_call" in text) == (platform == "tpu")


def test_pallas_interpret_attention_equals_xla(deepseek):
    assert_pallas_interpret_equals_xla(deepseek[0])


def test_each_mechanism_moves_the_logits(deepseek):
    """The HF comparison could fail: the choice bias, the group limit, the scaling, the rope
    reordering and the shared expert each move the logits well past 1e-4."""
    d, _ = deepseek
    cfg, params = load_hf(d)
    prompt = list(range(3, 40))
    want, _, _ = run_sequence(params, cfg, prompt, page_size=8, decode_steps=0)
    lay = lambda **kw: params.replace(layers=tuple(lp.replace(**{  # noqa: E731
        k: f(getattr(lp, k)) for k, f in kw.items()} if lp.router is not None else {})
        for lp in params.layers))
    variants = {
        "choice bias": (cfg, lay(router_choice_b=jnp.zeros_like)),
        "groups": (dataclasses.replace(cfg, router_groups=1, router_topk_groups=1), params),
        "scaling": (dataclasses.replace(cfg, routed_scaling=1.0), params),
        "shared expert": (cfg, lay(w_down=jnp.zeros_like)),
        "yarn mscale": (dataclasses.replace(cfg, query_pre_attn_scalar=48.0), params),
    }
    for name, (c, p) in variants.items():
        got, _, _ = run_sequence(p, c, prompt, page_size=8, decode_steps=0)
        assert np.abs(got - want).max() > 1e-3, name


@pytest.mark.parametrize("fmt,mode,bound", [("int8", "weight_only", 0.05),
                                             ("int8", "w8a8", 0.05), ("int4", None, 0.2)])
def test_quantized_tracks_the_float_model(deepseek, fmt, mode, bound):
    """The experts and latent attention's down / up projections (wq_a, wq_b, wkv_a) quantized
    as they load (the per-head w_uk / w_uv stay float): logits near the float model's, and
    exactly the float forward's over the same weights widened."""
    from jaxinfer.checkpoints.quantize import placer
    from jaxinfer.runtime.device.quantization import QuantizedArray

    d, _ = deepseek
    cfg, f32 = load_hf(d)
    _, q = load_hf(d, place=placer(fmt, jnp.float32, mode=mode))
    lp = q.layers[1]
    assert all(isinstance(getattr(lp, w), QuantizedArray)
               for w in ("we_gate", "wq_a", "wq_b", "wkv_a"))
    assert not isinstance(lp.w_uk, QuantizedArray)
    prompt = list(range(5, 40))
    want, _, _ = run_sequence(f32, cfg, prompt, page_size=8, decode_steps=0)
    got, _, _ = run_sequence(q, cfg, prompt, page_size=8, decode_steps=0)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < rel < bound, rel
    if mode != "w8a8":  # (W8A8 also rounds the activations)
        widened = jax.tree.map(lambda a: a.dequantize() if isinstance(a, QuantizedArray) else a,
                               q, is_leaf=lambda a: isinstance(a, QuantizedArray))
        ref, _, _ = run_sequence(widened, cfg, prompt, page_size=8, decode_steps=0)
        np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("bad,word", [
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"n_group": 3}, "groups"),
    ({"topk_group": 9}, "topk_group"),
    ({"scoring_func": "softmax"}, "routing"),
    ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ({"attention_bias": True}, "attention_bias"),
    ({"kv_lora_rank": "wide"}, "config.json"),
])
def test_bad_config_fields_are_config_errors(bad, word):
    from jaxinfer.checkpoints.hf_config import from_hf_config

    base = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
                kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                first_k_dense_replace=1)
    cfg = from_hf_config(base)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.q_lora_rank, cfg.dense_layers) == (24, 1, 0, (0,))
    with pytest.raises(ConfigError, match=word):
        from_hf_config({**base, **bad})


@on_8_devices
def test_tp_2_and_4_give_one_devices_greedy_tokens(tiny_dir, tmp_path):
    """Heads split by tp (the one latent head whole on every device), experts by expert."""
    def heads_split(llm, tp):
        assert len(llm.engine.params.layers[0].w_uk.sharding.device_set) == tp

    assert_tp_tokens_equal(served_dir("deepseek_v3", tiny_dir, tmp_path / "ds")[0], heads_split)


def test_absorbed_attention_equals_the_expanded_reference():
    """The algebra the engine relies on: attention over the latent head with w_uk absorbed into
    q and w_uv applied after equals attention over per-head K and V expanded from the latents
    (hand-built independent path), at small dims; and the bench tool reports the same."""
    from jaxinfer.tools.bench_mla import run

    rows = run(heads=4, lengths=[5, 17], repeats=1,
               dims=dict(kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
                         v_head_dim=10))
    for r in rows:
        assert r["max_abs_diff"] < 1e-5 and r["absorbed_ms"] > 0 and r["expanded_ms"] > 0
    # hand-worked work counts at 17 tokens, 4 heads: absorbed T^2 H (2C + R), expanded
    # T H C (N + V) x 2 + T^2 H (N + R + V)
    assert rows[1]["absorbed_gflop"] == pytest.approx(17 * 17 * 4 * 56 / 1e9)
    assert rows[1]["expanded_gflop"] == pytest.approx(
        (2 * 17 * 4 * 24 * 22 + 17 * 17 * 4 * 30) / 1e9)


def test_bf16_runs_on_cpu_and_tracks_f32(deepseek):
    """bf16 weights and cache (the per-head latent products run in f32 on XLA:CPU, which has no
    batched bf16 dot with f32 accumulation): the prefill and decode steps run and their logits
    stay near the f32 model's."""
    d, _ = deepseek
    cfg, params = load_hf(d)
    bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    prompt = list(range(3, 30))
    want, _, _ = run_sequence(params, cfg, prompt, page_size=8, decode_steps=0)
    got, _, dec = run_sequence(bf, cfg, prompt, page_size=8, decode_steps=2,
                               cache_dtype=jnp.bfloat16)
    assert np.isfinite(dec).all()
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_nan_in_unused_latent_pages_changes_nothing(deepseek, backend):
    """The latent pool is read as both K and V: NaN in the pages and slots a sequence does not
    own (a freed sequence's leftovers, the null page) must not reach its logits."""
    from jaxinfer.runtime.device.kv_cache import init_cache
    from tests.model_utils import _fwd, single_sequence_metadata

    d, _ = deepseek
    cfg, params = load_hf(d)
    tokens = jnp.asarray(list(range(3, 23)) + [0] * 4, jnp.int32)  # 20 tokens, 4 padding rows
    md = single_sequence_metadata(0, 20, 8, [2, 4, 5, 0], rows=24)
    clean = init_cache(cfg, 7, 8)
    dirty = clean.replace(k=tuple(jnp.full_like(k, jnp.nan) for k in clean.k))
    want, _ = _fwd(params, tokens, clean, md, cfg, backend)
    got, _ = _fwd(params, tokens, dirty, md, cfg, backend)
    np.testing.assert_array_equal(np.asarray(got)[:20], np.asarray(want)[:20])
    assert np.isfinite(np.asarray(got)[:20]).all()
