"""One entry point for every model source: a named model, an HF dir, a GGUF file, or a dir
written by `jaxinfer convert`. The kind is read from the content (manifest, config.json, the
GGUF magic), never guessed from a file name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.named import DEFAULT_MODEL
from jaxinfer.runtime.config import COMPUTE_DTYPES, ModelConfig
from jaxinfer.runtime.device.model import Params
from jaxinfer.runtime.host.tokenizer import Tokenizer, check_compatible, load_tokenizer



@dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Params
    tokenizer: Tokenizer | None  # None: loaded with tokenizer=False
    source: Path
    vision: object = None  # checkpoints.hf_vision.VisionModel: a vision model's image side


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve(model: str | Path) -> Path:
    from jaxinfer.checkpoints.named import resolve_named

    named = resolve_named(str(model)) if isinstance(model, str) else None
    path = named or Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{model}: no such file or directory, and not a known model name "
            f"(known: {DEFAULT_MODEL!r})"
        )
    return path


def _tokenizer(path: Path, cfg):
    return load_tokenizer(path, bos_id=cfg.bos_token_id, eos_ids=cfg.eos_token_ids or None)


def load_model(model: str | Path, dtype: str = "float32", place=None, mesh=None,
               keep_quantized: bool = False, keep_int4: bool = False,
               keep_mxfp4: bool = False, tokenizer: bool = True,
               with_vision: bool = True) -> LoadedModel:
    """`place(path, f32_array)`: optional per-leaf hook (quantization while streaming); a
    converted dir that is already quantized is restored as saved. `keep_quantized`: a GGUF's
    block-quantized matmul weights stay in their blocks (QuantizedArray fmt "gguf");
    `keep_int4`: a 4-bit HF checkpoint's (AWQ, GPTQ, compressed-tensors) stay int4;
    `keep_mxfp4`: an MXFP4 HF checkpoint's (gpt-oss's experts) stay MXFP4 (QuantizedArray fmt
    "mxfp4", exact), else they are dequantized to `dtype`. A hook with a
    `finish(cfg, params, tokenizer)` method (checkpoints.quantize.Placer) gets the assembled
    params once everything is read (int8 smoothing calibrates there) and returns the final ones.
    `tokenizer=False`: the weights only (LoadedModel.tokenizer None; a trainer's checkpoint for
    update_weights need not carry one). `with_vision=False`: a vision model's text side only
    (a draft model)."""
    from jaxinfer.checkpoints.orbax_io import is_converted, load_converted

    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    jdtype = getattr(jnp, dtype)
    path = resolve(model)
    vision = None
    if path.is_file():
        if not is_gguf_file(path):
            raise CheckpointError(f"{path}: not a GGUF file (bad magic) and not a checkpoint dir")
        from jaxinfer.checkpoints.gguf import load_gguf, load_gguf_tokenizer, open_gguf

        reader = open_gguf(path)  # the header (262k-entry vocab) is parsed once
        cfg, params = load_gguf(path, dtype=jdtype, reader=reader, place=place,
                                keep_quantized=keep_quantized)
        tok = load_gguf_tokenizer(path, reader=reader) if tokenizer else None
    elif is_converted(path):
        cfg, params = load_converted(path, dtype=jdtype, place=place, mesh=mesh)
        tok = _tokenizer(path, cfg) if tokenizer else None
    elif (path / "config.json").is_file():
        from jaxinfer.checkpoints.hf import load_hf

        from jaxinfer.checkpoints.hf_vision import load_hf_vision

        cfg, params = load_hf(path, dtype=jdtype, place=place, keep_int4=keep_int4,
                              keep_mxfp4=keep_mxfp4)
        vision = load_hf_vision(path, jdtype) if with_vision else None
        tok = _tokenizer(path, cfg) if tokenizer else None
    else:
        raise CheckpointError(
            f"{path}: not a model: expected config.json (HF checkpoint), jaxinfer.json "
            "(a `jaxinfer convert` output) or a .gguf file"
        )
    if tok is not None:
        check_compatible(tok, cfg.vocab_size, str(path))
    finish = getattr(place, "finish", None)
    if finish is not None:
        params = finish(cfg, params, tok)
    return LoadedModel(cfg, params, tok, path, vision)
