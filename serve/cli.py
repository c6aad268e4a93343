"""The `jaxinfer` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxinfer.serve.engine_args import engine_args, llm_from_args, sampling_args, sampling_kwargs


def cmd_generate(args) -> int:
    from jaxinfer.runtime.host.requests import SamplingParams

    sp = SamplingParams(**sampling_kwargs(args))  # bad values fail before the model loads
    images = []
    for path in args.image:
        try:
            images.append(Path(path).read_bytes())
        except OSError as e:
            raise ValueError(f"--image {path}: {e.strerror}") from None
    t0 = time.perf_counter()
    llm = llm_from_args(args)
    load_s = time.perf_counter() - t0
    prompt = _with_images(llm, args.prompt, images) if images else args.prompt
    t1 = time.perf_counter()
    first = None
    if args.no_stream:
        out = llm.generate(prompt, sp)[0]
        sys.stdout.write(args.prompt + out.text + "\n")
        first = t1 + (out.metrics["ttft_s"] or 0.0)
    else:
        sys.stdout.write(args.prompt)
        for d in llm.stream(prompt, sp):
            if first is None and d.token_ids:
                first = time.perf_counter()
            sys.stdout.write(d.text)
            sys.stdout.flush()
            out = d.output
        sys.stdout.write("\n")
    done = time.perf_counter()
    if sp.logprobs is not None or sp.prompt_logprobs is not None:  # one JSON line, asked for
        print(json.dumps({"logprobs": out.logprobs, "prompt_logprobs": out.prompt_logprobs}),
              file=sys.stderr)
    n = len(out.token_ids)
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


def cmd_compile(args) -> int:
    """Every program an engine of these options runs, compiled into a dir beside the checkpoint
    (runtime/compiled.py): the first answers' small programs, then every whole step program."""
    from jaxinfer.checkpoints.loader import resolve
    from jaxinfer.runtime import compiled

    where = Path(args.out) if args.out else compiled.default_dir(resolve(args.model))
    compiled.start_dir(where, args.overwrite)
    t0 = time.perf_counter()
    llm = llm_from_args(argparse.Namespace(**{**vars(args), "compiled_dir": None,
                                              "warmup": False}))
    warm = llm.warmup(first_answers=True)
    m = compiled.write_manifest(where, llm.config, model=str(args.model),
                                seconds=round(time.perf_counter() - t0, 1),
                                warmup_programs=warm["programs"])
    print(f"wrote {m['programs']} programs ({m['bytes'] / 1e6:.1f} MB) and {where}/"
          f"manifest.json in {m['seconds']:.1f}s; engines of this model on a host like this "
          f"one start with them given --compiled-dir "
          f"{'auto' if not args.out else where}", file=sys.stderr)
    return 0


# Modules that add their own subcommands: each has `register(subparsers, engine_args)`.
COMMAND_MODULES: tuple[str, ...] = ("jaxinfer.tools.bench_throughput", "jaxinfer.serve.batch",
                                    "jaxinfer.serve.grpc_server", "jaxinfer.tools.bench_serving",
                                    "jaxinfer.tools.bench_quality", "jaxinfer.tools.bench_structured")


def _with_images(llm, text: str, images: list[bytes]) -> dict:
    """The prompt dict of `text` and image files; without the model's image mark in the text,
    one mark per image goes first (as llama.cpp's multimodal CLI places them)."""
    door = llm.engine.image_door()
    if door is None:
        raise ValueError("--image: this model takes no images (it is text only)")
    if door.spec.mark not in text:
        text = door.spec.mark * len(images) + text
    return {"prompt": text, "multi_modal_data": {"image": images}}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from jaxinfer.runtime.config import COMPUTE_DTYPES
    from jaxinfer.runtime.config import FORMATS

    p = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    engine_args(g)
    g.add_argument("prompt")
    sampling_args(g, skip=("priority",), max_tokens=64, temperature=0.0)  # one request: no queue
    g.add_argument("--no-stream", action="store_true")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image file for a vision model (repeat for several); the prompt "
                        "marks where each goes (else they go first)")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint (HF dir or GGUF) to orbax")
    c.add_argument("src", help="HF checkpoint dir, .gguf file or model name")
    c.add_argument("out")
    c.add_argument("--dtype", default="float32", choices=COMPUTE_DTYPES)
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quantize", default=None, choices=FORMATS,
                   help="save int8 / fp8 weights with per-channel scales")
    c.add_argument("--keep-embeddings", action="store_true",
                   help="with --quantize: keep embed / lm_head in --dtype")
    c.set_defaults(fn=cmd_convert)
    k = sub.add_parser("compile", help="compile a model's step programs ahead, beside its "
                                       "checkpoint (engines that start on a like host load them)")
    engine_args(k)
    k.add_argument("--out", default=None,
                   help="where to write them (default: <dir>/compiled or <file>.compiled)")
    k.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    k.set_defaults(fn=cmd_compile)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, engine_args)
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
