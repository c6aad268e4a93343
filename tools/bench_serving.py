"""Load-test a running `jaxinfer serve` over gRPC (jaxinfer.v1.Generate).

    python -m jaxinfer.tools.bench_serving --target 127.0.0.1:9000 --rates 1,2,4,inf --num-requests 64
    jaxinfer bench-serving --target 127.0.0.1:9000 --concurrency 1,4,16

Requests: seeded random prompt token ids with lengths uniform in --input-len LO:HI and output
lengths uniform in --output-len LO:HI (greedy, ignore_eos, so every request produces exactly its
output length). Arrivals: Poisson at each offered rate (req/s; `inf` = all at once), or a fixed
number of concurrent clients. Reports request and token throughput and TTFT, ITL (gap between
streamed messages) and TPOT ((e2e - TTFT) / (tokens - 1)) mean/p50/p90/p99 in ms; writes JSON
and, over several rates, a PNG of latency percentiles vs offered load (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import numpy as np


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    lo_i = int(lo)
    hi_i = int(hi) if hi else lo_i
    if lo_i < 1 or hi_i < lo_i:
        raise argparse.ArgumentTypeError(f"bad range {s!r}: want LO:HI with 1 <= LO <= HI")
    return lo_i, hi_i


def make_requests(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        li = int(rng.integers(input_len[0], input_len[1] + 1))
        lo = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append((rng.integers(3, vocab, size=li).tolist(), lo))
    return out


def channel(target: str, tls_ca: str | None = None, server_name: str | None = None):
    import grpc

    opts = [("grpc.max_receive_message_length", 64 << 20)]
    if tls_ca:
        with open(tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(target, creds, options=opts)
    return grpc.aio.insecure_channel(target, options=opts)


async def _one(stub, prompt, max_tokens, metadata) -> dict:
    from jaxinfer.serve.proto import jaxinfer_pb2

    req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                                       temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    times, n_tok, final = [], 0, None
    try:
        async for msg in stub.Generate(req, metadata=metadata):
            if msg.token_ids:
                times.append(time.perf_counter())
                n_tok += len(msg.token_ids)
            if msg.HasField("final"):
                final = msg.final
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "prompt_len": len(prompt)}
    t1 = time.perf_counter()
    ok = final is not None and n_tok > 0
    return {
        "ok": ok, "prompt_len": len(prompt), "output_len": n_tok, "e2e": t1 - t0,
        "ttft": times[0] - t0 if times else None,
        "itl": list(np.diff(times)) if len(times) > 1 else [],
        "tpot": (t1 - times[0]) / (n_tok - 1) if n_tok > 1 else None,
        "finish_reason": final.finish_reason if final is not None else None,
    }


def _pct(xs, scale=1000.0) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


async def run_load(target: str, requests, *, rate: float | None = None,
                   concurrency: int | None = None, seed: int = 0, metadata=(),
                   tls_ca: str | None = None, server_name: str | None = None,
                   keep: bool = False) -> dict:
    """One load level: Poisson arrivals at `rate` req/s (inf: all at once) or `concurrency`
    closed-loop clients. Returns the summary dict (`keep`: with each request's record under
    "requests")."""
    from jaxinfer.serve.proto import jaxinfer_pb2_grpc

    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate or concurrency")
    rng = np.random.default_rng(seed + 1)
    async with channel(target, tls_ca, server_name) as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)
        t0 = time.perf_counter()
        if rate is not None:
            tasks = []
            for prompt, m in requests:
                tasks.append(asyncio.create_task(_one(stub, prompt, m, metadata)))
                if math.isfinite(rate):
                    await asyncio.sleep(float(rng.exponential(1.0 / rate)))
            results = await asyncio.gather(*tasks)
        else:
            it = iter(requests)
            results = []

            async def worker():
                for prompt, m in it:
                    results.append(await _one(stub, prompt, m, metadata))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        dur = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tok = sum(r["output_len"] for r in ok)
    in_tok = sum(r["prompt_len"] for r in ok)
    return {
        "rate": rate if rate is None or math.isfinite(rate) else "inf",
        "concurrency": concurrency, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "duration_s": dur, "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tok / dur, "total_token_throughput": (in_tok + out_tok) / dur,
        "ttft_ms": _pct([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_ms": _pct([x for r in ok for x in r["itl"]]),
        "tpot_ms": _pct([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_ms": _pct([r["e2e"] for r in ok]),
    } | ({"requests": results} if keep else {})


async def server_vocab(target: str, metadata=(), tls_ca=None, server_name=None) -> int:
    from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc

    async with channel(target, tls_ca, server_name) as ch:
        s = await jaxinfer_pb2_grpc.GenerationStub(ch).Stats(jaxinfer_pb2.StatsRequest(),
                                                           metadata=metadata)
    return s.vocab_size


def table(results: list[dict]) -> str:
    head = ("| load | done/sent | req/s | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
            "| TPOT p50/p90/p99 ms |\n|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        load = f"rate {r['rate']}" if r["concurrency"] is None else f"conc {r['concurrency']}"

        def f(d):
            return "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))

        rows.append(f"| {load} | {r['completed']}/{r['num_requests']} | "
                    f"{r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | "
                    f"{f(r['ttft_ms'])} | {f(r['itl_ms'])} | {f(r['tpot_ms'])} |")
    return "\n".join([head, *rows])


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rate = results[0]["concurrency"] is None
    labels = [str(r["rate"] if by_rate else r["concurrency"]) for r in results]
    pos = list(range(len(results)))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms", "tpot_ms"), ("TTFT", "ITL", "TPOT")):
        for q in ("p50", "p90", "p99"):
            ax.plot(pos, [r[key][q] if r[key][q] is not None else np.nan for r in results],
                    marker="o", label=q)
        ax.set_title(f"{title} (ms)")
        ax.set_xticks(pos, labels)
        ax.set_xlabel("offered rate (req/s)" if by_rate else "concurrency")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[3]
    ax.plot(pos, [r["output_token_throughput"] for r in results], marker="o")
    ax.set_title("output tokens/s")
    ax.set_xticks(pos, labels)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def bench(args) -> dict:
    metadata = (("authorization", f"Bearer {args.auth_token}"),) if args.auth_token else ()
    vocab = await server_vocab(args.target, metadata, args.tls_ca, args.server_name)
    reqs = make_requests(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
    levels = ([("rate", float(x)) for x in args.rates.split(",")] if args.rates
              else [("concurrency", int(x)) for x in args.concurrency.split(",")])
    if args.warmup:  # one untimed pass over the same requests: every shape bucket compiles here
        await run_load(args.target, reqs, rate=float("inf"), metadata=metadata,
                       tls_ca=args.tls_ca, server_name=args.server_name)
        await run_load(args.target, reqs[:8], concurrency=2, metadata=metadata,
                       tls_ca=args.tls_ca, server_name=args.server_name)
    results = []
    for kind, v in levels:
        r = await run_load(args.target, reqs, seed=args.seed, metadata=metadata, tls_ca=args.tls_ca,
                           server_name=args.server_name, **{kind: v})
        results.append(r)
        print(table([r]).splitlines()[-1], flush=True)
    return {"config": {k: v for k, v in vars(args).items() if k != "fn" and k != "auth_token"},
            "results": results}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:9000")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rates", default=None, help="comma-separated Poisson rates in req/s (inf ok)")
    g.add_argument("--concurrency", default=None, help="comma-separated client counts")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=_range, default=(32, 256), help="LO:HI prompt tokens")
    p.add_argument("--output-len", type=_range, default=(16, 128), help="LO:HI output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/serving", help="output prefix (.json, .png)")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--tls-ca", default=None, help="PEM CA (the server's self-signed cert)")
    p.add_argument("--server-name", default=None, help="TLS name override")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")


def cmd_bench_serving(args) -> int:
    if not args.rates and not args.concurrency:
        args.concurrency = "1,4"
    report = asyncio.run(bench(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(table(report["results"]))
    print(f"wrote {out.with_suffix('.json')}", file=sys.stderr)
    if len(report["results"]) > 1:
        try:
            print(f"wrote {plot(report['results'], out.with_suffix('.png'))}", file=sys.stderr)
        except ImportError:
            print("matplotlib not installed (pip install jaxinfer[bench]): no plot", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1


def register(subparsers, engine_args) -> None:
    p = subparsers.add_parser("bench-serving", help="load-test a running `jaxinfer serve`")
    add_args(p)
    p.set_defaults(fn=cmd_bench_serving)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return cmd_bench_serving(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
