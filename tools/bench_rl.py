"""`python -m jaxinfer.tools.bench_rl`: what the RL rollout features cost, side by side in one run.

    python -m jaxinfer.tools.bench_rl                          # the default model, 3 repeats
    python -m jaxinfer.tools.bench_rl --model DIR --repeats 1 --out r.json

- `batch_invariant=True` against the same engine without it (one device both), on two devices
  (tensor_parallel=2, where the mode stays invariant), and against the default engine (the
  CPU's automatic tensor parallel), greedy, on three
  workloads: batch 1 and 16 (prompts of 32 tokens, 64 out) and a mixed one (32 requests, prompts
  16-128, outputs 16-64); first run (compiling) and steady state (median of --repeats) apart.
- `update_weights`: seconds to serve new weights from an in-memory Params tree (the first
  update, then the median of --repeats) and from a `jaxinfer convert` directory; `sleep`:
  device bytes in use awake, at level 1 and 2, and woken again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

WORKLOADS = {"batch 1": (1, (32, 32), (64, 64)), "batch 16": (16, (32, 32), (64, 64)),
             "mixed 32": (32, (16, 128), (16, 64))}
F32 = {"quantization": "dequantize"}
ENGINES = {"default": {}, "one device": {"tensor_parallel": 1},
           "batch_invariant": {"batch_invariant": True},
           "batch_invariant tp2": {"batch_invariant": True, "tensor_parallel": 2}}


def _throughput(llm, repeats: int, log) -> dict:
    from jaxinfer.tools.engine_runs import run_engine, workload

    special = set(llm.tokenizer.eos_ids) | {llm.tokenizer.bos_id or 0}
    out = {}
    for name, (n, inp, outp) in WORKLOADS.items():
        reqs = workload(n, llm.engine.text_vocab, inp, outp, 0, special)
        first = run_engine(llm, reqs, static=False)["output_tokens_per_s"]
        steady = statistics.median(run_engine(llm, reqs, static=False)["output_tokens_per_s"]
                                   for _ in range(repeats))
        out[name] = {"first_tok_s": first, "steady_tok_s": steady}
        log(f"  {name:9s} first run {first:7.1f} tok/s, steady {steady:7.1f}")
    return out


def _update_times(llm, repeats: int, log) -> dict:
    from jaxinfer.checkpoints.orbax_io import save_converted

    w = llm.get_weights()
    t = time.perf_counter()
    llm.update_weights(w)
    first = time.perf_counter() - t
    again = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.update_weights(w)
        again.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as tmp:
        d = save_converted(f"{tmp}/weights", llm.model.cfg, w, source="bench_rl")
        from_dir = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.update_weights(str(d))
            from_dir.append(time.perf_counter() - t)
    out = {"pytree_first_s": first, "pytree_s": statistics.median(again),
           "dir_s": statistics.median(from_dir)}
    log(f"  update_weights: from a Params tree {out['pytree_s']:.2f} s (first {first:.2f} s), "
        f"from a directory {out['dir_s']:.2f} s")
    return out


def _sleep_bytes(llm, log) -> dict:
    """Device bytes in use awake, asleep at level 1 and 2, and woken (runtime/weights.py)."""
    import jax
    import jax.numpy as jnp

    llm.update_weights(jax.tree.map(jnp.copy, llm.get_weights()))  # arrays only it holds
    one, two = llm.sleep(1), llm.sleep(2)
    t = time.perf_counter()
    woke = llm.wake_up()
    out = {"awake": one["device_bytes_before"], "level_1": one["device_bytes_after"],
           "level_2": two["device_bytes_after"], "woken": woke["device_bytes_after"],
           "wake_s": time.perf_counter() - t}
    mb = {k: v / 2 ** 20 for k, v in out.items() if k != "wake_s"}
    log(f"  sleep: {mb['awake']:.0f} MiB awake, {mb['level_1']:.0f} at level 1, "
        f"{mb['level_2']:.0f} at level 2, {mb['woken']:.0f} woken ({out['wake_s']:.2f} s)")
    return out


def run(model: str = "gemma3-270m", repeats: int = 3, max_slots: int = 16,
        engines=tuple(ENGINES), log=print) -> dict:
    from jaxinfer.runtime.llm import LLM

    report = {"model": model, "max_slots": max_slots, "repeats": repeats, "engines": {}}
    for name in engines:
        log(f"{name}:")
        t = time.perf_counter()
        # f32 weights (a GGUF dequantized): the layout a trainer updates in place
        llm = LLM(model, max_slots=max_slots, compile_mode="blocking", **F32, **ENGINES[name])
        row = {"load_s": time.perf_counter() - t,
               "tensor_parallel": llm.config.tensor_parallel, **_throughput(llm, repeats, log)}
        if name == "one device":
            row["update_weights"] = _update_times(llm, repeats, log)
            row["sleep"] = _sleep_bytes(llm, log)
        report["engines"][name] = row
        del llm
    e = report["engines"]
    for name, key in (("batch_invariant", "invariant_vs_one_device"),
                      ("batch_invariant tp2", "invariant_tp2_vs_one_device")):
        if {"one device", name} <= set(e):
            report[key] = {w: e[name][w]["steady_tok_s"] / e["one device"][w]["steady_tok_s"]
                           for w in WORKLOADS}
            log(f"{name} / one device, steady: " + ", ".join(
                f"{w} {r:.2f}x" for w, r in report[key].items()))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxinfer.tools.bench_rl",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--repeats", type=int, default=3, help="steady-state runs (median)")
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated, of {list(ENGINES)}")
    ap.add_argument("--out", help="write the report as JSON")
    a = ap.parse_args(argv)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if a.repeats < 1 or not engines or any(e not in ENGINES for e in engines):
        ap.error(f"--repeats must be >= 1 and --engines a non-empty list of {list(ENGINES)}")
    report = run(a.model, a.repeats, a.max_slots, engines)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
