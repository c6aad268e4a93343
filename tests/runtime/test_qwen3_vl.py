"""Qwen3-VL with images through the engine, held against HF transformers on a random-init
Qwen3VLForConditionalGeneration (tests/vision_models.py): the image token count follows the
image's size, the tokens take multimodal RoPE positions (t, h, w) and the generated ones
position + delta, the encoder's deepstack features join the first layers' hidden states.
Logits within 1e-4 with one and two images, greedy tokens and logprobs equal to HF with 2 slots
and chunked prefill, and a second turn served from the prefix and encoder caches."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.vision_models import (QWEN_IMAGE_TOKEN_ID, QWEN_MARK, QWEN_VISION_END_ID,
                                 make_qwen3_vl_dir, random_image)

MARK = QWEN_MARK


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_qwen3_vl_dir(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def llm(qwen_dir):
    from jaxinfer import LLM

    return LLM(str(qwen_dir[0]), max_slots=2, page_size=8, max_model_len=256, prefill_chunk=16)


def _hf_images(vision, ids: torch.Tensor, images) -> dict:
    """HF's image inputs (pixel_values, image_grid_thw, mm_token_type_ids) of our preprocessed
    images (the door's patches, tested against HF's processor in test_qwen3_vl_vision.py)."""
    if not images:
        return {}
    from jaxinfer.runtime.host.image_prompt import decode_images
    from jaxinfer.runtime.images import image_spec

    decoded = decode_images(images, image_spec(vision), 10**7)
    return dict(pixel_values=torch.tensor(np.concatenate([im.pixels for im in decoded])),
                image_grid_thw=torch.tensor([im.grid for im in decoded]),
                mm_token_type_ids=(ids == QWEN_IMAGE_TOKEN_ID).int())


def _hf_logits(hf, vision, ids, images) -> np.ndarray:
    t = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=t, **_hf_images(vision, t, images)).logits[0].float().numpy()


def test_mrope_positions_by_hand():
    from jaxinfer.runtime.host.image_prompt import ImageSpan, mrope_positions

    px = np.zeros(1, np.float32)
    # 2 text tokens, an image of a (1, 4, 6) patch grid = 2 x 3 tokens (merge 2), 1 text token
    pos, delta = mrope_positions(9, [ImageSpan(2, 6, b"a", px, (1, 4, 6))], 2)
    assert pos.tolist() == [[0, 0, 0], [1, 1, 1],
                            [2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4],
                            [5, 5, 5]]
    assert delta == 6 - 9


@pytest.mark.parametrize("count", [1, 2])
def test_logits_equal_hf_with_multimodal_rope_and_deepstack(qwen_dir, count):
    from jaxinfer.checkpoints.loader import load_model
    from jaxinfer.runtime.device.attention import whole_sequence_metadata
    from jaxinfer.runtime.device.kv_cache import init_cache
    from jaxinfer.runtime.device.model import compute_logits, forward_hidden
    from jaxinfer.runtime.host.image_prompt import decode_images, expand, mrope_positions
    from jaxinfer.runtime.images import Images, image_spec
    from jaxinfer.runtime.config import EngineConfig

    d, hf = qwen_dir
    lm = load_model(d)
    spec = image_spec(lm.vision)
    images = [random_image(1, (40, 50, 3)), random_image(2, (70, 30, 3))][:count]
    decoded = decode_images(images, spec, 10**7)
    text = "A " + " and ".join([MARK] * count) + " ok"
    ids, spans = expand(lm.tokenizer.encode(text), decoded, spec)
    assert [s.length for s in spans] == [im.tokens for im in decoded]
    assert len({im.tokens for im in decoded}) == count  # the count follows the image's size
    rope, _ = mrope_positions(len(ids), spans, spec.mrope_merge)
    outs = Images(lm.vision, EngineConfig()).outputs(spans)  # {digest: [1 + K, N, D]}
    t, k = len(ids), next(iter(outs.values())).shape[0] - 1
    assert k >= 1  # deepstack features exist
    given = np.zeros((1 + k, t, lm.cfg.hidden_size), np.float32)
    mask = np.zeros(t, bool)
    for s in spans:
        given[:, s.start:s.end], mask[s.start:s.end] = outs[s.key], True
    md, pages = whole_sequence_metadata(t, 8, all_logits=True)

    def logits(rope_positions, deep):
        cache = init_cache(lm.cfg, pages, 8, jnp.float32)
        h, _ = forward_hidden(lm.params, jnp.asarray(ids), cache,
                              md.replace(rope_positions=rope_positions), lm.cfg, "xla", None,
                              (jnp.asarray(given[0]), jnp.asarray(mask), deep))
        return np.asarray(compute_logits(lm.params, h, lm.cfg))

    want = _hf_logits(hf, lm.vision, ids, images)
    np.testing.assert_allclose(logits(jnp.asarray(rope), jnp.asarray(given[1:])), want,
                               atol=1e-4, rtol=0)
    # the test can tell: 1-D positions, or no deepstack, are far off
    assert np.abs(logits(None, jnp.asarray(given[1:])) - want).max() > 1e-2
    assert np.abs(logits(jnp.asarray(rope), None) - want).max() > 1e-2


def test_engine_greedy_and_logprobs_equal_hf(qwen_dir, llm):
    from jaxinfer import SamplingParams

    _, hf = qwen_dir
    vision = llm.engine.images
    a, b = random_image(3, (40, 50, 3)), random_image(4, (70, 30, 3))
    prompts = [{"prompt": f"Look {MARK} at it", "multi_modal_data": {"image": a}},
               {"prompt": f"{MARK} vs {MARK}?", "multi_modal_data": {"image": [b, a]}},
               "Only text here, nothing else."]
    n = 8
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                logprobs=0))
    from jaxinfer.checkpoints.hf_vision import load_hf_vision

    vm = load_hf_vision(qwen_dir[0])
    for o, ims in zip(outs, [[a], [b, a], []]):
        ids = o.prompt_token_ids
        t = torch.tensor([ids])
        with torch.no_grad():
            g = hf.generate(t, max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0, **_hf_images(vm, t, ims))
        assert o.token_ids == g[0, len(ids):].tolist(), o.prompt
        want = torch.log_softmax(torch.tensor(
            _hf_logits(hf, vm, ids + o.token_ids[:-1], ims)), -1).numpy()
        exp = [want[len(ids) - 1 + j, tok] for j, tok in enumerate(o.token_ids)]
        np.testing.assert_allclose([lp["logprob"] for lp in o.logprobs], exp, atol=1e-4)
    assert vision.encoded == 2  # a and b, once each


def test_second_turn_hits_the_prefix_and_encoder_caches(llm):
    from jaxinfer import SamplingParams

    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    img = random_image(9, (64, 48, 3))
    first = f"<|im_start|>user\n{MARK}Describe this picture in detail.<|im_end|>\n"
    llm.generate({"prompt": first, "multi_modal_data": {"image": img}}, sp)
    runs = llm.engine.images.runs
    (o,) = llm.generate({"prompt": first + "<|im_start|>user\nMore?<|im_end|>\n",
                         "multi_modal_data": {"image": img}}, sp)
    end = o.prompt_token_ids.index(QWEN_VISION_END_ID)
    assert o.usage["cached_tokens"] >= end - 8
    assert llm.engine.images.runs == runs


def test_layer_by_layer_equals_the_whole_programs_with_images(qwen_dir, llm, stalled):
    """compile_mode "background" before anything is compiled: the body runs layer by layer
    (multimodal RoPE rows and deepstack inputs included) and gives the whole programs' tokens."""
    from tests.vision_models import assert_layerwise_equals_whole

    prompt = {"prompt": f"See {MARK} and {MARK}", "multi_modal_data": {
        "image": [random_image(5, (40, 50, 3)), random_image(6, (70, 30, 3))]}}
    assert_layerwise_equals_whole(llm, qwen_dir[0], prompt, max_slots=2, page_size=8,
                                  max_model_len=256, prefill_chunk=16)


def test_ngram_speculative_decoding_keeps_the_greedy_tokens(qwen_dir, llm):
    """Proposals verified at position + delta (multimodal RoPE past the prompt): every token
    equals plain greedy decoding's."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt": f"Look {MARK} and {MARK} look", "multi_modal_data": {
        "image": [random_image(21, (40, 50, 3)), random_image(22, (70, 30, 3))]}},
        "Plain text, plain text, plain text."]
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    fast = LLM(str(qwen_dir[0]), max_slots=2, page_size=8, max_model_len=256, prefill_chunk=16,
               speculative={"method": "ngram", "k": 3})
    assert [o.token_ids for o in fast.generate(prompts, sp)] == want
    assert fast.engine.spec_proposed > 0


def test_int8_engine_quantizes_the_vision_tower_too(qwen_dir, llm):
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.runtime.device.quantization import QuantizedArray

    q = LLM(str(qwen_dir[0]), max_slots=2, page_size=8, max_model_len=256, prefill_chunk=16,
            quantization="int8")
    block = q.model.vision.params.blocks[0]
    assert isinstance(block.fc1, QuantizedArray) and isinstance(block.wo, QuantizedArray)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    prompt = {"prompt": f"Look {MARK} now", "multi_modal_data": {
        "image": random_image(31, (40, 50, 3))}}
    (want,), (got,) = llm.generate(prompt, sp), q.generate(prompt, sp)
    assert got.token_ids == want.token_ids
    assert abs(got.logprobs[0]["logprob"] - want.logprobs[0]["logprob"]) < 0.05
