"""The model's attention backends agree, and the whole jitted step lowers for TPU and CUDA.

- the XLA path (CPU serving) vs the kernels' jnp reference over the parameter product, with
  unused pages NaN-filled;
- the model forward with the Pallas kernel (interpret mode) vs the XLA path;
- `jax.export` of runtime.device.steps.step with attention_backend pallas for ["tpu"] and ["cuda"].
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from jaxinfer.runtime.device.attention import resolve_backend, xla_ragged_paged_attention
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.fused_projections import fuse_projections
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import init_params
from jaxinfer.runtime.plan import STEP_GROUPS, fields_of
from jaxinfer.runtime.device.processors import init_state
from jaxinfer.runtime.device.steps import step
from jaxinfer.runtime.host.processors import Dims
from tests.aot import cuda_target
from tests.model_utils import run_sequence
from tests.pallas_kernels.test_ragged_paged_attention import make_case

MIXED = lambda ps: [(1, 1), (0, 0), (1, ps - 1), (5, ps), (1, ps + 1), (12, 4 * ps + 3),  # noqa: E731
                    (1, 6 * ps), (5, ps + 1)]


# Jitted: one program per case instead of one per primitive and shape (eager dispatch).
_xla_jit = jax.jit(xla_ragged_paged_attention,
                   static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len"))
_reference_jit = jax.jit(ragged_paged_attention_reference,
                         static_argnames=("sm_scale", "sliding_window", "soft_cap"))


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["g1", "g4", "g8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("window,dtype", [(None, jnp.float32), (7, jnp.float32),
                                          (None, jnp.bfloat16)], ids=["f32", "f32-w7", "bf16"])
def test_xla_path_matches_reference(heads, head_dim, page_size, window, dtype):
    hq, hkv = heads
    case = make_case(MIXED(page_size), num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, seed=head_dim + page_size)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    out = _xla_jit(*case.args, **kw, max_q_len=16)
    ref = _reference_jit(*case.args, **kw)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any(), "an unused (NaN) page leaked into the output"
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out[case.owned], ref[case.owned], atol=tol, rtol=tol)
    assert (out[~case.owned] == 0).all()



@pytest.mark.parametrize("seqs,max_q,window,gather_bytes", [
    ([(1, 40), (1, 3), (1, 97)], 1, None, None),  # decode-only: one-row tiles
    ([(1, 40), (1, 3), (1, 97)], 1, 9, None),  # decode under a window: only its pages gathered
    # 20 decodes: tiles in groups, each reading the chunks its longest sequence needs
    ([(1, n) for n in (1, 200, 9, 64, 65, 130, 7, 3, 150, 33, 2, 90, 120, 8, 1, 17, 66, 5,
                       199, 40)], 1, None, None),
    ([(70, 70), (1, 33), (33, 80)], 128, None, None),  # 32-row tiles, a prompt of 3 tiles
    ([(70, 70), (1, 33), (33, 80)], 128, 20, None),
    ([(70, 70), (1, 33), (33, 80)], 128, 20, 1),  # tiles run one at a time (lax.map)
], ids=["decode", "decode-w9", "decode-groups", "tiles", "tiles-w20", "tiles-seq"])
def test_xla_path_query_tiles(monkeypatch, seqs, max_q, window, gather_bytes):
    """The tiled XLA path over prompts longer than one tile, windows narrower than the context
    (tiles gather a page window), and the sequential-tiles branch, vs the reference."""
    import jaxinfer.runtime.device.attention as ra

    if gather_bytes is not None:
        monkeypatch.setattr(ra, "_GATHER_BYTES", gather_bytes)
    case = make_case(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, seed=3)
    kw = dict(sm_scale=0.125, sliding_window=window, soft_cap=30.0)
    # a jit of its own: _GATHER_BYTES (patched above) is read when the path traces
    fresh = jax.jit(functools.partial(ra.xla_ragged_paged_attention),
                    static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_q_len"))
    out = np.asarray(fresh(*case.args, **kw, max_q_len=max_q))
    ref = np.asarray(_reference_jit(*case.args, **kw))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out[case.owned], ref[case.owned], atol=1e-5, rtol=1e-5)
    assert (out[~case.owned] == 0).all()

def _cfg(**kw) -> ModelConfig:
    base = dict(family="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, bos_token_id=1,
                eos_token_ids=(2,))
    return ModelConfig(**{**base, **kw})


GEMMA_LIKE = dict(family="gemma3", num_heads=4, num_kv_heads=1, qk_norm=True, sandwich_norms=True,
                  activation="gelu_tanh", embed_scale=128 ** 0.5, query_pre_attn_scalar=64.0,
                  sliding_window=8, layer_types=("local", "global"), rope_local_theta=10000.0,
                  rope_theta=1e6, tie_word_embeddings=True)


@pytest.mark.parametrize("kind,kv", [("llama", "f32"), ("gemma_like", "f32"),
                                     ("gemma_like", "int8"), ("llama", "fp8")])
def test_model_pallas_interpret_equals_xla(kind, kv):
    cfg = _cfg(**(GEMMA_LIKE if kind == "gemma_like" else {}))
    params = init_params(cfg, jax.random.key(1), scale=0.1)
    prompt = list(np.random.RandomState(0).randint(3, 256, size=21))  # crosses the window
    cache_dtype = jnp.float32 if kv == "f32" else kv
    runs = {b: run_sequence(params, cfg, prompt, page_size=16, backend=b, decode_steps=6,
                            cache_dtype=cache_dtype) for b in ("xla", "pallas_interpret")}
    (pa, ta, da), (pb, tb, db) = runs["xla"], runs["pallas_interpret"]
    assert np.abs(pa - pb).max() <= 1e-5
    assert ta == tb
    assert np.abs(da - db).max() <= 1e-5


def test_resolve_backend():
    assert resolve_backend(None, "cpu") == "xla"
    assert resolve_backend(None, "tpu") == "pallas_tpu"
    assert resolve_backend("pallas", "gpu") == "pallas_gpu"
    assert resolve_backend("pallas_interpret", "cpu") == "pallas_interpret"
    with pytest.raises(ValueError, match="needs a TPU or GPU"):
        resolve_backend("pallas", "cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("flash", "cpu")


# --------------------------------------------------------------- lowering of the whole step

GEMMA3_270M = ModelConfig(
    family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
    num_heads=4, num_kv_heads=1, head_dim=256, qk_norm=True, sandwich_norms=True,
    activation="gelu_tanh", embed_scale=640 ** 0.5, query_pre_attn_scalar=256.0,
    sliding_window=512, layer_types=tuple("global" if (i + 1) % 6 == 0 else "local"
                                          for i in range(18)),
    rope_local_theta=10000.0, rope_theta=1e6, tie_word_embeddings=True,
)
TRITON_OK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def _step_args(cfg, dtype, t, s, p, num_pages=64, page_size=16, fused=False, tp=1,
               kv_dtype=None):
    """Abstract step arguments; `fused`: Q/K/V and gate/up joined, as engines on TPU/GPU hold
    them (runtime/device/fused_projections.py; for `tp` devices); `kv_dtype`: the pools'
    (dtype, or "int8" / "fp8"), else `dtype`."""
    sds = jax.ShapeDtypeStruct
    fuse = (lambda x: fuse_projections(x, tp)) if fused else (lambda x: x)
    params = jax.eval_shape(lambda: fuse(init_params(cfg, jax.random.key(0), dtype=dtype)))
    kv = dtype if kv_dtype is None else kv_dtype
    cache = jax.eval_shape(lambda: init_cache(cfg, num_pages, page_size, kv))
    dims = {"T": t, "S": s, "P": p, "K": 0, "W": -(-cfg.vocab_size // 32)}
    arrays = {f.name: sds(f.extent(dims), f.dtype) for f in fields_of(*STEP_GROUPS)}
    return params, cache, arrays


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("model,dtype", [
    ("gemma3_270m", jnp.bfloat16),
    ("llama_d128_gqa4", jnp.bfloat16),
    ("llama_d64_gqa1", jnp.float32),
])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_step_exports_with_pallas(platform, model, dtype, shape):
    cfg = {
        "gemma3_270m": GEMMA3_270M,
        "llama_d128_gqa4": _cfg(num_heads=8, num_kv_heads=2, head_dim=128, hidden_size=256),
        "llama_d64_gqa1": _cfg(num_heads=2, num_kv_heads=2),
    }[model]
    t, q = (16, 1) if shape == "decode" else (64, 64)
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    # with the logits processors' state (8 slots): they lower for the target too
    procs = jax.eval_shape(lambda: init_state(8, Dims(cfg.vocab_size).shapes()))
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=q, num_logprobs=20,
                          filtered=True)
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        exported = jax.export.export(
            jax.jit(lambda *args, procs: f(*args, procs=procs)), platforms=[platform],
            disabled_checks=TRITON_OK if platform == "cuda" else ())(
            *_step_args(cfg, dtype, t, s=8, p=8, fused=True), procs=procs)
    packed = exported.out_avals[0]
    assert (8, cfg.vocab_size) in [a.shape for a in exported.out_avals]  # processors' counts
    assert packed.shape == (8, 1 + 1 + 2 * 20) and packed.dtype == jnp.float32
    text = exported.mlir_module()
    hkv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.hidden_size
    assert f"tensor<{d}x{hkv}x{g + 2}x{cfg.head_dim}x" in text  # the fused Q/K/V weight
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_step_with_fp8_kv_pages_exports(platform):
    """The whole decode step over fp8 (e4m3) KV pages lowers for TPU and CUDA: the kernel's
    call takes the f8E4M3FN pages and their f32 scales as they are (no dequantized copy)."""
    cfg = GEMMA3_270M
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=1, num_logprobs=0,
                          filtered=False)
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        exported = jax.export.export(jax.jit(f), platforms=[platform],
                                     disabled_checks=TRITON_OK if platform == "cuda" else ())(
            *_step_args(cfg, jnp.bfloat16, 16, s=8, p=8, fused=True, kv_dtype="fp8"))
    text = exported.mlir_module()
    pages = f"tensor<{cfg.num_kv_heads}x64x16x{cfg.head_dim}xf8E4M3FN>"
    assert text.count(pages) >= 2 * cfg.num_layers  # K and V pools of every layer, in and out
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


def _gguf_kept(params, group: int = 32):
    """Abstract params with every matmul weight as GGUF blocks kept quantized (int8 values,
    f32 per-group scales and offsets along the axis the weight's einsum contracts)."""
    from jaxinfer.checkpoints.quantize import WEIGHT_REDUCE_AXES
    from jaxinfer.runtime.device.quantization import QuantizedArray
    from jaxinfer.runtime.device.tree_paths import path_str

    group_axis = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 0, "w_up": 0, "w_down": 0,
                  "embed": 1, "lm_head": 1}

    def one(kp, a):
        name = path_str(kp).rsplit(".", 1)[-1]
        if name not in group_axis:
            return a
        ax = group_axis[name]
        groups = tuple(n // group if i == ax else n for i, n in enumerate(a.shape))
        f32 = jax.ShapeDtypeStruct(groups, jnp.float32)
        return QuantizedArray(values=jax.ShapeDtypeStruct(a.shape, jnp.int8), scales=f32,
                              offsets=f32, fmt="gguf", mode="weight_only",
                              reduce_axes=WEIGHT_REDUCE_AXES[name], group_size=group,
                              group_axis=ax, dtype=a.dtype.name)

    return jax.tree_util.tree_map_with_path(one, params)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_step_with_gguf_blocks_kept_exports(platform):
    """The default model's step with its GGUF blocks kept (what TPU/GPU load by default) lowers
    for both targets, the int8 block values reaching the program as they are."""
    cfg = GEMMA3_270M
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=1, num_logprobs=20,
                          filtered=True)
    params, cache, arrays = _step_args(cfg, jnp.bfloat16, 16, s=8, p=8)
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        exported = jax.export.export(jax.jit(f), platforms=[platform],
                                     disabled_checks=TRITON_OK if platform == "cuda" else ())(
            _gguf_kept(params), cache, arrays)
    assert exported.out_avals[0].shape == (8, 1 + 1 + 2 * 20)
    text = exported.mlir_module()
    assert f"tensor<{cfg.vocab_size}x{cfg.hidden_size}xi8>" in text
    assert f"tensor<{cfg.vocab_size}x{cfg.hidden_size // 32}xf32>" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_step_with_int4_weights_exports(platform):
    """The default model's step with int4 weights (packed nibbles, groups of 128 with zero
    points, as quantization="int4" makes them) lowers for both targets, the packed bytes
    reaching the program as they are."""
    from jaxinfer.checkpoints.quantize import WEIGHT_REDUCE_AXES, abstract_quantized
    from jaxinfer.runtime.device.tree_paths import path_str

    cfg = GEMMA3_270M
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    f = functools.partial(step, cfg=cfg, backend=backend, max_q_len=1, num_logprobs=20,
                          filtered=True)
    params, cache, arrays = _step_args(cfg, jnp.bfloat16, 16, s=8, p=8)

    def int4(kp, a):
        p = path_str(kp)
        if p.rsplit(".", 1)[-1] not in WEIGHT_REDUCE_AXES:
            return a
        return abstract_quantized(p, a, "int4", "weight_only", a.dtype, group_size=128)

    params = jax.tree_util.tree_map_with_path(int4, params)
    with cuda_target() if platform == "cuda" else contextlib.nullcontext():
        exported = jax.export.export(jax.jit(f), platforms=[platform],
                                     disabled_checks=TRITON_OK if platform == "cuda" else ())(
            params, cache, arrays)
    assert exported.out_avals[0].shape == (8, 1 + 1 + 2 * 20)
    text = exported.mlir_module()
    assert f"tensor<{cfg.vocab_size}x{cfg.hidden_size // 2}xui8>" in text
    assert f"tensor<{cfg.vocab_size}x{cfg.hidden_size // 128}xf16>" in text
