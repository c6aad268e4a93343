"""The engine options every `jaxinfer` command takes, and the LLM they build. Allowed values
come from the typed configs (runtime/config.py, runtime/device/quantization.py), never listed here."""

from __future__ import annotations

import argparse
import json
import sys

from jaxinfer.checkpoints.named import DEFAULT_MODEL
from jaxinfer.runtime.config import (ATTENTION_BACKENDS, COMPUTE_DTYPES, KV_CACHE_DTYPES,
                                     QUANTIZATIONS, WEIGHT_LAYOUTS)


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint dir, .gguf file, `jaxinfer convert` dir, or a model name "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=COMPUTE_DTYPES)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None,
                   choices=[b for b in ATTENTION_BACKENDS if b])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS[1:],
                   help="int8 / fp8: quantize weights at load (per-channel scales); gguf: keep a "
                        "GGUF file's quantized blocks (the default for GGUF files); dequantize: "
                        "every weight in --dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="int8 KV pages with per-token-per-head scales (XLA attention path)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="per-step prompt token budget (chunked prefill)")
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest token-row bucket a step pads to (default: 16 on TPU/GPU, 1 "
                        "on CPU; env JAXINFER_MIN_TOKEN_BUCKET)")
    p.add_argument("--min-page-bucket", type=int, default=None,
                   help="narrowest page table a step pads to, in pages (env JAXINFER_MIN_PAGE_BUCKET; "
                        "default: every page with the XLA attention path, which reads only the "
                        "pages sequences fill; 1 with the Pallas kernels, which walk the table)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV pages of common prompt prefixes")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="each step waits for the previous step's tokens (default: step n+1 is "
                        "planned and launched while step n runs)")
    p.add_argument("--speculative", default=None, type=json.loads,
                   help='speculative decoding, e.g. \'{"method": "ngram", "k": 4, "n": 3}\' or '
                        '\'{"method": "draft", "model": "PATH", "k": 4}\'')
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-modules)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT adapters to load at start; requests name them (HTTP `model`, "
                        "gRPC `lora`, JSONL `lora`)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters on the device at once")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: all loaded)")
    p.add_argument("--itl-slo-ms", type=float, default=None,
                   help="inter-token latency budget: steps with decodes carry only as many tokens "
                        "as the measured step times fit (admissions and prefill chunks shrink)")
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="time-to-first-token budget: waiting requests go by priority, on-time "
                        "ones before late ones (no request waits past 5x the budget)")
    p.add_argument("--refuse-late", action="store_true",
                   help="with --ttft-slo-ms: refuse requests predicted to miss it (429 / "
                        "RESOURCE_EXHAUSTED with a retry hint) instead of queueing them")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step shape before the first request (default: on for "
                        "`serve`, off for one-off commands; the compilation cache makes later "
                        "starts load them)")
    p.add_argument("--tensor-parallel", type=int, default=None,
                   help="shard params and KV cache over N devices (multi-host: all devices); "
                        "default: on CPU, over the host's cores where the model's heads split "
                        "evenly and it is wide enough to gain (1: one device)")
    p.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS, default="auto",
                   help="how dense layer weights are stored: auto = output axes first on CPU "
                        "(faster small matmuls there), as loaded elsewhere")
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="Q/K/V and gate/up as one weight each, split after the product "
                        "(default: yes, except with CPU's output-major layer weights)")
    p.add_argument("--distributed", action="store_true",
                   help="join a multi-host job (jax.distributed.initialize; env "
                        "JAXINFER_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID or "
                        "auto-detected on TPU pods); process 0 serves, the others follow")


def llm_from_args(args):
    from jaxinfer.runtime.llm import LLM

    opts = dict(dtype=args.dtype, max_slots=args.max_slots, page_size=args.page_size,
                num_pages=args.num_pages, attention_backend=args.attention_backend,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                prefill_chunk=args.prefill_chunk, min_token_bucket=args.min_token_bucket,
                min_page_bucket=args.min_page_bucket,
                enable_prefix_caching=not args.no_prefix_caching,
                async_scheduling=not getattr(args, "no_async_scheduling", False),
                speculative=args.speculative,
                itl_slo_ms=getattr(args, "itl_slo_ms", None),
                ttft_slo_ms=getattr(args, "ttft_slo_ms", None),
                refuse_late=getattr(args, "refuse_late", False),
                weight_layout=getattr(args, "weight_layout", "auto"),
                fuse_projections=getattr(args, "fuse_projections", None))
    modules = lora_modules(getattr(args, "lora_modules", []))
    if modules or getattr(args, "enable_lora", False):
        opts.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                    max_cpu_loras=args.max_cpu_loras)
    if args.max_model_len:
        opts["max_model_len"] = args.max_model_len
    warm = getattr(args, "warmup", None)
    opts["warmup"] = getattr(args, "cmd", None) == "serve" if warm is None else warm
    tp = getattr(args, "tensor_parallel", None)
    if tp is not None:
        opts["tensor_parallel"] = tp
    if getattr(args, "distributed", False):
        llm = LLM(args.model, distributed=True, **opts)
        if not llm.engine.leader:  # a follower runs the leader's steps on its devices until released
            llm.engine.follow()
            sys.exit(0)
        import atexit

        atexit.register(llm.engine.release_followers)
        return llm
    llm = LLM(args.model, **opts)
    for name, path in modules.items():
        try:
            llm.engine.add_lora(name, path)
        except ValueError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e}") from None
    return llm


def lora_modules(items: list[str]) -> dict[str, str]:
    """["name=path", ...] -> {name: path}; SystemExit naming a malformed or repeated item."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in out:
            raise SystemExit(f"--lora-modules: adapter name {name!r} given twice")
        out[name] = path
    return out
