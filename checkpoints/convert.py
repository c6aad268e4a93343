"""`jaxinfer convert SRC OUT`: any loadable model -> orbax params + manifest + tokenizer."""

from __future__ import annotations

from pathlib import Path

from jaxinfer.checkpoints.loader import load_model
from jaxinfer.checkpoints.orbax_io import save_converted


def convert(src: str, out: str | Path, *, dtype: str = "float32", overwrite: bool = False,
            quantize: str | None = None, quantize_embeddings: bool = True) -> Path:
    """`quantize` "int8" | "fp8" | "int4": weights are quantized as they stream in and saved quantized
    (loading the output needs no re-quantization)."""
    place = None
    if quantize is not None:
        from jaxinfer.checkpoints.quantize import placer

        place = placer(quantize, dtype, quantize_embeddings=quantize_embeddings)
    m = load_model(src, dtype=dtype, place=place)
    tok_dir = m.source if m.source.is_dir() else None
    extra = {}
    if tok_dir is None:  # GGUF: its vocabulary travels as a sentencepiece / tokenizer.json file
        extra = m.tokenizer.export_files()
    return save_converted(out, m.cfg, m.params, source=str(m.source), tokenizer_dir=tok_dir,
                          extra_files=extra, overwrite=overwrite)
