"""Gemma 4 (text) through the engine against HF transformers' Gemma4ForCausalLM (random init,
every mechanism on: global layers with their own head_dim and KV heads, V from K, proportional
RoPE, the last two layers reading earlier layers' KV, per-layer inputs, double-wide MLPs, a soft
cap; and the MoE block). Logits over a prefill and 16 cached decode steps:
tests/runtime/test_model_hf.py (the "gemma4" and "gemma4_moe" families)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.runtime.config import ConfigError
from tests.hf_models import make_hf_model
from tests.model_utils import run_sequence
from tests.family_checks import (PROMPTS, assert_pallas_interpret_equals_xla,
                                 assert_served_equals_hf, assert_tp_tokens_equal, hf_greedy,
                                 served_dir)
from tests.runtime.test_tensor_parallel import on_8_devices


def _gemma4_dir(tiny_dir, out, family="gemma4"):
    return served_dir(family, tiny_dir, out, vocab_size_per_layer_input=2000)


@pytest.fixture(scope="module")
def gemma4(tiny_dir, tmp_path_factory):
    """The MoE form: every dense mechanism and the experts beside the MLP (the dense form's
    logits: test_model_hf; its engine: the tests below that make their own)."""
    return _gemma4_dir(tiny_dir, tmp_path_factory.mktemp("gemma4_moe"), "gemma4_moe")


def test_served_greedy_equals_hf_with_two_slots_chunks_and_prefix_hits(gemma4):
    llm = assert_served_equals_hf(*gemma4)
    # the cache: the two reading layers store nothing; global layers 1 head of 64
    cache = llm.engine.cache
    assert [k is None for k in cache.k] == [False, False, True, True]
    assert cache.k[0].shape[::3] == (2, 32) and cache.k[1].shape[::3] == (1, 64)
    assert cache.bytes_per_token == 2 * (2 * 32 + 1 * 64) * 4


def test_each_mechanism_moves_the_logits(tiny_dir, tmp_path):
    """The HF comparison could fail: the per-layer inputs, the layer scalars, proportional RoPE
    (every dim rotated instead) and the V norm each move the logits well past 1e-4."""
    d, _ = _gemma4_dir(tiny_dir, tmp_path)
    cfg, params = load_hf(d)
    prompt = list(range(3, 40))
    want, _, _ = run_sequence(params, cfg, prompt, page_size=8, decode_steps=0)
    lay = lambda **kw: params.replace(layers=tuple(  # noqa: E731
        lp.replace(**{k: f(getattr(lp, k)) for k, f in kw.items()}) for lp in params.layers))
    variants = {
        "per-layer inputs": (cfg, lay(ple_proj=jnp.zeros_like)),
        "layer scalar": (cfg, lay(scalar=jnp.ones_like)),
        "proportional rope": (dataclasses.replace(cfg, rope_scaling=None), params),
        "v norm": (dataclasses.replace(cfg, v_norm=False), params),
    }
    for name, (c, p) in variants.items():
        got, _, _ = run_sequence(p, c, prompt, page_size=8, decode_steps=0)
        assert np.abs(got - want).max() > 1e-3, name


def test_pallas_interpret_attention_equals_xla(tmp_path):
    """Per-layer head dims and shared KV through the Pallas kernel path (head dims 64 / 128:
    the TPU kernel takes multiples of 64)."""
    make_hf_model("gemma4", tmp_path, hidden=64, vocab=2000, vocab_size_per_layer_input=2000,
                  head_dim=64, global_head_dim=128)
    assert_pallas_interpret_equals_xla(tmp_path)


@pytest.mark.parametrize("bad,word", [
    ({"per_layer_config": {"0": {"head_dim": 64}}}, "global"),
    ({"per_layer_config": {"1": {"head_dim": 64}, "3": {"head_dim": 128}}}, "same"),
    ({"num_kv_shared_layers": 4}, "kv_shared_layers"),
    ({"num_kv_shared_layers": 3}, "kv_shared_layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope_type"),
    ({"enable_moe_block": True}, "config.json"),  # no num_experts
    ({"attention_k_eq_v": "yes"}, "attention_k_eq_v"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
])
def test_bad_config_fields_are_config_errors(bad, word):
    from jaxinfer.checkpoints.hf_config import from_hf_config

    base = dict(model_type="gemma4_text", vocab_size=100, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
                per_layer_config={"1": {"head_dim": 16, "num_key_value_heads": 1},
                                  "3": {"head_dim": 16, "num_key_value_heads": 1}},
                num_kv_shared_layers=2)
    cfg = from_hf_config(base)
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.kv_shared_layers) == (16, 1, 2)
    # Google's configs name them directly (transformers then builds per_layer_config)
    direct = {k: v for k, v in base.items() if k != "per_layer_config"}
    cfg = from_hf_config({**direct, "global_head_dim": 16, "num_global_key_value_heads": 1,
                          "attention_k_eq_v": True})
    assert (cfg.global_head_dim, cfg.global_kv_heads) == (16, 1)
    assert from_hf_config(direct).global_head_dim == 512  # transformers' default
    with pytest.raises(ConfigError, match=word):
        from_hf_config({**base, **bad})


@on_8_devices
def test_tp_2_and_4_give_one_devices_greedy_tokens(tiny_dir, tmp_path):
    """Heads split by tp (the global layers' one KV head replicated), shared KV read on every
    device, the MoE block's experts split by expert."""
    assert_tp_tokens_equal(_gemma4_dir(tiny_dir, tmp_path / "g4", "gemma4_moe")[0])


def test_lora_on_per_layer_dims_equals_hf_peft(tiny_dir, tmp_path):
    """A PEFT adapter on every projection of a Gemma 4 whose layers differ (global q / o of
    4 x 64, local of 4 x 32, double-wide MLPs on the last two, no K / V there): served greedy
    tokens equal HF + PEFT's."""
    import copy

    import peft
    import torch

    from jaxinfer import LLM, LoRARequest, SamplingParams

    d, hf = _gemma4_dir(tiny_dir, tmp_path / "base")
    torch.manual_seed(3)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).eval()
    pm.save_pretrained(tmp_path / "adapter")
    llm = LLM(str(d), max_slots=2, page_size=8, max_model_len=128, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], greedy,
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    for o in outs:
        want = hf_greedy(pm, o.prompt_token_ids, 12)
        assert o.token_ids == want and want != hf_greedy(hf, o.prompt_token_ids, 12)


def test_composes_with_preemption_ngram_int8_and_int4(tiny_dir, tmp_path):
    """A page pool too small for the batch (preemption and recompute) and n-gram speculation
    give HF's greedy tokens; int8 and int4 weights load with per-layer shapes."""
    from jaxinfer import LLM, SamplingParams

    d, hf = _gemma4_dir(tiny_dir, tmp_path)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(str(d), page_size=8, max_model_len=128, num_pages=14, max_slots=4,
              speculative={"method": "ngram", "k": 3, "n": 2})
    outs = llm.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, o.prompt_token_ids, 16) for o in outs]
    assert llm.engine.scheduler.num_preemptions > 0
    # int8 / int4: the served tokens are those of the float forward over the same weights
    # widened (a random Gemma 4, its q / k / v RMS-normed, moves far under any rounding: the
    # oracle is the quantized weights themselves)
    import jax

    from jaxinfer.runtime.device.quantization import QuantizedArray

    for fmt in ("int8", "int4"):
        q = LLM(str(d), page_size=8, max_model_len=128, max_slots=2, quantization=fmt)
        w = q.get_weights()
        assert isinstance(w.layers[3].w_gate, QuantizedArray)
        assert w.layers[3].w_gate.shape[-1] == 2 * 128  # the double-wide MLP, quantized
        widened = jax.tree.map(lambda a: a.dequantize() if isinstance(a, QuantizedArray) else a,
                               w, is_leaf=lambda a: isinstance(a, QuantizedArray))
        for o in q.generate(PROMPTS[1:3], greedy):
            _, ref, _ = run_sequence(widened, q.engine.cfg, o.prompt_token_ids, page_size=8,
                                     decode_steps=16)
            assert o.token_ids == ref, fmt


def test_layer_by_layer_programs_equal_hf(tiny_dir, tmp_path, stalled):
    """compile_mode="background" with its compiler stalled: every step runs layer by layer
    (one program per layer kind: the reading layers are kinds of their own, their pages the
    source layers'), and the tokens are HF's."""
    from jaxinfer import LLM, SamplingParams

    d, hf = _gemma4_dir(tiny_dir, tmp_path)
    llm = LLM(str(d), max_slots=2, page_size=8, max_model_len=128, compile_mode="background")
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    assert all(o.token_ids == hf_greedy(hf, o.prompt_token_ids, 8) for o in outs)
    assert llm.engine._step.layerwise_steps > 0
    assert len(set(llm.engine._step._kinds)) == 4  # local / global, storing / reading
