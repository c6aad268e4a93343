"""Accelerator proof kit: the Pallas kernels, their bandwidth and the engine on the device JAX sees.

    python -m jaxinfer.tools.bench_device --out DIR                 # TPU VM / GPU box, checkout
    python -m jaxinfer.tools.bench_device --smoke --out DIR         # CPU: tiny shapes, few cases
    python -m jaxinfer.tools.bench_device --cpu-scale 16 --out DIR  # CPU: every case, scaled

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
             a mixed workload (256 seeded requests, prompts of 16-256 tokens, outputs of 8-128,
             every token produced) on 64 slots, continuously batched against static batches of 64
             (engine_runs.run_engine): output tok/s of each and their ratio, first run and
             steady state; int8 and int4 weights against bf16 at batch 1.
  moe        a random-init Qwen3-30B-A3B-shaped MoE (128 experts, top 8; 12 of its 48 layers)
             in bf16: batch-1 and 64-way decode tok/s (first run, then steady state), and int8
             experts at batch 1.
  deepseek_v3
             a random-init DeepSeek-V3-shaped model in bf16: multi-head latent attention (128
             heads, kv_lora_rank 512, q_lora_rank 1536, nope 128 / rope 64 / v 128 dims), 256
             experts of 2048 (top 8 of the best 4 of 8 groups, sigmoid scores, scaled 2.5) and a
             shared expert of 2048, vocabulary 129280; 2 of its 61 layers, the first dense (MLP
             18432), the second MoE, so its ~28 GB of weights fit an 80 GB H100. Batch-1 and
             64-way decode tok/s (first run, then steady state); the latent KV cache's bytes per
             token against the K and V of the 128 heads it stands for (their ratio: 71x).
  gpt_oss    a random-init gpt-oss-20b-shaped model in bf16 (64 query / 8 KV heads of 64,
             attention sinks, q/k/v/o and router and expert biases, 32 experts of 2880, top 4,
             clamped GLU; a 128-token sliding window on alternate layers; YaRN rope, factor 32
             over 4096; vocabulary 201088); 4 of its 24 layers. Batch-1 and 64-way decode tok/s
             (first run, then steady state).
  gemma4     a random-init Gemma-4-26B-A4B-shaped model in bf16: five sliding layers (16 query /
             8 KV heads of 256, window 1024) to one global (2 KV heads of 512, V from K's
             projection, proportional RoPE over a quarter of the dims), 128 experts of 704 (top
             8) beside a dense MLP of 2112 in every layer, q / k / v norms, sandwich norms, layer
             scalars, a tied head of 262144 soft-capped at 30; 12 of its 30 layers (~21 GB of
             its ~50 GB). Batch-1 and 64-way decode tok/s (first run, then steady state); the
             KV bytes a token takes in a sliding and in a global layer, and in all of them.
  vision     a random-init Gemma-3-4B-shaped vision encoder in bf16 (runtime/device/vision.py's
             encode_images, jitted): a SigLIP tower of 27 layers (hidden 1152, 16 heads, MLP
             4304) over 896-pixel images in 64 x 64 patches of 14, and the projector (4 x 4
             average pool to 256 soft tokens, text width 2560); its products run in bf16 with
             f32 accumulation. Batch 1 and 16 images, pixels already on the device: run as the
             engine runs it (runtime/images.py: calls of at most MAX_IMAGES_PER_CALL = 4
             images, so 16 in 4 calls of 4) and, past that, as one call of 16 (an out-of-memory
             error is the row's note, not the section's failure); first run (with its compile,
             whose seconds are given apart) and steady state (median of the repeats): ms for
             the batch and per call, images/s, and the steady state's TFLOP/s from the encoder's
             FLOPs an image counted by hand (tools/cost_model.py vision_flops: patch embedding,
             q / k / v / o, the scores and their weighted sum, MLP, projector; 5.46 TFLOP at
             this shape), against the chip's dense bf16 peak where the kit knows it.

Three sets of shapes (`Shapes`), one code path:
  full       the shapes above: the default on a TPU or GPU. On CPU, where they would take hours
             in interpret mode, the kit runs --smoke unless --cpu-scale is given.
  --smoke    tiny shapes and 8 kernel cases, kernels in interpret mode, on any device (the tests
             run it).
  --cpu-scale N
             CPU only (refused with exit status 2 on a TPU or GPU, where the full shapes run).
             Every kernel case, layout, bandwidth grid point and engine section's batch of the
             full run, with its dimensions divided by N. Rounded up: KV lengths, query lengths
             over 16 (decode and verify queries are kept), contexts, prompt and output lengths
             (decode rates over at least 8 new tokens), sliding windows, hidden / MLP / expert /
             shared expert widths, latent attention's kv_lora_rank and q_lora_rank, and
             vocabulary. Rounded down, at least 1: layers (an MoE model's dense first layers and
             its MoE layers apart; sliding and full layers keep one of each) and KV heads (query
             heads keep the model's GQA ratio; latent attention keeps its one KV head and
             divides the query heads; Gemma 4's global layers' KV heads are divided too, to a
             divisor of the query heads). Kept: batch sizes, request counts, slots, head_dim
             (Gemma 4's global head_dim too; latent attention: its rope, nope and v dims,
             head_dim = the divided kv_lora_rank + rope), page sizes, the kernel cases' GQA and
             dtypes, expert count, groups and top-k. The vision encoder: its width divided and
             rounded up to a multiple of its 16 heads (kept), MLP and text widths divided (up),
             layers (down, at least 1) and its 16 soft tokens a side (up), patch size (14) and
             4 x 4 pooling kept: the patch grid's side is 4 x ceil(16 / N) (N=16: 4 x 4
             patches, one token, 56-pixel images); image batches kept. Kernels run in interpret
             mode. Each row of a scaled run has a `shape` cell "nominal -> run": its figures are
             those of the shapes run, not of the nominal ones. N=16 takes about 8 minutes on 2
             cores, the deepseek_v3 and gpt_oss sections a minute or two more, gemma4 about
             one, vision seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxinfer.runtime.config import RopeScaling
from jaxinfer.runtime.host.tokenizer import Tokenizer
# the full models' shapes (cut to a few layers here); the vision encoder's shape and FLOPs
from jaxinfer.tools.cost_model import MODELS, VISION_MODELS, vision_flops

# JAX and the kernels are imported where they run: `jaxinfer --help` registers this command
# without starting JAX
DTYPES = {"bf16": "bfloat16", "f32": "float32"}
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
# DeepSeek-V3's attention and expert dims; 2 of its 61 layers (the first dense, the second MoE);
# softmax scale (nope + rope)^-0.5 (its YaRN mscale left out: rope scaling does not change speed)
DEEPSEEK_V3 = dict(MODELS["DeepSeek-V3"], num_layers=2, dense_layers=(0,))
# head_dim 48 + 16 = 64: the TPU kernel's multiple of 64
TINY_DEEPSEEK_V3 = dict(DEEPSEEK_V3, vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_heads=4, head_dim=48 + 16, kv_lora_rank=48, q_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        query_pre_attn_scalar=16.0 + 16, num_experts=16, experts_per_token=4,
                        moe_intermediate_size=32, shared_expert_size=32, router_groups=4,
                        router_topk_groups=2)
# gpt-oss-20b's dims; 4 of its 24 layers, sliding (window 128) and full alternating
GPT_OSS_20B = dict(MODELS["gpt-oss-120b"], num_layers=4, layer_types=("local", "global") * 2,
                   num_experts=32, rms_norm_eps=1e-5,
                   rope_scaling=RopeScaling(kind="yarn", factor=32.0,
                                            original_max_position_embeddings=4096,
                                            truncate=False))
TINY_GPT_OSS = dict(GPT_OSS_20B, vocab_size=512, hidden_size=64, intermediate_size=32,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8,
                    layer_types=("local", "global"), num_experts=8, experts_per_token=2,
                    moe_intermediate_size=32)
# Gemma-4-26B-A4B's dims (its GGUF's metadata; the global layers' 2 KV heads and V = K: NeMo's
# Gemma 4 provider); no KV-shared layers and no per-layer inputs in this model. 12 of its 30
# layers: two periods of five sliding layers and one global
GEMMA4_26B_A4B = dict(MODELS["Gemma-4-26B-A4B"], num_layers=12,
                      layer_types=(("local",) * 5 + ("global",)) * 2)
TINY_GEMMA4 = dict(GEMMA4_26B_A4B, vocab_size=512, hidden_size=64, intermediate_size=48,
                   num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, global_head_dim=32,
                   global_kv_heads=1, sliding_window=8, layer_types=("local", "global"),
                   embed_scale=8.0, num_experts=8, experts_per_token=2, moe_intermediate_size=16)
# Gemma 3 4B's vision encoder (VisionConfig fields): 27 SigLIP layers on 64 x 64 patches of 14
# pixels, 4 x 4 pooled to 256 soft tokens of the text's 2560
GEMMA3_4B_VISION = VISION_MODELS["Gemma-3-4B vision"]
# 8 x 8 patches of 4 pixels, 2 x 2 pooled to 16 tokens
TINY_VISION = dict(GEMMA3_4B_VISION, image_size=32, patch_size=4, hidden_size=32, num_layers=2,
                   num_heads=2, intermediate_size=64, tokens_per_image=16, text_hidden_size=64)



# ------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Shapes:
    """Every size one run measures at: the sections read theirs from here, so the full, the
    smoke and the scaled run share one code path. kind "full": the shapes of the module
    docstring; "smoke": tiny shapes and a short list of kernel cases; "scaled": the full run's
    lists with its dimensions divided by `div` (`--cpu-scale`; the docstring says which)."""

    kind: str = "full"
    div: int = 1

    def __post_init__(self):
        if self.kind not in ("full", "smoke", "scaled") or self.div < 1 or (
                self.kind != "scaled" and self.div != 1):
            raise ValueError(f"bad shapes {self.kind!r} / {self.div}")

    @property
    def smoke(self) -> bool:
        return self.kind == "smoke"

    @property
    def scaled(self) -> bool:
        return self.kind == "scaled"

    def describe(self) -> str:
        if not self.scaled:
            return self.kind
        return (f"scaled 1/{self.div}: every case of the full run, its lengths, head counts, "
                f"widths, layers and vocabulary divided by {self.div}; figures are for the shapes "
                "run (column shape: nominal -> run), not the nominal ones")

    def n(self, x: int, floor: int = 1) -> int:
        """A length or width at this run's scale: x / div rounded up, at least `floor` (never
        more than x)."""
        return min(x, max(floor, -(-x // self.div)))

    def tag(self, nominal: str, run: str) -> dict:
        """The `shape` cell of a scaled run's row (nothing in the others)."""
        return {"shape": f"{nominal} -> {run}"} if self.scaled else {}

    # kernels: the case list is the full (or smoke) one; a scaled run shortens the layouts
    def kernel_cases(self) -> list[dict]:
        return kernel_cases(self.smoke)

    def layouts(self) -> dict[str, tuple[list[int], list[int]]]:
        lays = layouts(self.smoke)
        if not self.scaled:
            return lays
        out = {}
        for name, (qs, kvs) in lays.items():
            q2 = [q if q <= 16 else self.n(q) for q in qs]
            out[name] = (q2, [max(self.n(kv), q) for kv, q in zip(kvs, q2)])
        return out

    @property
    def kernel_kv_heads(self) -> int:
        return 1 if self.smoke else max(1, 2 // self.div)

    # bandwidth
    @property
    def bandwidth_heads(self) -> tuple[int, int]:
        """(Hkv, head_dim); Hq = 4 Hkv."""
        return (2, 64) if self.smoke else (max(1, 8 // self.div), 128)

    def bandwidth_grid(self) -> list[tuple[int, int, int]]:
        """(batch, nominal context, context run)."""
        if self.smoke:
            return [(4, 256, 256), (8, 256, 256)]
        return [(b, c, self.n(c)) for b in (64, 256) for c in (2048, 8192, 32768)]

    @property
    def copy_bytes(self) -> int:
        return (16 if self.smoke else max(16, 1024 // self.div)) << 20

    @property
    def repeats(self) -> int:
        return 5 if self.kind == "full" else 3

    # the engine sections
    def model(self, full: dict, tiny: dict) -> dict:
        """ModelConfig fields: `tiny` for smoke, `full` divided for a scaled run. Latent
        attention keeps its one KV head and divides the query heads and the latent widths
        (head_dim: the divided kv_lora_rank + the kept rope dims); the global layers' own KV
        heads (Gemma 4) are divided too, to a divisor of the query heads; an MoE model's dense
        first layers and its MoE layers are divided apart, and sliding / full layer types keep
        a layer of each kind."""
        if self.smoke:
            return tiny
        out = dict(full, **self._layers(full))
        if full.get("kv_lora_rank"):
            out.update(num_heads=max(1, full["num_heads"] // self.div),
                       head_dim=self.n(full["kv_lora_rank"]) + full["qk_rope_head_dim"])
        else:
            kv = max(1, full["num_kv_heads"] // self.div)
            out.update(num_kv_heads=kv, num_heads=kv * (full["num_heads"] // full["num_kv_heads"]))
            if full.get("global_kv_heads"):
                out["global_kv_heads"] = math.gcd(out["num_heads"],
                                                  max(1, full["global_kv_heads"] // self.div))
        for k in ("hidden_size", "intermediate_size", "vocab_size", "moe_intermediate_size",
                  "shared_expert_size", "kv_lora_rank", "q_lora_rank", "sliding_window"):
            if full.get(k):
                out[k] = self.n(full[k])
        return out

    def _layers(self, full: dict) -> dict:
        """num_layers (dense_layers, layer_types) of a scaled run: the dense first layers (an
        MoE model's dense_layers, a prefix) and the other layers each divided, at least 1; at
        least as many layers as it takes layer_types to show each of its kinds."""
        n, types = full["num_layers"], tuple(full.get("layer_types", ()))
        dense = len(full.get("dense_layers", ()))
        if tuple(full.get("dense_layers", ())) != tuple(range(dense)):
            raise ValueError(f"dense_layers {full['dense_layers']}: not the first layers")
        kd = max(1, dense // self.div) if dense else 0
        layers = kd + (max(1, (n - dense) // self.div) if n > dense else 0)
        if types:
            layers = max(layers, 1 + max(types.index(t) for t in set(types)))
        out = dict(num_layers=layers)
        if dense:
            out["dense_layers"] = tuple(range(kd))
        if types:
            out["layer_types"] = types[:layers]
        return out

    @property
    def engine_dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"

    @property
    def decode_lens(self) -> tuple[int, int]:
        """(prompt, new tokens) of the decode-rate rows."""
        return (16, 8) if self.smoke else (self.n(128, 8), self.n(64, 8))

    def batches(self, section: str) -> tuple[int, ...]:
        if self.smoke:
            return (1, 4)
        return (1, 64, 256) if section == "engine" else (1, 64)

    def vision(self, full: dict, tiny: dict) -> dict:
        """VisionConfig fields: `tiny` for smoke, `full` divided for a scaled run: hidden width
        divided and rounded up to a multiple of the heads (kept), MLP and text widths divided
        (up), layers (down, at least 1), soft tokens a side divided (up); patch size and the
        pooling window kept, so the patch grid's side is the pool x the tokens a side."""
        if self.smoke:
            return tiny
        h, side = full["num_heads"], math.isqrt(full["tokens_per_image"])
        pool = full["image_size"] // full["patch_size"] // side
        t = self.n(side)
        return dict(full, hidden_size=h * -(-self.n(full["hidden_size"]) // h),
                    intermediate_size=self.n(full["intermediate_size"]),
                    text_hidden_size=self.n(full["text_hidden_size"]),
                    num_layers=max(1, full["num_layers"] // self.div), tokens_per_image=t * t,
                    image_size=full["patch_size"] * pool * t)

    @property
    def vision_batches(self) -> tuple[int, ...]:
        return (1, 2) if self.smoke else (1, 16)

    @property
    def mixed(self) -> dict:
        """The mixed workload: `requests` seeded requests of prompt and output lengths drawn from
        the ranges, on `slots` slots (static batches of `slots`)."""
        if self.smoke:
            return dict(requests=12, slots=4, prompt=(4, 24), output=(2, 12))
        return dict(requests=256, slots=64, prompt=(self.n(16), self.n(256)),
                    output=(self.n(8), self.n(128)))


def model_desc(c: dict) -> str:
    """Layers, width, attention (query / KV heads and head_dim, or latent attention's dims:
    C kv_lora_rank, q q_lora_rank, N nope, R rope, V value), sliding-window layers, the global
    layers' own KV heads and head_dim (K=V: their V from K's projection), MLP width (an MoE
    model's dense layers, or the dense MLP beside the experts), experts (+ the shared expert's
    width), vocabulary: one line."""
    if c.get("kv_lora_rank"):
        attn = (f"H{c['num_heads']} MLA C{c['kv_lora_rank']} q{c.get('q_lora_rank', 0)} "
                f"N{c['qk_nope_head_dim']} R{c['qk_rope_head_dim']} V{c['v_head_dim']}")
    else:
        attn = f"H{c['num_heads']}/{c['num_kv_heads']} d{c['head_dim']}"
    local = c.get("layer_types", ()).count("local")
    window = f" {local} local w{c['sliding_window']}" if local else ""
    if c.get("global_head_dim"):
        window += (f" global /{c.get('global_kv_heads') or c['num_kv_heads']} "
                   f"d{c['global_head_dim']}" + (" K=V" if c.get("global_k_eq_v") else ""))
    dense = len(c.get("dense_layers", ()))
    ff = (f" ff{c['intermediate_size']}" if not c.get("num_experts") or c.get("moe_block")
          else f" {dense} dense ff{c['intermediate_size']}" if dense else "")
    moe = (f" E{c['num_experts']}/{c['experts_per_token']}x{c['moe_intermediate_size']}"
           + (f"+{c['shared_expert_size']}" if c.get("shared_expert_size") else "")
           if c.get("num_experts") else "")
    return f"L{c['num_layers']} h{c['hidden_size']} {attn}{window}{ff}{moe} V{c['vocab_size']}"


def vision_desc(c: dict) -> str:
    """A vision encoder's layers, width, heads, MLP width, image side / patch size (the patch
    grid), soft tokens and text width: one line."""
    g = c["image_size"] // c["patch_size"]
    return (f"L{c['num_layers']} h{c['hidden_size']} H{c['num_heads']} ff{c['intermediate_size']} "
            f"{c['image_size']}px/{c['patch_size']} ({g}x{g}) {c['tokens_per_image']} tok "
            f"D{c['text_hidden_size']}")


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
    import jax

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
    import jax.numpy as jnp

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


def kernels_section(rep: Report, shapes: Shapes, platform: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention, ragged_paged_attention_reference)

    interpret = shapes.smoke or jax.default_backend() == "cpu"
    rep.section("kernels", platform=platform, interpret=interpret,
                tolerance="max|kernel - reference| / max(1, max|reference|) <= "
                          + ", ".join(f"{k} {v}" for k, v in TOL.items()))
    nominal, lays, hkv = layouts(shapes.smoke), shapes.layouts(), shapes.kernel_kv_heads
    for c in shapes.kernel_cases():
        q_lens, kv_lens = lays[c["layout"]]
        (nq, nkv), nhkv = nominal[c["layout"]], 1 if shapes.smoke else 2
        row = {"layout": c["layout"],
               **shapes.tag(f"q {_csv(nq)} kv {_csv(nkv)} Hkv {nhkv}",
                            f"q {_csv(q_lens)} kv {_csv(kv_lens)} Hkv {hkv}"),
               **{k: v for k, v in c.items() if k != "layout"}}
        try:
            args, scales = make_case(q_lens, kv_lens, num_kv_heads=hkv, gqa=c["gqa"],
                                     head_dim=c["head_dim"], page_size=c["page_size"],
                                     dtype=getattr(jnp, DTYPES[c["dtype"]]), int8=c["int8"],
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


def _csv(xs) -> str:
    return ",".join(map(str, xs))


# -------------------------------------------------------------------------- bandwidth section


def bandwidth_section(rep: Report, shapes: Shapes, platform: str, mem_bytes: int) -> float:
    import jax
    import jax.numpy as jnp

    from jaxinfer.pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from jaxinfer.tools.bench_attention import copy_bandwidth, make_step, median_seconds

    from jaxinfer.runtime.device.attention import xla_ragged_paged_attention

    repeats = shapes.repeats
    bw = copy_bandwidth(shapes.copy_bytes, repeats)
    (hkv, d), interpret = shapes.bandwidth_heads, shapes.smoke or jax.default_backend() == "cpu"
    rep.section("bandwidth", copy_bandwidth_gbs=bw / 1e9, page_size=16, dtype="bf16",
                heads=f"Hq {4 * hkv}, Hkv {hkv}, D {d}")
    for batch, nominal, ctx in shapes.bandwidth_grid():
        kv_bytes = batch * ctx * hkv * d * 2 * 2
        row = dict(batch=batch, context=ctx, kv_gib=kv_bytes / 2**30,
                   **shapes.tag(f"b{batch} ctx {nominal} Hkv 8", f"b{batch} ctx {ctx} Hkv {hkv}"))
        if mem_bytes and 2.2 * kv_bytes > mem_bytes:
            rep.row("bandwidth", dict(row, skipped="does not fit"))
            continue
        try:
            args = make_step([1] * batch, [ctx] * batch, num_q_heads=4 * hkv,
                             num_kv_heads=hkv, head_dim=d, page_size=16, dtype=jnp.bfloat16)
            kern = jax.jit(lambda *a: ragged_paged_attention(
                *a, sm_scale=d ** -0.5, platform=platform, interpret=interpret))
            t = median_seconds(lambda a=args: kern(*a), 1, repeats)
            row.update(kernel_ms=t * 1e3, kernel_gbs=kv_bytes / t / 1e9,
                       kernel_of_copy=kv_bytes / t / bw)
            if 3 * kv_bytes < (mem_bytes or 1 << 62) and kv_bytes <= 8 << 30:
                xla = jax.jit(lambda *a: xla_ragged_paged_attention(*a, sm_scale=d ** -0.5,
                                                                    max_q_len=1))
                t = median_seconds(lambda a=args: xla(*a), 1, repeats)
                row.update(xla_ms=t * 1e3, xla_gbs=kv_bytes / t / 1e9)
            del args
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rep.row("bandwidth", row)
    return bw


# ----------------------------------------------------------------------------- engine section


def _decode_rate(eng, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """`batch` requests of random prompts: wall until every one has its first token (prefill),
    then decode tokens/s and ms/step until all finish. A failed step (the engine ends its
    requests with finish reason "error") aborts the rest and raises."""
    from jaxinfer.runtime.host.requests import SamplingParams

    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(rng.integers(3, eng.cfg.vocab_size, prompt_len).tolist(), sp)
            for _ in range(batch)]
    t0, got = time.perf_counter(), {r: 0 for r in rids}  # tokens so far, by request

    def step():
        for d in eng.step():
            if d.finish_reason == "error":
                for r in rids:
                    eng.abort(r)
                raise RuntimeError(d.error)
            got[d.request_id] += len(d.token_ids)

    while not all(got.values()):
        step()
    t1, tok1, steps = time.perf_counter(), sum(got.values()), 0
    while eng.num_unfinished:
        step()
        steps += 1
    t2 = time.perf_counter()
    toks = sum(got.values()) - tok1
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


def engine_section(rep: Report, shapes: Shapes, bw: float) -> None:
    _engine_rows(rep, "engine", shapes, LLAMA3_8B, TINY_LLAMA,
                 "tiny Llama" if shapes.smoke else "Llama-3-8B shape, random init", bw,
                 formats=("int8", "int4"), mixed=True)


def moe_section(rep: Report, shapes: Shapes, bw: float) -> None:
    _engine_rows(rep, "moe", shapes, QWEN3_30B_A3B, TINY_MOE,
                 "tiny MoE" if shapes.smoke
                 else "Qwen3-30B-A3B shape (12 of 48 layers), random init", bw, formats=("int8",))


def deepseek_v3_section(rep: Report, shapes: Shapes, bw: float) -> None:
    _engine_rows(rep, "deepseek_v3", shapes, DEEPSEEK_V3, TINY_DEEPSEEK_V3,
                 "tiny DeepSeek-V3 (latent attention, grouped sigmoid routing, shared expert, "
                 "first layer dense)" if shapes.smoke
                 else "DeepSeek-V3 shape (2 of 61 layers: the first dense, the second MoE, so "
                      "the bf16 weights, ~28 GB, fit an H100's 80 GB), random init", bw,
                 formats=(), kv=latent_kv)


def gpt_oss_section(rep: Report, shapes: Shapes, bw: float) -> None:
    _engine_rows(rep, "gpt_oss", shapes, GPT_OSS_20B, TINY_GPT_OSS,
                 "tiny gpt-oss (sinks, biases, clamped GLU, sliding and full layers, YaRN)"
                 if shapes.smoke else "gpt-oss-20b shape (4 of 24 layers), random init", bw,
                 formats=())


def gemma4_section(rep: Report, shapes: Shapes, bw: float) -> None:
    _engine_rows(rep, "gemma4", shapes, GEMMA4_26B_A4B, TINY_GEMMA4,
                 "tiny Gemma 4 (sliding and global layers of their own KV heads and head_dim, "
                 "V = K on the global ones, experts beside the dense MLP)" if shapes.smoke
                 else "Gemma-4-26B-A4B shape (12 of 30 layers: two periods of five sliding and "
                      "one global, so the bf16 weights, ~21 GB of the whole model's ~50 GB, "
                      "leave an H100's 80 GB room for the decode's expert temporaries and the "
                      "section's time short), random init", bw, formats=(), kv=layer_kv)


# published dense bf16 peaks (tools/cost_model.py CHIPS) by device kind: (substring, chip)
PEAKS = (("H100 PCIe", None), ("H100", "H100 SXM"), ("H200", "H200 SXM"),
         ("v5 lite", "TPU v5e"), ("v5e", "TPU v5e"), ("v6 lite", "TPU v6e"), ("v6e", "TPU v6e"))


def chip_peak(device_kind: str) -> tuple[str, float] | None:
    """(chip, dense bf16 peak FLOP/s) of a device kind the cost model knows, else None."""
    from jaxinfer.tools.cost_model import CHIPS

    chip = next((c for k, c in PEAKS if k.lower() in device_kind.lower()), None)
    return (chip, CHIPS[chip][0]) if chip else None


def is_oom(e: BaseException) -> bool:
    """An allocation the device refused (XLA's RESOURCE_EXHAUSTED, at compile or run time)."""
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def vision_section(rep: Report, shapes: Shapes) -> None:
    """A random-init Gemma-3-4B-shaped vision encoder (the module docstring): per image batch
    and way of calling (`vision_modes`), a first-run row (compile included, its seconds apart)
    and a steady-state row (median of shapes.repeats) with TFLOP/s."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.runtime.device.vision import VisionConfig, encode_images, init_vision_params
    from jaxinfer.runtime.images import MAX_IMAGES_PER_CALL

    full, fields = GEMMA3_4B_VISION, shapes.vision(GEMMA3_4B_VISION, TINY_VISION)
    cfg = VisionConfig(**fields)
    dname = shapes.engine_dtype
    dtype = jnp.bfloat16 if dname == "bfloat16" else jnp.float32
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_vision_params(cfg, jax.random.key(0), dtype=dtype))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    flops = vision_flops(fields)
    peak = chip_peak(jax.devices()[0].device_kind)
    model = ("tiny Gemma 3 vision encoder" if shapes.smoke
             else "Gemma-3-4B vision encoder shape (SigLIP tower + projector), random init")
    rep.section("vision", model=model + (f" ({vision_desc(full)}), scaled 1/{shapes.div}: "
                                         f"{vision_desc(fields)}" if shapes.scaled else
                                         f" ({vision_desc(fields)})"),
                dtype=dname, compute=f"{dname} products, f32 accumulation",
                weight_gib=weight_bytes / 2**30, init_s=time.perf_counter() - t0,
                gflops_per_image=flops / 1e9, max_images_per_call=MAX_IMAGES_PER_CALL,
                **({"nominal_gflops_per_image": vision_flops(full) / 1e9} if shapes.scaled
                   else {}),
                **({"peak_bf16_tflop_s": f"{peak[1] / 1e12:.0f} ({peak[0]})"} if peak else {}))
    fn = jax.jit(functools.partial(encode_images, cfg=cfg))
    tag = shapes.tag(vision_desc(full), vision_desc(fields))
    for batch in shapes.vision_batches:
        pixels = jax.random.normal(jax.random.key(batch), (batch, cfg.image_size,
                                                           cfg.image_size, 3), jnp.float32)
        for mode, per_call in vision_modes(batch, MAX_IMAGES_PER_CALL):
            row = dict(batch=batch, mode=mode, calls=-(-batch // per_call), **tag)
            try:
                first, steady = _vision_runs(fn, params, pixels, per_call, shapes.repeats)
            except Exception as e:  # out of memory: a finding about this batch, not a failure
                rep.row("vision", dict(row, **(
                    {"note": "out of memory: " + str(e).strip().splitlines()[0][:200]}
                    if is_oom(e) else {"error": f"{type(e).__name__}: {str(e)[:200]}"})))
                continue
            for run, (wall, compile_s) in (("first", first), ("steady", (steady, None))):
                r = dict(row, run=run, ms=wall * 1e3, ms_per_call=wall * 1e3 / row["calls"],
                         images_per_s=batch / wall)
                if compile_s is not None:
                    r["compile_s"] = compile_s
                else:
                    r["tflop_s"] = batch * flops / wall / 1e12
                    if peak:
                        r["of_peak"] = r["tflop_s"] * 1e12 / peak[1]
                rep.row("vision", r)
        del pixels


def vision_modes(batch: int, max_per_call: int) -> list[tuple[str, int]]:
    """(mode, images a call): as the engine runs the encoder (at most max_per_call images a
    call), and past that as one call of the whole batch."""
    calls = -(-batch // max_per_call)
    modes = [(f"engine: {calls} call{'s' * (calls > 1)} of {min(batch, max_per_call)}",
              min(batch, max_per_call))]
    if batch > max_per_call:
        modes.append((f"one call of {batch}", batch))
    return modes


def _vision_runs(fn, params, pixels, per_call: int, repeats: int):
    """((first run's wall s, its compile s), steady state's median wall s) of encoding
    `pixels` in calls of at most `per_call` images, each call's output waited for (the engine
    fetches each call's tokens before the next). The first run compiles the programs (one a
    call size) ahead of its calls."""
    import jax

    chunks = [pixels[i:i + per_call] for i in range(0, pixels.shape[0], per_call)]
    t0 = time.perf_counter()
    progs = {}
    for c in chunks:
        if c.shape not in progs:
            progs[c.shape] = fn.lower(params, c).compile()
    compile_s = time.perf_counter() - t0

    def run():
        for c in chunks:
            jax.block_until_ready(progs[c.shape](params, c))

    run()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t1 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t1)
    return (first, compile_s), float(np.median(times))


# name -> the section: a random-init model through the engine
ENGINE_SECTIONS = {"engine": engine_section, "moe": moe_section,
                   "deepseek_v3": deepseek_v3_section, "gpt_oss": gpt_oss_section,
                   "gemma4": gemma4_section}


def _engine_rows(rep: Report, section: str, shapes: Shapes, full: dict, tiny: dict, model: str,
                 bw: float, formats: tuple[str, ...], mixed: bool = False, kv=None) -> None:
    """Decode rates of a random-init model at each batch (first run, then steady state), a row
    of its KV cache's bytes a token (`kv`: latent_kv, layer_kv), the mixed workload continuous
    against static batches (`mixed`), then decode of its weights in each of `formats` at
    batch 1."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.checkpoints.quantize import quantize_params
    from jaxinfer.runtime.config import EngineConfig, ModelConfig
    from jaxinfer.runtime.build import prepare
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.device.model import init_params
    from jaxinfer.runtime.device.quantization import param_bytes

    fields = shapes.model(full, tiny)
    cfg = ModelConfig(**{"family": "llama", **fields})
    dname = shapes.engine_dtype
    dtype = jnp.bfloat16 if dname == "bfloat16" else jnp.float32
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.key(0), dtype=dtype))
    weight_bytes = param_bytes(params)
    rep.section(section, model=model + (f" ({model_desc(full)}), scaled 1/{shapes.div}: "
                                        f"{model_desc(fields)}" if shapes.scaled else ""),
                dtype=dname, weight_gib=weight_bytes / 2**30,
                init_s=time.perf_counter() - t0, hbm_floor_ms=weight_bytes / bw * 1e3)
    prompt, new = shapes.decode_lens

    def tag(nominal_lens: str, run_lens: str) -> dict:  # model and lengths, nominal -> run
        return shapes.tag(f"{model_desc(full)} {nominal_lens}", f"{model_desc(fields)} {run_lens}")

    lens_tag = tag("p128 n64", f"p{prompt} n{new}")

    def engine(p, max_slots, max_len=prompt + new + 16):
        ecfg = EngineConfig(max_slots=max_slots, max_model_len=max_len, dtype=dname,
                            prefill_chunk=256)
        return Engine(prepare(cfg, p, _IdTokenizer(cfg.vocab_size), ecfg))

    eng = engine(params, max(shapes.batches(section)) if not shapes.smoke else 8)
    for batch in shapes.batches(section):
        for run in ("first", "steady"):
            t0, c0 = time.perf_counter(), eng.compile_count
            try:
                r = _decode_rate(eng, batch, prompt, new, seed=batch)
            except Exception as e:
                rep.row(section, dict(weights=dname, batch=batch, run=run, **lens_tag,
                                       error=f"{type(e).__name__}: {str(e)[:200]}"))
                break
            rep.row(section, dict(weights=dname, batch=batch, run=run, **lens_tag,
                                   wall_s=time.perf_counter() - t0,
                                   compiles=eng.compile_count - c0, **r))
    if kv is not None:
        try:
            rep.row(section, dict(weights=dname, batch="kv", **shapes.tag(
                model_desc(full), model_desc(fields)), **kv(eng.cache, cfg)))
        except Exception as e:
            rep.row(section, dict(weights=dname, batch="kv",
                                  error=f"{type(e).__name__}: {str(e)[:200]}"))
    del eng
    if mixed:
        m, n = shapes.mixed, (MIXED_FULL["prompt"], MIXED_FULL["output"])
        rep.section(section, mixed_workload=(
            f"{m['requests']} seeded requests, prompts of {m['prompt'][0]}-{m['prompt'][1]} "
            f"tokens, outputs of {m['output'][0]}-{m['output'][1]} (ignore_eos, every token "
            f"produced), {m['slots']} slots: continuous batching against static batches of "
            f"{m['slots']} (a batch starts when the whole previous one finished)"))
        mtag = tag(f"p{_rng(n[0])} n{_rng(n[1])}", f"p{_rng(m['prompt'])} n{_rng(m['output'])}")
        try:
            for row in mixed_rows(cfg, params, engine, m):
                rep.row(section, dict(weights=dname, **mtag, **row))
        except Exception as e:
            rep.row(section, dict(weights=dname, batch="mixed", **mtag,
                                  error=f"{type(e).__name__}: {str(e)[:200]}"))
    for fmt in formats:  # int4: round to nearest (no calibration text here)
        try:
            q = quantize_params(params, fmt, dtype)
            eng = engine(q, 1 if shapes.smoke else 8)
            for run in ("first", "steady"):
                t0, c0 = time.perf_counter(), eng.compile_count
                r = _decode_rate(eng, 1, prompt, new, seed=1)
                rep.row(section, dict(weights=f"{fmt} ({param_bytes(q) / 2**30:.2f} GiB)",
                                       batch=1, run=run, **lens_tag,
                                       wall_s=time.perf_counter() - t0,
                                       compiles=eng.compile_count - c0, **r))
            del eng, q
        except Exception as e:
            rep.row(section, dict(weights=fmt, batch=1, **lens_tag,
                                   error=f"{type(e).__name__}: {str(e)[:200]}"))


def latent_kv(cache, cfg) -> dict:
    """The engine's latent KV cache: bytes a token takes (every layer's pool) against the
    expanded K (H heads of nope + rope dims) and V (H heads of v dims) it stands for, at the
    pool's itemsize, and their ratio."""
    latent = cache.bytes_per_token
    itemsize = cache.k[0].dtype.itemsize
    expanded = cfg.num_layers * cfg.num_heads * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * itemsize
    return dict(kv_bytes_per_token=latent, expanded_kv_bytes_per_token=expanded,
                kv_compression=expanded / latent)


def layer_kv(cache, cfg) -> dict:
    """The engine's KV cache by layer type (Gemma 4): bytes a token takes in one sliding and in
    one global layer storing its own KV (K and V pools at the type's KV heads and head_dim; a
    V from K's projection is still cached apart: K is normed and rotated, V only normed), the
    layers of each type storing their own, those reading another layer's (none stored), and
    bytes a token takes in every layer's pools."""
    tokens = cache.num_pages * cache.page_size
    row = {}
    for kind, local in (("local", True), ("global", False)):
        own = [i for i in range(cfg.num_layers)
               if cfg.layer_is_local(i) == local and cfg.layer_kv_source(i) == i]
        row[f"{kind}_layers"] = len(own)
        row[f"{kind}_kv_bytes_per_token"] = (cache.k[own[0]].nbytes
                                             + cache.v[own[0]].nbytes) / tokens
    row["kv_shared_layers"] = cfg.kv_shared_layers
    row["kv_bytes_per_token"] = cache.bytes_per_token
    return row


MIXED_FULL = Shapes().mixed


def _rng(r: tuple[int, int]) -> str:
    return f"{r[0]}-{r[1]}"


def mixed_rows(cfg, params, make_engine, m: dict) -> list[dict]:
    """The mixed workload `m` (Shapes.mixed) on a fresh engine of m["slots"] slots, through
    engine_runs.run_engine (as in bench throughput): continuously batched, then in static
    batches of m["slots"]; twice (first run with its compiles, then steady state). One row a
    pass: output tok/s of each, their ratio, compiles. Raises if either run produced other
    than every requested token."""
    from jaxinfer.tools.engine_runs import run_engine, workload

    reqs = workload(m["requests"], cfg.vocab_size, m["prompt"], m["output"], seed=0,
                    special={0})
    want = sum(o for _, o in reqs)
    eng = make_engine(params, m["slots"], m["prompt"][1] + m["output"][1] + 16)
    llm = _as_llm(eng)
    rows = []
    for run in ("first", "steady"):
        c0, res = eng.compile_count, {}
        for mode in ("continuous", "static"):
            res[mode] = run_engine(llm, reqs, static=mode == "static")
            if res[mode]["output_tokens"] != want:
                raise RuntimeError(f"mixed {mode}: {res[mode]['output_tokens']} output tokens, "
                                   f"{want} requested")
        c, s = res["continuous"], res["static"]
        rows.append(dict(batch="mixed", run=run, wall_s=c["wall_s"] + s["wall_s"],
                         compiles=eng.compile_count - c0, output_tokens=want,
                         continuous_tok_s=c["output_tokens_per_s"],
                         static_tok_s=s["output_tokens_per_s"],
                         continuous_vs_static=c["output_tokens_per_s"] / s["output_tokens_per_s"],
                         continuous_steps=c["steps"], static_steps=s["steps"]))
    del eng, llm
    return rows


def _as_llm(eng):
    """An LLM around `eng` (run_engine drives LLM.generate; random-init weights have no
    checkpoint to load)."""
    from jaxinfer.runtime.llm import LLM

    llm = object.__new__(LLM)
    llm.engine, llm.config, llm.tokenizer = eng, eng.ecfg, eng.tokenizer
    return llm


# ------------------------------------------------------------------------------------- main


def _scale(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return n


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="directory for device.json, device.md")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true",
                   help="tiny shapes, 8 kernel cases, interpret-mode kernels (runs on CPU)")
    g.add_argument("--cpu-scale", type=_scale, default=None, metavar="N",
                   help="CPU only (refused on a TPU or GPU): every kernel case, layout, bandwidth "
                        "grid point and engine section batch of the full run, with lengths, head "
                        "counts, model widths, layers and vocabulary divided by N; each row's "
                        "shape column says nominal -> run. 16: about 11 minutes on 2 cores")
    p.add_argument("--sections", default=",".join(["env", "kernels", "bandwidth",
                                                   *ENGINE_SECTIONS, "vision"]),
                   help="comma-separated, run in this order (default: %(default)s)")
    p.add_argument("--platform", default=None, choices=["tpu", "gpu"],
                   help="kernel to run (default: the device's; 'tpu' in interpret mode on CPU)")


def register(bench) -> None:
    """`jaxinfer bench device` (bench: the `bench` command's subparsers)."""
    p = bench.add_parser("device", help="accelerator proof: kernels, bandwidth, engine, vision")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    return cmd(p.parse_args(argv))


def cmd(args) -> int:
    import jax

    from jaxinfer.tools.bench_attention import copy_bandwidth

    backend = jax.default_backend()
    platform = args.platform or ("gpu" if backend in ("gpu", "cuda", "rocm") else "tpu")
    scale = getattr(args, "cpu_scale", None)
    if scale is not None and backend != "cpu":
        print(f"bench device: --cpu-scale is for CPU runs; on {backend} run the full shapes "
              "(drop --cpu-scale)", file=sys.stderr)
        return 2
    if backend == "cpu" and not args.smoke and scale is None:
        print("bench device: no accelerator: full shapes in interpret mode would take hours; "
              "running --smoke (--cpu-scale N: every full case, dimensions divided by N)",
              file=sys.stderr)
        args.smoke = True
    shapes = Shapes("smoke") if args.smoke else Shapes("scaled", scale) if scale else Shapes()
    rep = Report(args.out)
    sections = args.sections.split(",")
    t_all = time.perf_counter()
    env_section(rep)
    rep.section("env", shapes=shapes.describe())
    mem = int(jax.devices()[0].memory_stats().get("bytes_limit", 0)) if backend != "cpu" else 0
    bw = None
    for name in sections:
        t0 = time.perf_counter()
        print(f"bench device: {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "kernels":
                kernels_section(rep, shapes, platform)
            elif name == "bandwidth":
                bw = bandwidth_section(rep, shapes, platform, mem)
            elif name in ENGINE_SECTIONS:
                if bw is None:
                    bw = copy_bandwidth(shapes.copy_bytes, 3)
                ENGINE_SECTIONS[name](rep, shapes, bw)
            elif name == "vision":
                vision_section(rep, shapes)
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
