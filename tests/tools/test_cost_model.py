"""The cost model (tools/cost_model.py): XLA's counts of the decode step against hand-worked
figures, the layer extrapolation, the roofline and the table."""

import pytest

from jaxinfer.runtime.config import RopeScaling
from jaxinfer.tools import cost_model as cm

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=32)
# latent attention (C 32, Cq 24, N 16, R 8, V 12; one cached head of 40), the first of 3 layers
# dense, then 8 experts of 16 (top 2) and a shared expert of 16
LATENT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
              num_kv_heads=1, head_dim=40, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, num_experts=8, experts_per_token=2,
              moe_intermediate_size=16, shared_expert_size=16, dense_layers=(0,),
              norm_topk_prob=True, router_scoring="sigmoid", router_groups=4,
              router_topk_groups=2, routed_scaling=2.5)
# gpt-oss: 8 experts of 32 (top 2) in both layers, the first sliding (window 8)
GPT_OSS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, sliding_window=8, layer_types=("local", "global"),
               qkv_bias=True, num_experts=8, experts_per_token=2, moe_intermediate_size=32,
               norm_topk_prob=True, attn_sinks=True, attn_out_bias=True, router_bias=True,
               expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
# Gemma 4, every mechanism: sliding layers of 2 KV heads x 16, global ones of 1 x 32 with V = K;
# the last 2 layers (global) read layer 1's KV, their MLP twice as wide; 8 experts of 16 (top 2)
# beside every layer's dense MLP of 32; per-layer inputs of 8; a tied head
GEMMA4 = dict(family="gemma4", vocab_size=512, hidden_size=64, intermediate_size=32,
              num_layers=5, num_heads=4, num_kv_heads=2, head_dim=16, global_head_dim=32,
              global_kv_heads=1, global_k_eq_v=True, v_norm=True, sliding_window=8,
              layer_types=("local", "global", "local", "global", "global"), kv_shared_layers=2,
              double_wide_shared_mlp=True, per_layer_input_size=8, per_layer_vocab=512,
              rope_theta=1e6, rope_local_theta=1e4,
              rope_scaling=RopeScaling(kind="proportional", factor=1.0,
                                       partial_rotary_factor=0.25),
              qk_norm=True, sandwich_norms=True, embed_scale=8.0, query_pre_attn_scalar=1.0,
              final_logit_softcap=30.0, tie_word_embeddings=True, activation="gelu_tanh",
              num_experts=8, experts_per_token=2, moe_intermediate_size=16, norm_topk_prob=True,
              moe_block=True, layer_scalar=True)


def _cost(shape, layers=None, batch=4, context=64, tp=1):
    return cm.step_cost(shape, batch, context, tp, layers)


def test_extrapolation_equals_the_whole_model_compiled():
    # identical layers: one and two layers give the third
    assert cm.extrapolated(dict(SMALL, num_layers=3), 4, 64, 1) == _cost(
        dict(SMALL, num_layers=3))
    # a dense first layer, then MoE layers alternating sliding and full: one layer of each of
    # the three kinds, and each doubled, give the five layers
    mixed = dict(LATENT, num_layers=5, sliding_window=8,
                 layer_types=("local", "global", "local", "global", "local"))
    assert cm.layer_kinds(cm._config(mixed)) == [0, 1, 2, 1, 2]
    assert cm.extrapolated(mixed, 4, 64, 1) == _cost(mixed)
    # Gemma 4: a sliding and a global layer storing KV, a global one reading layer 1's; the
    # per-layer inputs' L^2 term from the first kind's layer tripled
    assert cm.layer_kinds(cm._config(GEMMA4)) == [0, 1, 0, 3, 3]
    assert cm.extrapolated(GEMMA4, 4, 64, 1) == _cost(GEMMA4)


def test_matmul_params_count_what_a_token_multiplies():
    d, h, c, cq, n, r, v = 64, 4, 32, 24, 16, 8, 12
    attn = (d * cq + cq * h * (n + r)  # wq_a, wq_b
            + d * (c + r)  # wkv_a
            + h * n * c + h * c * v  # w_uk, w_uv
            + h * v * d)  # wo
    assert attn == 1536 + 2304 + 2560 + 2048 + 1536 + 3072 == 13056
    dense = 3 * d * 96
    moe = d * 8 + 2 * 3 * d * 16 + 3 * d * 16  # router, 2 of 8 experts, the shared expert
    assert cm.matmul_params(LATENT) == 3 * attn + dense + 2 * moe + 512 * d == 109824
    # q projected directly: wq [D, H, N + R] instead of wq_a and wq_b
    assert cm.matmul_params(dict(LATENT, q_lora_rank=0)) == 109824 + 3 * (d * h * (n + r) - 3840)
    # gpt-oss: q, k, v, o; router and 2 of 8 experts (biases: no products)
    attn = d * 4 * 16 + 2 * d * 2 * 16 + 4 * 16 * d
    assert cm.matmul_params(GPT_OSS) == 2 * (attn + d * 8 + 2 * 3 * d * 32) + 512 * d == 82944
    # the published active parameters (gpt-oss-120b: 5.1B; DeepSeek-V3: 37B, with its
    # 0.9B embedding table, which a token gathers)
    assert cm.matmul_params(cm.MODELS["gpt-oss-120b"]) == pytest.approx(5.13e9, rel=0.01)
    assert cm.matmul_params(cm.MODELS["DeepSeek-V3"]) + 129280 * 7168 == pytest.approx(
        37e9, rel=0.02)
    # Gemma 4: q / k / v / o at each layer type's dims, no v where V = K, q and o alone on the
    # KV-shared layers; the dense MLP (twice as wide on the shared layers) beside the router and
    # 2 of 8 experts; the per-layer input gate and projection
    local = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64  # wq, wk, wv, wo
    glob = 64 * 4 * 32 + 64 * 1 * 32 + 4 * 32 * 64  # wq, wk, wo
    shared = 64 * 4 * 32 + 4 * 32 * 64  # wq, wo
    moe, ple = 64 * 8 + 2 * 3 * 64 * 16, 64 * 8 + 8 * 64
    layers = (2 * (local + 3 * 64 * 32 + moe + ple) + glob + 3 * 64 * 32 + moe + ple
              + 2 * (shared + 3 * 64 * 64 + moe + ple))
    assert layers == 2 * 26112 + 32256 + 2 * 36352
    # + the tied head and the embedding's projection to the 5 layers' inputs
    assert cm.matmul_params(GEMMA4) == layers + 512 * 64 + 64 * 5 * 8 == 192512
    # the published 3.8B active, 25.2B in all (its tied 0.74B table counted once, as the head)
    g4 = cm.MODELS["Gemma-4-26B-A4B"]
    assert cm.matmul_params(g4) == pytest.approx(3.8e9, rel=0.01)
    assert cm.matmul_params(dict(g4, experts_per_token=128)) == pytest.approx(25.2e9, rel=0.01)


def test_floor_reads_the_latent_head_the_window_and_the_chosen_experts():
    # latent: per token and layer one head of C + R = 40 values (K and V), whatever the tp
    assert cm.kv_bytes(LATENT, 2, 40, 1) == 3 * 2 * 40 * 40 * 2 == cm.kv_bytes(LATENT, 2, 40, 4)
    # gpt-oss: 2 KV heads x 16 dims, K and V; the sliding layer reads 8 of the 40 tokens
    assert cm.kv_bytes(GPT_OSS, 2, 40, 1) == 2 * (8 + 40) * 2 * 2 * 16 * 2 == 12288
    assert cm.kv_bytes(GPT_OSS, 2, 40, 2) == 12288 / 2
    # batch 1: one token's weights; batch 2: 8 (1 - (6/8)^2) = 3.5 distinct experts a layer
    assert cm.routed_experts(cm._config(LATENT), 1) == pytest.approx(2)
    assert cm.floor_bytes(LATENT, 1, 40, 1) == pytest.approx(109824 * 2 + 3 * 40 * 40 * 2)
    extra = 2 * 1.5 * 3 * 64 * 16  # 1.5 more experts in each MoE layer
    assert cm.floor_bytes(LATENT, 2, 40, 1) == pytest.approx((109824 + extra) * 2 + 19200)
    # Gemma 4, per token: a sliding layer 2 x 2 x 16 values over its window of 8, a global one
    # 2 x 1 x 32 (V cached apart from K) over all 40; the two KV-shared layers read layer 1's
    # again but hold none; tp 2 splits the sliding layers' 2 KV heads, not the global one
    assert cm.kv_bytes(GEMMA4, 2, 40, 1) == 2 * (2 * 8 * 64 + 3 * 40 * 64) * 2 == 34816
    assert cm.kv_bytes(GEMMA4, 2, 40, 1, stored=True) == 2 * (2 * 8 * 64 + 40 * 64) * 2
    assert cm.kv_bytes(GEMMA4, 2, 40, 2) == 2 * (2 * 8 * 32 + 3 * 40 * 64) * 2
    assert cm.floor_bytes(GEMMA4, 1, 40, 1) == pytest.approx(192512 * 2 + 34816 / 2)


def test_counts_match_hand_worked_flops_and_bytes():
    batch, context = 4, 64
    cost = _cost(SMALL, batch=batch, context=context)
    # 2 FLOPs per weight per token, plus q.k and p.v over the context for every head
    attention = 2 * 2 * batch * context * SMALL["num_heads"] * SMALL["head_dim"] * 2
    flops = 2 * batch * cm.matmul_params(SMALL) + attention
    assert flops <= cost["flops"] <= 1.5 * flops
    # f32 compile: at least every weight and the KV once, and not several times over
    floor = cm.floor_bytes(SMALL, batch=1, context=context, tp=1, itemsize=4)
    one = _cost(SMALL, batch=1, context=context)
    assert floor <= one["bytes"] <= 2 * floor
    # MoE layers: a token's active experts' products, as if dense; latent attention: q . k and
    # p . v over the cached head's C + R = 40 dims for every head
    cost = _cost(LATENT, batch=batch, context=context)
    attention = 2 * 2 * batch * context * 4 * 40 * 3
    flops = 2 * batch * cm.matmul_params(LATENT) + attention
    assert flops <= cost["flops"] <= 1.5 * flops


def test_roofline_and_fit():
    # H100: 1 TFLOP in 1.011 ms beats 1 GB in 0.299 ms -> compute-bound
    p = cm.predict(1e12, 1e9, "H100 SXM", batch=8)
    assert p["bound"] == "compute" and p["step_ms"] == pytest.approx(1e12 / 989e12 * 1e3)
    assert p["tok_s"] == pytest.approx(8 / (1e12 / 989e12))
    assert cm.predict(1e9, 1e9, "TPU v5e", batch=1)["bound"] == "bandwidth"
    big = cm.MODELS["Llama-3-70B"]
    assert not cm.fits(big, "H200 SXM", 1, 2048, 1)  # 141 GB of bf16 weights
    assert cm.fits(big, "H200 SXM", 1, 2048, 4)
    # every expert held: gpt-oss-120b's 234 GB of bf16 weights need 4 H100s
    oss = cm.MODELS["gpt-oss-120b"]
    assert not cm.fits(oss, "H200 SXM", 1, 2048, 1) and cm.fits(oss, "H100 SXM", 1, 2048, 4)
    assert not cm.fits(cm.MODELS["DeepSeek-V3"], "H200 SXM", 1, 2048, 8)  # 1.3 TB
    g4 = cm.MODELS["Gemma-4-26B-A4B"]  # 50 GB: one H100, not one TPU v6e
    assert cm.fits(g4, "H100 SXM", 1, 2048, 1) and not cm.fits(g4, "TPU v6e", 1, 2048, 1)


def test_table_from_a_small_build():
    rows = cm.build({"small": SMALL}, tps=(1,), batches=(1, 4), context=64, log=lambda s: None)
    assert [r["batch"] for r in rows] == [1, 4]
    assert rows[1]["gflops"] > rows[0]["gflops"] and all(r["H200 SXM"] for r in rows)
    md = cm.markdown(rows, "cmd")
    assert "| small | 1 | 4 |" in md and "`cmd`" in md and "bandwidth-bound" in md
    assert "Vision encoder" not in md
    vision = cm.vision_build({"tiny vision": VISION}, images=(1,), log=lambda s: None)
    both = cm.markdown(rows, "cmd", vision)
    assert both.startswith(md.rstrip("\n")) and "| tiny vision | 1 |" in both


# a small Gemma 3 vision encoder: 8 x 8 patches of 4 pixels, 2 x 2 pooled to 16 soft tokens
VISION = dict(cm.VISION_MODELS["Gemma-3-4B vision"], image_size=32, patch_size=4, hidden_size=32,
              num_layers=2, num_heads=2, intermediate_size=48, tokens_per_image=16,
              text_hidden_size=24)


def test_vision_counts_match_hand_worked_figures():
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.vision import VisionConfig, init_vision_params

    g = cm.VISION_MODELS["Gemma-3-4B vision"]
    t, dv, f = 64 * 64, 1152, 4304  # 896 / 14 = 64 patches a side
    patch = 2 * t * 14 * 14 * 3 * dv
    layer = 4 * 2 * t * dv * dv + 2 * 2 * t * t * dv + 2 * 2 * t * dv * f
    assert (patch, layer) == (5_549_064_192, 202_031_235_072)
    assert cm.vision_flops(g) == patch + 27 * layer + 2 * 256 * dv * 2560 == 5_461_902_360_576
    # every array init_vision_params makes (SigLIP so400m's ~400M, the projector, positions)
    for shape, want in ((g, 419_816_304), (VISION, None)):
        params = jax.eval_shape(lambda s=shape: init_vision_params(
            VisionConfig(**s), jax.random.key(0), jnp.bfloat16))
        n = sum(x.size for x in jax.tree.leaves(params))
        assert cm.vision_params(shape) == n == (want or n)
    # XLA counts the products and the norms, softmax and GELU besides: under 1 % more here
    xla = cm.vision_xla_flops(g, 1)
    assert cm.vision_flops(g) < xla < 1.01 * cm.vision_flops(g)
    small = cm.vision_xla_flops(VISION, 2)
    assert 2 * cm.vision_flops(VISION) < small < 1.2 * 2 * cm.vision_flops(VISION)


def test_vision_table():
    rows = cm.vision_build({"tiny vision": VISION}, images=(1, 2), log=lambda s: None)
    assert [r["images_per_call"] for r in rows] == [1, 2]
    r = rows[1]
    assert r["gflops_per_image"] == cm.vision_flops(VISION) / 1e9 == rows[0]["gflops_per_image"]
    weights = 2 * cm.vision_params(VISION)
    assert r["floor_gbytes_per_call"] * 1e9 == pytest.approx(
        weights + 2 * 4 * (32 * 32 * 3 + 16 * 24))
    assert r["scores_gbytes_per_image"] * 1e9 == pytest.approx(2 * 2 * 64 * 64 * 4)
    p = cm.predict(2 * cm.vision_flops(VISION), r["floor_gbytes_per_call"] * 1e9, "H100 SXM", 2)
    assert r["H100 SXM"] == p
    lines = cm.vision_markdown(rows)
    assert "## Vision encoder: predicted ms per image" in lines
    assert any(line.startswith("| tiny vision | 2 |") for line in lines)
