"""Load a GGUF file (llama.cpp's format) into ModelConfig + Params.

Supported architectures (`general.architecture`): "gemma3", "llama" (also Mistral, and Mixtral's
mixture of experts, converted by llama.cpp), "qwen2", "qwen3" (per-head q/k norms), "qwen3moe"
(Qwen3's attention, a mixture of experts in every layer), "qwen2moe" (Qwen1.5/Qwen2-MoE:
Qwen2's attention, routed experts plus a gated shared expert in every layer) and "gpt-oss"
(OpenAI's gpt-oss, llama.cpp's LLM_ARCH_OPENAI_MOE: see `_gpt_oss` for the facts it relies on).
Quantized tensors (Q4_K, Q5_0, Q6_K, Q8_0, MXFP4, ... — whatever `gguf.quants.dequantize`
implements) and F32 / F16 / BF16 are dequantized one tensor at a time to the runtime dtype, so peak
host memory stays near one copy of the weights in that dtype plus one f32 tensor.

Facts about GGUF this loader relies on (checked numerically against HF transformers in the tests):
- Tensor shapes are stored in ggml `ne` order (fastest axis first); the numpy array of a tensor
  is shaped `reversed(ne)`, i.e. `[out, in]` for a linear weight — the same as PyTorch/HF.
- llama.cpp permutes the rows of q/k projections of the "llama" architecture so that its
  interleaved (GPT-J style) rope acts on pairs (2i, 2i+1). Our forward uses the rotate-half
  layout (pairs i, i + Dh/2), so those rows are un-permuted here. "gemma3", "qwen2/3" and
  "gpt-oss" use NEOX-style rope in llama.cpp and are stored unpermuted.
- A mixture-of-experts layer has a router `ffn_gate_inp` (numpy [E, D]) and each projection's
  experts stacked in one tensor: `ffn_gate_exps` / `ffn_up_exps` numpy [E, F, D], `ffn_down_exps`
  numpy [E, D, F] (HF's per-expert [out, in] weights, stacked by expert).
- A "qwen2moe" layer adds a shared expert, a gated MLP `ffn_gate_shexp` / `ffn_up_shexp`
  numpy [Fs, D], `ffn_down_shexp` numpy [D, Fs], and its gate `ffn_gate_inp_shexp`: HF's [1, D]
  weight written unchanged (ne [D, 1]; llama.cpp reads it as ne [D], the same ggml shape).
- Gemma norm weights are stored with the +1 already added (llama.cpp adds it at conversion), so
  they are the effective multiplier our forward expects; they are loaded unchanged.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoints import gguf_blocks
from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf import assemble_params
from jaxinfer.checkpoints.quantize import WEIGHT_REDUCE_AXES, weight_name
from jaxinfer.runtime.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.runtime.device.model import Params, init_params
from jaxinfer.runtime.device.quantization import QuantizedArray, pack_nibbles

try:  # the import is cheap, but keep a clear message if the package is absent
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # pragma: no cover - gguf is a declared dependency
    gguf = None
    QT = None
if TYPE_CHECKING:
    from jaxinfer.checkpoints.gguf_header import GGUFFile

ARCHITECTURES = ("gemma3", "gpt-oss", "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


def _require_gguf() -> None:
    if gguf is None:
        raise CheckpointError("reading GGUF files needs the `gguf` package (pip install gguf)")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and parse a GGUF file's header (memory-mapped; tensor data is read lazily).
    Raises CheckpointError naming the file if it is missing, truncated or not GGUF."""
    _require_gguf()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (not a GGUF file)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    from jaxinfer.checkpoints.gguf_header import GGUFFile

    try:
        return GGUFFile(path)  # every offset, length and tensor extent checked against the size
    except (ValueError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{path}: corrupt GGUF file ({size} bytes): {e}") from None


# ----------------------------------------------------------------------------- metadata


_MISSING = object()


class _Meta:
    def __init__(self, reader, source: str):
        self.reader, self.source = reader, source

    def get(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} is missing")
        return v

    # Typed reads: a missing key without a default, or a value of another type, is an error
    # naming the file and the key (GGUF stores integers as (u)int8..64, reals as f32 / f64).

    def integer(self, key: str, default=_MISSING, *, least: int | None = None) -> int:
        v = self._typed(key, default, (int,), "an integer")
        if least is not None and v is not None and v < least:
            raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} is {v}, must be "
                                  f">= {least}")
        return v

    def number(self, key: str, default=_MISSING) -> float:
        v = self._typed(key, default, (int, float), "a number")
        if v is not None and not math.isfinite(v):
            raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} is {v}, must be "
                                  f"finite")
        return v if v is None else _f32_decimal(float(v))

    def string(self, key: str, default=_MISSING) -> str:
        return self._typed(key, default, (str,), "a string")

    def _typed(self, key: str, default, types: tuple, what: str):
        v = self.get(key)
        if v is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} is missing")
            return default
        if isinstance(v, bool) or not isinstance(v, types):
            raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} must be {what}, "
                                  f"got {type(v).__name__} {_short(v)}")
        return v


def _f32_decimal(v: float) -> float:
    """A real the converter wrote as f32 (1e-5 reads back as 9.99999974737875e-06): the shortest
    decimal that is the same f32 (1e-05), i.e. the value the converter was given. Equal in f32
    (the forward's precision) either way; a value f32 cannot hold exactly is left as it is."""
    v32 = np.float32(v)
    return float(str(v32)) if float(v32) == v else v  # numpy prints the shortest


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def architecture(reader, source: str) -> str:
    arch = _Meta(reader, source).get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{source}: GGUF metadata has no 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {list(ARCHITECTURES)}"
        )
    return arch


def _token_text(reader, i: int) -> str | None:
    f = reader.fields.get("tokenizer.ggml.tokens")
    tokens = [] if f is None else f.contents()
    return tokens[i] if i < len(tokens) else None


def gguf_config(reader, source: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (+ the tensor directory for vocab size and tying)."""
    arch = architecture(reader, source)
    m = _Meta(reader, source)
    a = f"{arch}."
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{source}: GGUF has no 'token_embd.weight' tensor")
    embd_ne = [int(x) for x in tensors["token_embd.weight"].shape]  # [D, V]
    if len(embd_ne) != 2:
        raise CheckpointError(f"{source}: tensor 'token_embd.weight' has ne {embd_ne}, expected "
                              f"[embedding_length, vocab]")
    hidden = m.integer(a + "embedding_length", least=1)
    n_layers = m.integer(a + "block_count", least=1)
    n_heads = m.integer(a + "attention.head_count", least=1)
    n_kv = _uniform(m, a + "attention.head_count_kv", n_heads)
    # gpt-oss: llama.cpp reads only expert_feed_forward_length (its converter writes both)
    ffn = _uniform(m, a + "feed_forward_length", None if arch == "gpt-oss" else _MISSING)
    head_dim = m.integer(a + "attention.key_length", 0) or hidden // n_heads
    v_len = m.integer(a + "attention.value_length", None)
    if v_len is not None and v_len != head_dim:
        raise CheckpointError(
            f"{source}: key_length {head_dim} != value_length {v_len} is not supported"
        )
    rope_dims = m.integer(a + "rope.dimension_count", None)
    if rope_dims is not None and rope_dims != head_dim:
        raise CheckpointError(
            f"{source}: partial rope (rope.dimension_count {rope_dims} < head_dim {head_dim}) "
            "is not supported"
        )
    bos = m.integer("tokenizer.ggml.bos_token_id", None)
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = m.integer(key, None)
        if v is not None and v not in eos:
            eos.append(v)
    common = dict(
        architecture=f"gguf:{arch}",
        vocab_size=embd_ne[1],
        hidden_size=hidden,
        intermediate_size=ffn or 0,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=m.number(a + "attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=m.integer(a + "context_length", 4096, least=1),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=bos,
    )
    try:
        if arch == "gpt-oss":
            return _gpt_oss(m, tensors, common, tuple(eos))
        rope_scaling = _rope_scaling(m, a, reader, head_dim,
                                     float(m.get(a + "rope.freq_base", 1e4)))
        if arch == "gemma3":
            # Gemma 3 chat turns end with <end_of_turn>; HF's generation config stops on it too.
            for i in (106,):
                if _token_text(reader, i) == "<end_of_turn>" and i not in eos:
                    eos.append(i)
            pattern = int(m.get(a + "attention.sliding_window_pattern", 6))
            layer_types = tuple(
                "global" if (i + 1) % pattern == 0 else "local" for i in range(n_layers)
            )
            # llama.cpp: attention scale 1/sqrt(key_length), except Gemma 3 27B (62 layers),
            # which uses 1/sqrt(hidden / heads) — the same values HF's configs carry.
            scalar = hidden / n_heads if n_layers == 62 else head_dim
            return ModelConfig(
                family="gemma3",
                **common,
                eos_token_ids=tuple(eos),
                rope_theta=float(m.get(a + "rope.freq_base", 1_000_000.0)),
                rope_scaling=rope_scaling,
                rope_local_theta=float(m.get(a + "rope.freq_base_swa", 10_000.0)),
                activation="gelu_tanh",
                qk_norm=True,
                sandwich_norms=True,
                embed_scale=math.sqrt(hidden),
                query_pre_attn_scalar=float(scalar),
                sliding_window=int(m.get(a + "attention.sliding_window", 4096)),
                layer_types=layer_types,
                final_logit_softcap=_opt_float(m.get(a + "final_logit_softcapping")),
                attn_logit_softcap=_opt_float(m.get(a + "attn_logit_softcapping")),
            )
        window = m.get(a + "attention.sliding_window")
        window = int(window) if window else None
        return ModelConfig(
            family="llama",
            **common,
            eos_token_ids=tuple(eos),
            rope_theta=float(m.get(a + "rope.freq_base", 10_000.0)),
            rope_scaling=rope_scaling,
            qkv_bias=arch in ("qwen2", "qwen2moe") or "blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            activation="silu",
            sliding_window=window,
            layer_types=("local",) * n_layers if window else (),
            **_experts(m, arch, tensors, hidden, ffn, n_layers),
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _uniform(m: _Meta, key: str, default=_MISSING) -> int | None:
    """An integer key that some archs write per layer (a list): the lists must be uniform."""
    v = m.get(key)
    if isinstance(v, list):
        if not v or len(set(v)) != 1:
            raise CheckpointError(f"{m.source}: per-layer {key} {_short(v)} is not supported")
        if isinstance(v[0], bool) or not isinstance(v[0], int) or v[0] < 1:
            raise CheckpointError(f"{m.source}: GGUF metadata key {key!r} must hold positive "
                                  f"integers, got {_short(v)}")
        return v[0]
    return m.integer(key, default, least=1)


# gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp): llama.cpp hard-codes
# the clamped GLU's constants (build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE); HF's gpt-oss configs
# carry the same values (swiglu_limit 7.0; alpha 1.702 in GptOssExperts).
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702


def _gpt_oss(m: _Meta, tensors: dict, common: dict, eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig of a "gpt-oss" GGUF, as llama.cpp reads and runs one:
    - keys: attention.layer_norm_rms_epsilon, expert_feed_forward_length and
      attention.sliding_window are required (llama.cpp's get_key without a default);
      attention.sliding_window_pattern (default 2) makes layer i sliding iff i % p < p - 1
      (llama_hparams::set_swa_pattern: the even layers of the default, as HF's gpt-oss
      layer_types alternate sliding, full); rope.freq_base_swa, if present, must equal
      rope.freq_base (llama.cpp then rotates every layer alike, as HF does);
    - the graph (openai-moe.cpp): NEOX rope (q/k rows unpermuted), attention scale
      1/sqrt(head_dim), q/k/v/o biases, a per-head sink logit `attn_sinks`, the MLP input norm
      `post_attention_norm`, a biased router whose top-k logits are softmaxed
      (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT = softmax, top k, renormalised), biased
      experts with the clamped GLU of constants GPT_OSS_SWIGLU_*, an untied `output`;
    - YaRN from rope.scaling.{type, factor, original_context_length, yarn_beta_fast,
      yarn_beta_slow, yarn_attn_factor} (convert_hf_to_gguf.py writes HF's rope parameters
      there). The ramp's ends are not rounded (truncate false): gpt-oss's HF config says so and
      HF runs it that way, where ggml's ggml_rope_yarn_corr_dims floors / ceils them; we follow
      the reference model (HF), the same choice checkpoints/hf_config.py makes."""
    a = "gpt-oss."
    source = m.source
    m.number(a + "attention.layer_norm_rms_epsilon")  # required by llama.cpp
    window = m.integer(a + "attention.sliding_window", least=1)
    pattern = m.integer(a + "attention.sliding_window_pattern", 2)
    n_layers = common["num_layers"]
    layer_types = tuple("local" if pattern == 0 or i % pattern < pattern - 1 else "global"
                        for i in range(n_layers))
    theta = m.number(a + "rope.freq_base", 10_000.0)
    swa_theta = m.number(a + "rope.freq_base_swa", None)
    if swa_theta is not None and swa_theta != theta:
        raise CheckpointError(f"{source}: rope.freq_base_swa {swa_theta} != rope.freq_base "
                              f"{theta} is not supported for gpt-oss")
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(f"{source}: a rope_freqs.weight tensor is not supported for "
                              f"gpt-oss (llama.cpp's gpt-oss has none)")
    if "output.weight" not in tensors:
        raise CheckpointError(f"{source}: gpt-oss needs an 'output.weight' tensor (its head is "
                              f"not tied to token_embd)")
    experts = _experts(m, "gpt-oss", tensors, common["hidden_size"], common["intermediate_size"],
                       n_layers)
    common = common | dict(tie_word_embeddings=False,
                           intermediate_size=common["intermediate_size"]
                           or experts["moe_intermediate_size"])
    return ModelConfig(
        family="llama",
        **common,
        eos_token_ids=eos,
        rope_theta=theta,
        rope_scaling=_yarn(m, a, common["max_position_embeddings"]),
        qkv_bias=True,
        qk_norm=False,
        activation="silu",
        sliding_window=window,
        layer_types=layer_types,
        **experts,
        attn_sinks=True,
        attn_out_bias=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        swiglu_alpha=GPT_OSS_SWIGLU_ALPHA,
    )


def _yarn(m: _Meta, a: str, n_ctx: int) -> RopeScaling | None:
    """YaRN rope scaling from the rope.scaling.* keys (None when rope.scaling.type is absent or
    "none"); keys whose effect HF's YaRN has no counterpart for must be absent or neutral."""
    kind = m.string(a + "rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise CheckpointError(f"{m.source}: unsupported rope scaling type {kind!r} for "
                              f"{a[:-1]} (yarn or none)")
    for key, neutral in (("rope.scaling.yarn_ext_factor", 1.0),
                         ("rope.scaling.yarn_log_multiplier", 0.0),
                         ("rope.scaling.attn_factor", 1.0)):
        v = m.number(a + key, neutral)
        if v != neutral:
            raise CheckpointError(f"{m.source}: GGUF metadata key {a + key!r} = {v} is not "
                                  f"supported (only {neutral})")
    factor = m.number(a + "rope.scaling.factor")
    if not factor > 0:
        raise CheckpointError(f"{m.source}: GGUF metadata key {a + 'rope.scaling.factor'!r} "
                              f"is {factor}, must be > 0")
    return RopeScaling(
        kind="yarn", factor=factor,
        # llama.cpp's default for a missing original context: the training context
        original_max_position_embeddings=m.integer(a + "rope.scaling.original_context_length",
                                                   n_ctx, least=1),
        beta_fast=m.number(a + "rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=m.number(a + "rope.scaling.yarn_beta_slow", 1.0),
        truncate=False,
        attention_factor=m.number(a + "rope.scaling.yarn_attn_factor", None))


# A mixture-of-experts layer's tensors -> their ne (ggml order) for D, expert F, E experts
_EXPERT_NE = {
    "ffn_gate_inp": lambda d, f, e: [d, e],
    "ffn_gate_exps": lambda d, f, e: [d, f, e],
    "ffn_up_exps": lambda d, f, e: [d, f, e],
    "ffn_down_exps": lambda d, f, e: [f, d, e],
}
# gpt-oss's router and expert biases -> their ne for D, expert F, E experts
_BIAS_NE = {
    "ffn_gate_inp": lambda d, f, e: [e],
    "ffn_gate_exps": lambda d, f, e: [f, e],
    "ffn_up_exps": lambda d, f, e: [f, e],
    "ffn_down_exps": lambda d, f, e: [d, e],
}
# A "qwen2moe" layer's shared expert -> its ne for D and the shared expert's F
_SHARED_NE = {
    "ffn_gate_inp_shexp": lambda d, f: [d],
    "ffn_gate_shexp": lambda d, f: [d, f],
    "ffn_up_shexp": lambda d, f: [d, f],
    "ffn_down_shexp": lambda d, f: [f, d],
}


def _ggml_shape(ne: list[int]) -> list[int]:
    """ne without trailing axes of 1 (ggml pads every shape to 4 axes with 1s)."""
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


def _experts(m: _Meta, arch: str, tensors: dict, hidden: int, ffn: int | None,
             n_layers: int) -> dict:
    """The mixture-of-experts fields (none for a dense model), checked against every layer's
    expert tensors. "qwen2moe" / "qwen3moe" / "gpt-oss": experts of `expert_feed_forward_length`
    (and qwen2moe's shared expert of `expert_shared_feed_forward_length`; llama.cpp's converter
    writes both from HF's config); Mixtral ("llama"): of `feed_forward_length`, as llama.cpp
    reads them. Top-k routing weights: "qwen3moe", "gpt-oss" and Mixtral renormalise them:
    llama.cpp's qwen3moe graph always does, and its converter records no key for HF's
    `norm_topk_prob` (Qwen3-MoE's released configs set it true; HF's default is false), so a GGUF
    cannot say otherwise; Mixtral always renormalises; gpt-oss softmaxes the k chosen logits
    (the same weights). "qwen2moe" never does: llama.cpp's qwen2moe graph
    (src/models/qwen2moe.cpp) calls build_moe_ffn with norm_w false, matching HF Qwen2-MoE's
    default norm_topk_prob false. "gpt-oss" also has a bias for the router and each expert
    projection (`<tensor>.bias`: ne [E], [F, E], [F, E], [D, E])."""
    a = f"{arch}."
    moe_arch = arch.endswith("moe") or arch == "gpt-oss"
    n = m.integer(a + "expert_count", 0)
    if not n:
        stray = next((name for name in tensors if name.endswith("_exps.weight")), None)
        if stray is not None or moe_arch:
            raise CheckpointError(f"{m.source}: GGUF metadata key {a + 'expert_count'!r} is "
                                  f"missing" + (f" (expert tensor {stray!r})" if stray else ""))
        return {}
    used = m.integer(a + "expert_used_count", least=1)
    f = m.integer(a + "expert_feed_forward_length", least=1) if moe_arch else ffn
    shared = (m.integer(a + "expert_shared_feed_forward_length", least=1)
              if arch == "qwen2moe" else 0)
    experts = f"{a}expert_count {n}, embedding_length {hidden}, expert length {f}"
    want = {kind + ".weight": (ne(hidden, f, n), experts) for kind, ne in _EXPERT_NE.items()}
    if arch == "gpt-oss":
        want |= {kind + ".bias": (ne(hidden, f, n), experts) for kind, ne in _BIAS_NE.items()}
        fused = next((k for k in tensors if k.endswith(".ffn_gate_up_exps.weight")), None)
        if fused is not None:
            raise CheckpointError(
                f"{m.source}: fused gate/up expert tensors ({fused!r}, convert_hf_to_gguf.py "
                f"--fuse-gate-up-exps) are not supported; convert with gate and up apart")
    if shared:
        want |= {kind + ".weight": (ne(hidden, shared), f"embedding_length {hidden}, shared "
                                                        f"expert length {shared}")
                 for kind, ne in _SHARED_NE.items()}
    for i in range(n_layers):
        for kind, (ne, implied_by) in want.items():
            name = f"blk.{i}.{kind}"
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(
                    f"{m.source}: layer {i} has no expert tensor {name!r} ({a}expert_count {n}); "
                    + ("layers without experts are not supported"
                       if kind.removesuffix(".weight") in _EXPERT_NE
                       else f"every {arch} layer has a shared expert" if arch == "qwen2moe"
                       else f"every {arch} layer has one"))
            got = [int(x) for x in t.shape]
            if _ggml_shape(got) != _ggml_shape(ne):
                raise CheckpointError(f"{m.source}: tensor {name!r} has ne {got}, the metadata "
                                      f"implies {ne} ({implied_by})")
    return dict(num_experts=n, experts_per_token=used, moe_intermediate_size=f,
                norm_topk_prob=arch != "qwen2moe", shared_expert_size=shared,
                shared_expert_gate=bool(shared))


def _opt_float(v) -> float | None:
    return None if v is None or float(v) == 0.0 else float(v)


def _rope_scaling(m: _Meta, a: str, reader, head_dim: int, theta: float) -> RopeScaling | None:
    kind = m.get(a + "rope.scaling.type")
    factor = m.get(a + "rope.scaling.factor")
    if kind == "linear" and factor and float(factor) != 1.0:
        return RopeScaling(kind="linear", factor=float(factor))
    if kind not in (None, "none", "linear"):
        raise CheckpointError(f"{m.source}: unsupported rope scaling type {kind!r}")
    # Llama 3.x: llama.cpp stores the per-frequency divisors as a `rope_freqs.weight` tensor.
    # Recover the llama3 parameters and check they reproduce the stored divisors exactly.
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    stored = np.asarray(_dequantize(t, m.source), np.float32).reshape(-1)
    if np.allclose(stored, 1.0):
        return None
    from jaxinfer.runtime.device.model import rope_inv_freq

    orig = int(m.get(a + "rope.scaling.original_context_length") or 8192)
    cand = RopeScaling(kind="llama3", factor=float(stored.max()), low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=orig)
    base = rope_inv_freq(head_dim, theta, None)
    want = base / rope_inv_freq(head_dim, theta, cand)
    if want.shape != stored.shape or not np.allclose(want, stored, rtol=1e-4):
        raise CheckpointError(
            f"{m.source}: rope_freqs.weight does not match llama3 rope scaling "
            f"(factor {cand.factor}, low 1, high 4, original context {orig}); not supported"
        )
    return cand


# ----------------------------------------------------------------------------- tensors


def _dequantize(t, source: str) -> np.ndarray:
    """One tensor as an f32 numpy array in numpy (reversed-ne) shape."""
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    qtype = t.tensor_type
    if qtype.name in gguf_blocks.GROUP_SIZES:  # same values as gguf.quants, ~2x faster
        try:
            return gguf_blocks.dequantize(t.data, qtype.name, shape)
        except ValueError as e:
            raise CheckpointError(f"{source}: tensor {t.name!r}: {e}") from None
    if qtype in (QT.F32, QT.F16, QT.BF16) or qtype in _dequantizable():
        try:
            return _dequantize_rows(t.data, qtype, shape)
        except NotImplementedError:
            pass
    raise CheckpointError(
        f"{source}: tensor {t.name!r} has quantization type {qtype.name}, which cannot be "
        f"dequantized (supported: {', '.join(sorted(q.name for q in _dequantizable()))})"
    )


_ROW_CHUNK_BYTES = 32 << 20  # dequantize big tensors in ~32 MB slabs of rows


def _dequantize_rows(data: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize into one preallocated f32 array, a slab of rows at a time, so the
    temporaries of gguf.quants stay small next to a 262k-row embedding."""
    if qtype == QT.F32:
        return np.asarray(data, np.float32).reshape(shape)
    out = np.empty(shape, np.float32)
    rows_out = out.reshape(-1, shape[-1]) if shape else out.reshape(1, 1)
    rows_in = data.reshape(rows_out.shape[0], -1)
    step = max(1, _ROW_CHUNK_BYTES // max(1, rows_in.shape[1] * rows_in.itemsize))
    for r in range(0, rows_in.shape[0], step):
        chunk = gguf.quants.dequantize(rows_in[r: r + step], qtype)
        rows_out[r: r + step] = chunk.reshape(-1, rows_out.shape[1])
    return out


_DEQ_CACHE: set | None = None


def _dequantizable() -> set:
    """Quantization types gguf.quants implements (probed once on one zero block)."""
    global _DEQ_CACHE
    if _DEQ_CACHE is None:
        ok = set()
        for q in QT:
            size = gguf.GGML_QUANT_SIZES.get(q)
            if size is None:
                continue
            block, nbytes = size
            if q in (QT.F32, QT.F16, QT.BF16):
                ok.add(q)
                continue
            if q.name.startswith(("I8", "I16", "I32", "I64", "F64")):
                continue
            try:
                gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), q)
            except (NotImplementedError, ValueError, KeyError, AssertionError):
                continue
            ok.add(q)
        _DEQ_CACHE = ok
    return _DEQ_CACHE


def _unpermute_rows(n_head: int) -> Callable:
    """Invert llama.cpp's q/k row permutation ([H, 2, Dh/2] -> [H, Dh/2, 2] per head)."""

    def fn(w):  # w: [H*Dh, D] (rows = outputs)
        out, d = w.shape
        return w.reshape(n_head, out // n_head // 2, 2, d).swapaxes(1, 2).reshape(out, d)

    return fn


def _unpermute_bias(n_head: int) -> Callable:
    def fn(b):
        return b.reshape(n_head, -1, 2).swapaxes(1, 2).reshape(-1)

    return fn


# Router numpy [E, D] -> [D, E]; experts numpy [E, out, in] -> [E, in, out]. The expert stacks
# (and a shared expert's projections) follow load_gguf's rule for matmul weights
# (quantize.WEIGHT_REDUCE_AXES names them): in a block format gguf_blocks reads, kept quantized
# with keep_quantized, else widened at load; any other type is dequantized at load.
_EXPERT_PLAN = {
    "ffn_gate_inp.weight": ("router", lambda w: w.T),
    "ffn_gate_exps.weight": ("we_gate", lambda w: w.swapaxes(1, 2)),
    "ffn_up_exps.weight": ("we_up", lambda w: w.swapaxes(1, 2)),
    "ffn_down_exps.weight": ("we_down", lambda w: w.swapaxes(1, 2)),
}


def _mlp_plan(suffix: str = "") -> dict[str, tuple[str, Callable]]:
    """A gated MLP's numpy [out, in] projections (`suffix` "_shexp": a shared expert's) ->
    w_gate / w_up [D, F], w_down [F, D]."""
    return {f"ffn_{p}{suffix}.weight": (f"w_{p}", lambda w: w.T) for p in ("gate", "up", "down")}


def gguf_tensor_plan(cfg: ModelConfig, arch: str) -> dict[str, tuple[str, Callable]]:
    """GGUF tensor name -> (our param path, transform from the numpy [out, in] layout)."""
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda w: w  # noqa: E731
    perm_q = _unpermute_rows(hq) if arch == "llama" else ident
    perm_k = _unpermute_rows(hkv) if arch == "llama" else ident
    perm_bq = _unpermute_bias(hq) if arch == "llama" else ident
    perm_bk = _unpermute_bias(hkv) if arch == "llama" else ident
    plan = {
        "token_embd.weight": ("embed", ident),
        "output_norm.weight": ("final_norm", ident),
    }
    if not cfg.tie_word_embeddings:
        plan["output.weight"] = ("lm_head", ident)
    for i in range(cfg.num_layers):
        layer = {
            "attn_norm.weight": ("attn_norm", ident),
            # -1 on the input axis: the same transform lays out per-group scales (in / g)
            "attn_q.weight": ("wq", lambda w, p=perm_q: p(w).T.reshape(-1, hq, dh)),
            "attn_k.weight": ("wk", lambda w, p=perm_k: p(w).T.reshape(-1, hkv, dh)),
            "attn_v.weight": ("wv", lambda w: w.T.reshape(-1, hkv, dh)),
            "attn_output.weight": ("wo", lambda w: w.T.reshape(hq, -1, d)),
            # gpt-oss names its MLP input norm post_attention_norm (HF's
            # post_attention_layernorm); Gemma 3's post_attention_norm is a sandwich norm
            ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight"):
                ("mlp_norm", ident),
        }
        if not cfg.layer_has_experts(i):
            layer |= _mlp_plan()
        else:
            layer |= _EXPERT_PLAN
            if cfg.shared_expert_size:
                layer |= _mlp_plan("_shexp")
            if cfg.shared_expert_gate:  # numpy [1, D] (or [D]) -> [D]
                layer["ffn_gate_inp_shexp.weight"] = ("shared_gate", lambda w: w.reshape(-1))
        if cfg.sandwich_norms:
            layer |= {
                "post_attention_norm.weight": ("post_attn_norm", ident),
                "post_ffw_norm.weight": ("post_mlp_norm", ident),
            }
        if cfg.qk_norm:
            layer |= {
                "attn_q_norm.weight": ("q_norm", ident),
                "attn_k_norm.weight": ("k_norm", ident),
            }
        if cfg.qkv_bias:
            layer |= {
                "attn_q.bias": ("bq", lambda b, p=perm_bq: p(b).reshape(hq, dh)),
                "attn_k.bias": ("bk", lambda b, p=perm_bk: p(b).reshape(hkv, dh)),
                "attn_v.bias": ("bv", lambda b: b.reshape(hkv, dh)),
            }
        if cfg.attn_out_bias:  # gpt-oss: [D]
            layer["attn_output.bias"] = ("bo", ident)
        if cfg.attn_sinks:  # gpt-oss: one logit per query head [Hq]
            layer["attn_sinks.weight"] = ("sinks", ident)
        if cfg.router_bias:  # [E]
            layer["ffn_gate_inp.bias"] = ("router_b", ident)
        if cfg.expert_bias:  # [E, F] gate / up, [E, D] down: llama.cpp splits HF's gate_up
            layer |= {f"ffn_{p}_exps.bias": (f"we_{p}_b", ident) for p in ("gate", "up", "down")}
        for k, (field, fn) in layer.items():
            plan[f"blk.{i}.{k}"] = (f"layers.{i}.{field}", fn)
    return plan


# Tensors some converters write that carry no weights we need.
_IGNORED = ("rope_freqs.weight",)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize_on_device(w: QuantizedArray, dtype) -> jax.Array:
    return w.dequantize(dtype)


@dataclass
class KeptBlocks:
    """One tensor's GGUF blocks as int8 values with per-group f32 scales (and offsets), numpy
    [out, in] layout (checkpoints/gguf_blocks.py). `layout` makes the runtime's weight: kept
    (`keep`), or widened on the device, where no f32 copy is made on the host."""

    name: str
    kind: str  # the GGUF type, e.g. "Q4_K"
    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # f32 [out, in / g]
    offset: np.ndarray | None
    keep: bool

    def layout(self, fn: Callable, target: str, dtype, widen_to
               ) -> QuantizedArray | jax.Array | None:
        """The weight of param `target`: `fn` (the plan's [out, in] -> param layout transform)
        applied to values, scales and offsets alike, as a QuantizedArray (`dtype`: the compute
        dtype of its rows) if kept, else widened to `widen_to`. None when a group spans several
        param axes (e.g. 32-weight groups over heads of 16 in o_proj's input)."""
        q = fn(self.q)
        try:
            scale = fn(self.scale)
        except ValueError:
            return None
        axes = [i for i, (a, b) in enumerate(zip(q.shape, scale.shape)) if a != b]
        reduce_axes = WEIGHT_REDUCE_AXES[weight_name(target)]
        if len(axes) != 1 or axes[0] not in reduce_axes or q.ndim != scale.ndim:
            return None
        offset = None if self.offset is None else jnp.asarray(fn(self.offset))
        group = q.shape[axes[0]] // scale.shape[axes[0]]
        if self.kind in gguf_blocks.PACKED_KINDS:  # 4-bit values: two a byte (signed when no offset)
            q = pack_nibbles(q, axes[0])
        w = QuantizedArray(
            values=jnp.asarray(q), scales=jnp.asarray(scale), offsets=offset, fmt="gguf",
            mode="weight_only", reduce_axes=reduce_axes,
            group_size=group, group_axis=axes[0],
            dtype=jnp.dtype(dtype).name)
        return w if self.keep else _dequantize_on_device(w, jnp.dtype(widen_to))

    def dense(self) -> np.ndarray:
        """f32 [out, in], equal to gguf's dequantizer."""
        return gguf_blocks.widen(self.q, self.scale, self.offset,
                                 gguf_blocks.GROUP_SIZES[self.kind])


def iter_gguf_tensors(reader, source: str, blocks: frozenset[str] = frozenset(),
                      keep: bool = False
                      ) -> Iterator[tuple[str, np.ndarray | KeptBlocks, str]]:
    """Yield (name, array, source) one tensor at a time: tensors named in `blocks` whose type
    gguf_blocks reads as KeptBlocks (kept quantized if `keep`), the rest dequantized to f32
    numpy."""
    for t in reader.tensors:
        if t.name in _IGNORED or t.name.endswith(".attn_rot_embd"):
            continue
        kind = t.tensor_type.name
        if t.name in blocks and kind in gguf_blocks.GROUP_SIZES:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            try:
                q, scale, offset = gguf_blocks.decode(t.data, kind, shape)
            except ValueError as e:
                raise CheckpointError(f"{source}: tensor {t.name!r}: {e}") from None
            yield t.name, KeptBlocks(t.name, kind, q, scale, offset, keep), source
        else:
            yield t.name, _dequantize(t, source), source
        if hasattr(reader, "release"):  # consumed: its mapped pages leave the resident set
            reader.release(t)


def _check_unsupported_types(reader, source: str) -> None:
    """Fail before any dequantization work if a tensor's type cannot be read."""
    ok = _dequantizable()
    for t in reader.tensors:
        if t.tensor_type not in ok:
            raise CheckpointError(
                f"{source}: tensor {t.name!r} has unsupported quantization type "
                f"{t.tensor_type.name}; supported: {', '.join(sorted(q.name for q in ok))}"
            )


def _is_quantized(a) -> bool:  # a runtime.device.quantization.QuantizedArray counts as one leaf
    return hasattr(a, "dequantize")


def _check_shapes(cfg: ModelConfig, params: Params, source: str) -> None:
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    got_leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    if len(got_leaves) != len(want_leaves):
        raise CheckpointError(f"{source}: tensor set does not match the metadata's architecture")
    for (kp, a), (_, b) in zip(got_leaves, want_leaves):
        if tuple(a.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{source}: tensor {jax.tree_util.keystr(kp)} has shape {tuple(a.shape)}, "
                f"the GGUF metadata implies {tuple(b.shape)}"
            )


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, *, reader=None, place=None,
              keep_quantized: bool = False) -> tuple[ModelConfig, Params]:
    """Read a GGUF file into (ModelConfig, Params) with weights dequantized to `dtype`, or with
    `keep_quantized` the matmul weights stored in a block format gguf_blocks reads kept as
    QuantizedArray (fmt "gguf": no f32 copy is made); other tensors are dequantized.

    `reader`: an already open `open_gguf(path)` (parsing the header of a 262k-token vocabulary
    takes seconds; the tokenizer needs the same reader). `place(path, leaf)`: see
    hf.assemble_params; it receives the QuantizedArray of a kept tensor."""
    source = str(path)
    if reader is None:
        reader = open_gguf(path)
    cfg = gguf_config(reader, source)
    arch = architecture(reader, source)
    _check_unsupported_types(reader, source)
    plan = gguf_tensor_plan(cfg, arch)
    # the matmul weights' blocks are decoded once; kept, or widened on the device
    blocks = frozenset(name for name, (target, _) in plan.items()
                       if weight_name(target) in WEIGHT_REDUCE_AXES)
    tensors = iter_gguf_tensors(reader, source, blocks, keep_quantized)
    try:
        params = assemble_params(cfg, tensors, plan, dtype, place)
    except ValueError as e:
        if isinstance(e, CheckpointError):
            if source not in str(e):
                raise CheckpointError(f"{source}: {e}") from None
            raise
        # a reshape in a layout transform: the metadata and the tensor shapes disagree
        raise CheckpointError(f"{source}: tensor shapes disagree with the metadata ({e})") from None
    _check_shapes(cfg, params, source)
    return cfg, params


def load_gguf_tokenizer(path: str | os.PathLike, *, reader=None):
    """The tokenizer stored in the GGUF's metadata (runtime.host.tokenizer.tokenizer_from_gguf).
    Pass the `reader` already used for load_gguf to avoid parsing the header twice."""
    from jaxinfer.runtime.host.tokenizer import TokenizerError, tokenizer_from_gguf

    if reader is None:
        reader = open_gguf(path)
    try:
        tok = tokenizer_from_gguf(reader, str(path))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    field = reader.fields.get("tokenizer.chat_template")
    tok.chat_template = str(field.contents()) if field is not None else None
    return tok
