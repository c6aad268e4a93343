"""Where a CPU step's time goes: small matmuls per core count, and achieved GFLOP/s per step kind.

    python -m jaxinfer.tools.bench_cpu [--model gemma3-270m] [--profile] [--compare-hf]
                                       [--out report.json]

1. Matmul table: a chain of 16 [M, D] x [D, D] products (D = --width, tanh between, one jitted
   program) at M = 1, 8, 32, 256; microseconds per product, median of --repeats:
   XLA on one device; XLA with each weight output-major in a piece per core (the engine's
   unsplit CPU layout, runtime/device/weight_layout.py); the weights int8 / fp8 per channel and
   int4 in groups of 64, widened by XLA and multiplied by the CPU kernels
   (runtime/device/cpu_matmul.py); XLA split over the host devices (column-split then row-split
   products with an all-reduce, as tensor parallelism lays a layer out); torch with one thread
   and with every core (when torch is installed).
2. Step kinds on --model: decode steps of 1 / 8 / 32 sequences (median inter-token latency) and
   a mixed step (one 256-token prompt chunk, time to first token): matmul GFLOP/s achieved
   (2 x rows x layer weights, plus the vocabulary projection per logits row) beside the chain's
   GFLOP/s at that M on one device.
3. --profile: XLA:CPU op time of the decode-32 steps by kind (matmuls, attention's page
   gathers, collectives, the rest), from a jax.profiler trace.
4. --compare-hf: greedy decode tokens/s at batch 1 and 16, ours and HF transformers'.
5. --compare-llamacpp: greedy decode tokens/s at batch 1 and 16 (64 tokens each, prefill
   included), ours and llama.cpp's (tools/llamacpp_peer.py: llama-cpp-python, not a
   dependency) on the same GGUF file, alternating in one process, medians of --peer-repeats.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.runtime.device.host_devices import request_host_devices

CHAIN = 16
ROWS = (1, 8, 32, 256)


def _median_us(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / CHAIN * 1e6


def matmul_table(width: int, repeats: int) -> dict:
    """us per [M, D] x [D, D] product, by M, for each way of running it."""
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((width, width)) * width ** -0.5).astype(np.float32)
          for _ in range(CHAIN)]
    @jax.jit
    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    # the engine's layout on one CPU device: each weight output-major, a piece per core
    from jaxinfer.runtime.device.weight_layout import OutputMajor, cpu_pieces

    pieces = cpu_pieces()
    oms = [OutputMajor.of(jnp.asarray(w), (0,), pieces) for w in ws]

    @jax.jit
    def om_chain(x, oms):
        for w in oms:
            x = jnp.tanh(w.einsum("md,de->me", x))
        return x

    engine_row = f"XLA, output-major in {pieces} pieces (engine)"
    out: dict[str, dict[int, float]] = {"XLA, one device": {}, engine_row: {}}
    out.update(_quantized_rows(ws, repeats, rng))
    n = jax.device_count()
    if n > 1 and width % n == 0:
        from jaxinfer.runtime.device.sharding import make_mesh

        mesh = make_mesh(n)
        col, row = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
        split = [jax.device_put(w, col if i % 2 == 0 else row) for i, w in enumerate(ws)]
        out[f"XLA, split over {n} host devices"] = {}
    for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, width)).astype(np.float32))
        out["XLA, one device"][m] = _median_us(chain, (x, [jnp.asarray(w) for w in ws]), repeats)
        out[engine_row][m] = _median_us(om_chain, (x, oms), repeats)
        if n > 1 and width % n == 0:
            xr = jax.device_put(x, NamedSharding(mesh, P()))
            out[f"XLA, split over {n} host devices"][m] = _median_us(chain, (xr, split), repeats)
    try:
        import torch
    except ImportError:
        return out
    tws = [torch.from_numpy(w) for w in ws]

    def tchain(x):
        for w in tws:
            x = torch.tanh(x @ w)
        return x

    threads = torch.get_num_threads()
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        row_us = {}
        with torch.inference_mode():
            for m in ROWS:
                x = torch.randn(m, width)
                row_us[m] = _median_us(lambda x: tchain(x).numpy(), (x,), repeats)
        out[f"torch, {t} thread{'s' if t > 1 else ''}"] = row_us
    torch.set_num_threads(threads)
    return out


# quantized forms of the chain's weights: (row name, quantize(...) arguments)
QUANTIZED = (("int8 per channel", "int8", {}), ("fp8 per channel", "fp8", {}),
             ("int4, groups of 64", "int4", {}))


def _quantized_rows(ws: list, repeats: int, rng) -> dict:
    """us per product of the chain with quantized weights: XLA's path (the weight widened in
    the program) and the CPU kernels (runtime/device/cpu_matmul.py) where they load."""
    from jaxinfer.runtime.device import cpu_kernels, cpu_matmul
    from jaxinfer.runtime.device.quantization import quantize

    @jax.jit
    def qchain(x, qs):
        for w in qs:
            x = jnp.tanh(w.einsum("md,de->me", x))
        return x

    out = {}
    isa = cpu_kernels.load()
    for name, fmt, kw in QUANTIZED:
        qs = [quantize(jnp.asarray(w), fmt, (0,), mode="weight_only", **kw) for w in ws]
        forms = {f"XLA, {name} (widened)": qs}
        if isa is not None:
            forms[f"kernel ({isa}), {name}"] = [cpu_matmul.pack(w, (0,)) for w in qs]
        for row, weights in forms.items():
            out[row] = {m: _median_us(qchain, (jnp.asarray(
                rng.standard_normal((m, ws[0].shape[0])).astype(np.float32)), weights), repeats)
                for m in ROWS}
    return out


def _layer_weights(params) -> int:
    """Weights every token row multiplies (the layers' matmuls; embeddings are a gather)."""
    import dataclasses

    return sum(int(np.prod(w.shape)) for lp in params.layers for f in dataclasses.fields(lp)
               if len(getattr(w := getattr(lp, f.name), "shape", ())) >= 2)


def step_kinds(llm, repeats: int) -> dict:
    """Seconds and matmul GFLOP/s of decode steps (1 / 8 / 32 rows) and a 256-row prefill."""
    from jaxinfer.runtime.host.requests import SamplingParams

    cfg, eng = llm.model.cfg, llm.engine
    lw, vd = _layer_weights(llm.model.params), cfg.vocab_size * cfg.hidden_size
    rng = np.random.default_rng(0)
    vocab = eng.text_vocab

    def prompt(n):
        return rng.integers(3, vocab, size=n).tolist()

    out = {}
    for b in (1, 8, 32):
        if b > llm.config.max_slots:
            continue
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        llm.generate([prompt(8) for _ in range(b)], sp)  # compiles its shapes
        llm.engine.settle()  # steady state: the whole programs, not the layer-by-layer stand-ins
        itl = []
        for _ in range(repeats):
            outs = llm.generate([prompt(8) for _ in range(b)], sp)
            itl += [x for o in outs for x in o.metrics["itl_s"]]
        s = float(np.median(itl))
        out[f"decode {b}"] = {"rows": b, "step_s": s, "gflop_s": 2 * b * (lw + vd) / s / 1e9}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    chunk = min(256, llm.config.prefill_chunk, llm.config.max_model_len - 1)
    llm.generate([prompt(chunk)], sp)
    llm.engine.settle()
    ttft = [llm.generate([prompt(chunk)], sp)[0].metrics["ttft_s"] for _ in range(repeats)]
    s = float(np.median(ttft))
    out[f"prefill {chunk}"] = {"rows": chunk, "step_s": s,
                               "gflop_s": 2 * (chunk * lw + vd) / s / 1e9}
    return out


def decode_vs_hf(llm, source, tokens: int = 64, batches=(1, 16), repeats: int = 3) -> dict:
    """Greedy decode tokens/s (`tokens` per sequence, one prompt repeated `b` times, median of
    `repeats`) of ours and of HF transformers on the same checkpoint, in this process."""
    import torch

    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.tools.bench_throughput import hf_model

    prompt = "Tell me about the sea."
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    hf = hf_model(source)
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    out = {}
    for b in batches:
        if b > llm.config.max_slots:
            continue
        llm.generate([prompt] * b, sp)
        llm.engine.settle()
        ours, theirs = [], []
        with torch.no_grad():
            hf.generate(ids.repeat(b, 1), max_new_tokens=4, min_new_tokens=4, do_sample=False)
            for _ in range(repeats):
                t = time.perf_counter()
                n = sum(len(o.token_ids) for o in llm.generate([prompt] * b, sp))
                ours.append(n / (time.perf_counter() - t))
                t = time.perf_counter()
                hf.generate(ids.repeat(b, 1), max_new_tokens=tokens, min_new_tokens=tokens,
                            do_sample=False)
                theirs.append(b * tokens / (time.perf_counter() - t))
        out[b] = {"ours": float(np.median(ours)), "hf": float(np.median(theirs))}
    return out


def decode_vs_llamacpp(llm, gguf: str, tokens: int = 64, batches=(1, 16), repeats: int = 3
                       ) -> dict:
    """Greedy decode tokens/s (`tokens` per sequence, prefill included, one prompt repeated `b`
    times, medians of `repeats`) of ours and of llama.cpp on the same GGUF, and how many of the
    first sequence's tokens agree before they part."""
    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.tools.llamacpp_peer import Peer

    prompt = "Tell me about the sea."
    ids = llm.tokenizer.encode(prompt)
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    peer = Peer(gguf)
    out = {}
    try:
        for b in batches:
            if b > llm.config.max_slots:
                continue
            llm.generate([ids] * b, sp)  # compiles its shapes
            llm.engine.settle()  # steady state: the whole programs compiled in the background
            ours = []
            for _ in range(repeats):
                t = time.perf_counter()
                got = llm.generate([ids] * b, sp)
                ours.append(sum(len(o.token_ids) for o in got) / (time.perf_counter() - t))
            theirs, their_ids = peer.decode(ids, b, tokens, repeats)
            mine = list(got[0].token_ids)
            same = next((i for i, (x, y) in enumerate(zip(mine, their_ids)) if x != y),
                        min(len(mine), len(their_ids)))
            out[b] = {"ours": float(np.median(ours)), "llama.cpp": theirs,
                      "same_prefix_tokens": same}
    finally:
        peer.close()
    return out


_GATHER = re.compile(r"(copy_bitcast|bitcast_select|broadcast_select|bitcast_gather)")
_COLLECTIVE = re.compile(r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)")
_NOT_OPS = re.compile(r"^[$]|^(Pjit|np\.|Thunk)|::|Execute|Wait|Rendezvous|shard_arg")


def profile_decode(llm, rows: int) -> dict:
    """Share of XLA:CPU op time by kind over steady decode steps of `rows` sequences."""
    from jaxinfer.runtime.host.requests import SamplingParams

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(rows)]
    llm.generate(prompts, sp)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        llm.generate(prompts, sp)
    f = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
    kinds: collections.Counter = collections.Counter()
    for e in json.load(gzip.open(f))["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or _NOT_OPS.search(name):
            continue  # host-side spans and waits
        if name.startswith(("dot", "ynn_fusion", "xnn_fusion")):
            kind = "matmuls"
        elif _GATHER.match(name):
            kind = "attention page gathers"
        elif _COLLECTIVE.match(name):
            kind = "collectives"
        else:
            kind = "other ops"
        kinds[kind] += e.get("dur", 0)
    total = sum(kinds.values()) or 1
    return {k: v / total for k, v in kinds.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--width", type=int, default=640, help="D of the matmul table")
    p.add_argument("--max-slots", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tensor-parallel", type=int, default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compare-hf", action="store_true",
                   help="greedy decode at batch 1 and 16 against HF transformers")
    p.add_argument("--compare-llamacpp", action="store_true",
                   help="greedy decode at batch 1 and 16 against llama.cpp on the same GGUF "
                        "(needs llama-cpp-python; see tools/llamacpp_peer.py)")
    p.add_argument("--peer-repeats", type=int, default=3)
    p.add_argument("--skip-steps", action="store_true",
                   help="skip the step-kind table (the peer comparisons only)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    request_host_devices()  # before JAX starts: one device per core for the split row
    from jaxinfer.runtime.llm import LLM

    rep = {"platform": jax.default_backend(), "devices": jax.device_count(),
           "matmul_us": matmul_table(a.width, a.repeats)}
    print(f"[M, {a.width}] x [{a.width}, {a.width}], us per product (median of {a.repeats}):")
    print(f"{'':44s}" + "".join(f"{'M=' + str(m):>10s}" for m in ROWS))
    for name, row in rep["matmul_us"].items():
        print(f"{name:44s}" + "".join(f"{row[m]:10.1f}" for m in ROWS))
    opts = {"max_slots": a.max_slots, "max_model_len": 512}
    if a.tensor_parallel is not None:
        opts["tensor_parallel"] = a.tensor_parallel
    llm = LLM(a.model, **opts)
    rep["model"], rep["tensor_parallel"] = a.model, llm.config.tensor_parallel
    rep["steps"] = {} if a.skip_steps else step_kinds(llm, max(2, a.repeats // 10))
    one = rep["matmul_us"]["XLA, one device"]
    print(f"\n{a.model} (tensor parallel {llm.config.tensor_parallel}): matmul GFLOP/s by step")
    for kind, r in rep["steps"].items():
        m = min(ROWS, key=lambda x: abs(x - r["rows"]))
        chain = 2 * m * a.width ** 2 / (one[m] * 1e-6) / 1e9
        print(f"{kind:12s} {r['step_s'] * 1e3:8.2f} ms  {r['gflop_s']:7.1f} GFLOP/s   "
              f"(the chain at M={m}: {chain:.1f})")
    if a.profile:
        rep["decode_op_share"] = profile_decode(llm, min(32, a.max_slots))
        print("decode step op time: " + ", ".join(
            f"{k} {v:.0%}" for k, v in rep["decode_op_share"].items()))
    if a.compare_hf:
        rep["decode_vs_hf"] = decode_vs_hf(llm, llm.model.source)
        for b, r in rep["decode_vs_hf"].items():
            print(f"greedy decode, batch {b}: ours {r['ours']:.1f} tok/s, HF transformers "
                  f"{r['hf']:.1f} ({r['ours'] / r['hf']:.2f}x)")
    if a.compare_llamacpp:
        from jaxinfer.checkpoints.loader import is_gguf_file, resolve
        from jaxinfer.tools.llamacpp_peer import available

        path = resolve(a.model)
        if available() is None or not is_gguf_file(path):
            print("--compare-llamacpp needs llama-cpp-python (tools/llamacpp_peer.py says how "
                  "to build it) and a GGUF model")
            return 2
        rep["decode_vs_llamacpp"] = decode_vs_llamacpp(llm, str(path),
                                                       repeats=a.peer_repeats)
        for b, r in rep["decode_vs_llamacpp"].items():
            print(f"greedy decode, batch {b}: ours {r['ours']:.1f} tok/s, llama.cpp "
                  f"{r['llama.cpp']:.1f} ({r['ours'] / r['llama.cpp']:.2f}x); the first "
                  f"sequence's first {r['same_prefix_tokens']} tokens agree")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
