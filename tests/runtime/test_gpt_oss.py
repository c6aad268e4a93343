"""gpt-oss through the engine against HF transformers' GptOssForCausalLM (random init, every
mechanism on: attention sinks, sliding and full layers alternating, YaRN rope, q/k/v/o biases,
a biased router, biased experts with the clamped GLU). Logits over a prefill and 16 cached decode
steps: tests/runtime/test_model_hf.py (the "gpt_oss" family)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.runtime.config import ConfigError
from tests.family_checks import (PROMPTS, assert_pallas_interpret_equals_xla,
                                 assert_served_equals_hf, assert_tp_tokens_equal, hf_greedy,
                                 served_dir)
from tests.model_utils import run_sequence
from tests.runtime.test_tensor_parallel import on_8_devices

@pytest.fixture(scope="module")
def gpt_oss(tiny_dir, tmp_path_factory):
    return served_dir("gpt_oss", tiny_dir, tmp_path_factory.mktemp("gpt_oss"))


def test_served_greedy_equals_hf_with_two_slots_chunks_and_prefix_hits(gpt_oss):
    assert_served_equals_hf(*gpt_oss)


def test_each_mechanism_moves_the_logits(gpt_oss):
    """The HF comparison could fail: switching off any one mechanism moves the logits far more
    than its 1e-4 tolerance (sinks, the clamp, the window, the o bias, YaRN, expert biases)."""
    d, _ = gpt_oss
    cfg, params = load_hf(d)
    prompt = list(range(3, 40))
    want, _, _ = run_sequence(params, cfg, prompt, page_size=8, decode_steps=0)

    def drop(field):
        return params.replace(layers=tuple(lp.replace(**{field: jnp.zeros_like(getattr(lp, field))})
                                           for lp in params.layers))

    variants = {
        "sinks": (cfg, params.replace(layers=tuple(
            lp.replace(sinks=jnp.full_like(lp.sinks, -1e30)) for lp in params.layers))),
        "clamp": (dataclasses.replace(cfg, swiglu_limit=None), params),
        "window": (dataclasses.replace(cfg, sliding_window=None, layer_types=()), params),
        "o bias": (cfg, drop("bo")),
        "expert bias": (cfg, drop("we_down_b")),
        "yarn": (dataclasses.replace(cfg, rope_scaling=None), params),
    }
    for name, (c, p) in variants.items():
        got, _, _ = run_sequence(p, c, prompt, page_size=8, decode_steps=0)
        assert np.abs(got - want).max() > 1e-3, name


def test_pallas_interpret_attention_with_sinks_equals_xla(gpt_oss):
    """The engine's Pallas kernel path (interpret mode on CPU) with sinks gives the XLA path's
    logits."""
    assert_pallas_interpret_equals_xla(gpt_oss[0])


def test_int8_and_ngram_speculation(gpt_oss):
    """int8 weights (experts per expert and channel) track the float model; n-gram speculation
    gives the greedy tokens of plain decoding."""
    from jaxinfer import LLM, SamplingParams

    d, hf = gpt_oss
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    spec = LLM(str(d), max_slots=2, page_size=8, max_model_len=128,
               speculative={"method": "ngram", "k": 3, "n": 2})
    for o in spec.generate(PROMPTS[2:4], greedy):
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, 12)
    q8 = LLM(str(d), max_slots=2, page_size=8, max_model_len=128, quantization="int8")
    lp = q8.engine.params.layers[0]
    assert type(lp.we_gate).__name__ == "QuantizedArray"
    assert lp.we_gate_b.dtype == jnp.float32  # biases stay float
    agree = [a == b for o in q8.generate(PROMPTS, greedy)
             for a, b in zip(o.token_ids, hf_greedy(hf, o.prompt_token_ids, 12))]
    assert np.mean(agree) > 0.5


@pytest.mark.parametrize("bad,word", [
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked"]}, "layer_types"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"swiglu_limit": "big"}, "config.json"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64, "truncate": "no"}}, "truncate"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0,
                          "original_max_position_embeddings": 64}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "original_max_position_embeddings"),
    ({"attention_bias": False}, "attention_bias"),
])
def test_bad_config_fields_are_config_errors(bad, word):
    from jaxinfer.checkpoints.hf_config import from_hf_config

    base = dict(model_type="gpt_oss", vocab_size=100, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], attention_bias=True)
    cfg = from_hf_config(base)
    assert (cfg.layer_types, cfg.attn_sinks, cfg.expert_bias, cfg.norm_topk_prob) == (
        ("local", "global"), True, True, True)
    with pytest.raises(ConfigError, match=word):
        from_hf_config({**base, **bad})


@on_8_devices
def test_tp_2_and_4_give_one_devices_greedy_tokens(tiny_dir, tmp_path):
    """Heads split by tp, sinks with them; experts split by expert (8 experts: 4 / 2 a device)."""
    def sinks_split(llm, tp):
        assert len(llm.engine.params.layers[0].sinks.sharding.device_set) == tp

    assert_tp_tokens_equal(served_dir("gpt_oss", tiny_dir, tmp_path / "gpt_oss")[0],
                           sinks_split)


def test_yarn_inverse_frequencies_equal_hfs():
    """YaRN's ramp (truncated or not) and attention factor against transformers' own."""
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxinfer.runtime.config import RopeScaling
    from jaxinfer.runtime.device.model import rope_attention_factor, rope_inv_freq

    for truncate in (True, False):
        rp = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                  beta_slow=1.0, truncate=truncate, original_max_position_embeddings=4096)
        hfc = SimpleNamespace(rope_parameters=rp, head_dim=64, hidden_size=512,
                              num_attention_heads=8, max_position_embeddings=131072,
                              standardize_rope_params=lambda: None)
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hfc, "cpu")
        ours = RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                           truncate=truncate)
        np.testing.assert_allclose(rope_inv_freq(64, 150000.0, ours), inv.numpy(), rtol=1e-6)
        assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-7)
