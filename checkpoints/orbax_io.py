"""`jaxinfer convert` output: runtime params saved with orbax, plus a manifest and tokenizer.

Layout of a converted dir:
  jaxinfer.json   {"format": "jaxinfer-orbax", "version": 1, "model_config": {...},
                   "dtype": "float32", "source": "...",
                   "quantization": null | {"fmt": "int8"|"fp8"|"int4", "mode": ..., "weights": [paths],
                                     int4: "group_size", "zero_point", "embeddings"}}
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

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.model import Params, init_params

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
    from jaxinfer.checkpoints.quantize import quantization_spec

    dtype = str(params.final_norm.dtype)  # the compute dtype (quantized leaves are int8 / fp8)
    qspec = quantization_spec(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    for name, data in (extra_files or {}).items():
        (out / name).write_bytes(data)
    manifest = {"format": FORMAT, "version": 1, "model_config": cfg.to_dict(), "dtype": dtype,
                "source": source, "quantization": qspec}
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


def load_converted(path: str | Path, dtype=None, place=None, mesh=None
                   ) -> tuple[ModelConfig, Params]:
    """Restore params saved by `save_converted`. `dtype` None keeps the saved dtype.
    `mesh` (tensor parallel): restore straight into the shards `runtime.device.sharding` assigns, on
    any layout whatever the one saved (each device reads only its slice).
    Quantized params (manifest "quantization") are restored as saved, bit-exact, with no
    re-quantization; `place` (a quantizing hook) then applies only to unquantized params."""
    from jaxinfer.checkpoints.quantize import abstract_quantized
    from jaxinfer.runtime.device.quantization import QuantizedArray
    from jaxinfer.runtime.device.tree_paths import path_str

    path = Path(path).absolute()
    m = read_manifest(path)
    cfg = ModelConfig.from_dict(m["model_config"])
    saved = jnp.dtype(m["dtype"])
    qspec = m.get("quantization")
    target = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=saved))
    if qspec:  # the abstract target with the quantized leaves' types
        weights = set(qspec["weights"])

        def leaf(kp, a):
            p = path_str(kp)
            if p not in weights:
                return a
            return abstract_quantized(p, a, qspec["fmt"], qspec["mode"], saved,
                                      group_size=qspec.get("group_size"),
                                      zero_point=qspec.get("zero_point", True),
                                      embeddings=qspec.get("embeddings"),
                                      scale_dtype=qspec.get("scale_dtypes", {}).get(p, "float16"))

        target = jax.tree_util.tree_map_with_path(leaf, target)
    if mesh is not None:
        from jaxinfer.runtime.device.sharding import param_shardings

        target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              target, param_shardings(target, mesh))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / "params", target)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path / 'params'}: cannot restore orbax params ({e})") from None
    if dtype is not None and jnp.dtype(dtype) != saved:
        def cast(a):
            if isinstance(a, QuantizedArray):
                return a.replace(dtype=jnp.dtype(dtype).name)
            return a.astype(dtype)

        params = jax.tree.map(cast, params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    if place is not None and not qspec:
        params = jax.tree_util.tree_map_with_path(lambda kp, a: place(path_str(kp), a), params)
    return cfg, params
