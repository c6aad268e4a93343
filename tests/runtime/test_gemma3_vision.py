"""Gemma 3 with images through the engine, held against HF transformers on a random-init
Gemma3ForConditionalGeneration (tests/vision_models.py): logits within 1e-4 over prompts with
one and two images (the image tokens attend to each other both ways), greedy tokens equal to
HF `generate` with 2 slots and chunked prefill, the prefix and encoder caches keyed by the
image's content, and the door's refusals."""

from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.vision_models import (EOI_TOKEN_ID, IMAGE_TOKEN_ID, MM_TOKENS_PER_IMAGE,
                                 random_image)

N = MM_TOKENS_PER_IMAGE
_image = random_image


@pytest.fixture(scope="module")
def vision_dir(gemma3_vision_dir):
    return gemma3_vision_dir


@pytest.fixture(scope="module")
def llm(vision_dir):
    from jaxinfer import LLM

    return LLM(str(vision_dir[0]), max_slots=2, page_size=8, max_model_len=256,
               prefill_chunk=N, max_image_pixels=100_000)


def _pixels(images) -> torch.Tensor:
    """HF's pixel_values [n, 3, S, S] of our preprocessed images (the door's, tested against HF's
    image processor in tests/runtime/test_vision.py)."""
    from jaxinfer.runtime.host.images import load_image, pixel_values

    px = [pixel_values(load_image(im, "x"), 64, (0.5,) * 3, (0.5,) * 3) for im in images]
    return torch.tensor(np.stack(px)).permute(0, 3, 1, 2)


def _hf_images(t: torch.Tensor, images) -> dict:
    """HF's image inputs for ids `t` (none without images)."""
    if not images:
        return {}
    return dict(pixel_values=_pixels(images), token_type_ids=(t == IMAGE_TOKEN_ID).long())


def _hf_logits(hf, ids, images) -> np.ndarray:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf(input_ids=t, **_hf_images(t, images))
    return out.logits[0].float().numpy()


def _hf_greedy(hf, ids, images, n) -> list[int]:
    t = torch.tensor([ids])
    kw = _hf_images(t, images)
    with torch.no_grad():
        out = hf.generate(t, max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def _prompt(text: str, images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


# ---- the door's expansion, by hand ------------------------------------------------------------
def test_expand_writes_each_image_run_and_refuses_a_count_that_does_not_match():
    from jaxinfer.runtime.host.errors import RequestError
    from jaxinfer.runtime.host.image_prompt import ImageInput, ImageSpec, chunk_end, expand

    spec = ImageSpec(kind="gemma3", mark="<boi>", mark_id=7, image_id=9, after=(8,))
    px = np.zeros((4, 4, 3), np.float32)
    a, b = ImageInput(b"a", px, 3), ImageInput(b"b", px, 3)
    ids, spans = expand([1, 7, 2, 7], [a, b], spec)
    assert ids == [1, 7, 9, 9, 9, 8, 2, 7, 9, 9, 9, 8]
    assert [(s.start, s.length, s.key) for s in spans] == [(2, 3, b"a"), (8, 3, b"b")]
    again, spans2 = expand(ids, [a, b], spec)  # expanded already: kept
    assert again == ids and [s.start for s in spans2] == [2, 8]
    for bad, imgs, why in (([1, 7, 2], [a, b], r"2 image\(s\) given"),
                           ([7, 7], [a], "more image marks"),
                           ([1, 9, 2], [], "outside an image run"),
                           ([7, 9, 9, 8], [a], "exactly 3")):
        with pytest.raises(RequestError, match=why):
            expand(bad, imgs, spec)
    # a chunk never ends inside a run: cut back to its start, or none when it starts in it
    assert chunk_end(spans, 0, 4) == 2 and chunk_end(spans, 0, 5) == 5
    assert chunk_end(spans, 2, 2) == 0 and chunk_end(spans, 2, 3) == 3
    assert chunk_end(spans, 6, 4) == 2 and chunk_end(spans, 9, 2) == 2  # (started in: exact)


# ---- the model: logits ------------------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2])
def test_logits_equal_hf_with_images_attending_both_ways(vision_dir, count):
    from jaxinfer.checkpoints.loader import load_model
    from jaxinfer.runtime.device.attention import whole_sequence_metadata
    from jaxinfer.runtime.device.kv_cache import init_cache
    from jaxinfer.runtime.device.model import compute_logits, forward_hidden
    from jaxinfer.runtime.device.vision import encode_images
    from jaxinfer.runtime.host.image_prompt import decode_images, expand, mark_text
    from jaxinfer.runtime.images import image_spec

    d, hf = vision_dir
    lm = load_model(d)
    spec = image_spec(lm.vision)
    images = [_image(s, shape) for s, shape in zip((1, 2), ((40, 50, 3), (90, 30, 3)))][:count]
    text = "Compare " + " and ".join(["<start_of_image>"] * count) + " please."
    decoded = decode_images(images, spec, 10**6)
    ids, spans = expand(lm.tokenizer.encode(mark_text(text, spec)), decoded, spec)
    emb = np.asarray(encode_images(lm.vision.params, jnp.asarray(np.stack(
        [im.pixels for im in decoded])), lm.vision.cfg))  # [n, N, D]
    t = len(ids)
    embeds, mask = np.zeros((t, lm.cfg.hidden_size), np.float32), np.zeros(t, bool)
    see = np.arange(t, dtype=np.int32)
    for s, e in zip(spans, emb):
        embeds[s.start:s.end], mask[s.start:s.end], see[s.start:s.end] = e, True, s.end - 1
    md, pages = whole_sequence_metadata(t, 8, all_logits=True)

    def logits(see_until):
        cache = init_cache(lm.cfg, pages, 8, jnp.float32)
        h, _ = forward_hidden(lm.params, jnp.asarray(ids), cache, md.replace(
            see_until=see_until), lm.cfg, "xla", None,
            (jnp.asarray(embeds), jnp.asarray(mask), None))
        return np.asarray(compute_logits(lm.params, h, lm.cfg))

    want = _hf_logits(hf, ids, images)
    np.testing.assert_allclose(logits(jnp.asarray(see)), want, atol=1e-4, rtol=0)
    # the test can tell: image tokens attending causally only are far off
    assert np.abs(logits(None) - want).max() > 1e-2


# ---- the engine -------------------------------------------------------------------------------
def test_engine_greedy_and_logprobs_equal_hf_with_slots_and_chunks(vision_dir, llm):
    from jaxinfer import SamplingParams

    _, hf = vision_dir
    a, b = _image(1), _image(2, (90, 30, 3))
    prompts = [_prompt("Look: <start_of_image> what is it?", a),
               _prompt("Two: <start_of_image> then <start_of_image>. Same?", [b, a]),
               "Plain text, no image at all here.",
               _prompt("<start_of_image>", b)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp)
    images = [[a], [b, a], [], [b]]
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * N  # several chunks of N
    for o, ims in zip(outs, images):
        ids = o.prompt_token_ids
        assert ids.count(IMAGE_TOKEN_ID) == N * len(ims)
        assert o.token_ids == _hf_greedy(hf, ids, ims, 8), o.prompt
        # the chosen tokens' logprobs, every step, against HF's log-softmax
        full = ids + o.token_ids[:-1]
        want = torch.log_softmax(torch.tensor(_hf_logits(hf, full, ims)), -1).numpy()
        got = [lp["logprob"] for lp in o.logprobs]
        exp = [want[len(ids) - 1 + j, tok] for j, tok in enumerate(o.token_ids)]
        np.testing.assert_allclose(got, exp, atol=1e-4)


def test_the_same_image_again_comes_from_the_prefix_and_encoder_caches(llm):
    from jaxinfer import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    img = _image(7, (33, 61, 3))
    first = "<start_of_turn>user\n<start_of_image> Describe it.<end_of_turn>\n"
    (o1,) = llm.generate(_prompt(first, img), sp)
    runs = llm.engine.images.runs
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(img).save(png, format="PNG")  # the same pixels, another encoding
    (o2,) = llm.generate(_prompt(first + "<start_of_turn>user\nAnd again?<end_of_turn>\n",
                                 png.getvalue()), sp)
    end = o2.prompt_token_ids.index(EOI_TOKEN_ID)  # the image run's end
    assert o2.usage["cached_tokens"] >= end - 8  # every full page through the image
    assert llm.engine.images.runs == runs  # no encoder call: the encoder cache had it
    # another image at the same place: the same token ids, but no page past its start is hit
    (o3,) = llm.generate(_prompt(first, _image(8, (33, 61, 3))), sp)
    assert o3.usage["cached_tokens"] <= o3.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert llm.engine.images.runs == runs + 1


def test_bad_image_inputs_are_refused_naming_the_field_and_the_engine_serves_on(llm):
    from jaxinfer import SamplingParams
    from jaxinfer.runtime.host.errors import RequestError

    sp = SamplingParams(max_tokens=2, temperature=0)
    cases = [
        (_prompt("<start_of_image>", b"not an image"), "multi_modal_data.image"),
        (_prompt("<start_of_image>", "data:image/png;base64,@@@"), "multi_modal_data.image"),
        (_prompt("<start_of_image>", "https://example.com/cat.png"), "remote"),
        (_prompt("no mark", _image(1)), "prompt marks 0"),
        (_prompt("<start_of_image><start_of_image>", _image(1)), "more image marks"),
        (_prompt("<start_of_image>" * 5, [_image(i) for i in range(5)]), "limit_mm_per_prompt"),
        (_prompt("<start_of_image>", np.zeros((400, 300, 3), np.uint8)), "pixels"),
        ({"prompt": "x", "multi_modal_data": {"audio": b""}}, "modality"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
    ]
    for prompt, why in cases:
        with pytest.raises(RequestError, match=why):
            llm.generate(prompt, sp)
    assert llm.engine.num_unfinished == 0
    (o,) = llm.generate(_prompt("<start_of_image>", _image(3)), sp)
    assert len(o.token_ids) == 2


def test_images_for_a_text_only_model_are_refused(tiny_dir):
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.runtime.host.errors import RequestError

    text_llm = LLM(str(tiny_dir), max_slots=1, max_model_len=64)
    with pytest.raises(RequestError, match="text only"):
        text_llm.generate(_prompt("hi", _image(1)), SamplingParams(max_tokens=2))


def test_pallas_backend_runs_image_prefills_with_the_xla_attention(tmp_path):
    """The Pallas kernels mask causally only: a step with image rows takes the XLA attention
    (runtime/device/attention.py), the other steps the kernel; tokens and logprobs equal the
    XLA backend's (interpret mode; head_dim 64, which the kernels tile)."""
    from jaxinfer import LLM, SamplingParams
    from tests.vision_models import make_gemma3_vision_dir

    d, _ = make_gemma3_vision_dir(tmp_path, text={"head_dim": 64})
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    prompt = _prompt("Two <start_of_image> and <start_of_image>", [_image(5), _image(6)])
    outs = {}
    for backend in ("xla", "pallas_interpret"):
        llm = LLM(str(d), max_slots=2, page_size=8, max_model_len=128, prefill_chunk=N,
                  attention_backend=backend)
        (outs[backend],) = llm.generate(prompt, sp)
        assert outs[backend].finish_reason == "length"
    assert outs["xla"].token_ids == outs["pallas_interpret"].token_ids
    np.testing.assert_allclose([x["logprob"] for x in outs["xla"].logprobs],
                               [x["logprob"] for x in outs["pallas_interpret"].logprobs],
                               atol=1e-4)


def test_layer_by_layer_equals_the_whole_programs_with_images(vision_dir, llm, stalled):
    """compile_mode "background" before anything is compiled: the body runs layer by layer
    (the image rows' inputs and how far they see included) and gives the whole programs'
    tokens."""
    from tests.vision_models import assert_layerwise_equals_whole

    prompt = _prompt("Two <start_of_image> and <start_of_image>", [_image(5), _image(6)])
    assert_layerwise_equals_whole(llm, vision_dir[0], prompt, max_slots=2, page_size=8,
                                  max_model_len=256, prefill_chunk=N)


def test_preempted_image_requests_recompute_to_the_same_tokens(vision_dir, llm):
    """A pool too small for both image requests to finish side by side: one is preempted and
    recomputed (its images again, from the encoder cache), and every token equals a roomy
    engine's."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [_prompt("One <start_of_image> here", _image(11)),
               _prompt("And <start_of_image> there, longer", _image(12, (60, 20, 3)))]
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    tight = LLM(str(vision_dir[0]), max_slots=2, page_size=8, max_model_len=128,
                prefill_chunk=N, num_pages=1 + 11)
    got = tight.generate(prompts, sp)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == want
    assert tight.engine.images.encoded == 2  # the recompute took the encoder cache's


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_images_keeps_the_greedy_tokens(vision_dir, llm, method):
    """Proposals (n-gram, or the model drafting itself) verified beside image prefills: every
    token equals plain greedy decoding's."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [_prompt("Look: <start_of_image> again <start_of_image>", [_image(21), _image(22)]),
               "A plain text prompt, repeated: a plain text prompt."]
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    spec = {"method": method, "k": 3} | ({"model": str(vision_dir[0])} if method == "draft"
                                         else {})
    fast = LLM(str(vision_dir[0]), max_slots=2, page_size=8, max_model_len=256,
               prefill_chunk=N, speculative=spec)
    assert [o.token_ids for o in fast.generate(prompts, sp)] == want
    assert fast.engine.spec_proposed > 0


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_engines_quantize_the_vision_tower_too(vision_dir, llm, fmt):
    """quantization=int8 / fp8 / int4: the tower's layer products are QuantizedArrays (int4 as
    int8) and the engine's image answers stay close to the float engine's."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.runtime.device.quantization import QuantizedArray

    q = LLM(str(vision_dir[0]), max_slots=2, page_size=8, max_model_len=256, prefill_chunk=N,
            quantization=fmt)
    layer = q.model.vision.params.layers[0]
    assert all(isinstance(getattr(layer, w), QuantizedArray)
               for w in ("wq", "wk", "wv", "wo", "fc1", "fc2"))
    assert layer.fc1.values.dtype == (jnp.int8 if fmt != "fp8" else jnp.float8_e4m3fn)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    prompt = _prompt("Look <start_of_image> now", _image(31))
    (want,), (got,) = llm.generate(prompt, sp), q.generate(prompt, sp)
    assert got.token_ids == want.token_ids
    assert abs(got.logprobs[0]["logprob"] - want.logprobs[0]["logprob"]) < 0.05
