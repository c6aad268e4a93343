"""`jaxinfer batch`: the command line over the JSONL runner (runtime/host/batch.py).

    jaxinfer batch --model M --input in.jsonl --output out.jsonl [--resume] [--ordered]
    jaxinfer batch --ray [--replicas N] [--ray-address ADDR] ...   (serve/ray_batch.py)
"""

from __future__ import annotations

import json
import os
import sys

from jaxinfer.runtime.host import batch
from jaxinfer.runtime.host.batch import (FSYNC_MODES, BatchError, format_summary, prepare_output,
                                    run_batch)
from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.serve.engine_args import sampling_args, sampling_kwargs


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
                   help="write results in input order (bounded reorder buffer; with --ray: "
                        "OUTPUT is written once at the end, then renamed into place)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="admitted-but-unfinished requests (default 2 x max-slots + 4)")
    p.add_argument("--reorder-window", type=int, default=None,
                   help="--ordered: max records between the oldest unwritten one and the newest")
    p.add_argument("--fsync", default="step", choices=FSYNC_MODES,
                   help="step: one fsync per engine step (group commit, default); line: per line")
    p.add_argument("--summary-json", default=None, help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    r = p.add_argument_group("Ray Data (pip install 'jaxinfer[ray]'; see serve/ray_batch.py)")
    r.add_argument("--ray", action="store_true",
                   help="run on Ray Data: --replicas engines, one part file per input block in "
                        "OUTPUT.shards/; each finished block is appended to OUTPUT and fsynced "
                        "(a ledger makes --resume add every block once), or with --ordered "
                        "OUTPUT is written whole in input order at the end")
    r.add_argument("--replicas", type=int, default=1, help="engine replicas (Ray actors)")
    r.add_argument("--ray-address", default=None,
                   help="a running cluster (e.g. ray://head:10001 or auto); default: a local one")
    r.add_argument("--block-lines", type=int, default=256,
                   help="input lines per block: the unit of scheduling, output and re-run")
    r.add_argument("--replica-cpus", type=float, default=1, help="CPUs each replica reserves")
    r.add_argument("--replica-gpus", type=float, default=0, help="GPUs each replica reserves")
    r.add_argument("--replica-tpus", type=float, default=0,
                   help="TPU chips each replica reserves (the 'TPU' resource)")
    r.add_argument("--replica-resources", type=json.loads, default=None,
                   help='custom resources per replica, JSON: {"v5e-8-head": 1}')
    sampling_args(p, title="sampling defaults (SamplingParams fields; lines may override them)",
                  max_tokens=64, temperature=0.0)
    p.set_defaults(fn=cmd_batch)


def cmd_batch(args) -> int:
    from jaxinfer.serve.engine_args import llm_from_args

    sampling = sampling_kwargs(args)
    try:
        prepare_output(args.output, args.resume, args.overwrite)
        if args.input != "-" and not os.path.isfile(args.input):
            raise BatchError(f"input {args.input} is not a file")
        SamplingParams(**sampling)  # bad defaults fail before the model loads
        if args.ray:
            return _cmd_ray(args, sampling)
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


def _cmd_ray(args, sampling: dict) -> int:
    try:
        from jaxinfer.serve import ray_batch
        import ray.data  # noqa: F401
    except ImportError as e:
        raise BatchError(f"--ray needs Ray Data: pip install 'jaxinfer[ray]' ({e})") from None
    if args.fsync != "step" or args.max_inflight or args.reorder_window:
        raise BatchError("--fsync, --max-inflight and --reorder-window are for one host; with "
                         "--ray every part is fsynced whole and each replica fills its engine")
    engine_args = {k: v for k, v in vars(args).items() if k != "fn"}
    summary = ray_batch.run(args, engine_args, sampling)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    print(ray_batch.format_summary(summary), file=sys.stderr)
    return 0
