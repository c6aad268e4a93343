"""Mixture-of-experts feed-forward speed, side by side in one run.

    python -m jaxinfer.tools.bench_moe [--experts 64] [--top-k 8] [--hidden 1024]
                                       [--expert-ffn 256] [--tokens 1,16,128] [--repeats 20]

For each token count (a decode batch, a prefill chunk): what the engine serves (runtime/device/moe.py:
on CPU blocks padded per expert; on TPU/GPU experts gathered per pair when T*k <= E, else
ragged_dot), then each form alone: gathered, grouped (pairs sorted by expert, `ragged_dot`),
blocked; the dense-over-experts reference (every expert on every token), and a dense gated
MLP with the same *active* parameters (F = k x the expert's F). `--quantization
int8|fp8|int4`: the expert weights quantized (the dense MLP stays f32). Milliseconds per call,
median of `--repeats` after one compiling call (reported apart). Prints a table; `--json`
writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _time(fn, args, repeats: int) -> tuple[float, float]:
    """(first call s, median ms of the next `repeats`)."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append((time.perf_counter() - t) * 1e3)
    return first, statistics.median(runs)


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.moe import _blocked, _gathered, _grouped, moe_mlp, moe_mlp_dense, route
    from jaxinfer.runtime.device.quantization import quantize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--tokens", default="1,16,128")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    e, k, d, f = a.experts, a.top_k, a.hidden, a.expert_ffn
    ks = jax.random.split(jax.random.key(0), 8)
    w = lambda i, *s: 0.05 * jax.random.normal(ks[i], s, jnp.float32)  # noqa: E731
    router, wg, wu, wd = w(0, d, e), w(1, e, d, f), w(2, e, d, f), w(3, e, f, d)
    dg, du, dd = w(4, d, k * f), w(5, d, k * f), w(6, k * f, d)
    if a.quantization:
        wg, wu, wd = (quantize(x, a.quantization, (1,), mode="weight_only") for x in (wg, wu, wd))
    glu = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    kw = dict(k=k, norm_topk=True, glu=glu)
    # weights are arguments, not constants folded into the programs
    served = jax.jit(lambda h, ws: moe_mlp(h, *ws[:4], **kw))
    grouped = jax.jit(lambda h, ws: _grouped(h, *route(h, ws[0], k, True), *ws[1:4], None, glu))
    blocked = jax.jit(lambda h, ws: _blocked(h, *route(h, ws[0], k, True), *ws[1:4], None, glu))
    gathered = jax.jit(
        lambda h, ws: _gathered(h, *route(h, ws[0], k, True), *ws[1:4], None, glu))
    every = jax.jit(lambda h, ws: moe_mlp_dense(h, *ws[:4], **kw))
    dense = jax.jit(lambda h, ws: (jax.nn.silu(h @ ws[4]) * (h @ ws[5])) @ ws[6])
    ws = (router, wg, wu, wd, dg, du, dd)
    rows = []
    print(f"E={e} top-{k}, D={d}, expert F={f} (dense F={k * f}), experts "
          f"{a.quantization or 'f32'}, {jax.default_backend()}; ms per call, median of "
          f"{a.repeats}")
    print(f"{'tokens':>6} | {'served':>8} | {'gathered':>8} | {'grouped (ragged_dot)':>20} | "
          f"{'blocked':>8} | {'dense over experts':>18} | {'dense MLP, same active':>22} | "
          f"first calls s")
    for t in (int(x) for x in a.tokens.split(",")):
        h = jax.random.normal(ks[7], (t, d), jnp.float32)
        times = [_time(fn, (h, ws), a.repeats)
                 for fn in (served, gathered, grouped, blocked, every, dense)]
        (_, sv), (_, ga), (_, g), (_, b), (_, ev), (_, dn) = times
        rows.append(dict(tokens=t, served_ms=sv, gathered_ms=ga, grouped_ms=g, blocked_ms=b,
                         dense_over_experts_ms=ev, dense_mlp_ms=dn,
                         first_s=[x[0] for x in times]))
        print(f"{t:>6} | {sv:>8.3f} | {ga:>8.3f} | {g:>20.3f} | {b:>8.3f} | {ev:>18.3f} | "
              f"{dn:>22.3f} | {' / '.join(f'{x[0]:.2f}' for x in times)}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(experts=e, top_k=k, hidden=d, expert_ffn=f,
                           quantization=a.quantization, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
