"""The `jaxinfer` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_MODEL = "gemma3-270m"


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint dir, .gguf file, `jaxinfer convert` dir, or a model name "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None,
                   choices=["xla", "pallas", "pallas_interpret"])
    p.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                   help="quantize weights at load (per-channel scales)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8 KV pages with per-token-per-head scales (XLA attention path)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="per-step prompt token budget (chunked prefill)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV pages of common prompt prefixes")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="each step waits for the previous step's tokens (default: step n+1 is "
                        "planned and launched while step n runs)")
    p.add_argument("--speculative", default=None, type=json.loads,
                   help='speculative decoding, e.g. \'{"method": "ngram", "k": 4, "n": 3}\' or '
                        '\'{"method": "draft", "model": "PATH", "k": 4}\'')
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard params and KV cache over N devices (multi-host: all devices)")
    p.add_argument("--distributed", action="store_true",
                   help="join a multi-host job (jax.distributed.initialize; env "
                        "JAXINFER_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID or "
                        "auto-detected on TPU pods); process 0 serves, the others follow")


def llm_from_args(args):
    from jaxinfer.runtime.llm import LLM

    opts = dict(dtype=args.dtype, max_slots=args.max_slots, page_size=args.page_size,
                num_pages=args.num_pages, attention_backend=args.attention_backend,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                prefill_chunk=args.prefill_chunk,
                enable_prefix_caching=not args.no_prefix_caching,
                async_scheduling=not getattr(args, "no_async_scheduling", False),
                speculative=args.speculative)
    if args.max_model_len:
        opts["max_model_len"] = args.max_model_len
    tp = getattr(args, "tensor_parallel", 1)
    if tp != 1:
        opts["tensor_parallel"] = tp
    if getattr(args, "distributed", False):
        from jaxinfer.runtime.sharding import follow, init_distributed

        leader = init_distributed()
        llm = LLM(args.model, **opts)
        if not leader:  # a follower runs the leader's steps on its devices until released
            follow(llm.engine)
            sys.exit(0)
        import atexit

        atexit.register(llm.engine.release_followers)
        return llm
    return LLM(args.model, **opts)


def cmd_generate(args) -> int:
    from jaxinfer.runtime.requests import SamplingParams

    t0 = time.perf_counter()
    llm = llm_from_args(args)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        stop=tuple(args.stop or ()))
    t1 = time.perf_counter()
    ids, first = [], None
    if args.no_stream:
        out = llm.generate([args.prompt], sp)[0]
        sys.stdout.write(args.prompt + out.text + "\n")
        ids, m = out.token_ids, out.metrics
        first = t1 + (m["ttft_s"] or 0.0)
    else:
        sys.stdout.write(args.prompt)
        for d in llm.stream(args.prompt, sp):
            if first is None and d.token_ids:
                first = time.perf_counter()
            sys.stdout.write(d.text)
            sys.stdout.flush()
            ids += d.token_ids
        sys.stdout.write("\n")
    done = time.perf_counter()
    n = len(ids)
    rate = (n - 1) / (done - first) if n > 1 and first and done > first else float("nan")
    print(f"[{n} tokens; first token {(first or done) - t1:.2f}s (incl. compile); "
          f"decode {rate:.1f} tok/s; load {load_s:.1f}s]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from jaxinfer.checkpoints.convert import convert

    t0 = time.perf_counter()
    out = convert(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite,
                  quantize=args.quantize, quantize_embeddings=not args.keep_embeddings)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


# Modules that add their own subcommands: each has `register(subparsers, engine_args)`.
COMMAND_MODULES: tuple[str, ...] = ("jaxinfer.tools.bench_throughput", "jaxinfer.serve.batch", "jaxinfer.serve.grpc_server", "jaxinfer.tools.bench_serving")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    p = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-stream", action="store_true")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint (HF dir or GGUF) to orbax")
    c.add_argument("src", help="HF checkpoint dir, .gguf file or model name")
    c.add_argument("out")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quantize", default=None, choices=["int8", "fp8"],
                   help="save int8 / fp8 weights with per-channel scales")
    c.add_argument("--keep-embeddings", action="store_true",
                   help="with --quantize: keep embed / lm_head in --dtype")
    c.set_defaults(fn=cmd_convert)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, engine_args)
    importlib.import_module("jaxinfer.tools.bench_quality").register(sub, engine_args)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxinfer.checkpoints.errors import CheckpointError

    try:
        return args.fn(args)
    except (CheckpointError, ValueError, NotImplementedError) as e:
        print(f"jaxinfer {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
