"""The cost model on paper: predicted decode step time and tokens/s of the jitted step on TPUs
and GPUs, from XLA's cost analysis of that step and the chips' published peaks.

    python -m jaxinfer.tools.cost_model --out docs/cost_model.md   # ~6 min on 2 CPU cores

For each model shape (Llama-3-8B, -70B, DeepSeek-V3, gpt-oss-120b, Gemma-4-26B-A4B), tensor
parallel degree and batch, the decode step (one token per sequence, every sequence at
`--context` tokens, the XLA attention path) is compiled for CPU devices standing in for the
chips, sharded as the engine shards it, and `compiled.cost_analysis()` gives one device's
FLOPs and bytes accessed. The step is compiled for a model of one layer of each kind (dense or
MoE MLP, sliding or full attention, storing its KV or reading another layer's) and for that
model with each kind's layer doubled, and the whole model's cost extrapolated from the
differences (`extrapolated`; exact: the tests compile whole models). It is compiled in f32 and
its bytes halved for bf16: XLA:CPU widens a bf16 dot's weights to f32 first, which would count
every weight five times (measured: 79.7 GB for Llama-3-8B batch 1, whose bf16 weights are
16.1 GB).

Mixture-of-experts layers are compiled as dense ones as wide as a token's active experts plus
the shared expert (Gemma 4: plus the dense MLP beside them), the router's product added by
hand (`step_cost`; XLA:CPU's own expert form loops over blocks of rows, and XLA's cost
analysis counts a loop's body once): a token's FLOPs are its experts', and XLA's bytes one
token's experts' weights (the floor's: the batch's). Latent attention (DeepSeek-V3) is
compiled as the engine runs it: absorbed up-projections, attention over the one cached head
of kv_lora_rank + rope dims. So is Gemma 4: its global layers' own KV heads and head_dim, V =
K (no V projection), KV-shared layers (no K or V projection, their MLP twice as wide with
double_wide_shared_mlp), per-layer inputs.

Two byte counts per step: XLA's (the XLA attention path gathers each sequence's pages before
attending, so it reads and writes the KV about three times) and the floor (`floor_bytes`:
weights the batch multiplies + KV read once: the Pallas kernels' goal, whose custom calls
XLA's cost analysis cannot see into). The floor's weights: every dense projection and the
vocabulary projection, and per MoE layer its router, shared expert and the distinct routed
experts `batch` tokens choose were routing uniform (`routed_experts`: k at batch 1, nearly
every expert at batch 256), Gemma 4's per-layer input projections; its KV: each layer's
heads (Gemma 4's global layers: their own KV heads and head_dim) over the context, a sliding
layer's over at most its window, latent attention's one head of kv_lora_rank + rope dims (its
K and V), a KV-shared layer's the pages of the layer it reads, once more. The prediction on a
chip is the roofline max(FLOPs / peak FLOP/s, floor bytes / HBM bandwidth); the larger term
names the bound. Not modelled: tensor-parallel all-reduces (two of [batch, hidden] per layer)
and expert parallelism's load imbalance (every device is assumed to hold 1 / tp of the
weights read: DeepSeek-V3's wq_a, wkv_a and routers are in fact replicated), routing skew,
the engine's own MoE forms (gathered expert weights, ragged_dot) and their padding, launch and
host overheads. Weights and KV are bf16 (DeepSeek-V3 in bf16, 1.3 TB, fits no chip here even
at tp 8; its FP8 checkpoint is not modelled).

The vision encoder (VISION_MODELS: Gemma 3 4B's SigLIP tower and projector, runtime/device/
vision.py) gets a table of its own, per image at one image a call and at the engine's
MAX_IMAGES_PER_CALL (runtime/images.py): FLOPs counted by hand (`vision_flops`: the products
alone) beside XLA's count of `encode_images` compiled for CPU (`vision_xla_flops`; not its bytes:
XLA:CPU's fusions change with the images a call, its count an image falling from 172 GB at
one to 55 GB at two or more), the bf16 weights (`vision_params`), the floor bytes of a
call (weights once, the f32 pixels in and soft tokens out) and the f32 attention scores the jnp
path writes per image (every layer's H x T x T), each read back at least once. The prediction
is the same roofline at the floor bytes against the dense bf16 peak: the tower's products run
in the weights' dtype (bf16) with f32 accumulation.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from jaxinfer.runtime.config import RopeScaling

# Published dense bf16 peak FLOP/s, HBM bandwidth (bytes/s) and HBM capacity (bytes) per chip.
CHIPS = {
    "TPU v5e": (197e12, 819e9, 16e9),
    "TPU v6e": (918e12, 1640e9, 32e9),
    "H100 SXM": (989e12, 3.35e12, 80e9),
    "H200 SXM": (989e12, 4.8e12, 141e9),
}
MODELS = {
    "Llama-3-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       rope_theta=500000.0),
    "Llama-3-70B": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                        rope_theta=500000.0),
    # latent attention (one cached head of 512 + 64), 256 experts top 8 + a shared one, the
    # first 3 of 61 layers dense
    "DeepSeek-V3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_layers=61, num_heads=128, num_kv_heads=1, head_dim=512 + 64,
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, query_pre_attn_scalar=128.0 + 64,
                        num_experts=256, experts_per_token=8, moe_intermediate_size=2048,
                        shared_expert_size=2048, dense_layers=(0, 1, 2), norm_topk_prob=True,
                        router_scoring="sigmoid", router_groups=8, router_topk_groups=4,
                        routed_scaling=2.5),
    # 128 experts top 4 in every layer, a 128-token window on alternate layers
    "gpt-oss-120b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                         num_layers=36, num_heads=64, num_kv_heads=8, head_dim=64,
                         rope_theta=150000.0, sliding_window=128,
                         layer_types=("local", "global") * 18, qkv_bias=True, num_experts=128,
                         experts_per_token=4, moe_intermediate_size=2880, norm_topk_prob=True,
                         attn_sinks=True, attn_out_bias=True, router_bias=True,
                         expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    # five sliding layers (8 KV heads of 256, window 1024) to one global (2 KV heads of 512,
    # V = K, a quarter of the dims rotated), 128 experts of 704 (top 8) beside a dense MLP of
    # 2112 in every layer, a tied head of 262144; no KV-shared layers, no per-layer inputs
    "Gemma-4-26B-A4B": dict(family="gemma4", vocab_size=262144, hidden_size=2816,
                            intermediate_size=2112, num_layers=30, num_heads=16, num_kv_heads=8,
                            head_dim=256, global_head_dim=512, global_kv_heads=2,
                            global_k_eq_v=True, v_norm=True, sliding_window=1024,
                            layer_types=(("local",) * 5 + ("global",)) * 5,
                            rope_theta=1000000.0, rope_local_theta=10000.0,
                            rope_scaling=RopeScaling(kind="proportional", factor=1.0,
                                                     partial_rotary_factor=0.25),
                            qk_norm=True, sandwich_norms=True, embed_scale=2816 ** 0.5,
                            query_pre_attn_scalar=1.0, final_logit_softcap=30.0,
                            tie_word_embeddings=True, activation="gelu_tanh", num_experts=128,
                            experts_per_token=8, moe_intermediate_size=704, norm_topk_prob=True,
                            moe_block=True, layer_scalar=True),
}
TP = (1, 4, 8)
BATCHES = (1, 64, 256)
# Gemma 3 4B's image side (its config.json's vision_config, mm_tokens_per_image and
# text_config.hidden_size; runtime/device/vision.py's VisionConfig fields): a SigLIP tower of 27
# layers over 64 x 64 patches of 14 pixels, then the projector (4 x 4 average pool, RMSNorm,
# [1152, 2560]) to 256 soft tokens an image
VISION_MODELS = {
    "Gemma-3-4B vision": dict(image_size=896, patch_size=14, hidden_size=1152, num_layers=27,
                              num_heads=16, intermediate_size=4304, layer_norm_eps=1e-6,
                              tokens_per_image=256, text_hidden_size=2560, mm_norm_eps=1e-6,
                              image_token_id=262144, boi_token_id=255999, eoi_token_id=256000),
}
VISION_IMAGES = (1, 4)  # images per encoder call: one, and runtime/images.py's MAX_IMAGES_PER_CALL


def _config(shape: dict):
    from jaxinfer.runtime.config import ModelConfig

    return ModelConfig(**{"family": "llama", **shape})


def mlp_width(cfg, i: int) -> int:
    """The MLP width layer i multiplies a token by: the dense MLP's (layer_intermediate: twice
    as wide on Gemma 4's KV-shared layers with double_wide_shared_mlp), or an MoE layer's active
    experts and shared expert (experts_per_token x moe_intermediate_size + shared_expert_size),
    plus the dense MLP beside them (Gemma 4's moe_block)."""
    dense = cfg.layer_intermediate(i)
    if not cfg.layer_has_experts(i):
        return dense
    experts = cfg.experts_per_token * cfg.moe_intermediate_size + cfg.shared_expert_size
    return experts + (dense if cfg.moe_block else 0)


def step_cost(shape: dict, batch: int, context: int, tp: int, layers: tuple[int, ...] | None = None,
              page_size: int = 16) -> dict[str, float]:
    """One device's {"flops", "bytes"} of the f32 decode step (compiled, not run: every input is
    abstract) of the model made of `shape`'s layers `layers` (indices into its layers, repeats
    allowed, in order, a layer reading another's KV after every layer storing its own; None:
    all of them). The layers of `shape`'s last kv_shared_layers stay KV-shared (they read the
    pages of the last earlier layer of their type among `layers`). An MoE layer is compiled as
    a dense one whose gated MLP is as wide as a token's active experts and shared expert (and
    the dense MLP beside them: `mlp_width`), its router's product
    (2 x D x E FLOPs a token, its D x E weights read whole by every device) added by hand:
    XLA:CPU's expert blocks run in a loop whose body XLA's cost analysis counts once, and
    TPU/GPU run other forms (gathered weights, ragged_dot) whose count would not be theirs."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.attention import xla_attention_only
    from jaxinfer.runtime.device.kv_cache import init_cache
    from jaxinfer.runtime.device.model import init_params
    from jaxinfer.runtime.plan import STEP_GROUPS, fields_of
    from jaxinfer.runtime.device.sharding import (cache_shardings, make_mesh, param_shardings,
                                           replicated)
    from jaxinfer.runtime.device.steps import step

    full = _config(shape)
    idx = tuple(range(full.num_layers)) if layers is None else tuple(layers)
    cfg = dataclasses.replace(
        full, num_layers=len(idx), dense_layers=(), num_experts=0, experts_per_token=0,
        moe_intermediate_size=0, shared_expert_size=0, double_wide_shared_mlp=False,
        kv_shared_layers=sum(full.layer_kv_source(i) != i for i in idx),
        layer_types=tuple(full.layer_types[i] for i in idx) if full.layer_types else ())
    by_width = {f: jax.eval_shape(lambda f=f: init_params(
        dataclasses.replace(cfg, intermediate_size=f), jax.random.key(0), dtype=jnp.float32))
        for f in {mlp_width(full, i) for i in idx}}
    params = next(iter(by_width.values()))
    params = params.replace(layers=tuple(by_width[mlp_width(full, i)].layers[j]
                                         for j, i in enumerate(idx)))
    pages = -(-context // page_size)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch * pages + 1, page_size, jnp.float32))
    dims = {"T": batch, "S": batch, "P": pages, "K": 0, "W": -(-cfg.vocab_size // 32)}
    arrays = {f.name: jax.ShapeDtypeStruct(f.extent(dims), f.dtype)
              for f in fields_of(*STEP_GROUPS)}
    mesh = make_mesh(tp, devices=jax.devices()[:tp])
    f = jax.jit(functools.partial(step, cfg=cfg, backend="xla", max_q_len=1, num_logprobs=0,
                                  filtered=False),
                in_shardings=(param_shardings(params, mesh), cache_shardings(cache, mesh),
                              replicated(mesh)))
    with xla_attention_only():  # XLA's attention ops, whose FLOPs count (not the CPU kernel)
        cost = f.lower(params, cache, arrays).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    routers = sum(full.layer_has_experts(i) for i in idx) * full.hidden_size * full.num_experts
    return {"flops": float(cost.get("flops", 0.0)) + 2 * batch * routers,
            "bytes": float(cost.get("bytes accessed", 0.0)) + 4 * routers}


def layer_kinds(cfg) -> list[int]:
    """Per layer, the first layer of its kind: the same static attention (runtime/device/model.py
    layer_kind: window, RoPE) and the same MLP (dense or MoE)."""
    from jaxinfer.runtime.device.model import layer_kind

    key = lambda i: (layer_kind(cfg, i), cfg.layer_has_experts(i))  # noqa: E731
    return [next(j for j in range(i + 1) if key(j) == key(i)) for i in range(cfg.num_layers)]


def extrapolated(shape: dict, batch: int, context: int, tp: int) -> dict[str, float]:
    """step_cost of the whole model from a model of one layer of each kind (`layer_kinds`:
    e.g. DeepSeek-V3's dense and MoE layers, gpt-oss's sliding and full ones, Gemma 4's layers
    storing their KV and those reading another's) and, for each kind, that model with the
    kind's layer doubled (the copy right after it, so KV-shared layers stay last): the
    difference is a layer of the kind, and the whole model the first plus each further layer's
    kind's difference. Exact (the tests compile whole models to check): XLA's counts add up
    over layers once every kind is present (what layers of several kinds share, e.g. a sliding
    window's mask, is in the first), but for Gemma 4's per-layer inputs: each layer's fusion
    recomputes the whole [T, L, P] input it slices its own from, a term in L^2. With them one
    more compile, the first kind's layer tripled, gives that term's second difference 2c, and
    the m further layers add c m (m - 1) to their differences (each difference holds the c
    (2 k + 1) of a (k + 1)-th layer)."""
    kinds = layer_kinds(_config(shape))
    reps = tuple(dict.fromkeys(kinds))  # the first layer of each kind

    def cost(j: int = 0, more: int = 0) -> dict[str, float]:  # reps, `more` copies of the j-th
        return step_cost(shape, batch, context, tp,
                         reps[:j + 1] + (reps[j],) * more + reps[j + 1:])

    base = cost()
    per = {r: {k: v - base[k] for k, v in cost(j, 1).items()} for j, r in enumerate(reps)}
    m = len(kinds) - len(reps)
    c = dict.fromkeys(base, 0.0)
    if _config(shape).per_layer_input_size and m > 1:
        c = {k: (v - base[k] - 2 * per[reps[0]][k]) / 2 for k, v in cost(0, 2).items()}
    return {k: base[k] + sum(per[r][k] for i, r in enumerate(kinds) if r != i) + c[k] * m * (m - 1)
            for k in base}


def layer_params(cfg, i: int, experts: float) -> float:
    """Weights layer i's products read for its tokens: attention's projections (latent
    attention: wq_a and wq_b, or wq; wkv_a; w_uk; w_uv; wo; else wq, wk, wv, wo at the layer's
    own KV heads and head_dim, no wv where V is K and neither wk nor wv on a layer reading
    another's KV), then the dense MLP (layer_intermediate wide), or an MoE layer's router,
    `experts` routed experts and its shared expert (and with moe_block the dense MLP beside
    them), then Gemma 4's per-layer input gate and projection. Norms and biases: none."""
    d = cfg.hidden_size
    if cfg.latent_attention:
        h, c, cq = cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = d * cq + cq * h * (n + r) if cq else d * h * (n + r)
        attn = q + d * (c + r) + h * n * c + h * c * v + h * v * d
    else:
        hq, hkv, dh = cfg.num_heads, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
        kv = 0 if cfg.layer_kv_source(i) != i else 1 if cfg.layer_k_eq_v(i) else 2
        attn = d * (hq + kv * hkv) * dh + hq * dh * d
    attn += 2 * d * cfg.per_layer_input_size
    dense = 3 * d * cfg.layer_intermediate(i)
    if not cfg.layer_has_experts(i):
        return attn + dense
    return (attn + d * cfg.num_experts + experts * 3 * d * cfg.moe_intermediate_size
            + 3 * d * cfg.shared_expert_size + (dense if cfg.moe_block else 0))


def model_params(cfg) -> int:
    """Weights outside the layers a token multiplies: the vocabulary projection and Gemma 4's
    projection of the embedding to the per-layer inputs (the embedding tables' rows are a
    gather: not counted)."""
    return (cfg.vocab_size + cfg.num_layers * cfg.per_layer_input_size) * cfg.hidden_size


def matmul_params(shape: dict) -> int:
    """Weights a token multiplies: every layer's projections (an MoE layer's router, its
    experts_per_token active experts and its shared expert) and model_params."""
    cfg = _config(shape)
    return sum(layer_params(cfg, i, cfg.experts_per_token) for i in range(cfg.num_layers)) + (
        model_params(cfg))


def routed_experts(cfg, batch: int) -> float:
    """Distinct experts an MoE layer reads for `batch` tokens, each choosing experts_per_token
    of num_experts, were the choices uniform and independent: E (1 - (1 - k / E)^batch)."""
    e, k = cfg.num_experts, cfg.experts_per_token
    return e * (1 - (1 - k / e) ** batch) if e else 0.0


def kv_bytes(shape: dict, batch: int, context: int, tp: int, itemsize: int = 2,
             stored: bool = False) -> float:
    """Bytes of KV pages one device reads per decode step: each layer's K and V heads at its
    own KV heads and head_dim (latent attention: its one head of kv_lora_rank +
    qk_rope_head_dim, both K and V; a global Gemma 4 layer whose V is K's projection still
    caches V apart: K is normed and rotated, V only normed) over the context (a sliding layer:
    at most its window), the KV heads split over min(tp, KV heads). A KV-shared layer reads its
    source layer's pages once more. stored: the pages held instead, which the KV-shared layers
    add none to."""
    cfg = _config(shape)
    total = 0.0
    for i in range(cfg.num_layers):
        if stored and cfg.layer_kv_source(i) != i:
            continue
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.latent_attention
                     else 2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i))
        tokens = min(context, cfg.layer_window(i) or context)
        total += tokens * per_token / min(tp, cfg.layer_kv_heads(i))
    return batch * total * itemsize


def floor_bytes(shape: dict, batch: int, context: int, tp: int, itemsize: int = 2) -> float:
    """Bytes one device must read per decode step: its shard of the weights the batch
    multiplies (the embedding table's rows are a gather: not counted; an MoE layer's
    routed_experts for `batch` tokens) and its KV heads' pages (kv_bytes)."""
    cfg = _config(shape)
    experts = routed_experts(cfg, batch)
    weights = sum(layer_params(cfg, i, experts) for i in range(cfg.num_layers)) + (
        model_params(cfg))
    return weights * itemsize / tp + kv_bytes(shape, batch, context, tp, itemsize)


def predict(flops: float, nbytes: float, chip: str, batch: int) -> dict:
    peak, bw, _ = CHIPS[chip]
    t_flops, t_bytes = flops / peak, nbytes / bw
    step_s = max(t_flops, t_bytes)
    return {"step_ms": step_s * 1e3, "tok_s": batch / step_s,
            "bound": "compute" if t_flops > t_bytes else "bandwidth"}


def fits(shape: dict, chip: str, batch: int, context: int, tp: int) -> bool:
    """Weights (every expert, the embedding table too unless tied to the head, Gemma 4's
    per-layer table) and the KV pages held fit in 90 % of one chip's HBM."""
    cfg = _config(shape)
    tables = ((not cfg.tie_word_embeddings) * cfg.vocab_size * cfg.hidden_size
              + cfg.per_layer_vocab * cfg.num_layers * cfg.per_layer_input_size)
    weights = sum(layer_params(cfg, i, cfg.num_experts) for i in range(cfg.num_layers)) + (
        model_params(cfg) + tables)
    return weights * 2 / tp + kv_bytes(shape, batch, context, tp, stored=True) < (
        0.9 * CHIPS[chip][2])


def build(models=MODELS, tps=TP, batches=BATCHES, context: int = 2048, log=print) -> list[dict]:
    rows = []
    for name, shape in models.items():
        for tp in tps:
            for batch in batches:
                t0 = time.perf_counter()
                cost = extrapolated(shape, batch, context, tp)
                xla_bytes = cost["bytes"] / 2  # f32 -> bf16
                floor = floor_bytes(shape, batch, context, tp)
                row = {"model": name, "tp": tp, "batch": batch, "context": context,
                       "gflops": cost["flops"] / 1e9, "xla_gbytes": xla_bytes / 1e9,
                       "floor_gbytes": floor / 1e9}
                for chip in CHIPS:
                    ok = fits(shape, chip, batch, context, tp)
                    row[chip] = predict(cost["flops"], floor, chip, batch) if ok else None
                rows.append(row)
                log(f"{name} tp{tp} batch {batch}: {row['gflops']:.0f} GFLOP, "
                    f"{row['xla_gbytes']:.1f} GB XLA, {row['floor_gbytes']:.1f} GB floor "
                    f"({time.perf_counter() - t0:.1f} s)")
    return rows


def vision_flops(shape: dict) -> int:
    """FLOPs one image takes through the vision encoder (2 a multiply-add; the products alone:
    norms, biases, softmax, GELU and the pooling are left out, under 1 % of XLA's count at
    Gemma 3's size). T = (S / P)^2 patches of P x P x 3 values, width Dv, MLP width F, L layers:
    patch embedding 2 T (3 P^2) Dv; per layer q, k, v and o 4 x 2 T Dv^2, the scores q . k and
    their weighted sum of v 2 x 2 T^2 Dv (over all heads: H x Dh = Dv), fc1 and fc2 2 x 2 T Dv F;
    the projector 2 t Dv D (t soft tokens, D the text width)."""
    s = shape
    t, dv, f = (s["image_size"] // s["patch_size"]) ** 2, s["hidden_size"], s["intermediate_size"]
    layer = 4 * 2 * t * dv * dv + 2 * 2 * t * t * dv + 2 * 2 * t * dv * f
    return (2 * t * 3 * s["patch_size"] ** 2 * dv + s["num_layers"] * layer
            + 2 * s["tokens_per_image"] * dv * s["text_hidden_size"])


def vision_params(shape: dict) -> int:
    """Every weight of the vision encoder (init_vision_params' arrays): patch embedding and its
    bias, position embeddings, per layer two LayerNorms, q / k / v / o and fc1 / fc2 with their
    biases, the post LayerNorm, the projector's norm and matrix."""
    s = shape
    t, dv, f = (s["image_size"] // s["patch_size"]) ** 2, s["hidden_size"], s["intermediate_size"]
    layer = 2 * 2 * dv + 4 * (dv * dv + dv) + dv * f + f + f * dv + dv
    return ((3 * s["patch_size"] ** 2 + 1) * dv + t * dv + s["num_layers"] * layer + 3 * dv
            + dv * s["text_hidden_size"])


def vision_xla_flops(shape: dict, images: int) -> float:
    """XLA's FLOPs of encode_images on `images` images, compiled for CPU (not run: abstract
    bf16 weights and f32 pixels)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.vision import VisionConfig, encode_images, init_vision_params

    cfg = VisionConfig(**shape)
    params = jax.eval_shape(lambda: init_vision_params(cfg, jax.random.key(0), jnp.bfloat16))
    pixels = jax.ShapeDtypeStruct((images, cfg.image_size, cfg.image_size, 3), jnp.float32)
    f = jax.jit(functools.partial(encode_images, cfg=cfg))
    cost = f.lower(params, pixels).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def vision_build(models=VISION_MODELS, images=VISION_IMAGES, log=print) -> list[dict]:
    """Per model and images per call: GFLOP an image (by hand and XLA's), weight GB (bf16),
    floor GB a call (weights once, f32 pixels in, f32 soft tokens out), scores GB an image
    (every layer's f32 H x T x T, written once), and per chip the roofline (`predict`: its
    step_ms is a call's, tok_s images/s)."""
    rows = []
    for name, shape in models.items():
        s, flops = shape, vision_flops(shape)
        weights = 2 * vision_params(shape)
        t = (s["image_size"] // s["patch_size"]) ** 2
        for n in images:
            t0 = time.perf_counter()
            io = n * 4 * (3 * s["image_size"] ** 2 + s["tokens_per_image"] * s["text_hidden_size"])
            row = {"model": name, "encoder": "vision", "images_per_call": n,
                   "gflops_per_image": flops / 1e9,
                   "xla_gflops_per_image": vision_xla_flops(shape, n) / n / 1e9,
                   "weight_gbytes": weights / 1e9, "floor_gbytes_per_call": (weights + io) / 1e9,
                   "scores_gbytes_per_image": s["num_layers"] * s["num_heads"] * t * t * 4 / 1e9}
            for chip in CHIPS:
                row[chip] = predict(n * flops, weights + io, chip, n)
            rows.append(row)
            log(f"{name} {n} a call: {row['gflops_per_image']:.0f} GFLOP an image, XLA "
                f"{row['xla_gflops_per_image']:.0f} ({time.perf_counter() - t0:.1f} s)")
    return rows


def vision_markdown(rows: list[dict]) -> list[str]:
    chips = list(CHIPS)
    out = [
        "", "## Vision encoder: predicted ms per image", "",
        ("The image side of a vision-language model (runtime/device/vision.py), per image at one "
         "image a call and at the engine's MAX_IMAGES_PER_CALL (runtime/images.py). GFLOP: the "
         "products counted by hand (patch embedding; q, k, v, o, the scores and their weighted "
         "sum; the MLP; the projector) and XLA's count of the compiled encoder (the norms, "
         "softmax and GELU besides). Floor: a call's bf16 weights read once, its f32 pixels in "
         "and soft tokens out. Scores: every layer's f32 attention scores (H x T x T) an image, "
         "which the jnp attention writes and reads back: not in the floor. Each cell: predicted "
         "ms per image / images/s at the floor bytes against the dense bf16 peak, and the "
         "bound; the encoder's products run in bf16 (the weights' dtype) with f32 "
         "accumulation."),
        "",
        "| model | images a call | GFLOP an image | GFLOP, XLA | weight GB | GB a call, floor | "
        "scores GB an image | " + " | ".join(chips) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(chips),
    ]
    for r in rows:
        n = r["images_per_call"]
        cells = [f"{r[c]['step_ms'] / n:.2f} / {r[c]['tok_s']:,.0f} {r[c]['bound'][0].upper()}"
                 for c in chips]
        out.append(f"| {r['model']} | {n} | {r['gflops_per_image']:,.0f} | "
                   f"{r['xla_gflops_per_image']:,.0f} | {r['weight_gbytes']:.2f} | "
                   f"{r['floor_gbytes_per_call']:.2f} | {r['scores_gbytes_per_image']:.1f} | "
                   + " | ".join(cells) + " |")
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        r = mine[0]
        ratio = r["gflops_per_image"] * r["images_per_call"] / r["floor_gbytes_per_call"]
        bounds = {r[c]["bound"] for r in mine for c in chips}
        bound = f"{bounds.pop()}-bound on every chip" if len(bounds) == 1 else "bound as marked"
        two = {c: 2 * r["scores_gbytes_per_image"] / CHIPS[c][1] * 1e12 for c in chips}
        slower = [c for c in chips if two[c] > r[c]["step_ms"] / r["images_per_call"]]
        pace = ("on every chip" if len(slower) == len(chips) else
                "on " + ", ".join(slower) if slower else "on no chip")
        out += ["", (f"{name}: {ratio:,.0f} FLOPs a floor byte at {r['images_per_call']} image "
                     f"a call, so {bound} at the floor. Its scores written and read back once "
                     "at HBM bandwidth take " + ", ".join(f"{c} {t:.1f} ms" for c, t in two.items())
                     + f" an image: more than the floor's time {pace}, where unless the "
                     "attention is fused (a flash kernel) their traffic, not the products, sets "
                     "the pace.")]
    return out


def markdown(rows: list[dict], command: str, vision: list[dict] = ()) -> str:
    chips = list(CHIPS)
    out = [
        "# Cost model: predicted decode step on TPU and GPU",
        "",
        (f"Made by `{command}` from XLA's cost analysis of the jitted decode step (one "
         "device's share under tensor parallelism) and published chip peaks:"),
        "",
        "| chip | dense bf16 FLOP/s | HBM bandwidth | HBM |",
        "|---|---|---|---|",
    ]
    for c, (f, b, m) in CHIPS.items():
        out.append(f"| {c} | {f / 1e12:.0f} T | {b / 1e9:.0f} GB/s | {m / 1e9:.0f} GB |")
    out += [
        "",
        ("Each cell: predicted ms per step / tokens/s at the floor bytes, and the bound (B = HBM "
         "bandwidth, C = compute); `-` = weights + KV do not fit the chips' HBM. Context "
         f"{rows[0]['context']} tokens per sequence, bf16 weights and KV. GFLOP and GB are one "
         "device's per step; floor = weight shard + KV read once (the Pallas kernels' goal), "
         "XLA path = XLA's count for the XLA attention path, which gathers pages first. "
         "Mixture-of-experts layers are compiled as dense ones as wide as a token's active "
         "experts and shared expert (Gemma 4: and the dense MLP beside them): their FLOPs are "
         "those experts', their XLA-path bytes one token's experts; the floor reads the "
         "distinct experts the batch chooses were routing uniform. Sliding-window layers read "
         "at most their window of KV, latent attention its one head of kv_lora_rank + rope "
         "dims, Gemma 4's global layers their own KV heads and head_dim (V = K: no V "
         "projection, V still cached)."),
        "",
        "| model | tp | batch | GFLOP | GB, XLA path | GB, floor | " + " | ".join(chips) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(chips),
    ]
    for r in rows:
        cells = []
        for c in chips:
            p = r[c]
            cells.append("-" if p is None else
                         f"{p['step_ms']:.2f} / {p['tok_s']:,.0f} {p['bound'][0].upper()}")
        out.append(f"| {r['model']} | {r['tp']} | {r['batch']} | {r['gflops']:,.0f} | "
                   f"{r['xla_gbytes']:.2f} | {r['floor_gbytes']:.2f} | " + " | ".join(cells)
                   + " |")
    ridge = ", ".join(f"{c} {f / b:.0f}" for c, (f, b, _) in CHIPS.items())
    compute = [f"{r['model']} tp{r['tp']} batch {r['batch']} on {c}" for r in rows for c in chips
               if r[c] is not None and r[c]["bound"] == "compute"]
    verdict = ("Every shape here is bandwidth-bound." if not compute else
               "Compute-bound: " + "; ".join(compute) + ". Every other shape is bandwidth-bound.")
    out += ["", (f"{verdict} A decode step does about 1 FLOP per weight "
                 "byte per sequence in the batch, so the weights alone would need a batch above "
                 f"each chip's FLOP-per-byte ridge ({ridge}) to be compute-bound, and the KV "
                 "reads grow with batch × context at a few FLOPs per byte.")]
    out += ["", ("Not modelled: tensor-parallel all-reduces (two of [batch, hidden] per layer), "
                 "expert parallelism's load imbalance and routing skew, replicated weights "
                 "(each device is taken to read 1 / tp of them), the engine's own MoE forms "
                 "(gathered expert weights, ragged_dot), launch and host overheads, and the "
                 "fusion differences between XLA:CPU, whose counts these are, and XLA:TPU/GPU. "
                 "Weights are bf16 (DeepSeek-V3's FP8 checkpoint is not modelled). No device "
                 "run exists yet to set beside these predictions (`jaxinfer bench device` "
                 "makes one)."), ""]
    if vision:
        out[-1:] = vision_markdown(vision) + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.tools.cost_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the markdown table here (and .json beside)")
    p.add_argument("--context", type=int, default=2048)
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", max(TP))
    jax.config.update("jax_platforms", "cpu")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = build(context=args.context, log=log)
    vision = vision_build(log=log)
    cmd = "python -m jaxinfer.tools.cost_model" + (f" --out {args.out}" if args.out else "")
    md = markdown(rows, cmd, vision)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps(rows + vision, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
