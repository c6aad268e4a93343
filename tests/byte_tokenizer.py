"""A byte-level `tokenizer.json` written in a fixture (the `tokenizers` library, no merges: one
token per UTF-8 byte) with special tokens at chosen ids, a tokenizer_config.json and a chat
template: what a test model needs to be served through the chat API with special tokens (image
marks) in its text."""

from __future__ import annotations

import json
from pathlib import Path


def write_byte_tokenizer(out: Path, specials: dict[str, int], vocab_size: int,
                         chat_template: str | None = None, *, bos: str | None = "<bos>",
                         eos: str = "<eos>") -> None:
    """tokenizer.json + tokenizer_config.json in `out`: bytes at ids 3.., `specials` {text: id}
    (unused ids up to `vocab_size` filled with "<unused_i>"); `bos` None: none is added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    byte_chars = ByteLevel.alphabet()
    vocab = {c: 3 + i for i, c in enumerate(sorted(byte_chars))}
    vocab.update(specials)
    taken = set(vocab.values())
    vocab.update({f"<unused_{i}>": i for i in range(vocab_size) if i not in taken})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(specials))
    tk.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": bos, "eos_token": eos, "add_bos_token": bos is not None,
           "add_eos_token": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))


# Gemma 3's turn format with image parts written as its image mark (as its own template does)
GEMMA3_VISION_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


# Qwen's ChatML turns with image parts written as <|vision_start|><|image_pad|><|vision_end|>
QWEN_VL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' ~ m['role'] ~ '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
