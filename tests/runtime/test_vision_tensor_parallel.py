"""Vision towers under tensor parallel (8 CPU devices, one child pytest: test_tensor_parallel's
`on_8_devices`): at tp 2 and 4 the tower's heads and MLP width are split over the mesh like the
language model's layers (each device holds its share of the bytes), and the engine's answers on
images equal one device's: greedy tokens identical, logprobs and the encoder's outputs within
float tolerance (the split products sum in another order)."""

from __future__ import annotations

import numpy as np

from tests.runtime.test_tensor_parallel import on_8_devices
from tests.vision_models import random_image

HEADS = 4  # vision heads that split at tp 2 and 4 (the fixtures' default is 2)


def _split_share(leaf) -> float:
    """The fraction of `leaf`'s elements one device holds."""
    return leaf.addressable_shards[0].data.size / leaf.size


def _assert_tp_equals_one_device(model_dir, prompts, layer_of, weights, **options):
    """Greedy tokens at tp 2 / 4 equal tp 1's; logprobs within 1e-4; the encoder's outputs
    within 1e-4; each of `weights` (names in the tower's first layer, `layer_of(params)`) held
    1 / tp a device."""
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for tp in (1, 2, 4):
        llm = LLM(str(model_dir), tensor_parallel=tp, max_slots=2, page_size=8,
                  max_model_len=256, **options)
        outs = llm.generate(prompts, sp)
        cache = llm.engine.images.cache
        encoded = {k: cache.get(k) for k in list(cache._entries)}
        runs[tp] = ([o.token_ids for o in outs],
                    [[lp["logprob"] for lp in o.logprobs] for o in outs], encoded)
        layer = layer_of(llm.model.vision.params)
        for name in weights:
            share = _split_share(getattr(layer, name))
            assert share == 1 / tp, (tp, name, share)
    tokens, logprobs, encoded = runs[1]
    assert len(encoded) == 2
    for tp in (2, 4):
        assert runs[tp][0] == tokens, tp
        np.testing.assert_allclose(runs[tp][1], logprobs, atol=1e-4)
        assert runs[tp][2].keys() == encoded.keys()
        for k, v in encoded.items():
            np.testing.assert_allclose(runs[tp][2][k], v, atol=1e-4)


@on_8_devices
def test_gemma3_tower_splits_over_tp_and_answers_as_one_device(tmp_path):
    from tests.vision_models import MM_TOKENS_PER_IMAGE, make_gemma3_vision_dir

    d, _ = make_gemma3_vision_dir(tmp_path / "g3", vision={"num_attention_heads": HEADS})
    a, b = random_image(1), random_image(2, (30, 70, 3))
    prompts = [{"prompt": "Look <start_of_image> here", "multi_modal_data": {"image": a}},
               {"prompt": "<start_of_image> and <start_of_image>?",
                "multi_modal_data": {"image": [b, a]}}]
    _assert_tp_equals_one_device(d, prompts, lambda p: p.layers[0],
                                 ("wq", "wk", "wv", "wo", "fc1", "fc2"),
                                 prefill_chunk=2 * MM_TOKENS_PER_IMAGE + 16)


@on_8_devices
def test_qwen3_vl_tower_and_deepstack_split_over_tp_and_answer_as_one_device(tmp_path):
    from tests.vision_models import QWEN_MARK as mark, make_qwen3_vl_dir

    d, _ = make_qwen3_vl_dir(tmp_path / "qwen", vision_config={"num_heads": HEADS})
    a, b = random_image(3, (40, 50, 3)), random_image(4, (70, 30, 3))
    prompts = [{"prompt": f"Look {mark} at it", "multi_modal_data": {"image": a}},
               {"prompt": f"{mark} vs {mark}?", "multi_modal_data": {"image": [b, a]}}]
    _assert_tp_equals_one_device(d, prompts, lambda p: p.blocks[0], ("wqkv", "wo", "fc1", "fc2"),
                                 prefill_chunk=64)
