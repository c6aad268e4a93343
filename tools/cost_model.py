"""The cost model on paper: predicted decode step time and tokens/s of the jitted step on TPUs
and GPUs, from XLA's cost analysis of that step and the chips' published peaks.

    python -m jaxinfer.tools.cost_model --out docs/cost_model.md   # ~2 min on 2 CPU cores

For each model shape (Llama-3-8B, -70B), tensor parallel degree and batch, the decode step
(one token per sequence, every sequence at `--context` tokens, the XLA attention path) is
compiled for CPU devices standing in for the chips, sharded as the engine shards it, and
`compiled.cost_analysis()` gives one device's FLOPs and bytes accessed. Layers are identical,
so the step is compiled at 1 and 2 layers and the per-layer cost extrapolated (exact: the
tests check it at 3). It is compiled in f32 and its bytes halved for bf16: XLA:CPU widens a
bf16 dot's weights to f32 first, which would count every weight five times (measured: 79.7 GB
for Llama-3-8B batch 1, whose bf16 weights are 16.1 GB).

Two byte counts per step: XLA's (the XLA attention path gathers each sequence's pages before
attending, so it reads and writes the KV about three times) and the floor (weights + KV read
once: the Pallas kernels' goal, whose custom calls XLA's cost analysis cannot see into). The
prediction on a chip is the roofline max(FLOPs / peak FLOP/s, floor bytes / HBM bandwidth);
the larger term names the bound. Not modelled: tensor-parallel all-reduces (two of
[batch, hidden] per layer), launch and host overheads.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

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
}
TP = (1, 4, 8)
BATCHES = (1, 64, 256)


def step_cost(shape: dict, layers: int, batch: int, context: int, tp: int,
              page_size: int = 16) -> dict[str, float]:
    """One device's {"flops", "bytes"} of the f32 decode step at `layers` layers (compiled,
    not run: every input is abstract)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.config import ModelConfig
    from jaxinfer.runtime.device.kv_cache import init_cache
    from jaxinfer.runtime.device.model import init_params
    from jaxinfer.runtime.plan import STEP_GROUPS, fields_of
    from jaxinfer.runtime.device.sharding import (cache_shardings, make_mesh, param_shardings,
                                           replicated)
    from jaxinfer.runtime.device.steps import step

    cfg = ModelConfig(family="llama", **(shape | {"num_layers": layers}))
    pages = -(-context // page_size)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=jnp.float32))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch * pages + 1, page_size, jnp.float32))
    dims = {"T": batch, "S": batch, "P": pages, "K": 0, "W": -(-cfg.vocab_size // 32)}
    arrays = {f.name: jax.ShapeDtypeStruct(f.extent(dims), f.dtype)
              for f in fields_of(*STEP_GROUPS)}
    mesh = make_mesh(tp, devices=jax.devices()[:tp])
    f = jax.jit(functools.partial(step, cfg=cfg, backend="xla", max_q_len=1, num_logprobs=0,
                                  filtered=False),
                in_shardings=(param_shardings(params, mesh), cache_shardings(cache, mesh),
                              replicated(mesh)))
    cost = f.lower(params, cache, arrays).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def extrapolated(shape: dict, batch: int, context: int, tp: int) -> dict[str, float]:
    """step_cost at the model's layer count from its values at 1 and 2 layers."""
    one = step_cost(shape, 1, batch, context, tp)
    two = step_cost(shape, 2, batch, context, tp)
    n = shape["num_layers"]
    return {k: one[k] + (n - 1) * (two[k] - one[k]) for k in one}


def matmul_params(shape: dict) -> int:
    """Weights a token multiplies: every layer's projections and the vocabulary projection."""
    d, f, v, n = (shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"],
                  shape["num_layers"])
    hq, hkv, dh = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    return n * (d * (hq + 2 * hkv) * dh + hq * dh * d + 3 * d * f) + v * d


def floor_bytes(shape: dict, batch: int, context: int, tp: int, itemsize: int = 2) -> float:
    """Bytes one device must read per decode step: its shard of the weights (the embedding
    table's rows are a gather: not counted) and its KV heads' pages."""
    n, hkv, dh = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    weights = matmul_params(shape) * itemsize / tp
    kv = 2 * n * batch * context * hkv * dh * itemsize / min(tp, hkv)
    return weights + kv


def predict(flops: float, nbytes: float, chip: str, batch: int) -> dict:
    peak, bw, _ = CHIPS[chip]
    t_flops, t_bytes = flops / peak, nbytes / bw
    step_s = max(t_flops, t_bytes)
    return {"step_ms": step_s * 1e3, "tok_s": batch / step_s,
            "bound": "compute" if t_flops > t_bytes else "bandwidth"}


def fits(shape: dict, chip: str, batch: int, context: int, tp: int) -> bool:
    """Weights (the embedding table too) and KV fit in 90 % of one chip's HBM."""
    table = shape["vocab_size"] * shape["hidden_size"] * 2 / tp
    return floor_bytes(shape, batch, context, tp) + table < 0.9 * CHIPS[chip][2]


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


def markdown(rows: list[dict], command: str) -> str:
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
         "XLA path = XLA's count for the XLA attention path, which gathers pages first."),
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
                 "launch and host overheads, and the fusion differences between XLA:CPU, whose "
                 "counts these are, and XLA:TPU/GPU. No device run exists yet to set beside "
                 "these predictions (`jaxinfer bench device` makes one)."), ""]
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
    rows = build(context=args.context, log=lambda s: print(s, file=sys.stderr, flush=True))
    cmd = "python -m jaxinfer.tools.cost_model" + (f" --out {args.out}" if args.out else "")
    md = markdown(rows, cmd)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
