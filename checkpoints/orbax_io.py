"""`jaxinfer convert` output: runtime params saved with orbax, plus a manifest and tokenizer.

Layout of a converted dir:
  jaxinfer.json   {"format": "jaxinfer-orbax", "version": 1, "model_config": {...},
                   "dtype": "float32", "source": "..."}
  params/         orbax checkpoint of the Params pytree
  tokenizer files copied from the source (tokenizer.json / tokenizer.model / configs), or
  tokenizer.model written from a GGUF vocabulary
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from checkpoints.errors import CheckpointError
from runtime.config import ModelConfig
from runtime.model import Params, init_params

MANIFEST = "jaxinfer.json"
FORMAT = "jaxinfer-orbax"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json",
)


def is_converted(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def save_converted(out: str | Path, cfg: ModelConfig, params: Params, *, source: str,
                   tokenizer_dir: Path | None = None, extra_files: dict[str, bytes] | None = None,
                   overwrite: bool = False) -> Path:
    out = Path(out).absolute()
    if out.exists():
        if not overwrite and any(out.iterdir()):
            raise CheckpointError(f"{out}: exists and is not empty (pass overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    dtype = str(jax.tree.leaves(params)[0].dtype)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    for name, data in (extra_files or {}).items():
        (out / name).write_bytes(data)
    manifest = {"format": FORMAT, "version": 1, "model_config": cfg.to_dict(), "dtype": dtype,
                "source": source}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    try:
        m = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if m.get("format") != FORMAT or m.get("version") != 1:
        raise CheckpointError(f"{f}: not a {FORMAT} v1 manifest")
    return m


def load_converted(path: str | Path, dtype=None) -> tuple[ModelConfig, Params]:
    """Restore params saved by `save_converted`. `dtype` None keeps the saved dtype."""
    path = Path(path).absolute()
    m = read_manifest(path)
    cfg = ModelConfig.from_dict(m["model_config"])
    saved = jnp.dtype(m["dtype"])
    target = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=saved))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / "params", target)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path / 'params'}: cannot restore orbax params ({e})") from None
    if dtype is not None and jnp.dtype(dtype) != saved:
        params = jax.tree.map(lambda a: a.astype(dtype), params)
    return cfg, params
