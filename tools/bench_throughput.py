"""`jaxinfer bench throughput`: a seeded workload through the engine, optionally side by side with
HF transformers `generate` and with static batching, plus batch-1 decode step time vs the
memory-bandwidth floor and decode step time vs context length.

    jaxinfer bench throughput --model M --num-requests 32 --input-len 16:128 --output-len 16:64 \
        [--compare-hf] [--static-batching] [--compare-sync] [--decode-contexts 512,2048,8192] \
        [--out r.json]

Every figure is a median or a percentile over the run; ratios are measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jaxinfer.tools.engine_runs import run_engine, workload  # noqa: F401 (also imported from here)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def hf_model(model_source, dtype: str = "float32"):
    """HF transformers' model of a checkpoint dir or a GGUF file, in eval mode."""
    import torch
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    src = Path(model_source)
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    kw = {"gguf_file": src.name} if src.is_file() else {}
    return AutoModelForCausalLM.from_pretrained(str(src.parent if src.is_file() else src),
                                                dtype=tdtype, **kw).eval()


def run_hf(model_source, reqs, batches: tuple[int, ...], dtype: str, repeats: int = 1) -> dict:
    """HF transformers generate at each static batch size of `batches` (greedy, left padding;
    each batch generates its longest requested length, static batching's cost, and is credited
    only the requested tokens); the best size's median of `repeats` is HF's figure."""
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = hf_model(model_source, dtype)
    pad = 0

    def gen(group):
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        n = max(o for _, o in group)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad)

    gen(reqs[:1])  # warm-up
    ntok = sum(o for _, o in reqs)
    by_batch = {}
    for batch in batches:
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(0, len(reqs), batch):
                gen(reqs[i:i + batch])
            walls.append(time.perf_counter() - t0)
        by_batch[batch] = ntok / float(np.median(walls))
    best = max(by_batch, key=by_batch.get)
    return {"hf_output_tokens": ntok, "hf_best_batch": best,
            "hf_output_tokens_per_s": by_batch[best],
            "hf_output_tokens_per_s_by_batch": {str(b): v for b, v in by_batch.items()}}


def decode_step_time(llm, context: int, steps: int = 24) -> float:
    """Median inter-token latency of one sequence decoding at `context` tokens."""
    from jaxinfer.runtime.host.requests import SamplingParams

    prompt = (np.arange(context) % 1000 + 10).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0,
                                                ignore_eos=True))[0]
    return float(np.median(out.metrics["itl_s"][2:]))


def run(args) -> dict:
    import jax

    from jaxinfer.runtime.llm import LLM
    from jaxinfer.runtime.device.quantization import param_bytes
    from jaxinfer.serve.engine_args import engine_kwargs
    from jaxinfer.tools.bench_attention import copy_bandwidth

    opts = engine_kwargs(args)  # the engine flags of add_args
    t0 = time.perf_counter()
    llm = LLM(args.model, **opts)
    load_s = time.perf_counter() - t0
    cfg = llm.model.cfg
    special = set(llm.tokenizer.eos_ids) | {llm.tokenizer.bos_id or 0}
    reqs = workload(args.num_requests, llm.engine.text_vocab, _range(args.input_len),
                    _range(args.output_len), args.seed, special)
    # first run: the workload as a user's first one meets the engine, compiling (or loading
    # from the persistent cache) the step shapes it needs; then every shape, then steady state
    first = run_engine(llm, reqs, static=False)
    first["programs"] = llm.engine.compile_count
    for k in ("_spec_proposed", "_spec_accepted"):
        first.pop(k)
    t0 = time.perf_counter()
    compiles = llm.engine.warmup()
    report = {
        "model": str(llm.model.source), "dtype": args.dtype, "max_slots": args.max_slots,
        "quantization": llm.config.quantization, "load_s": load_s,
        "tensor_parallel": llm.config.tensor_parallel,
        "platform": jax.default_backend(), "first_run": first, "warmup_compiles": compiles,
        "warmup_s": time.perf_counter() - t0,
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "seed": args.seed,
                     "output_tokens": sum(o for _, o in reqs)},
    }
    report |= run_engine(llm, reqs, static=False)
    if opts.get("speculative"):
        report["speculative"] = opts["speculative"]
        report |= {k: report.pop("_" + k) for k in ("spec_proposed", "spec_accepted")}
        p, a = report["spec_proposed"], report["spec_accepted"]
        report["acceptance_rate"] = a / p if p else None
    else:
        report.pop("_spec_proposed", None), report.pop("_spec_accepted", None)
    if args.compare_sync:  # the same engine, each step waiting for the last one's tokens
        sync = LLM(args.model, **opts, async_scheduling=False)
        sync.engine.warmup()
        report["sync"] = run_engine(sync, reqs, static=False)
        report["async_vs_sync"] = (report["output_tokens_per_s"]
                                   / report["sync"]["output_tokens_per_s"])
        del sync
    if args.static_batching:
        st = run_engine(llm, reqs, static=True)
        report["static"] = st
        report["continuous_vs_static"] = report["output_tokens_per_s"] / st["output_tokens_per_s"]
    report["new_compiles_after_warmup"] = (llm.engine.compile_count - compiles
                                           - first["programs"])
    report["steady_vs_first_run"] = (report["output_tokens_per_s"]
                                     / first["output_tokens_per_s"])
    if args.decode_contexts:
        ctxs = [int(c) for c in args.decode_contexts.split(",")]
        report["decode_step_s_by_context"] = {str(c): decode_step_time(llm, c) for c in ctxs}
    wbytes = param_bytes(llm.model.params)
    bw = copy_bandwidth(512 * 2**20, repeats=5)
    step1 = decode_step_time(llm, 16)
    report |= {"param_bytes": wbytes, "copy_bandwidth_GBps": bw / 1e9,
               "batch1_decode_step_s": step1, "bandwidth_floor_s": wbytes / bw,
               "batch1_vs_floor": step1 / (wbytes / bw)}
    if args.compare_hf:
        batches = tuple(int(b) for b in args.hf_batches.split(","))
        report |= run_hf(llm.model.source, reqs, batches, args.dtype, args.hf_repeats)
        report["speedup_vs_hf"] = report["output_tokens_per_s"] / report["hf_output_tokens_per_s"]
    return report


def format_table(r: dict) -> str:
    fr = r["first_run"]
    rows = [(f"engine, first run ({fr['programs']} programs)", fr["output_tokens_per_s"],
             fr["ttft_s_p50"], fr["ttft_s_p99"], fr["itl_s_p50"], fr["itl_s_p99"]),
            ("engine (continuous)", r["output_tokens_per_s"], r["ttft_s_p50"], r["ttft_s_p99"],
             r["itl_s_p50"], r["itl_s_p99"])]
    if "static" in r:
        s = r["static"]
        rows.append(("engine (static batches)", s["output_tokens_per_s"], s["ttft_s_p50"],
                     s["ttft_s_p99"], s["itl_s_p50"], s["itl_s_p99"]))
    if "sync" in r:
        s = r["sync"]
        rows.append(("engine (sync scheduling)", s["output_tokens_per_s"], s["ttft_s_p50"],
                     s["ttft_s_p99"], s["itl_s_p50"], s["itl_s_p99"]))
    if "hf_output_tokens_per_s" in r:
        for b, v in r["hf_output_tokens_per_s_by_batch"].items():
            best = " (best)" if int(b) == r["hf_best_batch"] else ""
            rows.append((f"HF generate, batch {b}{best}", v, None, None, None, None))
    f = lambda x, s=1e3: "-" if x is None else f"{x * s:9.1f}"  # noqa: E731
    out = [f"{'system':34s} {'tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>9s} "
           f"{'ITL p99':>9s}   (ms)"]
    for name, tps, a, b, c, d in rows:
        out.append(f"{name:34s} {tps:9.1f} {f(a)} {f(b)} {f(c)} {f(d)}")
    if r.get("speculative"):
        ar = r["acceptance_rate"]
        out.append(f"speculative {json.dumps(r['speculative'])}: {r['spec_accepted']}/"
                   f"{r['spec_proposed']} proposals accepted"
                   + ("" if ar is None else f" (acceptance rate {ar:.3f})"))
    for name, x in (("continuous", r), ("sync scheduling", r.get("sync"))):
        if x is not None:
            out.append(f"{name}: {x['steps']} steps, host work {x['host_ms_per_step']:.2f} ms/step "
                       f"(overlaps the next step under async scheduling), blocked on results "
                       f"{x['wait_ms_per_step']:.2f} ms/step")
    for k in ("steady_vs_first_run", "continuous_vs_static", "async_vs_sync", "speedup_vs_hf",
              "batch1_vs_floor"):
        if k in r:
            out.append(f"{k}: {r[k]:.2f}x")
    out.append(f"load {r['load_s']:.1f} s (quantization {r['quantization']}, tensor parallel "
               f"{r['tensor_parallel']}); warm-up "
               f"{r['warmup_s']:.1f} s, {r['warmup_compiles']} programs")
    out.append(f"batch-1 decode step {r['batch1_decode_step_s'] * 1e3:.2f} ms; floor "
               f"{r['bandwidth_floor_s'] * 1e3:.2f} ms ({r['param_bytes'] / 1e6:.0f} MB of params "
               f"at {r['copy_bandwidth_GBps']:.1f} GB/s)")
    for c, s in (r.get("decode_step_s_by_context") or {}).items():
        out.append(f"decode step at context {c}: {s * 1e3:.2f} ms")
    return "\n".join(out)


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxinfer.serve.engine_args import option_flags

    p.add_argument("--model", default="gemma3-270m")
    option_flags(p, "dtype", "quantization", "max_slots", "page_size", "num_pages",
                 "max_model_len", "prefill_chunk", "fuse_projections", "speculative",
                 dtype="float32", max_slots=8, max_model_len=1024)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", default="16:128", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", default="16:64", help="MIN:MAX generated tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers at each --hf-batches size; its best is the peer")
    p.add_argument("--hf-batches", default="8,16,32",
                   help="HF static batch sizes to try (comma-separated)")
    p.add_argument("--hf-repeats", type=int, default=1, help="HF runs per batch size (median)")
    p.add_argument("--static-batching", action="store_true")
    p.add_argument("--compare-sync", action="store_true",
                   help="also run a second engine with asynchronous scheduling off")
    p.add_argument("--decode-contexts", default="", help="e.g. 512,2048,8192 (needs max-model-len)")
    p.add_argument("--out", default=None, help="write the JSON report here")


def cmd(args) -> int:
    report = run(args)
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def register(sub, engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    t = bench.add_parser("throughput", help="engine throughput / latency (vs HF, vs static)")
    add_args(t)
    t.set_defaults(fn=cmd)
    from jaxinfer.tools import bench_device, bench_multiturn, bench_startup, bench_sweep

    bench_device.register(bench)
    bench_sweep.register(bench)
    bench_multiturn.register(bench)
    bench_startup.register(bench)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
