"""Both ragged paged-attention kernels lower for their real targets without a device:
`jax.export` for platforms ["tpu"] (Mosaic custom call) and ["cuda"] (Triton custom call) at the
shapes the engine uses. Catches block-shape, layout and dtype errors interpret mode never sees
(not everything the device compilers check: Mosaic's layout passes and Triton's compile run later).
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.aot import cuda_target

# Triton custom calls carry no cross-version compatibility guarantee; export refuses them unless
# told this module is for same-version use (which is what the engine does: lower and run).
TRITON_OK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
CUSTOM_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}

MAX_SEQS, PAGES_PER_SEQ, NUM_PAGES = 8, 64, 512
STEPS = {"decode8": 8, "prefill128": 128}  # T query rows: a decode batch of 8; a 128-token chunk


def export_kernel(platform, num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                  max_seqs=MAX_SEQS, kv_int8=False, sinks=False, **kw):
    sds = jax.ShapeDtypeStruct
    kv_dtype = jnp.int8 if kv_int8 else dtype
    pool = (num_kv_heads, NUM_PAGES, page_size, head_dim)
    args = (
        sds((num_tokens, num_q_heads, head_dim), dtype),
        sds(pool, kv_dtype),
        sds(pool, kv_dtype),
        sds((max_seqs,), jnp.int32),
        sds((max_seqs, PAGES_PER_SEQ), jnp.int32),
        sds((max_seqs + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    extra = []  # keyword array arguments after the seven positional ones
    if kv_int8:  # k_scale, v_scale f32[Hkv, N, ps]
        args += (sds(pool[:3], jnp.float32), sds(pool[:3], jnp.float32))
        extra += ["k_scale", "v_scale"]
    if sinks:  # f32[Hq]
        args += (sds((num_q_heads,), jnp.float32),)
        extra.append("sinks")

    def f(*a):
        return ragged_paged_attention(*a[:7], sm_scale=head_dim ** -0.5, platform=platform,
                                      **dict(zip(extra, a[7:])), **kw)

    with cuda_target() if platform == "gpu" else contextlib.nullcontext():
        exported = jax.export.export(
            jax.jit(f), platforms=["tpu" if platform == "tpu" else "cuda"],
            disabled_checks=TRITON_OK if platform == "gpu" else ())(*args)
    assert exported.out_avals[0].shape == (num_tokens, num_q_heads, head_dim)
    assert exported.out_avals[0].dtype == dtype
    text = exported.mlir_module()
    assert CUSTOM_CALL[platform] in text, f"no {CUSTOM_CALL[platform]} custom call in the module"
    if kv_int8:  # the int8 pools reach the kernel as they are: no dequantized pool-sized copy
        pool_type = "tensor<" + "x".join(map(str, pool))
        assert f"{pool_type}xi8>" in text
        for float_type in ("f32", "bf16", "f16"):
            assert f"{pool_type}x{float_type}>" not in text, f"a dequantized {float_type} copy of the pool"
    return text


def all_pairs(*axes) -> list[tuple]:
    """A covering array of strength 2: every pair of values of every two axes appears in some
    row (greedy, deterministic). Lowering depends on each axis and on how two interact (block
    shape x dtype packing, GQA grouping x head_dim, ...); the full product adds only rows whose
    every pair is already lowered elsewhere."""
    full = list(itertools.product(*axes))
    pairs = lambda row: {(i, row[i], j, row[j])  # noqa: E731
                         for i in range(len(row)) for j in range(i + 1, len(row))}
    todo = set().union(*map(pairs, full))
    rows = []
    while todo:
        best = max(full, key=lambda r: len(pairs(r) & todo))
        rows.append(best)
        todo -= pairs(best)
    return rows


def test_all_pairs_covers_every_pair_in_fewer_rows():
    axes = ([64, 128, 256], [16, 32], [1, 4, 8], ["f32", "bf16"], ["d", "p"])
    rows = all_pairs(*axes)
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(axes[i], axes[j]))
    assert 9 <= len(rows) < 20  # 3 x 3 is the least possible; the full product has 72


ENGINE_SHAPES = all_pairs(
    [64, 128, 256],  # head_dim
    [16, 32],  # page_size
    [1, 4, 8],  # GQA ratio (num_kv_heads 2)
    [jnp.float32, jnp.bfloat16],
    list(STEPS),
)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize(
    "head_dim,page_size,gqa,dtype,step", ENGINE_SHAPES,
    ids=[f"d{d}-ps{ps}-g{g}-{jnp.dtype(dt).name}-{st}" for d, ps, g, dt, st in ENGINE_SHAPES])
def test_export_engine_shapes(platform, head_dim, page_size, gqa, dtype, step):
    export_kernel(platform, STEPS[step], 2 * gqa, 2, head_dim, page_size, dtype)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_export_gemma3_270m_layers(platform):
    """Gemma 3 270M: 4 q heads / 1 kv head, head_dim 256, sliding window 512 on local layers;
    also a soft cap, an odd sequence-row count and a GQA ratio of 3 (group padding on GPU)."""
    for kw in ({"sliding_window": 512}, {}, {"soft_cap": 50.0}):
        export_kernel(platform, 16, 4, 1, 256, 16, jnp.bfloat16, **kw)
    export_kernel(platform, 40, 6, 2, 128, 16, jnp.float32, max_seqs=5)


def test_export_tpu_block_options():
    export_kernel("tpu", 128, 8, 2, 128, 16, jnp.bfloat16, block_q=64, pages_per_block=8,
                  vmem_limit_bytes=32 << 20)
    export_kernel("gpu", 128, 8, 2, 128, 16, jnp.bfloat16, block_q=8, pages_per_block=4,
                  num_warps=8, num_stages=3)
    # batch-invariant mode's fixed block (runtime/device/attention.py): one sublane tile of rows
    export_kernel("tpu", 128, 8, 2, 128, 16, jnp.float32, block_q=8)
    export_kernel("tpu", 128, 8, 2, 128, 16, jnp.bfloat16, block_q=16)


INT8_SHAPES = all_pairs([64, 128, 256], [16, 32], list(STEPS))  # head_dim, page_size, step


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("head_dim,page_size,step", INT8_SHAPES,
                         ids=[f"d{d}-ps{ps}-{st}" for d, ps, st in INT8_SHAPES])
def test_export_int8_kv(platform, head_dim, page_size, step):
    """int8 KV pages with f32 per-token scales, bf16 queries, GQA 4 (the engine's int8 KV cache)."""
    export_kernel(platform, STEPS[step], 8, 2, head_dim, page_size, jnp.bfloat16, kv_int8=True)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_export_int8_kv_options(platform):
    """int8 KV with f32 queries, a window, a soft cap, GQA 3, and explicit block options."""
    export_kernel(platform, 16, 4, 1, 256, 16, jnp.bfloat16, kv_int8=True, sliding_window=512)
    export_kernel(platform, 40, 6, 2, 128, 16, jnp.float32, max_seqs=5, kv_int8=True, soft_cap=50.0)
    blocks = (dict(block_q=64, pages_per_block=8) if platform == "tpu"
              else dict(block_q=8, pages_per_block=4, num_warps=8))
    export_kernel(platform, 128, 8, 2, 128, 16, jnp.bfloat16, kv_int8=True, **blocks)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_export_gpt_oss_sinks(platform):
    """gpt-oss 20B attention: 64 q heads / 8 kv heads, head_dim 64, bf16, a sink logit per q
    head; sliding window 128 on alternate layers; decode and prefill steps, int8 KV too."""
    export_kernel(platform, STEPS["decode8"], 64, 8, 64, 16, jnp.bfloat16, sinks=True)
    export_kernel(platform, STEPS["prefill128"], 64, 8, 64, 16, jnp.bfloat16, sinks=True,
                  sliding_window=128)
    export_kernel(platform, STEPS["decode8"], 64, 8, 64, 32, jnp.bfloat16, sinks=True,
                  kv_int8=True, sliding_window=128)
    export_kernel(platform, 40, 6, 2, 128, 16, jnp.float32, max_seqs=5, sinks=True, soft_cap=50.0)
