"""The Pallas attention kernels under tensor parallelism, on 8 CPU devices (the child pytest of
tests/runtime/test_tensor_parallel.py): the jitted steps built for a mesh run the kernel in a
shard_map over the "model" axis (runtime/device/sharding.py `shard_kv_heads`).

- export: the whole decode / prefill / verify steps with the TPU and CUDA kernels on tp 2 and 4
  meshes of CPU devices carry the kernel's custom call inside the manual (per-device)
  computation, on each device's heads, and no XLA attention;
- numbers: prefill, decode and verify steps with the interpret-mode kernel on tp 2 and 4 equal
  the XLA path on one device.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device import sharding as shd
from jaxinfer.runtime.device.fused_projections import fuse_projections
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import init_params
from jaxinfer.runtime.device.steps import make_step, make_verify
from jaxinfer.runtime.plan import STEP_GROUPS, padding_arrays, verify_inputs
from tests.runtime.test_attention_backends import GEMMA3_270M, GEMMA_LIKE, TRITON_OK, _cfg, \
    _step_args
from tests.runtime.test_tensor_parallel import on_8_devices

# ------------------------------------------------------------------------------------ export

LLAMA_GQA = _cfg(num_heads=16, num_kv_heads=4, head_dim=128, hidden_size=256)  # kv heads: 4
KERNEL = {"tpu": ("ragged_paged_attention_tpu", "tpu_custom_call"),
          "cuda": ("ragged_paged_attention_gpu", "__gpu$xla.gpu.triton")}


def _export(cfg, tp: int, platform: str, kv: str, shape: str):
    """The mesh step (or verify step) of `cfg` exported for `platform` -> (exported, T)."""
    mesh = shd.make_mesh(tp)
    t, q = {"decode": (16, 1), "prefill": (64, 64), "verify": (24, 3)}[shape]
    params, cache, arrays = _step_args(cfg, jnp.bfloat16, t, s=8, p=8, fused=True, tp=tp,
                                       kv_dtype="int8" if kv == "int8" else None)
    sh = (shd.param_shardings(params, mesh), shd.cache_shardings(cache, mesh),
          shd.replicated(mesh))
    on = lambda tree, s: jax.tree.map(  # noqa: E731
        lambda a, b: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=b), tree, s)
    rep = lambda tree: jax.tree.map(lambda a: on(a, sh[2]), tree)  # noqa: E731
    backend = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    statics = dict(max_q_len=q, num_logprobs=4, filtered=True)
    if shape == "verify":
        k = q - 1
        w = arrays["token_bitmask"].shape[1]
        extra = {"logits_indices": (8 * (k + 1),), "num_draft": (8,), "draft_ids": (8, k),
                 "draft_bitmask": (8, k, w)}
        arrays = {**arrays, **{n: jax.ShapeDtypeStruct(e, jnp.int32) for n, e in extra.items()}}
        fn = make_verify(cfg, backend, sh).jitted
        args = (rep(arrays), None, rep(jax.ShapeDtypeStruct((8,), jnp.int32)))
    else:
        fn = make_step(cfg, backend, sh).jitted
        args = (rep(arrays),)
    # (no tests/aot.py cuda_target: the step traces on its own CPU mesh, and jax 0.10 lowers
    # Triton for its minimum compute capability when it finds no GPU)
    exported = jax.export.export(fn, platforms=[platform],
                                 disabled_checks=TRITON_OK if platform == "cuda" else ())(
        on(params, sh[0]), on(cache, sh[1]), *args, **statics)
    return exported, t


def _kernel_calls(text: str, fn: str) -> tuple[list[str], int]:
    """(the operand types of each call of the kernel's functions `fn`, `fn`_0, ... made inside
    a manual computation, the number of calls made outside one)."""
    call = re.compile(rf"func\.call @{fn}(?:_\d+)?\(.*?: \(([^)]*)\)")
    inside = []
    for region in text.split("sdy.manual_computation(")[1:]:
        inside += call.findall(region.split("sdy.return")[0])
    return inside, len(call.findall(text)) - len(inside)


@on_8_devices  # (the child reports by test name: cases loop inside, no parametrize)
def test_mesh_steps_export_with_the_kernel_per_device():
    """TPU and CUDA: every layer's attention is the kernel's custom call, called inside the
    shard_map on the heads each device holds: KV heads that divide tp split with their q heads
    (Llama: 16 q / 4 kv); Gemma 3 270M's one KV head stays whole, its 4 q heads split (tp 2, 4)."""
    cases = [(GEMMA3_270M, tp, kv, shape) for tp in (2, 4) for kv in ("bf16", "int8")
             for shape in ("decode", "prefill")]
    cases += [(LLAMA_GQA, tp, kv, shape) for tp in (2, 4) for kv in ("bf16", "int8")
              for shape in ("decode", "prefill", "verify")]
    for platform, (cfg, tp, kv, shape) in itertools.product(("tpu", "cuda"), cases):
        fn, target = KERNEL[platform]
        where = f"{platform} {cfg.family} tp{tp} {kv} {shape}"
        exported, t = _export(cfg, tp, platform, kv, shape)
        assert exported.nr_devices == tp, where
        text = exported.mlir_module()
        calls, outside = _kernel_calls(text, fn)
        assert len(calls) == cfg.num_layers and outside == 0, (where, len(calls), outside)
        # each kernel function holds the kernel's custom call; no XLA attention anywhere
        bodies = re.findall(rf"func\.func private @{fn}(?:_\d+)?\(.*?\n  }}", text, re.S)
        assert bodies and all(f"custom_call @{target}" in b for b in bodies), where
        assert "xla_ragged_paged_attention" not in text, where
        hkv = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
        hq, dh = cfg.num_heads // tp, cfg.head_dim
        pages = f"tensor<{hkv}x64x16x{dh}x{'i8' if kv == 'int8' else 'bf16'}>"
        want = [f"tensor<{t}x{hq}x{dh}xbf16>", pages, pages]
        if kv == "int8":  # k_scale, v_scale [Hkv, N, ps] split like the pages
            want += [f"tensor<{hkv}x64x16xf32>"] * 2
        for c in calls:
            types = [a.strip() for a in c.split(",")]
            assert types[:3] + types[7:] == want, (where, types)


# ------------------------------------------------------------------------------------ numbers

PS, PAGES = 8, 12  # page size, pool pages
LLAMA_SMALL = _cfg(num_heads=4, num_kv_heads=2, head_dim=64)  # 2 kv heads: split on tp 2 only
GEMMA_SMALL = _cfg(**GEMMA_LIKE, head_dim=64)  # 1 kv head (window 8): q heads split on tp 2, 4
PAGE_ROWS = {0: [5, 2, 9], 1: [1, 8, 3, 6]}  # each sequence's pages (permuted)


def _arrays(rows, *, t: int, drafts=None):
    """A step's arrays: rows[s] = (tokens fed, their first position) of sequence s, in the
    pages PAGE_ROWS[s]; the logits of each sequence's last token. `drafts` [s] = proposals
    (already among the tokens fed, after the last accepted token): the verify step's arrays,
    logits at the last token and every proposal."""
    s, p = 4, 4
    k = 0 if drafts is None else max(len(d) for d in drafts)
    groups = STEP_GROUPS + (("speculative",) if drafts is not None else ())
    a = padding_arrays(groups, T=t, S=s, P=p, K=k, num_seqs=len(rows))
    r = 0
    for i, (toks, start) in enumerate(rows):
        n, pages = len(toks), np.asarray(PAGE_ROWS[i])
        pos = np.arange(start, start + n)
        a["token_ids"][r:r + n], a["positions"][r:r + n] = toks, pos
        a["slot_mapping"][r:r + n] = pages[pos // PS] * PS + pos % PS
        a["kv_lens"][i], a["page_indices"][i, :len(pages)] = start + n, pages
        a["logits_indices"][i] = r + n - 1
        if drafts is not None:
            d = len(drafts[i])
            a["num_draft"][i], a["draft_ids"][i, :d] = d, drafts[i]
            first = r + n - 1 - d  # the row of the last accepted token
            a["verify_indices"][i] = first + np.minimum(np.arange(k + 1), d)
            a["sample_positions"][i] = start + n - d
        else:
            a["sample_positions"][i] = start + n
        r += n
        a["cu_q_lens"][i + 1:] = r
    return a if drafts is None else verify_inputs(a)


def _run(cfg, params, cache, step, verify, on_host, drafts=None):
    """Prefill two sequences (13 and 20 tokens: page boundaries crossed), decode both twice,
    then verify `drafts` (proposals per sequence) -> the packed outputs and the final cache.
    drafts None: decode twice more instead -> the greedy tokens of those two steps (the
    continuation to propose). `on_host` places a step's arrays."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n) for n in (13, 20)]
    statics = dict(num_logprobs=2, filtered=False)
    packed, cache, _ = step(params, cache, on_host(_arrays(
        [(prompts[0], 0), (prompts[1], 0)], t=48)), max_q_len=48, **statics)
    out, lens = [np.asarray(packed)], [13, 20]
    for _ in range(2 if drafts is not None else 4):
        last = out[-1][:2, 0].astype(np.int32)
        packed, cache, _ = step(params, cache, on_host(_arrays(
            [([last[0]], lens[0]), ([last[1]], lens[1])], t=4)), max_q_len=1, **statics)
        out.append(np.asarray(packed))
        lens = [n + 1 for n in lens]
    if drafts is None:
        return [[int(o[i, 0]) for o in out[-2:]] for i in range(2)]
    last = out[-1][:2, 0].astype(np.int32)
    packed, cache, _ = verify(params, cache, on_host(_arrays(
        [([last[0], *drafts[0]], lens[0]), ([last[1], *drafts[1]], lens[1])], t=8,
        drafts=drafts)), None, on_host(np.zeros(4, np.int32)), max_q_len=3, **statics)
    return out + [np.asarray(packed)], jax.tree.map(np.asarray, cache)


@on_8_devices
def test_mesh_steps_with_interpret_kernel_equal_xla_on_one_device():
    """tp 2 and 4 with the interpret-mode kernel in the shard_map (Llama's 2 kv heads split on
    tp 2 and run whole on tp 4; Gemma's one kv head whole, its q heads split), f32 and int8 KV:
    the tokens of every step (and the verify step's acceptances) equal one device's XLA path,
    logprobs and the written cache within the tolerance of the interpret-vs-XLA model tests."""
    for (model, cfg), kv in itertools.product((("llama", LLAMA_SMALL), ("gemma", GEMMA_SMALL)),
                                              ("f32", "int8")):
        params = init_params(cfg, jax.random.key(1), scale=0.1)
        kv_dtype = "int8" if kv == "int8" else jnp.float32
        make = functools.partial(init_cache, cfg, PAGES, PS, kv_dtype)
        ref = functools.partial(_run, cfg, params, step=make_step(cfg, "xla"),
                                verify=make_verify(cfg, "xla"),
                                on_host=lambda a: jax.tree.map(jnp.asarray, a))
        # sequence 0 proposes the greedy continuation (both accepted: every verify row's
        # token is checked), sequence 1 a wrong second token after the right first
        (a0, a1), (b0, b1) = ref(make())
        drafts = [[a0, a1], [b0, (b1 + 1) % cfg.vocab_size]]
        want, want_cache = ref(make(), drafts=drafts)
        assert want[-1][:2, :4].tolist() == [[2, a0, a1, want[-1][0, 3]], [1, b0, b1, -1]]
        for tp in (2, 4):
            where = f"{model} {kv} tp{tp}"
            mesh = shd.make_mesh(tp)
            sharded = shd.shard_params(fuse_projections(params, tp), mesh)
            cache = shd.init_sharded_cache(make, mesh)
            sh = (shd.param_shardings(sharded, mesh), shd.cache_shardings(cache, mesh),
                  shd.replicated(mesh))
            rep = lambda a: jax.tree.map(lambda x: shd.put(x, sh[2]), a)  # noqa: E731
            got, got_cache = _run(cfg, sharded, cache, make_step(cfg, "pallas_interpret", sh),
                                  make_verify(cfg, "pallas_interpret", sh), rep, drafts)
            for i, (g, w) in enumerate(zip(got, want)):
                ids = [0] if i < 3 else slice(0, 4)  # token; or accepted count, K + 1 tokens
                assert (g[:2, ids] == w[:2, ids]).all(), (where, i, g[:2], w[:2])
                np.testing.assert_allclose(g[:2], w[:2], atol=1e-5, rtol=0, err_msg=where)
            for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
                np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=where)
