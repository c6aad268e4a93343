"""Latent attention at prefill: the absorbed form the engine runs against the expanded one.

    python -m jaxinfer.tools.bench_mla [--heads 16] [--lengths 128,512,2048] [--repeats 5]

One causal sequence of T tokens attending to itself (a prompt's prefill) at DeepSeek-V3's
latent dims (C 512, R 64, N 128, V 128) with `--heads` heads (128 in the model): the absorbed
form (runtime/device/mla.py `absorbed_attention`: scores over the cached C + R dims, the values
taken from the latent, then w_uv) against the expanded one (`expanded_attention`: the cached
latents expanded to per-head K and V first). Milliseconds per call, median of `--repeats` after
a compiling call, the max |difference| of the two (they are the same function), and each
form's FLOPs by the formulas in mla.py. Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def run(heads: int, lengths: list[int], repeats: int, dims: dict = DIMS) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.config import ModelConfig
    from jaxinfer.runtime.device.mla import absorbed_attention, expanded_attention
    from jaxinfer.runtime.device.model import init_params

    c, r, n, v = (dims[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                    "v_head_dim"))
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=64, intermediate_size=64,
                      num_layers=1, num_heads=heads, num_kv_heads=1, head_dim=c + r,
                      query_pre_attn_scalar=float(n + r), **dims)
    lp = init_params(cfg, jax.random.key(0), scale=0.05).layers[0]
    fns = {"absorbed": jax.jit(lambda q, kv: absorbed_attention(lp, q, kv, cfg)),
           "expanded": jax.jit(lambda q, kv: expanded_attention(lp, q, kv, cfg))}
    rows = []
    for t in lengths:
        kq, kk = jax.random.split(jax.random.key(t))
        q = jax.random.normal(kq, (t, heads, n + r), jnp.float32)
        kv = jax.random.normal(kk, (t, c + r), jnp.float32)
        row = dict(tokens=t, heads=heads,
                   absorbed_gflop=2 * t * t * heads * (2 * c + r) / 2 / 1e9,  # causal: half
                   expanded_gflop=(2 * t * heads * c * (n + v)
                                   + 2 * t * t * heads * (n + r + v) / 2) / 1e9)
        outs = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(fn(q, kv))
            row[f"{name}_first_s"] = time.perf_counter() - t0
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, kv))
                times.append((time.perf_counter() - t0) * 1e3)
            row[f"{name}_ms"] = statistics.median(times)
        row["max_abs_diff"] = float(jnp.max(jnp.abs(outs["absorbed"] - outs["expanded"])))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    import jax

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--lengths", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = run(a.heads, [int(x) for x in a.lengths.split(",")], a.repeats)
    print(f"latent attention at prefill, {a.heads} heads, C 512 R 64 N 128 V 128, "
          f"{jax.default_backend()}; ms per call, median of {a.repeats}")
    print(f"{'tokens':>6} | {'absorbed ms':>11} | {'expanded ms':>11} | {'absorbed GFLOP':>14} | "
          f"{'expanded GFLOP':>14} | max |diff|")
    for r in rows:
        print(f"{r['tokens']:>6} | {r['absorbed_ms']:>11.2f} | {r['expanded_ms']:>11.2f} | "
              f"{r['absorbed_gflop']:>14.2f} | {r['expanded_gflop']:>14.2f} | "
              f"{r['max_abs_diff']:.1e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
