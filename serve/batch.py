"""`jaxinfer batch`: the command line over the JSONL runner (runtime/batch.py).

    jaxinfer batch --model M --input in.jsonl --output out.jsonl [--resume] [--ordered]
"""

from __future__ import annotations

import os
import sys

from jaxinfer.runtime import batch
from jaxinfer.runtime.batch import (FSYNC_MODES, BatchError, format_summary, prepare_output,
                                    run_batch)
from jaxinfer.runtime.requests import SamplingParams


def register(subparsers, engine_args) -> None:
    p = subparsers.add_parser(
        "batch", help="offline inference over a JSONL file (streaming, resumable)",
        description=batch.__doc__.split("\n\n")[1] if batch.__doc__ else None)
    engine_args(p)
    p.add_argument("--input", required=True, help="input JSONL (`-` for stdin)")
    p.add_argument("--output", required=True, help="output JSONL (appended to with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed job: skip ids already in the output, repair a torn tail")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    p.add_argument("--ordered", action="store_true",
                   help="write results in input order (bounded reorder buffer)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="admitted-but-unfinished requests (default 2 x max-slots + 4)")
    p.add_argument("--reorder-window", type=int, default=None,
                   help="--ordered: max records between the oldest unwritten one and the newest")
    p.add_argument("--fsync", default="step", choices=FSYNC_MODES,
                   help="step: one fsync per engine step (group commit, default); line: per line")
    p.add_argument("--summary-json", default=None, help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    g = p.add_argument_group("sampling defaults (lines may override them)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--prompt-logprobs", type=int, default=None,
                   help="logprob + top-n of each prompt token (computed in prefill)")
    g.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(fn=cmd_batch)


def cmd_batch(args) -> int:
    from jaxinfer.serve.engine_args import llm_from_args

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                    stop=tuple(args.stop or ()), logprobs=args.logprobs,
                    prompt_logprobs=args.prompt_logprobs,
                    ignore_eos=args.ignore_eos)
    try:
        prepare_output(args.output, args.resume, args.overwrite)
        if args.input != "-" and not os.path.isfile(args.input):
            raise BatchError(f"input {args.input} is not a file")
        SamplingParams(**sampling)  # bad defaults fail before the model loads
        llm = llm_from_args(args)
        summary = run_batch(
            llm.engine, llm.tokenizer, args.input, args.output, sampling=sampling,
            resume=args.resume, overwrite=args.overwrite, ordered=args.ordered,
            max_inflight=args.max_inflight, reorder_window=args.reorder_window,
            fsync=args.fsync, progress=False if args.no_progress else None,
            summary_json=args.summary_json)
    except BatchError as e:
        print(f"jaxinfer batch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxinfer batch: interrupted; records written so far are kept - rerun with "
              f"--resume to finish {args.output}", file=sys.stderr)
        return 130
    print(format_summary(summary), file=sys.stderr)
    return 0
