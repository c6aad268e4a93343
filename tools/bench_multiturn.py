"""Multi-turn chat with more conversations than the device's KV pages hold: TTFT and throughput
with the prefix cache's host tier on and off, side by side in one process.

    jaxinfer bench multiturn                                       # Gemma 3 270M, 16 x 4 turns
    python -m jaxinfer.tools.bench_multiturn --model DIR --conversations 4 --turns 2 --pages 24

C conversations take T turns; each turn's prompt is the whole conversation so far (its first
message, the model's answers, a new user line), all C sent at once. The device pool (`--pages`)
holds a fraction of the working set, so by its next turn a conversation's pages have been
evicted: without the tier its prefix is recomputed, with it the pages come back from host
memory. Turn 1 computes every prompt either way and is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

OPENING = ("You are a careful assistant. The user is planning a long journey through the old "
           "towns of the valley and wants advice about trains, inns, markets and walks. ")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(llm, *, conversations: int, turns: int, output_len: int, opening_repeats: int) -> dict:
    """The turns on `llm` -> {"turn1": ..., "later": ...}: TTFT p50/p99 (s), tok/s, and the
    engine's prefix-cache and host-tier counters."""
    from jaxinfer.runtime.host.requests import SamplingParams

    tok = llm.tokenizer
    # each conversation its own from its first token: nothing is shared between them
    chats = [tok.encode(f"Traveller {i} writes. " + OPENING * opening_repeats + "Where do I "
                        "start?") for i in range(conversations)]
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    phases: dict[str, dict] = {"turn1": {"ttft": [], "tokens": 0, "s": 0.0},
                               "later": {"ttft": [], "tokens": 0, "s": 0.0}}
    for t in range(turns):
        t0 = time.perf_counter()
        outs = llm.generate(chats, sp)
        ph = phases["turn1" if t == 0 else "later"]
        ph["s"] += time.perf_counter() - t0
        ph["ttft"] += [o.metrics["ttft_s"] for o in outs]
        ph["tokens"] += sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
        chats = [c + o.token_ids + tok.encode(f" Next question {t}: and after that?",
                                              add_special_tokens=False)
                 for c, o in zip(chats, outs)]
    report = {name: {"ttft_p50_s": _pct(ph["ttft"], 0.5), "ttft_p99_s": _pct(ph["ttft"], 0.99),
                     "prompt_and_output_tok_s": ph["tokens"] / ph["s"]}
              for name, ph in phases.items() if ph["ttft"]}
    report["prefix_cache"] = llm.engine.scheduler.prefix_cache_stats()
    report["engine"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("kv_host")}
    return report


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--opening-repeats", type=int, default=6, help="first message length knob")
    p.add_argument("--pages", type=int, default=96, help="device KV pages (of --page-size)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--host-gb", type=float, default=1.0, help="kv_host_cache_gb when on")
    p.add_argument("--json", default=None)


def register(bench) -> None:
    p = bench.add_parser("multiturn", help="multi-turn chat: the prefix cache's host tier on/off")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return cmd(p.parse_args(argv))


def cmd(a) -> int:
    from jaxinfer.runtime.llm import LLM

    common = dict(max_slots=a.max_slots, page_size=a.page_size, num_pages=a.pages,
                  max_model_len=2048)
    out = {}
    for name, gb in (("tier off", 0.0), ("tier on", a.host_gb)):
        llm = LLM(a.model, kv_host_cache_gb=gb, **common)
        llm.warmup()  # every program compiled, waited for: no compile timed
        out[name] = run(llm, conversations=a.conversations, turns=a.turns,
                        output_len=a.output_len, opening_repeats=a.opening_repeats)
        del llm
    for name, r in out.items():
        for phase in ("turn1", "later"):
            x = r[phase]
            print(f"{name:8s} {phase:6s} TTFT p50 {x['ttft_p50_s'] * 1e3:8.1f} ms  p99 "
                  f"{x['ttft_p99_s'] * 1e3:8.1f} ms  {x['prompt_and_output_tok_s']:8.1f} tok/s")
        pc = r["prefix_cache"]
        print(f"{name:8s} cached {pc['cached_tokens']} of {pc['prompt_tokens']} prompt tokens "
              f"(host tier: {pc['host_cached_tokens']}); {json.dumps(r['engine'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
