"""The latency / throughput trade-off: a grid of max_slots x offered load, with goodput.

    jaxinfer bench sweep --model M --max-slots 1,2,4,8 --rates 1,4,inf
                         --ttft-slo-ms 2000 --itl-slo-ms 300 --out docs/sweep_gemma
    python -m jaxinfer.tools.bench_sweep ...

The model loads once; for each `--max-slots` an engine over the same weights is served in
process (gRPC on a free port) and driven by the serving benchmark (tools/bench_serving.py: seeded
prompts, Poisson arrivals at each `--rates` value, `inf` = all at once, greedy with ignore_eos)
after `engine.warmup()` compiled every step shape, so each point is steady state. Each point reports output tokens/s, TTFT and
ITL p50/p99 and **goodput**: completed requests per second whose TTFT and slowest inter-token gap
met `--ttft-slo-ms` / `--itl-slo-ms` (with neither given, every completed request counts). Points
no other point beats on both throughput and ITL p99 form the Pareto front. The recommended
max_slots is the one of the point with the highest goodput. `--schedule-slo` also gives the
targets to the engines (EngineConfig.itl_slo_ms / ttft_slo_ms), to compare the scheduler's
policy against plain FCFS at the same load. Writes OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def pareto(points: list[dict]) -> list[int]:
    """Indices of points no other point beats on both axes (throughput up, ITL p99 down)."""
    def axes(p):
        return p["output_token_throughput"], p["itl_ms"]["p99"] or 0.0

    def beats(q, p):
        (tq, lq), (tp, lp) = axes(q), axes(p)
        return tq >= tp and lq <= lp and (tq > tp or lq < lp)

    return [i for i, p in enumerate(points) if not any(beats(q, p) for q in points)]


def goodput(results: list[dict], duration_s: float, ttft_ms: float | None,
            itl_ms: float | None) -> tuple[float, float]:
    """(requests/s meeting every target, fraction of completed requests meeting them)."""
    ok = [r for r in results if r["ok"]]
    met = [r for r in ok
           if (ttft_ms is None or (r["ttft"] is not None and r["ttft"] * 1e3 <= ttft_ms))
           and (itl_ms is None or max(r["itl"], default=0.0) * 1e3 <= itl_ms)]
    return len(met) / duration_s, (len(met) / len(ok) if ok else 0.0)


async def _point(port: int, reqs, rate: float, args) -> dict:
    from jaxinfer.tools.bench_serving import run_load

    r = await run_load(f"127.0.0.1:{port}", reqs, rate=rate, seed=args.seed, keep=True)
    r["goodput_rps"], r["slo_attainment"] = goodput(r.pop("requests"), r["duration_s"],
                                                    args.ttft_slo_ms, args.itl_slo_ms)
    return r


def sweep(args) -> dict:
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.llm import LLM
    from jaxinfer.serve.grpc_server import ServerConfig, ServerThread
    from jaxinfer.tools.bench_serving import make_requests

    slots = [int(x) for x in args.max_slots.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    opts = dict(max_model_len=args.max_model_len, min_token_bucket=args.min_token_bucket)
    llm = LLM(args.model, max_slots=max(slots), **opts)
    reqs = make_requests(args.num_requests, args.input_len, args.output_len,
                         llm.model.cfg.vocab_size, args.seed)
    slo = dict(itl_slo_ms=args.itl_slo_ms, ttft_slo_ms=args.ttft_slo_ms) if args.schedule_slo else {}
    points = []
    for m in slots:
        ecfg = dataclasses.replace(llm.config, max_slots=m, **slo)
        model = dataclasses.replace(llm.model, config=ecfg)  # the same prepared weights
        served = SimpleNamespace(engine=Engine(model), tokenizer=llm.tokenizer, model=model)
        server = ServerThread(served, ServerConfig(port=0, max_queue=None, model_name="sweep"))
        try:
            served.engine.warmup()  # every step shape compiled: the points are steady state
            for rate in rates:
                r = asyncio.run(_point(server.port, reqs, rate, args))
                r["max_slots"] = m
                sched = served.engine.scheduler  # what the scheduler measured (ms)
                r["step_ms_by_tokens"] = {k: round(v * 1e3, 1)
                                          for k, v in sched.step_times.snapshot().items()}
                r["decode_step_ms_by_seqs"] = {k: round(v * 1e3, 1)
                                               for k, v in sched.decode_times.snapshot().items()}
                points.append(r)
                print(f"max_slots {m:>3} rate {r['rate']!s:>5}: {r['output_token_throughput']:7.1f} "
                      f"tok/s, TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms, "
                      f"ITL p50/p99 {r['itl_ms']['p50']:.0f}/{r['itl_ms']['p99']:.0f} ms, goodput "
                      f"{r['goodput_rps']:.2f} req/s ({r['slo_attainment']:.0%})", flush=True)
        finally:
            server.stop()
    front = pareto(points)
    best = max(points, key=lambda p: (p["goodput_rps"], p["output_token_throughput"]))
    return {"config": {k: v for k, v in vars(args).items() if k != "fn"}, "points": points,
            "pareto": front, "recommended_max_slots": best["max_slots"]}


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, front = report["points"], set(report["pareto"])
    cfg = report["config"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, key, title, slo in ((axes[0], "itl_ms", "ITL", cfg["itl_slo_ms"]),
                                (axes[1], "ttft_ms", "TTFT", cfg["ttft_slo_ms"])):
        for q, marker in (("p50", "o"), ("p99", "^")):
            ax.scatter([p["output_token_throughput"] for p in pts], [p[key][q] for p in pts],
                       marker=marker, label=q)
        for p in pts:
            ax.annotate(f"{p['max_slots']}@{p['rate']}", (p["output_token_throughput"],
                                                         p[key]["p99"]), fontsize=7)
        if slo:
            ax.axhline(slo, color="red", ls="--", lw=1, label="target")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput (label: max_slots@rate)")
        ax.grid(alpha=0.3)
        ax.legend()
    fr = sorted((pts[i] for i in front), key=lambda p: p["output_token_throughput"])
    axes[0].plot([p["output_token_throughput"] for p in fr], [p["itl_ms"]["p99"] for p in fr],
                 color="black", lw=1, label="Pareto front (p99)")
    axes[0].legend()
    ax = axes[2]
    for rate in sorted({str(p["rate"]) for p in pts}):
        sel = [p for p in pts if str(p["rate"]) == rate]
        ax.plot([p["max_slots"] for p in sel], [p["goodput_rps"] for p in sel], marker="o",
                label=f"rate {rate}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_slots")
    ax.set_ylabel("goodput (req/s within the targets)")
    ax.set_title(f"goodput; recommended max_slots {report['recommended_max_slots']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(report: dict) -> str:
    rows = ["| max_slots | rate | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | goodput req/s | "
            "within targets | Pareto |", "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(report["points"]):
        rows.append(f"| {p['max_slots']} | {p['rate']} | {p['output_token_throughput']:.1f} | "
                    f"{p['ttft_ms']['p50']:.0f}/{p['ttft_ms']['p99']:.0f} | "
                    f"{p['itl_ms']['p50']:.0f}/{p['itl_ms']['p99']:.0f} | "
                    f"{p['goodput_rps']:.2f} | {p['slo_attainment']:.0%} | "
                    f"{'*' if i in report['pareto'] else ''} |")
    return "\n".join(rows)


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxinfer.tools.bench_serving import _range

    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--max-slots", default="1,2,4,8,16")
    p.add_argument("--rates", default="1,4,inf", help="Poisson rates in req/s (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=_range, default=(16, 128))
    p.add_argument("--output-len", type=_range, default=(16, 64))
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest step bucket (fewer programs to warm up per max_slots)")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--itl-slo-ms", type=float, default=None)
    p.add_argument("--schedule-slo", action="store_true",
                   help="give the targets to the engines' scheduler too (else FCFS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/sweep", help="output prefix (.json, .png)")


def cmd(args) -> int:
    report = sweep(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(table(report))
    try:
        print(f"wrote {plot(report, out.with_suffix('.png'))}", file=sys.stderr)
    except ImportError:
        print("matplotlib not installed (pip install jaxinfer[bench]): no plot", file=sys.stderr)
    targets = [f"{k} {v:g} ms" for k, v in (("TTFT", args.ttft_slo_ms), ("ITL", args.itl_slo_ms))
               if v is not None]
    print(f"recommended max_slots: {report['recommended_max_slots']} (highest goodput"
          f"{' within ' + ', '.join(targets) if targets else ''})")
    return 0


def register(bench) -> None:
    p = bench.add_parser("sweep", help="latency/throughput trade-off over max_slots x load")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
