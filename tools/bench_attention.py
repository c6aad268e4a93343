"""Microbenchmark of ragged paged attention: decode batches and chunked prefill.

For each step shape it reports the median time per call (after warm-up), the KV bytes the step
must read (sum over sequences of kv_len * Hkv * D * 2 (K and V) * itemsize), the effective
bandwidth, and its ratio to this machine's copy bandwidth (measured here: a large array scaled
by a constant, read + write bytes over median time).

    python tools/bench_attention.py --quick
    python tools/bench_attention.py --backend tpu --batches 8,32,64 --contexts 512,2048,8192 --out r.json

Backends: reference (jitted jnp gather + masked attention), xla
(runtime.device.attention.xla_ragged_paged_attention), tpu / gpu (the Pallas kernels; add --interpret to
run them on CPU, slowly). auto: the platform's kernel on TPU/GPU, xla (else reference) on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxinfer.pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def median_seconds(fn: Callable[[], jax.Array], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of a read + write pass over a large f32 array (x * c, jitted, buffer donated so no
    fresh output pages are faulted in each call)."""
    scale = jax.jit(lambda a: a * 0.999, donate_argnums=0)
    state = [jnp.ones((nbytes // 4,), jnp.float32)]

    def step():
        state[0] = scale(state[0])
        return state[0]

    t = median_seconds(step, warmup=2, repeats=repeats)
    return 2 * (nbytes // 4) * 4 / t


def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    try:
        from jaxinfer.runtime.device.attention import xla_ragged_paged_attention  # noqa: F401
    except ImportError:
        return "reference"
    return "xla"


def attention_fn(backend: str, *, sm_scale: float, max_q_len: int, interpret: bool):
    if backend == "reference":
        return jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale))
    if backend == "xla":
        from jaxinfer.runtime.device.attention import xla_ragged_paged_attention

        return jax.jit(lambda *a: xla_ragged_paged_attention(*a, sm_scale=sm_scale, max_q_len=max_q_len))
    if backend in ("tpu", "gpu"):
        return jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=sm_scale, platform=backend,
                                                         interpret=interpret))
    raise ValueError(f"unknown backend {backend!r}")


def make_step(q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed=0):
    """A step with sequences (q_len, kv_len); pages assigned in a shuffled order."""
    rng = np.random.default_rng(seed)
    pages = [-(-kv // page_size) for kv in kv_lens]
    pages_per_seq = max(pages)
    num_pages = 1 + sum(pages)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    used = 0
    for s, n in enumerate(pages):
        page_indices[s, :n] = perm[used: used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    pool = (num_kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(kq, (int(cu[-1]), num_q_heads, head_dim), dtype)
    k = jax.random.normal(kk, pool, dtype)
    v = jax.random.normal(kv_, pool, dtype)
    return (q, k, v, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray([len(kv_lens)], jnp.int32))


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    backend = resolve_backend(args.backend)
    bw = copy_bandwidth(args.copy_mb << 20, args.repeats)
    shape = dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim, page_size=args.page_size, dtype=dtype)
    itemsize = jnp.dtype(dtype).itemsize
    cases = [("decode", b, ctx, [1] * b, [ctx] * b) for b in args.batches for ctx in args.contexts]
    cases += [("prefill", 1, ctx, [args.chunk], [ctx]) for ctx in args.prefill_contexts]
    results = []
    for kind, batch, ctx, q_lens, kv_lens in cases:
        step = make_step(q_lens, kv_lens, **shape)
        fn = attention_fn(backend, sm_scale=args.head_dim ** -0.5, max_q_len=max(q_lens),
                          interpret=args.interpret)
        t = median_seconds(lambda: fn(*step), args.warmup, args.repeats)
        kv_bytes = sum(kv_lens) * args.num_kv_heads * args.head_dim * 2 * itemsize
        results.append(dict(kind=kind, batch=batch, context=ctx, q_tokens=sum(q_lens),
                            median_ms=t * 1e3, kv_bytes=kv_bytes, gbs=kv_bytes / t / 1e9,
                            frac_copy_bw=kv_bytes / t / bw))
        del step
    return dict(
        backend=backend, platform=jax.default_backend(), device=str(jax.devices()[0].device_kind),
        dtype=args.dtype, copy_bandwidth_gbs=bw / 1e9, interpret=args.interpret,
        shape=dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                   head_dim=args.head_dim, page_size=args.page_size),
        warmup=args.warmup, repeats=args.repeats, results=results,
    )


def format_table(report: dict) -> str:
    head = (f"backend={report['backend']} platform={report['platform']} dtype={report['dtype']} "
            f"shape={report['shape']} copy_bw={report['copy_bandwidth_gbs']:.1f} GB/s")
    cols = f"{'kind':8} {'batch':>5} {'context':>7} {'q_tok':>6} {'ms':>9} {'KV MB':>8} {'GB/s':>7} {'/copy':>6}"
    lines = [head, cols, "-" * len(cols)]
    for r in report["results"]:
        lines.append(f"{r['kind']:8} {r['batch']:5d} {r['context']:7d} {r['q_tokens']:6d} "
                     f"{r['median_ms']:9.3f} {r['kv_bytes'] / 2**20:8.2f} {r['gbs']:7.2f} "
                     f"{r['frac_copy_bw']:6.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "xla", "tpu", "gpu"])
    p.add_argument("--interpret", action="store_true", help="run a Pallas backend in interpret mode")
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--num-q-heads", type=int, default=4)  # defaults: Gemma 3 270M attention
    p.add_argument("--num-kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", type=_ints, default=[8, 32, 64])
    p.add_argument("--contexts", type=_ints, default=[512, 2048, 8192])
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk (query tokens)")
    p.add_argument("--prefill-contexts", type=_ints, default=[512, 2048])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy-mb", type=int, default=512, help="array size of the copy-bandwidth probe")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", type=Path, help="write the report as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.prefill_contexts = [8], [256, 512], [256]
        args.chunk, args.warmup, args.repeats, args.copy_mb = 32, 1, 3, 64
    report = run(args)
    print(format_table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
