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
    mm_tokens_per_image). Norms, biases and the projector (zero or one at init) are perturbed
    so a mapping error cannot hide. -> the model (eval mode)."""
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


def make_gemma3_vision_dir(out: Path, seed: int = 0):
    """`make_gemma3_vision` served as a model dir: with a byte-level tokenizer that knows
    SPECIALS and a chat template writing image parts as <start_of_image> -> (out, HF model)."""
    from tests.byte_tokenizer import GEMMA3_VISION_TEMPLATE, write_byte_tokenizer

    hf = make_gemma3_vision(out, seed)
    write_byte_tokenizer(out, SPECIALS, VOCAB, GEMMA3_VISION_TEMPLATE)
    return out, hf


def random_image(seed: int, shape=(40, 50, 3)):
    """A uint8 RGB image of random pixels (numpy)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
