"""bf16 weights/activations (f32 accumulation) vs HF transformers in bf16."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.checkpoints.hf import load_hf
from tests.hf_models import make_hf_model
from tests.model_utils import run_sequence


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_bf16")
    hf = make_hf_model("llama", path, seed=3, hidden=256, layers=4, vocab=1024)
    with torch.no_grad():  # sharper logits than the 0.02 init so top-1 is meaningful
        hf.lm_head.weight.mul_(20.0)
    hf.save_pretrained(path, safe_serialization=True)
    hf = hf.to(torch.bfloat16)
    cfg, params = load_hf(path, dtype=jnp.bfloat16)
    return hf, cfg, params


def test_bf16_greedy_agrees_with_hf_bf16(bf16_pair):
    hf, cfg, params = bf16_pair
    rng = np.random.RandomState(0)
    agree = total = 0
    for _ in range(4):
        prompt = rng.randint(3, cfg.vocab_size, size=12).tolist()
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
        # teacher-forced: our top-1 at each generated position of HF's greedy sequence
        logits, _, _ = run_sequence(params, cfg, seq, page_size=16)
        ours = logits[len(prompt) - 1: -1].argmax(-1)
        agree += int((ours == np.asarray(seq[len(prompt):])).sum())
        total += len(seq) - len(prompt)
    rate = agree / total
    print(f"bf16 top-1 agreement with HF bf16: {rate:.3f} over {total} positions")
    assert rate >= 0.95
