"""Prompt logprobs of the served model against HF transformers' log-softmax over the same prompt.

    python -m jaxinfer.tools.check_prompt_logprobs [--model gemma3-270m] [--chunk 64] [--top 5]

Our side: `LLM.generate(..., SamplingParams(prompt_logprobs=top))` with prefill chunks of
`--chunk` tokens (f32), so the scores come from several prefill steps. HF's side: the same
checkpoint loaded by transformers in f32 (a GGUF through its own loader), one forward. Prints the
largest |difference| over the prompt's tokens and how often the top-n ids agree; exits 1 past
`--tol`. Needs the `test` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TEXT = ("The river ran quietly past the mill, and the miller counted sacks of grain while his "
        "daughter sang old songs about the sea, the mountains and the long road home. ") * 3


def _hf_model(path: str):
    import torch
    import transformers

    kw = dict(dtype=torch.float32)
    if path.endswith(".gguf"):
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def main(argv=None) -> int:
    import numpy as np
    import torch

    from jaxinfer.runtime.llm import LLM
    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.checkpoints.named import resolve_named

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)

    llm = LLM(args.model, max_slots=4, max_model_len=512, prefill_chunk=args.chunk,
              dtype="float32")
    t = time.perf_counter()
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0,
                                              prompt_logprobs=args.top))[0]
    ours_s = time.perf_counter() - t
    ids = out.prompt_token_ids
    path = str(resolve_named(args.model) or args.model)
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1).numpy()
    diff = max(abs(out.prompt_logprobs[i]["logprob"] - ref[i - 1, ids[i]])
               for i in range(1, len(ids)))
    same_top = sum([t for t, _ in out.prompt_logprobs[i]["top"]]
                   == list(np.argsort(-ref[i - 1])[:args.top]) for i in range(1, len(ids)))
    print(f"{args.model}: {len(ids) - 1} prompt tokens in prefill chunks of {args.chunk} "
          f"({ours_s:.1f} s, compiles included): max |ours - HF log-softmax| = {diff:.2e}; "
          f"top-{args.top} ids equal at {same_top}/{len(ids) - 1}")
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
