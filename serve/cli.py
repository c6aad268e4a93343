"""The `jaxinfer` command line."""

from __future__ import annotations

import argparse
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


def llm_from_args(args):
    from runtime import LLM

    opts = dict(dtype=args.dtype, max_slots=args.max_slots, page_size=args.page_size,
                num_pages=args.num_pages, attention_backend=args.attention_backend)
    if args.max_model_len:
        opts["max_model_len"] = args.max_model_len
    return LLM(args.model, **opts)


def cmd_generate(args) -> int:
    from runtime import SamplingParams

    t0 = time.perf_counter()
    llm = llm_from_args(args)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        stop=tuple(args.stop or ()))
    n = 0
    t1 = time.perf_counter()
    if args.no_stream:
        out = llm.generate([args.prompt], sp)[0]
        sys.stdout.write(args.prompt + out.text + "\n")
        n = len(out.token_ids)
    else:
        sys.stdout.write(args.prompt)
        for d in llm.stream(args.prompt, sp):
            sys.stdout.write(d.text)
            sys.stdout.flush()
            n += len(d.token_ids)
        sys.stdout.write("\n")
    gen_s = time.perf_counter() - t1
    print(f"[{n} tokens in {gen_s:.2f}s ({n / gen_s:.1f} tok/s incl. compile); load {load_s:.1f}s]",
          file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from checkpoints.convert import convert

    t0 = time.perf_counter()
    out = convert(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


# Modules that add their own subcommands: each has `register(subparsers, engine_args)`.
COMMAND_MODULES: tuple[str, ...] = ()


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
    c.set_defaults(fn=cmd_convert)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, engine_args)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from checkpoints.errors import CheckpointError

    try:
        return args.fn(args)
    except (CheckpointError, ValueError, NotImplementedError) as e:
        print(f"jaxinfer {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
