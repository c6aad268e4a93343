"""A seeded workload and one run of it through an LLM, continuously batched or in static batches:
shared by `jaxinfer bench throughput` and the accelerator proof kit (bench_device)."""

from __future__ import annotations

import time

import numpy as np


def workload(n: int, vocab: int, in_len, out_len, seed: int, special: set[int]):
    """n (prompt ids, output length) pairs; ids avoid special tokens."""
    rng = np.random.default_rng(seed)
    pool = np.array([i for i in range(min(vocab, 32000)) if i not in special])
    reqs = []
    for _ in range(n):
        plen = int(rng.integers(in_len[0], in_len[1] + 1))
        olen = int(rng.integers(out_len[0], out_len[1] + 1))
        reqs.append((rng.choice(pool, size=plen).tolist(), olen))
    return reqs


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def run_engine(llm, reqs, *, static: bool) -> dict:
    from jaxinfer.runtime.host.requests import SamplingParams

    sps = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    prompts = [p for p, _ in reqs]
    # every run starts cold: prompts cached by an earlier run would spare this one their prefill
    llm.engine.scheduler.reset_prefix_cache()
    stats0 = dict(llm.engine.step_stats)
    cached0 = llm.engine.scheduler.prefix_cache_stats()["cached_tokens"]
    t0 = time.perf_counter()
    if static:  # wait for a full batch, run it to completion, then the next
        b = llm.config.max_slots
        outs = []
        for i in range(0, len(prompts), b):
            outs += llm.generate(prompts[i:i + b], sps[i:i + b])
    else:
        outs = llm.generate(prompts, sps)
    wall = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    # static batching: a request's clock starts when the whole workload is submitted
    ttft = [o.metrics["ttft_s"] for o in outs]
    if static:
        offsets, t = [], 0.0
        for i in range(0, len(outs), llm.config.max_slots):
            grp = outs[i:i + llm.config.max_slots]
            offsets += [t] * len(grp)
            t += max(o.metrics["e2e_s"] for o in grp)
        ttft = [a + b for a, b in zip(ttft, offsets)]
    itl = [x for o in outs for x in o.metrics["itl_s"]]
    st = {k: v - stats0[k] for k, v in llm.engine.step_stats.items()}
    return {
        "cached_prompt_tokens": llm.engine.scheduler.prefix_cache_stats()["cached_tokens"] - cached0,
        "steps": st["steps"], "host_ms_per_step": 1e3 * (st["step_s"] - st["wait_s"]) / st["steps"],
        "wait_ms_per_step": 1e3 * st["wait_s"] / st["steps"],
        "requests": len(outs), "output_tokens": ntok, "wall_s": wall,
        "output_tokens_per_s": ntok / wall,
        "ttft_s_p50": _pct(ttft, 50), "ttft_s_p99": _pct(ttft, 99),
        "itl_s_p50": _pct(itl, 50), "itl_s_p99": _pct(itl, 99),
        "_spec_proposed": sum(o.metrics.get("spec_proposed", 0) for o in outs),
        "_spec_accepted": sum(o.metrics.get("spec_accepted", 0) for o in outs),
    }
