"""Random-init HF vision-language models made in fixtures: the oracle for the image side.

`make_gemma3_vision(out)`: a tiny Gemma3ForConditionalGeneration (SigLIP tower 64 x 64 pixels in
8 x 8 patches -> an 8 x 8 grid pooled to 4 x 4 = 16 soft tokens per image; a 2-layer Gemma 3
text model) saved with its preprocessor_config.json. The image token ids sit near the top of
the vocab, as in the real checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIZE = 64
PATCH_SIZE = 8
VISION_HIDDEN = 32
VISION_LAYERS = 2
VISION_HEADS = 2
VISION_INTERMEDIATE = 64
MM_TOKENS_PER_IMAGE = 16

TEXT_HIDDEN = 64
TEXT_LAYERS = 2
TEXT_HEADS = 4
TEXT_KV_HEADS = 1
TEXT_HEAD_DIM = 16
VOCAB = 2000
SLIDING_WINDOW = 512

IMAGE_TOKEN_ID = 1990
BOI_TOKEN_ID = 1991
EOI_TOKEN_ID = 1992

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def make_gemma3_vision(out: Path, seed: int = 0, **overrides):
    """A random-init HF Gemma3ForConditionalGeneration saved (safetensors, f32) in `out`, with a
    preprocessor_config.json. `overrides`: Gemma3Config fields over the ones above (e.g.
    mm_tokens_per_image; `text={...}` / `vision={...}`: text- / vision-config fields). Norms, biases and the projector (zero
    or one at init) are perturbed so a mapping error cannot hide. -> the model (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    vision = dict(
        model_type="siglip_vision_model", image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        hidden_size=VISION_HIDDEN, num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS, intermediate_size=VISION_INTERMEDIATE,
        layer_norm_eps=1e-6, vision_use_head=False,
    )
    text = dict(
        vocab_size=VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS, head_dim=TEXT_HEAD_DIM,
        sliding_window=SLIDING_WINDOW, max_position_embeddings=1024,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    text.update(overrides.pop("text", {}))
    vision.update(overrides.pop("vision", {}))
    kw = dict(text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
              image_token_index=IMAGE_TOKEN_ID, boi_token_index=BOI_TOKEN_ID,
              eoi_token_index=EOI_TOKEN_ID, attn_implementation="eager")
    kw.update(overrides)
    cfg = transformers.Gemma3Config(**kw)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mm_input_projection_weight"):  # zeros at init
                p.copy_(torch.randn_like(p) / p.shape[0] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD)).save_pretrained(out)  # preprocessor_config.json
    return model


# the byte-level tokenizer's special tokens: Gemma's image and turn marks at Gemma-like ids
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<image_soft_token>": IMAGE_TOKEN_ID,
            "<start_of_image>": BOI_TOKEN_ID, "<end_of_image>": EOI_TOKEN_ID,
            "<start_of_turn>": 1993, "<end_of_turn>": 1994}


def make_gemma3_vision_dir(out: Path, seed: int = 0, **overrides):
    """`make_gemma3_vision` served as a model dir: with a byte-level tokenizer that knows
    SPECIALS and a chat template writing image parts as <start_of_image> -> (out, HF model)."""
    from tests.byte_tokenizer import GEMMA3_VISION_TEMPLATE, write_byte_tokenizer

    hf = make_gemma3_vision(out, seed, **overrides)
    write_byte_tokenizer(out, SPECIALS, VOCAB, GEMMA3_VISION_TEMPLATE)
    return out, hf


def random_image(seed: int, shape=(40, 50, 3)):
    """A uint8 RGB image of random pixels (numpy)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# --------------------------------------------------------------------------- Qwen3-VL

# a tiny Qwen3-VL: 8 x 8 patches, 2 x 2 merged (a 40 x 50 image -> a (1, 4, 6) grid -> 6 tokens)
QWEN_PATCH_SIZE = 8
QWEN_TEMPORAL_PATCH_SIZE = 2
QWEN_MERGE_SIZE = 2
QWEN_VISION_DEPTH = 3
QWEN_VISION_HIDDEN = 32
QWEN_VISION_HEADS = 2
QWEN_VISION_INTERMEDIATE = 64
QWEN_NUM_POSITION_EMBEDDINGS = 64  # an 8 x 8 learned grid
QWEN_DEEPSTACK_INDEXES = (0, 1)
QWEN_VISION_ROPE_THETA = 10_000.0

QWEN_TEXT_HIDDEN = 64  # = the vision tower's out_hidden_size
QWEN_TEXT_LAYERS = 3
QWEN_TEXT_HEADS = 4
QWEN_TEXT_KV_HEADS = 2
QWEN_TEXT_HEAD_DIM = 16
QWEN_TEXT_INTERMEDIATE = 128
QWEN_VOCAB = 2000
QWEN_ROPE_THETA = 5_000_000.0
# [t, h, w] frequency counts, summing to head_dim / 2, in the real checkpoints' proportions
# ([24, 20, 20]: t >= h == w). HF interleaves them (mrope_interleaved): frequency i is h's when
# i % 3 == 1 and i < 3 * h, w's when i % 3 == 2 and i < 3 * w, else t's; here t: 0, 3, 6, 7,
# h: 1, 4, w: 2, 5.
QWEN_MROPE_SECTION = (4, 2, 2)
QWEN_MROPE_INTERLEAVED = True
QWEN_RMS_NORM_EPS = 1e-6

QWEN_IMAGE_TOKEN_ID = 1990  # <|image_pad|>
QWEN_VISION_START_TOKEN_ID = 1991  # <|vision_start|>
QWEN_VISION_END_TOKEN_ID = 1992  # <|vision_end|>
QWEN_VIDEO_TOKEN_ID = 1993  # <|video_pad|>
QWEN_VISION_START_ID = QWEN_VISION_START_TOKEN_ID
QWEN_VISION_END_ID = QWEN_VISION_END_TOKEN_ID
QWEN_BOS_TOKEN_ID = 0  # <|endoftext|> (the real text_config's bos; the tokenizer adds none)
QWEN_EOS_TOKEN_ID = 2  # <|im_end|>

QWEN_IMAGE_MEAN = (0.5, 0.5, 0.5)  # as the real checkpoints' preprocessor_config.json
QWEN_IMAGE_STD = (0.5, 0.5, 0.5)
QWEN_MIN_PIXELS = 16 * 16 * 4  # size.shortest_edge: 4 merged tokens at least
QWEN_MAX_PIXELS = 128 * 128  # size.longest_edge: 64 merged tokens at most


def make_qwen3_vl(out: Path, seed: int = 0, **overrides):
    """A random-init HF Qwen3VLForConditionalGeneration saved (safetensors, f32) in `out`, with a
    preprocessor_config.json (Qwen2-VL's PIL image processor: QWEN_* patch / merge / size /
    mean / std). `overrides`: Qwen3VLConfig fields over the ones above (a `vision_config` or
    `text_config` dict is merged into the defaults). Norms (ones at init) and biases (zeros)
    are perturbed, and the vision tower's weights drawn at fan_in^-0.5 (not HF's 0.02, under
    which its attention is near uniform and the 2-D rotary changes outputs by ~1e-5), so a
    mapping error cannot hide. -> the model (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    vision = dict(
        depth=QWEN_VISION_DEPTH, hidden_size=QWEN_VISION_HIDDEN, num_heads=QWEN_VISION_HEADS,
        intermediate_size=QWEN_VISION_INTERMEDIATE, hidden_act="gelu_pytorch_tanh",
        in_channels=3, patch_size=QWEN_PATCH_SIZE, temporal_patch_size=QWEN_TEMPORAL_PATCH_SIZE,
        spatial_merge_size=QWEN_MERGE_SIZE, out_hidden_size=QWEN_TEXT_HIDDEN,
        num_position_embeddings=QWEN_NUM_POSITION_EMBEDDINGS,
        deepstack_visual_indexes=list(QWEN_DEEPSTACK_INDEXES),
        rope_parameters=dict(rope_type="axial", rope_theta=QWEN_VISION_ROPE_THETA),
    )
    text = dict(
        vocab_size=QWEN_VOCAB, hidden_size=QWEN_TEXT_HIDDEN,
        intermediate_size=QWEN_TEXT_INTERMEDIATE, num_hidden_layers=QWEN_TEXT_LAYERS,
        num_attention_heads=QWEN_TEXT_HEADS, num_key_value_heads=QWEN_TEXT_KV_HEADS,
        head_dim=QWEN_TEXT_HEAD_DIM, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=QWEN_RMS_NORM_EPS, attention_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=QWEN_ROPE_THETA,
                             mrope_section=list(QWEN_MROPE_SECTION),
                             mrope_interleaved=QWEN_MROPE_INTERLEAVED),
        bos_token_id=QWEN_BOS_TOKEN_ID, eos_token_id=QWEN_EOS_TOKEN_ID,
    )
    vision |= overrides.pop("vision_config", {})
    text |= overrides.pop("text_config", {})
    kw = dict(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE_TOKEN_ID,
              video_token_id=QWEN_VIDEO_TOKEN_ID, vision_start_token_id=QWEN_VISION_START_TOKEN_ID,
              vision_end_token_id=QWEN_VISION_END_TOKEN_ID, tie_word_embeddings=False,
              attn_implementation="eager")
    kw.update(overrides)
    cfg = transformers.Qwen3VLConfig(**kw)
    model = transformers.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.startswith("model.visual.") and p.ndim >= 2:
                p.normal_(0.0, 0.5 if "pos_embed" in name else p[0].numel() ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    vc = cfg.vision_config
    transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS},
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size, image_mean=list(QWEN_IMAGE_MEAN),
        image_std=list(QWEN_IMAGE_STD)).save_pretrained(out)  # preprocessor_config.json
    return model


# the byte-level tokenizer's special tokens for Qwen3-VL: its turn and image marks
QWEN_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
                 "<|image_pad|>": QWEN_IMAGE_TOKEN_ID, "<|vision_start|>": QWEN_VISION_START_ID,
                 "<|vision_end|>": QWEN_VISION_END_ID}
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"  # an image's place in a prompt


def make_qwen3_vl_dir(out: Path, seed: int = 0, **overrides):
    """`make_qwen3_vl` served as a model dir, with a byte-level tokenizer that knows
    QWEN_SPECIALS and Qwen's chat template -> (out, HF model)."""
    from tests.byte_tokenizer import QWEN_VL_TEMPLATE, write_byte_tokenizer

    hf = make_qwen3_vl(out, seed, **overrides)
    write_byte_tokenizer(out, QWEN_SPECIALS, QWEN_VOCAB, QWEN_VL_TEMPLATE, bos=None,
                         eos="<|im_end|>")
    return out, hf


def assert_layerwise_equals_whole(llm, model_dir, prompt, **options):
    """`prompt` (a dict with images) through a compile_mode "background" LLM of `model_dir`
    with nothing compiled (the `stalled` fixture: every body layer by layer) gives the tokens
    and logprobs of `llm` (the whole programs)."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    want = llm.generate(prompt, sp)[0]
    lazy = LLM(str(model_dir), compile_mode="background", **options)
    got = lazy.generate(prompt, sp)[0]
    assert lazy.engine._step.layerwise_steps > 0 and not lazy.engine._step.body.launched
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([x["logprob"] for x in got.logprobs],
                               [x["logprob"] for x in want.logprobs], atol=1e-5)
