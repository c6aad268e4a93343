"""Accelerator proof kit: the Pallas kernels, their bandwidth and the engine on the device JAX sees.

    python -m jaxinfer.tools.bench_device --out DIR           # TPU VM / GPU box, from a checkout
    python -m jaxinfer.tools.bench_device --smoke --out DIR   # CPU: tiny shapes, interpret kernels

Writes DIR/device.json and DIR/device.md after every section, so a run cut short keeps what it
measured. Sections, in order:
  env        jax / jaxlib versions, platform, device kind and memory.
  kernels    the platform's Pallas ragged paged attention against the jnp reference on the
             device: decode, chunked prefill, verify and mixed layouts; head_dim 64/128/256; GQA
             1/4/8; bf16 / f32; page 16 / 32; int8 KV pages; sliding window; NaN in every page
             slot no valid position reads (page 0, tails, spare pages).
  bandwidth  decode attention at batch 64/256 x context 2k/8k/32k (Llama-3-8B heads): GB/s of KV
             read against the device's copy bandwidth, for the kernel and the XLA path.
  engine     a random-init Llama-3-8B-shaped model in bf16 made on the device (no checkpoint):
             batch-1 decode ms/step against the HBM floor (weight bytes / copy bandwidth), 64- and
             256-way decode tok/s (first run with its compiles, then steady state), compile count;
             int8 and int4 weights against bf16 at batch 1.
  moe        a random-init Qwen3-30B-A3B-shaped MoE (128 experts, top 8; 12 of its 48 layers)
             in bf16: batch-1 and 64-way decode tok/s (first run, then steady state), and int8
             experts at batch 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxinfer.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jaxinfer.runtime.tokenizer import Tokenizer
from jaxinfer.tools.bench_attention import copy_bandwidth, make_step, median_seconds

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
TOL = {"bf16": 3e-2, "f32": 1e-2}  # max |kernel - reference| / max(1, max |reference|)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0)
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=12,
                     num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
                     rope_theta=1000000.0, num_experts=128, experts_per_token=8,
                     moe_intermediate_size=768, norm_topk_prob=True)
TINY_MOE = dict(TINY_LLAMA, qk_norm=True, num_experts=16, experts_per_token=4,
                moe_intermediate_size=32, norm_topk_prob=True)


# --------------------------------------------------------------------------------- the report


class Report:
    """Sections of rows, rewritten to device.json and device.md after every change."""

    def __init__(self, out: Path):
        self.out, self.data = out, {"sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def section(self, name: str, **fields) -> dict:
        sec = self.data["sections"].setdefault(name, {"rows": []})
        sec.update(fields)
        self.write()
        return sec

    def row(self, name: str, row: dict) -> None:
        self.data["sections"][name]["rows"].append(row)
        self.write()

    def write(self) -> None:
        (self.out / "device.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "device.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    lines = ["# jaxinfer device proof", ""]
    for name, sec in data["sections"].items():
        lines += [f"## {name}", ""]
        lines += [f"- {k}: {v}" for k, v in sec.items() if k != "rows"]
        rows = sec["rows"]
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            for r in rows:
                lines.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# -------------------------------------------------------------------------------- env section


def env_section(rep: Report) -> None:
    import jaxlib

    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    rep.section("env", jax=jax.__version__, jaxlib=jaxlib.__version__,
                platform=jax.default_backend(), device=dev.device_kind,
                device_count=jax.device_count(),
                memory_gib=round((stats or {}).get("bytes_limit", 0) / 2**30, 1))


# ---------------------------------------------------------------------------- kernels section


def make_case(q_lens, kv_lens, *, num_kv_heads, gqa, head_dim, page_size, dtype, int8=False,
              nan_fill=False, seed=0):
    """Step inputs for sequences (q_len, kv_len): pages in shuffled order plus two spare pages.
    nan_fill: every page slot no valid position reads (page 0, the tail of each sequence's last
    page, the spare pages) holds NaN (or, for int8 pages, a NaN scale)."""
    rng = np.random.default_rng(seed)
    need = [-(-kv // page_size) for kv in kv_lens]
    n_pages = 1 + sum(need) + 2
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = np.zeros((len(kv_lens), max(need)), np.int32)
    live = np.zeros((n_pages, page_size), bool)  # [N, ps] slots holding valid KV
    used = 0
    for s, (n, kv) in enumerate(zip(need, kv_lens)):
        table[s, :n] = perm[used: used + n]
        j = np.arange(kv)
        live[table[s, j // page_size], j % page_size] = True
        used += n
    hq = num_kv_heads * gqa
    shape = (num_kv_heads, n_pages, page_size, head_dim)
    k = rng.normal(size=shape).astype(np.float32)
    v = rng.normal(size=shape).astype(np.float32)
    q = rng.normal(size=(sum(q_lens), hq, head_dim)).astype(np.float32)
    scales = {}
    if int8:
        for name, x in (("k", k), ("v", v)):
            s = np.abs(x).max(-1) / 127.0  # [Hkv, N, ps]
            x[:] = np.round(x / s[..., None])
            if nan_fill:
                s = np.where(live[None], s, np.nan)
            scales[name] = jnp.asarray(s, jnp.float32)
        k_pages, v_pages = jnp.asarray(k, jnp.int8), jnp.asarray(v, jnp.int8)
    else:
        if nan_fill:
            k[:, ~live], v[:, ~live] = np.nan, np.nan
        k_pages, v_pages = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (jnp.asarray(q, dtype), k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(table), jnp.asarray(cu), jnp.asarray([len(kv_lens)], jnp.int32))
    return args, dict(k_scale=scales.get("k"), v_scale=scales.get("v"))


def layouts(smoke: bool) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (q_lens, kv_lens): every sequence's KV includes its own new tokens."""
    if smoke:
        return {"decode": ([1, 1, 1], [5, 33, 17]), "prefill": ([24], [40]),
                "verify": ([4, 4], [20, 9]), "mixed": ([1, 16, 4], [30, 16, 12])}
    return {"decode": ([1] * 8, [17, 300, 1024, 1, 64, 777, 128, 513]),
            "prefill": ([256, 64], [1024, 64]),
            "verify": ([5] * 6, [40, 300, 5, 1000, 77, 129]),
            "mixed": ([1, 1, 128, 5, 1], [900, 33, 384, 60, 1])}


def kernel_cases(smoke: bool) -> list[dict]:
    base = dict(page_size=16, head_dim=128, gqa=4, dtype="bf16", int8=False, window=None,
                nan_fill=False)
    if smoke:
        base.update(head_dim=64)
        cases = [dict(base, layout=lay) for lay in ("decode", "prefill", "verify", "mixed")]
        cases += [dict(base, layout="decode", dtype="f32", gqa=1),
                  dict(base, layout="mixed", int8=True, nan_fill=True),
                  dict(base, layout="prefill", window=8, nan_fill=True),
                  dict(base, layout="verify", page_size=32, gqa=8)]
        return cases
    cases = [dict(base, layout=lay, head_dim=hd, gqa=g)
             for lay in ("decode", "prefill") for hd in (64, 128, 256) for g in (1, 4, 8)]
    cases += [dict(base, layout=lay, dtype=dt) for lay in ("verify", "mixed")
              for dt in ("bf16", "f32")]
    cases += [dict(base, layout=lay, dtype="f32") for lay in ("decode", "prefill")]
    cases += [dict(base, layout=lay, page_size=32) for lay in ("decode", "prefill", "mixed")]
    cases += [dict(base, layout=lay, int8=True, dtype=dt) for lay in ("decode", "verify", "mixed")
              for dt in ("bf16", "f32")]
    cases += [dict(base, layout=lay, window=128) for lay in ("decode", "prefill", "mixed")]
    cases += [dict(base, layout=lay, nan_fill=True) for lay in ("decode", "prefill", "mixed")]
    cases += [dict(base, layout="mixed", int8=True, window=128, nan_fill=True)]
    return cases


def kernels_section(rep: Report, smoke: bool, platform: str) -> None:
    interpret = smoke or jax.default_backend() == "cpu"
    rep.section("kernels", platform=platform, interpret=interpret,
                tolerance="max|kernel - reference| / max(1, max|reference|) <= "
                          + ", ".join(f"{k} {v}" for k, v in TOL.items()))
    lays = layouts(smoke)
    for c in kernel_cases(smoke):
        q_lens, kv_lens = lays[c["layout"]]
        row = {"layout": c["layout"], **{k: v for k, v in c.items() if k != "layout"}}
        try:
            args, scales = make_case(q_lens, kv_lens, num_kv_heads=1 if smoke else 2, gqa=c["gqa"],
                                     head_dim=c["head_dim"], page_size=c["page_size"],
                                     dtype=DTYPES[c["dtype"]], int8=c["int8"],
                                     nan_fill=c["nan_fill"])
            opts = dict(sm_scale=c["head_dim"] ** -0.5, sliding_window=c["window"], **scales)
            t0 = time.perf_counter()
            out = jax.jit(lambda *a, o=opts: ragged_paged_attention(
                *a, platform=platform, interpret=interpret, **o))(*args)
            out = np.asarray(out.astype(jnp.float32))
            row["compile_run_s"] = time.perf_counter() - t0
            ref = np.asarray(jax.jit(lambda *a, o=opts: ragged_paged_attention_reference(*a, **o))(
                *args).astype(jnp.float32))
            err = float(np.abs(out - ref).max() / max(1.0, float(np.abs(ref).max())))
            row["max_err"] = err
            row["ok"] = bool(np.isfinite(out).all() and err <= TOL[c["dtype"]])
        except Exception as e:  # a kernel that fails to compile is a finding, not the end
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rep.row("kernels", row)
    rows = rep.data["sections"]["kernels"]["rows"]
    rep.section("kernels", passed=f"{sum(r['ok'] for r in rows)}/{len(rows)}")


# -------------------------------------------------------------------------- bandwidth section


def bandwidth_section(rep: Report, smoke: bool, platform: str, mem_bytes: int) -> float:
    from jaxinfer.runtime.attention import xla_ragged_paged_attention

    repeats = 3 if smoke else 5
    bw = copy_bandwidth((16 if smoke else 1024) << 20, repeats)
    hkv, d, interpret = (2, 64, True) if smoke else (8, 128, jax.default_backend() == "cpu")
    rep.section("bandwidth", copy_bandwidth_gbs=bw / 1e9, page_size=16, dtype="bf16",
                heads=f"Hq {4 * hkv}, Hkv {hkv}, D {d}")
    grid = [(4, 256), (8, 256)] if smoke else [(b, c) for b in (64, 256) for c in (2048, 8192, 32768)]
    for batch, ctx in grid:
        kv_bytes = batch * ctx * hkv * d * 2 * 2
        row = dict(batch=batch, context=ctx, kv_gib=kv_bytes / 2**30)
        if mem_bytes and 2.2 * kv_bytes > mem_bytes:
            rep.row("bandwidth", dict(row, skipped="does not fit"))
            continue
        try:
            args = make_step([1] * batch, [ctx] * batch, num_q_heads=4 * hkv,
                             num_kv_heads=hkv, head_dim=d, page_size=16, dtype=jnp.bfloat16)
            kern = jax.jit(lambda *a: ragged_paged_attention(
                *a, sm_scale=d ** -0.5, platform=platform, interpret=interpret))
            t = median_seconds(lambda: kern(*args), 1, repeats)
            row.update(kernel_ms=t * 1e3, kernel_gbs=kv_bytes / t / 1e9, kernel_of_copy=kv_bytes / t / bw)
            if 3 * kv_bytes < (mem_bytes or 1 << 62) and kv_bytes <= 8 << 30:
                xla = jax.jit(lambda *a: xla_ragged_paged_attention(*a, sm_scale=d ** -0.5,
                                                                    max_q_len=1))
                t = median_seconds(lambda: xla(*args), 1, repeats)
                row.update(xla_ms=t * 1e3, xla_gbs=kv_bytes / t / 1e9)
            del args
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rep.row("bandwidth", row)
    return bw


# ----------------------------------------------------------------------------- engine section


def _decode_rate(eng, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """`batch` requests of random prompts: wall until every one has its first token (prefill),
    then decode tokens/s and ms/step until all finish."""
    from jaxinfer.runtime.requests import SamplingParams

    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(rng.integers(3, eng.cfg.vocab_size, prompt_len).tolist(), sp)
            for _ in range(batch)]
    t0 = time.perf_counter()
    while any(not eng.requests[r].token_ids for r in rids):
        eng.step()
    t1, tok1, steps = time.perf_counter(), sum(len(eng.requests[r].token_ids) for r in rids), 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    t2 = time.perf_counter()
    toks = sum(len(eng.pop(r).token_ids) for r in rids) - tok1
    return dict(prefill_s=t1 - t0, decode_tok_s=toks / (t2 - t1),
                ms_per_step=(t2 - t1) / max(steps, 1) * 1e3)


class _IdTokenizer(Tokenizer):
    """Ids only (random-init weights have no vocabulary); decodes to nothing."""
    bos_id, eos_ids, add_bos = None, (), False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def encode(self, text, add_special_tokens=True):
        return [3] * max(len(text), 1)


def engine_section(rep: Report, smoke: bool, bw: float) -> None:
    from jaxinfer.runtime.config import ModelConfig

    _engine_rows(rep, "engine", ModelConfig(family="llama", **(TINY_LLAMA if smoke else LLAMA3_8B)),
                 "tiny Llama" if smoke else "Llama-3-8B shape, random init", smoke, bw,
                 batches=(1, 4) if smoke else (1, 64, 256), formats=("int8", "int4"))


def moe_section(rep: Report, smoke: bool, bw: float) -> None:
    from jaxinfer.runtime.config import ModelConfig

    _engine_rows(rep, "moe", ModelConfig(family="llama", **(TINY_MOE if smoke else QWEN3_30B_A3B)),
                 "tiny MoE" if smoke else "Qwen3-30B-A3B shape (12 of 48 layers), random init",
                 smoke, bw, batches=(1, 4) if smoke else (1, 64), formats=("int8",))


def _engine_rows(rep: Report, section: str, cfg, model: str, smoke: bool, bw: float,
                 batches: tuple[int, ...], formats: tuple[str, ...]) -> None:
    """Decode rates of a random-init `cfg` at each batch (first run, then steady state), then
    of its weights in each of `formats` at batch 1."""
    from jaxinfer.checkpoints.quantize import quantize_params
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.model import init_params
    from jaxinfer.runtime.quantization import param_bytes

    dtype = jnp.float32 if smoke else jnp.bfloat16
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.key(0), dtype=dtype))
    weight_bytes = param_bytes(params)
    rep.section(section, model=model, dtype=jnp.dtype(dtype).name, weight_gib=weight_bytes / 2**30,
                init_s=time.perf_counter() - t0,
                hbm_floor_ms=weight_bytes / bw * 1e3)
    prompt, new = (16, 8) if smoke else (128, 64)
    slots = 8 if smoke else max(batches)

    def engine(p, max_slots):
        ecfg = EngineConfig(max_slots=max_slots, max_model_len=prompt + new + 16,
                            dtype="float32" if smoke else "bfloat16", prefill_chunk=256)
        return Engine(cfg, p, _IdTokenizer(cfg.vocab_size), ecfg)

    eng = engine(params, slots)
    for batch in batches:
        for run in ("first", "steady"):
            t0, c0 = time.perf_counter(), eng.compile_count
            try:
                r = _decode_rate(eng, batch, prompt, new, seed=batch)
            except Exception as e:
                rep.row(section, dict(weights="float", batch=batch, run=run,
                                       error=f"{type(e).__name__}: {str(e)[:200]}"))
                break
            rep.row(section, dict(weights=jnp.dtype(dtype).name, batch=batch, run=run,
                                   wall_s=time.perf_counter() - t0,
                                   compiles=eng.compile_count - c0, **r))
    del eng
    for fmt in formats:  # int4: round to nearest (no calibration text here)
        try:
            q = quantize_params(params, fmt, dtype)
            eng = engine(q, 1 if smoke else 8)
            for run in ("first", "steady"):
                t0, c0 = time.perf_counter(), eng.compile_count
                r = _decode_rate(eng, 1, prompt, new, seed=1)
                rep.row(section, dict(weights=f"{fmt} ({param_bytes(q) / 2**30:.2f} GiB)",
                                       batch=1, run=run, wall_s=time.perf_counter() - t0,
                                       compiles=eng.compile_count - c0, **r))
            del eng, q
        except Exception as e:
            rep.row(section, dict(weights=fmt, batch=1,
                                   error=f"{type(e).__name__}: {str(e)[:200]}"))


# ------------------------------------------------------------------------------------- main


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="directory for device.json, device.md")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and interpret-mode kernels (runs on CPU)")
    p.add_argument("--sections", default="env,kernels,bandwidth,engine,moe")
    p.add_argument("--platform", default=None, choices=["tpu", "gpu"],
                   help="kernel to run (default: the device's; 'tpu' in interpret mode on CPU)")


def register(bench) -> None:
    """`jaxinfer bench device` (bench: the `bench` command's subparsers)."""
    p = bench.add_parser("device", help="accelerator proof: kernels, bandwidth, engine")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    return cmd(p.parse_args(argv))


def cmd(args) -> int:
    backend = jax.default_backend()
    platform = args.platform or ("gpu" if backend in ("gpu", "cuda", "rocm") else "tpu")
    if backend == "cpu" and not args.smoke:
        print("bench device: no accelerator: full shapes in interpret mode would take hours; "
              "running --smoke", file=sys.stderr)
        args.smoke = True
    rep = Report(args.out)
    sections = args.sections.split(",")
    t_all = time.perf_counter()
    env_section(rep)
    mem = int(jax.devices()[0].memory_stats().get("bytes_limit", 0)) if backend != "cpu" else 0
    bw = None
    for name in sections:
        t0 = time.perf_counter()
        print(f"bench device: {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "kernels":
                kernels_section(rep, args.smoke, platform)
            elif name == "bandwidth":
                bw = bandwidth_section(rep, args.smoke, platform, mem)
            elif name in ("engine", "moe"):
                if bw is None:
                    bw = copy_bandwidth((16 if args.smoke else 1024) << 20, 3)
                (engine_section if name == "engine" else moe_section)(rep, args.smoke, bw)
            elif name != "env":
                raise ValueError(f"unknown section {name!r}")
        except Exception:
            rep.section(name, error=traceback.format_exc(limit=3))
        rep.section(name, seconds=round(time.perf_counter() - t0, 1))
    rep.section("env", total_seconds=round(time.perf_counter() - t_all, 1))
    print(markdown(rep.data))
    failed = [r for r in rep.data["sections"].get("kernels", {"rows": []})["rows"] if not r["ok"]]
    return 1 if failed or any("error" in s for s in rep.data["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
