"""Multi-LoRA serving cost, side by side in one run.

    python -m jaxinfer.tools.bench_lora [--model gemma3-270m] [--requests 8] [--adapters 4]
                                        [--rank 16] [--max-tokens 64] [--repeats 3]

Three workloads of `--requests` concurrent greedy requests (same prompts, `--max-tokens` each,
ignore_eos): on an engine without LoRA; on an engine with `--adapters` LoRA slots, all requests
on the base model; and on that engine with the requests spread over `--adapters` random
rank-`--rank` adapters (every projection of every layer adapted). Output tokens/s over the whole
generate call, median of `--repeats` taken round robin after one compiling run each (reported
apart). The adapters are
random PEFT-format directories written for the model's shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = ["The history of the printing press", "Write a short poem about rivers",
           "Explain how a compiler works", "List three uses of copper",
           "Describe a walk through a forest", "What makes a good teacher?",
           "Summarise the plot of a heist film", "Give advice to a new gardener"]


def write_random_adapter(out: Path, cfg, rank: int, seed: int, scale: float = 0.02) -> Path:
    """A PEFT adapter dir (adapter_config.json + adapter_model.safetensors) adapting every
    attention and MLP projection of `cfg`'s layers with random rank-`rank` weights."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.runtime.device.lora import TARGETS, target_dims

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(cfg.num_layers):
        for t, (din, dout) in target_dims(cfg).items():
            kind = "mlp" if t in ("gate", "up", "down") else "self_attn"
            stem = f"base_model.model.model.layers.{i}.{kind}.{TARGETS[t][1]}"
            tensors[f"{stem}.lora_A.weight"] = (scale * rng.standard_normal((rank, din))).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (scale * rng.standard_normal((dout, rank))).astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m for _, m in TARGETS.values()]}))
    return out


def _timed(llm, prompts, params, loras) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)


def main(argv=None) -> int:
    from jaxinfer.runtime.llm import LLM
    from jaxinfer.runtime.host.requests import LoRARequest, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.requests)]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    kw = dict(max_slots=a.requests, max_model_len=a.max_model_len)
    plain = LLM(a.model, **kw)
    lora = LLM(a.model, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank, **kw)
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    reqs = [LoRARequest(f"ad{i}", i + 1, str(write_random_adapter(tmp / f"ad{i}",
                                                                  lora.model.cfg, a.rank, i)))
            for i in range(a.adapters)]
    mixed = [reqs[i % a.adapters] for i in range(a.requests)]
    work = {"no LoRA engine": (plain, None), "LoRA engine, base": (lora, None),
            f"LoRA engine, {a.adapters} adapters": (lora, mixed)}
    rows = {name: dict(first_s=_timed(llm, prompts, sp, loras)[0], rates=[])
            for name, (llm, loras) in work.items()}
    for _ in range(a.repeats):  # round robin: drift on a shared machine hits every workload
        for name, (llm, loras) in work.items():
            s, n = _timed(llm, prompts, sp, loras)
            rows[name]["rates"].append(n / s)
            rows[name]["tokens"] = n
    for r in rows.values():
        r["tok_s"] = statistics.median(r["rates"])
    base = rows["no LoRA engine"]["tok_s"]
    import jax

    print(f"{a.model}, {a.requests} concurrent requests x {a.max_tokens} tokens, rank {a.rank}, "
          f"{jax.default_backend()}; median of {a.repeats}")
    print(f"{'workload':>28} | {'tok/s':>8} | {'vs no LoRA':>10} | first run s")
    for name, r in rows.items():
        print(f"{name:>28} | {r['tok_s']:>8.1f} | {r['tok_s'] / base - 1:>+10.1%} | "
              f"{r['first_s']:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(vars(a), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
