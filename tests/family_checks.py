"""The engine checks every new model family passes against HF transformers (random-init models
from tests/hf_models.py with the tiny Llama's sentencepiece tokenizer): served greedy tokens
equal HF's `generate` with 2 slots, chunked prefill and prefix hits, and the same tokens at
tensor parallel 1 / 2 / 4."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.hf_models import make_hf_model

PROMPTS = ["The king is dead; long live the king. " * 3, "Hello there", "O Romeo, Romeo " * 4,
           "Now is the winter of our discontent", "Cry havoc " * 5]
# the same long prefix again: whole pages of it come from the prefix cache
SECOND = [PROMPTS[0] + "And then?", PROMPTS[2] + "wherefore"]


def served_dir(family: str, tiny_dir: Path, out: Path, **hf_kw):
    """A random-init HF `family` (hidden 64, vocab 2000) in `out` with the tiny tokenizer:
    (out, the HF model)."""
    out.mkdir(parents=True, exist_ok=True)
    hf = make_hf_model(family, out, hidden=64, vocab=2000, **hf_kw)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    return out, hf


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_served_equals_hf(d: Path, hf, new: int = 16):
    """Greedy tokens through LLM(d) (2 slots, prompt chunks of 16, then prompts that share a
    long prefix with the first round) equal HF's; -> the LLM."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(d), max_slots=2, page_size=8, max_model_len=160, prefill_chunk=16)
    greedy = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy)
    again = llm.generate(SECOND, greedy)
    assert max(len(o.prompt_token_ids) for o in outs) > 16  # chunked
    assert all(o.usage["cached_tokens"] >= 16 for o in again)  # prefix hits
    for o in outs + again:
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, new), o.prompt
    return llm


def assert_tp_tokens_equal(d: Path, check=None):
    """Greedy tokens at tensor_parallel 2 and 4 equal one device's; `check(llm, tp)` looks at
    each sharded engine."""
    from jaxinfer import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for tp in (1, 2, 4):
        llm = LLM(str(d), tensor_parallel=tp, max_slots=2, page_size=8, max_model_len=96,
                  prefill_chunk=16)
        outs[tp] = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        if check is not None and tp > 1:
            check(llm, tp)
    assert outs[2] == outs[1] and outs[4] == outs[1]


def assert_pallas_interpret_equals_xla(d: Path) -> None:
    """The checkpoint in d through the Pallas kernel path (interpret mode on CPU): a prefill
    and 3 decode steps give the XLA path's logits."""
    import numpy as np

    from jaxinfer.checkpoints.hf import load_hf
    from tests.model_utils import run_sequence

    cfg, params = load_hf(d)
    prompt = list(range(3, 30))
    want, _, dec_want = run_sequence(params, cfg, prompt, page_size=8, decode_steps=3)
    got, _, dec_got = run_sequence(params, cfg, prompt, page_size=8, decode_steps=3,
                                   backend="pallas_interpret")
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(dec_got, dec_want, atol=2e-5)
