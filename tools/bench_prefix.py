"""Prefix-caching benchmark: N requests sharing one long system prompt, with and without caching.

    python -m jaxinfer.tools.bench_prefix [--model gemma3-270m] [--requests 32] [--system-tokens 512]
                                 [--suffix-tokens 16] [--max-tokens 8] [--modes burst,sequential]

Each request is <system prompt> + <distinct short suffix>. For each setting (prefix caching on,
off) the engine first serves the same workload over a different system prompt of the same length
(compiles every shape the measured run uses, and leaves the pool in a steady state), then:
  * burst:      all requests submitted at once (continuous batching decides who shares what);
  * sequential: one request, then the rest one at a time (each TTFT measured in isolation).
Reported: TTFT p50 of the sharing requests (all but the first, which computes the prefix) and of
all requests, prompt tokens actually prefilled (prompt - cached, + recompute after preemption),
hit rate, wall time. Outputs are checked token-identical between the two settings (greedy).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _tokens(tok, text: str, n: int) -> list[int]:
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + tok.encode(" " + text)
    return ids[:n]


def build_workload(tok, n_req: int, sys_tokens: int, suffix_tokens: int, variant: int):
    words = ("Rule {i}: answer precisely, cite the clause, keep numbers exact and never invent "
             "facts about item {i} of batch {v}.")
    # the variant leads, so workloads of different variants share no page at all
    sys_text = f"[Context {variant}] " + " ".join(words.format(i=i, v=variant)
                                                 for i in range(sys_tokens // 8 + 8))
    system = _tokens(tok, sys_text, sys_tokens)
    prompts = []
    for r in range(n_req):
        q = f" Question {r} of set {variant}: what is {r * 7 + 3} plus {r * 11 + 5}, and why?"
        prompts.append(system + _tokens(tok, q, suffix_tokens))
    return prompts


def _run_mode(llm, prompts, params, mode: str):
    sch = llm.engine.scheduler
    before = sch.prefix_cache_stats()
    pre0 = sch.num_preemptions
    t0 = time.perf_counter()
    if mode == "burst":
        outs = llm.generate(prompts, params)
    elif mode == "sequential":
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    wall = time.perf_counter() - t0
    after = sch.prefix_cache_stats()
    d = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "recompute_tokens",
                                             "recompute_cached_tokens")}
    ttft = np.array([o.metrics["ttft_s"] for o in outs])
    prefilled = d["prompt_tokens"] - d["cached_tokens"] + d["recompute_tokens"] - d["recompute_cached_tokens"]
    return outs, {
        "ttft_p50_sharing_s": float(np.median(ttft[1:])) if len(ttft) > 1 else None,
        "ttft_p50_all_s": float(np.median(ttft)),
        "ttft_first_s": float(ttft[0]),
        "prefill_tokens_computed": int(prefilled),
        "prompt_tokens": int(d["prompt_tokens"]),
        "cached_tokens": int(d["cached_tokens"]),
        "hit_rate": d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0,
        "preemptions": sch.num_preemptions - pre0,
        "wall_s": wall,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--modes", default="burst,sequential")
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    from jaxinfer.runtime.llm import LLM
    from jaxinfer.runtime.host.requests import SamplingParams

    modes = [m for m in args.modes.split(",") if m]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    max_len = args.system_tokens + args.suffix_tokens + args.max_tokens
    max_len = -(-max_len // args.page_size) * args.page_size
    results: dict = {"config": vars(args)}
    tokens: dict = {}
    for caching in (True, False):
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, max_slots=args.max_slots, page_size=args.page_size,
                  max_model_len=max_len, prefill_chunk=args.prefill_chunk,
                  enable_prefix_caching=caching)
        load_s = time.perf_counter() - t0
        tok = llm.tokenizer
        for mi, mode in enumerate(modes):
            warm = build_workload(tok, args.requests, args.system_tokens, args.suffix_tokens, 1000 + mi)
            real = build_workload(tok, args.requests, args.system_tokens, args.suffix_tokens, mi)
            tw = time.perf_counter()
            _run_mode(llm, warm, params, mode)  # compile + steady state, different prefix
            warm_s = time.perf_counter() - tw
            compiles = llm.engine.compile_count
            outs, r = _run_mode(llm, real, params, mode)
            r["new_compiles"] = llm.engine.compile_count - compiles
            r["warmup_s"], r["load_s"] = warm_s, load_s
            key = f"{mode}/{'cache' if caching else 'no_cache'}"
            results[key] = r
            tokens[key] = [o.token_ids for o in outs]
            print(key, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
        del llm
    for mode in modes:
        on, off = results[f"{mode}/cache"], results[f"{mode}/no_cache"]
        same = tokens[f"{mode}/cache"] == tokens[f"{mode}/no_cache"]
        speed = off["ttft_p50_sharing_s"] / on["ttft_p50_sharing_s"] if on["ttft_p50_sharing_s"] else None
        results[f"{mode}/summary"] = {"ttft_p50_sharing_speedup": speed, "tokens_identical": same,
                                      "prefill_tokens": [on["prefill_tokens_computed"],
                                                         off["prefill_tokens_computed"]]}
        print(f"{mode}: TTFT p50 (sharing requests) {on['ttft_p50_sharing_s'] * 1e3:.1f} ms with "
              f"caching vs {off['ttft_p50_sharing_s'] * 1e3:.1f} ms without ({speed:.1f}x); prefill "
              f"tokens {on['prefill_tokens_computed']} vs {off['prefill_tokens_computed']}; "
              f"outputs identical: {same}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
