"""LoRA adapters from PEFT directories (adapter_config.json + adapter_model.safetensors).

Checked once, here: the adapter kind (plain LoRA: no DoRA, no trained biases, no extra saved
modules), its target modules (q/k/v/o and gate/up/down projections of decoder layers), each
rank against `max_rank`, each tensor's shape against the base model. Result: host arrays with
PEFT's scale (lora_alpha / r, rsLoRA: lora_alpha / sqrt(r)) folded into B, laid out for
runtime.device.lora (A [Din, r], B [r, Dout]).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from jaxinfer.checkpoints.errors import CheckpointError, read_json_object
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.lora import TARGETS, target_dims

_MODULE_TO_TARGET = {peft: t for t, (_, peft) in TARGETS.items()}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    rank: int  # the largest module rank
    targets: tuple[str, ...]  # runtime.device.lora target names present
    tensors: dict  # {(layer, target): (A [Din, r] f32, s * B [r, Dout] f32)}
    base_model: str | None


def _config(path: Path) -> dict:
    f = path / "adapter_config.json"
    cfg = read_json_object(f, "a PEFT adapter dir")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise CheckpointError(f"{f}: peft_type {kind!r} is not supported (only LORA)")
    for key, ok, what in (("use_dora", lambda v: not v, "DoRA adapters"),
                          ("bias", lambda v: v in (None, "none"), "trained biases (bias != 'none')"),
                          ("modules_to_save", lambda v: not v, "modules_to_save (full weights)"),
                          ("alpha_pattern", lambda v: not v, "per-module alpha_pattern"),
                          ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out layouts")):
        if not ok(cfg.get(key)):
            raise CheckpointError(f"{f}: {what} are not supported ({key}={cfg[key]!r})")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise CheckpointError(f"{f}: {key} must be a positive number, got {v!r}")
    return cfg


def load_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path` against the base model `cfg`; CheckpointError names
    the file and the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a PEFT adapter dir is expected)")
    conf = _config(path)
    alpha, rslora = float(conf["lora_alpha"]), bool(conf.get("use_rslora"))
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise CheckpointError(f"{f}: not found (adapters are read from safetensors)")
    try:
        raw = load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, arr in raw.items():
        m = _KEY.search(name)
        if m is None:
            raise CheckpointError(f"{f}: tensor {name!r} is not a LoRA A/B weight of a decoder "
                                  "layer's attention or MLP projection (not supported)")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        target = _MODULE_TO_TARGET.get(module)
        if target is None:
            raise CheckpointError(f"{f}: target module {module!r} ({name}) is not supported; "
                                  f"supported: {', '.join(_MODULE_TO_TARGET)}")
        if layer >= cfg.num_layers:
            raise CheckpointError(f"{f}: {name}: layer {layer}, but the base model has "
                                  f"{cfg.num_layers} layers")
        halves.setdefault((layer, target), {})[half] = np.asarray(arr, np.float32)
    if not halves:
        raise CheckpointError(f"{f}: no LoRA weights")
    tensors, rank = {}, 0
    for (layer, target), h in sorted(halves.items()):
        where = f"{f}: layer {layer} {TARGETS[target][1]}"
        if set(h) != {"A", "B"}:
            raise CheckpointError(f"{where}: lora_{'B' if 'A' in h else 'A'} is missing")
        a, b = h["A"], h["B"]  # [r, Din], [Dout, r]
        din, dout = target_dims(cfg, layer)[target]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{where}: lora_A {a.shape} and lora_B {b.shape} do not "
                                  "form a rank-r pair")
        if a.shape[1] != din or b.shape[0] != dout:
            raise CheckpointError(
                f"{where}: shapes A {a.shape}, B {b.shape} do not fit the base model's "
                f"{din} -> {dout} projection (adapter made for another model?)")
        r = a.shape[0]
        if r > max_rank:
            raise CheckpointError(f"{where}: rank {r} exceeds max_lora_rank {max_rank}")
        scale = alpha / (math.sqrt(r) if rslora else r)
        tensors[(layer, target)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * scale)
        rank = max(rank, r)
    return LoraAdapter(path=str(path), rank=rank,
                       targets=tuple(t for t in TARGETS if any(k[1] == t for k in tensors)),
                       tensors=tensors, base_model=conf.get("base_model_name_or_path"))


def write_peft_tensors(tensors: dict, like: str | Path) -> str:
    """A trainer's adapter tensors ({PEFT name: array}, e.g. "base_model.model.model.layers.0.
    self_attn.q_proj.lora_A.weight") as a PEFT dir in a new temporary directory, with the
    adapter_config.json of the adapter at `like` (its r, lora_alpha, targets); -> its path.
    Checked when read (load_peft_adapter), like any adapter."""
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    arrays = {}
    for k, v in tensors.items():
        a = np.asarray(v, np.float32)
        if not np.isfinite(a).all():
            raise CheckpointError(f"LoRA tensor {k!r}: holds NaN or infinite values")
        arrays[str(k)] = np.ascontiguousarray(a)
    out = Path(tempfile.mkdtemp(prefix="jaxinfer-lora-"))
    shutil.copy(Path(like) / "adapter_config.json", out / "adapter_config.json")
    save_file(arrays, str(out / "adapter_model.safetensors"))
    return str(out)
