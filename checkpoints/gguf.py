"""Load a GGUF file (llama.cpp's format) into ModelConfig + Params.

Supported architectures (`general.architecture`): "gemma3", "llama" (also Mistral, and Mixtral's
mixture of experts, converted by llama.cpp), "qwen2", "qwen3" (per-head q/k norms), "qwen3moe"
(Qwen3's attention, a mixture of experts in every layer), "qwen2moe" (Qwen1.5/Qwen2-MoE:
Qwen2's attention, routed experts plus a gated shared expert in every layer), "gpt-oss"
(OpenAI's gpt-oss, llama.cpp's LLM_ARCH_OPENAI_MOE: see `_gpt_oss` for the facts it relies on),
"deepseek2" (DeepSeek-V3's multi-head latent attention and sigmoid-routed experts: `_deepseek2`)
and "gemma4" (Gemma 4's text model: `_gemma4`).
Quantized tensors (Q4_K, Q5_0, Q6_K, Q8_0, MXFP4, ... — whatever `gguf.quants.dequantize`
implements) and F32 / F16 / BF16 are dequantized one tensor at a time to the runtime dtype, so peak
host memory stays near one copy of the weights in that dtype plus one f32 tensor.

Facts about GGUF this loader relies on (checked numerically against HF transformers in the tests):
- Tensor shapes are stored in ggml `ne` order (fastest axis first); the numpy array of a tensor
  is shaped `reversed(ne)`, i.e. `[out, in]` for a linear weight — the same as PyTorch/HF.
- llama.cpp permutes the rows of q/k projections of the "llama" architecture so that its
  interleaved (GPT-J style) rope acts on pairs (2i, 2i+1). Our forward uses the rotate-half
  layout (pairs i, i + Dh/2), so those rows are un-permuted here. "gemma3", "gemma4",
  "qwen2/3" and "gpt-oss" use NEOX-style rope in llama.cpp and are stored unpermuted;
  "deepseek2" rotates interleaved pairs on rows stored as HF has them (HF's DeepSeek-V3 rotates
  interleaved pairs too), so its rope dims are reordered evens-then-odds, as from HF's files.
- A mixture-of-experts layer has a router `ffn_gate_inp` (numpy [E, D]) and each projection's
  experts stacked in one tensor: `ffn_gate_exps` / `ffn_up_exps` numpy [E, F, D], `ffn_down_exps`
  numpy [E, D, F] (HF's per-expert [out, in] weights, stacked by expert).
- A "qwen2moe" layer adds a shared expert, a gated MLP `ffn_gate_shexp` / `ffn_up_shexp`
  numpy [Fs, D], `ffn_down_shexp` numpy [D, Fs], and its gate `ffn_gate_inp_shexp`: HF's [1, D]
  weight written unchanged (ne [D, 1]; llama.cpp reads it as ne [D], the same ggml shape).
- Gemma norm weights are stored with the +1 already added (llama.cpp adds it at conversion;
  Gemma 4's HF norms already hold their multiplier and are written as they are), so they are
  the effective multiplier our forward expects; they are loaded unchanged.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
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

ARCHITECTURES = ("deepseek2", "gemma3", "gemma4", "gpt-oss", "llama", "qwen2", "qwen2moe",
                 "qwen3", "qwen3moe")


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

    def boolean(self, key: str, default=_MISSING) -> bool:
        v = self.get(key)
        if v is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} is missing")
            return default
        if not isinstance(v, bool):
            raise CheckpointError(f"{self.source}: GGUF metadata key {key!r} must be a bool, "
                                  f"got {type(v).__name__} {_short(v)}")
        return v

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
    # gemma4: per-layer KV heads and MLP lengths, two layer types' head lengths: _gemma4
    n_kv = _uniform(m, a + "attention.head_count_kv", n_heads) if arch != "gemma4" else 1
    # gpt-oss: llama.cpp reads only expert_feed_forward_length (its converter writes both);
    # deepseek2: only its leading dense layers use feed_forward_length
    ffn = None if arch == "gemma4" else _uniform(
        m, a + "feed_forward_length", None if arch in ("gpt-oss", "deepseek2") else _MISSING)
    if arch in ("deepseek2", "gemma4"):
        head_dim = 0  # the latent head's (_deepseek2 reads the MLA keys), or per layer type
    else:
        head_dim = m.integer(a + "attention.key_length", 0) or hidden // n_heads
        v_len = m.integer(a + "attention.value_length", None)
        if v_len is not None and v_len != head_dim:
            raise CheckpointError(
                f"{source}: key_length {head_dim} != value_length {v_len} is not supported"
            )
        rope_dims = m.integer(a + "rope.dimension_count", None)
        if rope_dims is not None and rope_dims != head_dim:
            raise CheckpointError(
                f"{source}: partial rope (rope.dimension_count {rope_dims} < head_dim "
                f"{head_dim}) is not supported"
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
        if arch == "deepseek2":
            return _deepseek2(m, tensors, common, tuple(eos))
        if arch == "gemma4":
            return _gemma4(m, tensors, common, tuple(eos))
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
    factor = _yarn_factor(m, a, (("rope.scaling.yarn_ext_factor", 1.0),
                                 ("rope.scaling.yarn_log_multiplier", 0.0),
                                 ("rope.scaling.attn_factor", 1.0)))
    if factor is None:
        return None
    return _yarn_scaling(m, a, n_ctx, factor, truncate=False,
                         attention_factor=m.number(a + "rope.scaling.yarn_attn_factor", None))


def _yarn_factor(m: _Meta, a: str, neutral: tuple) -> float | None:
    """rope.scaling.factor of a YaRN file (None: no scaling); an other scaling type, a
    `neutral` key ((key, value) pairs) set otherwise, or a factor <= 0: a CheckpointError."""
    kind = m.string(a + "rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise CheckpointError(f"{m.source}: unsupported rope scaling type {kind!r} for "
                              f"{a[:-1]} (yarn or none)")
    for key, value in neutral:
        v = m.number(a + key, value)
        if v != value:
            raise CheckpointError(f"{m.source}: GGUF metadata key {a + key!r} = {v} is not "
                                  f"supported for {a[:-1]} (only {value})")
    factor = m.number(a + "rope.scaling.factor")
    if not factor > 0:
        raise CheckpointError(f"{m.source}: GGUF metadata key {a + 'rope.scaling.factor'!r} "
                              f"is {factor}, must be > 0")
    return factor


def _yarn_scaling(m: _Meta, a: str, n_ctx: int, factor: float, **kw) -> RopeScaling:
    return RopeScaling(
        kind="yarn", factor=factor,
        # llama.cpp's default for a missing original context: the training context
        original_max_position_embeddings=m.integer(a + "rope.scaling.original_context_length",
                                                   n_ctx, least=1),
        beta_fast=m.number(a + "rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=m.number(a + "rope.scaling.yarn_beta_slow", 1.0), **kw)


# deepseek2 (llama.cpp's LLM_ARCH_DEEPSEEK2: DeepSeek-V2 / V2.5 / V3 and relatives). The values
# of `expert_gating_func` (llama.cpp's llama_expert_gating_func_type; gguf.ExpertGatingFuncType).
_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
_GATING_SIGMOID = 2


def _deepseek2(m: _Meta, tensors: dict, common: dict, eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig of a "deepseek2" GGUF (multi-head latent attention, routed + shared experts),
    as llama.cpp reads and runs one (src/models/deepseek2.cpp, convert_hf_to_gguf.py's
    DeepseekV2Model):
    - required keys (llama.cpp's get_key without a default): attention.layer_norm_rms_epsilon,
      attention.kv_lora_rank, rope.dimension_count (R; its default, key_length, cannot leave
      nope dims), and, where a layer has experts, expert_count, expert_used_count,
      expert_feed_forward_length, expert_shared_count; attention.q_lora_rank unless q is
      projected directly (`attn_q`, the "lite" models);
    - the attention's dims, two layouts. The current converter splits HF's kv_b_proj
      ([H * (N + V), C], per head the N nope rows then the V value rows) into `attn_k_b` (per
      head its nope rows transposed: numpy [H, C, N]) and `attn_v_b` (numpy [H, V, C]) and
      writes key_length C + R, value_length C (the cached latent head), key_length_mla N + R,
      value_length_mla V. Older files keep `attn_kv_b` whole and write key_length N + R,
      value_length V without the _mla keys (llama.cpp's is_mla() false); both are read;
    - rope: llama.cpp rotates deepseek2 with its "normal" rope (pairs (2i, 2i + 1)) and the
      converter leaves q_b / kv_a_mqa rows as HF has them: the rope dims are reordered at load to
      evens then odds (the rotate-half layout of the same rotation), as for HF's checkpoint;
    - routing: llama.cpp gates with `expert_gating_func`, and with softmax where it is absent
      (DeepSeek-V2 / V2.5 files); only DeepSeek-V3's sigmoid (2) is supported, with the choice
      bias `exp_probs_b.bias` (HF's e_score_correction_bias), groups `expert_group_count`
      (default 1) of which the best `expert_group_used_count` are kept, the weights renormalised
      if `expert_weights_norm` (default false) and scaled by `expert_weights_scale` (default 1);
      the first `leading_dense_block_count` layers (default 0) have a dense MLP of
      feed_forward_length; every other one `expert_shared_count` shared experts of
      expert_feed_forward_length each (one MLP `ffn_*_shexp`);
    - YaRN (rope.scaling.type "yarn"): llama.cpp leaves cos / sin unscaled for deepseek2 (its
      yarn_attn_factor is mscale(s, mscale) / mscale(s, mscale_all_dim) with mscale taken equal
      to mscale_all_dim, which DeepSeek's own configs have) and scales the softmax by
      mscale(s, mscale_all_dim)^2 / sqrt(N + R), mscale_all_dim being
      rope.scaling.yarn_log_multiplier / 0.1 (the converter writes 0.1 * mscale_all_dim); the
      ramp's ends are rounded (ggml_rope_yarn_corr_dims), as HF's DeepSeek YaRN does."""
    a = "deepseek2."
    src = m.source
    n_layers, n_heads = common["num_layers"], common["num_heads"]
    hidden, ffn = common["hidden_size"], common["intermediate_size"]
    m.number(a + "attention.layer_norm_rms_epsilon")  # required by llama.cpp
    c = m.integer(a + "attention.kv_lora_rank", least=1)
    r = m.integer(a + "rope.dimension_count", least=2)
    if r % 2:
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'rope.dimension_count'!r} is {r}, "
                              f"must be even")
    q_lora = m.integer(a + "attention.q_lora_rank", None, least=0)
    if not q_lora and "blk.0.attn_q_a.weight" in tensors:
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'attention.q_lora_rank'!r} is "
                              f"{'missing' if q_lora is None else 0} (the file has compressed-q "
                              f"tensors 'attn_q_a')")
    q_lora = q_lora or 0
    k_len = m.integer(a + "attention.key_length", hidden // n_heads, least=1)
    v_len = m.integer(a + "attention.value_length", k_len, least=1)
    k_mla = m.integer(a + "attention.key_length_mla", None, least=1)
    v_mla = m.integer(a + "attention.value_length_mla", None, least=1)
    if (k_mla is None) != (v_mla is None):
        have, lacks = ("key", "value") if v_mla is None else ("value", "key")
        raise CheckpointError(f"{src}: GGUF metadata key {a + f'attention.{lacks}_length_mla'!r} "
                              f"is missing (attention.{have}_length_mla is set)")
    if k_mla is not None:  # the converter's split attn_k_b / attn_v_b
        if (k_len, v_len) != (c + r, c):
            raise CheckpointError(
                f"{src}: key_length {k_len} / value_length {v_len} must be kv_lora_rank + "
                f"rope.dimension_count {c + r} / kv_lora_rank {c} (the latent head) when "
                f"key_length_mla is set")
        if common["num_kv_heads"] != 1:
            raise CheckpointError(f"{src}: GGUF metadata key {a + 'attention.head_count_kv'!r} "
                                  f"is {common['num_kv_heads']}, must be 1 (one latent head)")
        qk, v = k_mla, v_mla
    else:  # an older file: attn_kv_b whole, key / value_length the expanded heads'
        qk, v = k_len, v_len
    nope = qk - r
    if nope < 1:
        raise CheckpointError(f"{src}: the q/k head length {qk} leaves no nope dims beside "
                              f"rope.dimension_count {r}")
    dense = m.integer(a + "leading_dense_block_count", 0, least=0)
    if dense > n_layers:
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'leading_dense_block_count'!r} is "
                              f"{dense}, more than block_count {n_layers}")
    if dense and not ffn:
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'feed_forward_length'!r} is "
                              f"missing ({dense} leading dense layers)")
    experts = _deepseek2_experts(m, tensors, hidden, n_layers, dense) if dense < n_layers else {}
    rope_scaling, scale = _deepseek2_yarn(m, common["max_position_embeddings"])
    return ModelConfig(
        family="llama",
        **(common | dict(num_kv_heads=1, head_dim=c + r, intermediate_size=ffn or 0)),
        eos_token_ids=eos,
        rope_theta=m.number(a + "rope.freq_base", 10_000.0),
        rope_scaling=rope_scaling,
        activation="silu",
        kv_lora_rank=c, q_lora_rank=q_lora, qk_nope_head_dim=nope, qk_rope_head_dim=r,
        v_head_dim=v,
        query_pre_attn_scalar=(nope + r) / scale ** 4,  # softmax scale scale^2 / sqrt(N + R)
        dense_layers=tuple(range(dense)) if experts else (),
        **experts,
    )


def _deepseek2_experts(m: _Meta, tensors: dict, hidden: int, n_layers: int,
                       dense: int) -> dict:
    """deepseek2's routing fields, checked against each expert layer's tensors."""
    a = "deepseek2."
    src = m.source
    n = m.integer(a + "expert_count", least=1)
    used = m.integer(a + "expert_used_count", least=1)
    if used > n:
        raise CheckpointError(f"{src}: expert_used_count {used} > expert_count {n}")
    f = m.integer(a + "expert_feed_forward_length", least=1)
    n_shared = m.integer(a + "expert_shared_count", least=0)
    gating = m.integer(a + "expert_gating_func", None)
    if gating is None:
        raise CheckpointError(
            f"{src}: GGUF metadata key {a + 'expert_gating_func'!r} is missing: llama.cpp then "
            f"routes with softmax (DeepSeek-V2 / V2.5 files), which is not supported; only "
            f"DeepSeek-V3's sigmoid gating ({_GATING_SIGMOID}) is")
    if gating != _GATING_SIGMOID:
        raise CheckpointError(
            f"{src}: GGUF metadata key {a + 'expert_gating_func'!r} is {gating} "
            f"({_GATING_FUNCS.get(gating, 'unknown')}); only {_GATING_SIGMOID} (sigmoid, "
            f"DeepSeek-V3's routing) is supported")
    scaling = m.number(a + "expert_weights_scale", 1.0)
    if not scaling > 0:
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'expert_weights_scale'!r} is "
                              f"{scaling}, must be > 0")
    groups = m.integer(a + "expert_group_count", 0, least=0) or 1
    topk_groups = m.integer(a + "expert_group_used_count", least=1) if groups > 1 else 1
    if n % groups or topk_groups > groups:
        raise CheckpointError(f"{src}: expert_group_count {groups} must divide expert_count {n} "
                              f"and expert_group_used_count {topk_groups} be <= it")
    fused = next((k for k in tensors if k.endswith(".ffn_gate_up_exps.weight")), None)
    if fused is not None:
        raise CheckpointError(f"{src}: fused gate/up expert tensors ({fused!r}) are not "
                              f"supported; convert with gate and up apart")
    implied = f"{a}expert_count {n}, embedding_length {hidden}, expert length {f}"
    want = {kind + ".weight": (ne(hidden, f, n), implied) for kind, ne in _EXPERT_NE.items()}
    want["exp_probs_b.bias"] = ([n], implied)
    shared = f * n_shared
    if shared:
        implied = (f"embedding_length {hidden}, expert_shared_count {n_shared} x expert length "
                   f"{f}")
        want |= {kind + ".weight": (ne(hidden, shared), implied)
                 for kind, ne in _SHARED_NE.items() if kind != "ffn_gate_inp_shexp"}
    for i in range(dense, n_layers):
        for kind, (ne, implied_by) in want.items():
            name = f"blk.{i}.{kind}"
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(
                    f"{src}: layer {i} has no expert tensor {name!r} ({a}expert_count {n}, "
                    f"leading_dense_block_count {dense}: every later layer has experts"
                    + (", a choice bias" if kind.startswith("exp_probs_b") else "")
                    + (f", {n_shared} shared" if shared else "") + ")")
            got = [int(x) for x in t.shape]
            if _ggml_shape(got) != _ggml_shape(ne):
                raise CheckpointError(f"{src}: tensor {name!r} has ne {got}, the metadata "
                                      f"implies {ne} ({implied_by})")
    return dict(num_experts=n, experts_per_token=used, moe_intermediate_size=f,
                norm_topk_prob=m.boolean(a + "expert_weights_norm", False),
                shared_expert_size=shared, router_scoring="sigmoid", router_groups=groups,
                router_topk_groups=topk_groups, routed_scaling=scaling)


def _deepseek2_yarn(m: _Meta, n_ctx: int) -> tuple[RopeScaling | None, float]:
    """(rope scaling, the softmax scale's mscale) of a deepseek2 file (see _deepseek2)."""
    a = "deepseek2."
    src = m.source
    factor = _yarn_factor(m, a, (("rope.scaling.yarn_ext_factor", 1.0),
                                 ("rope.scaling.attn_factor", 1.0),
                                 ("rope.scaling.yarn_attn_factor", 1.0)))
    if factor is None:
        return None, 1.0
    log_mul = m.number(a + "rope.scaling.yarn_log_multiplier", None)
    if not log_mul:  # llama.cpp would then also scale cos / sin, unlike HF's DeepSeek YaRN
        raise CheckpointError(
            f"{src}: GGUF metadata key {a + 'rope.scaling.yarn_log_multiplier'!r} is "
            f"{'missing' if log_mul is None else log_mul}: DeepSeek YaRN without "
            f"mscale_all_dim is not supported")
    # the converter wrote 0.1 * mscale_all_dim (f32): back to the decimal it was given
    mscale_all_dim = float(Decimal(repr(log_mul)) * 10)
    scaling = _yarn_scaling(m, a, n_ctx, factor, truncate=True, attention_factor=1.0)
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scaling, mscale


def _per_layer(m: _Meta, key: str, n: int, default=_MISSING) -> list[int]:
    """A key llama.cpp reads with get_key_or_arr: one positive integer for every layer, or a list
    of n of them."""
    v = m.get(key)
    if isinstance(v, list):
        if len(v) != n or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
            raise CheckpointError(f"{m.source}: GGUF metadata key {key!r} must hold {n} positive "
                                  f"integers (one a layer), got {_short(v)}")
        return list(v)
    return [m.integer(key, default, least=1)] * n


def _gemma4(m: _Meta, tensors: dict, common: dict, eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig of a "gemma4" GGUF (Gemma 4's text model), as llama.cpp reads and runs one
    (src/models/gemma4.cpp; convert_hf_to_gguf.py's Gemma4Model):
    - required keys (get_key without a default): attention.layer_norm_rms_epsilon,
      attention.sliding_window, attention.sliding_window_pattern (a bool a layer: sliding),
      attention.key_length_swa / value_length_swa (the sliding layers' head length; key_length /
      value_length the full-attention layers'; key = value length for each, as llama.cpp
      demands), embedding_length_per_layer_input (0: no per-layer inputs);
      attention.head_count_kv and feed_forward_length may be lists, one value a layer (the
      converter writes the two layer types' KV heads, and the doubled MLP of the KV-sharing
      layers with use_double_wide_mlp); attention.shared_kv_layers (default 0): the last layers
      read the KV of layer n_kv - 2 (sliding) or n_kv - 1 (full), n_kv the layers that store
      their own — llama.cpp's reuse rule, which must agree with "the last earlier layer of its
      type" (HF's);
    - rope: NEOX style (q/k rows unpermuted); rope.freq_base the full-attention layers',
      rope.freq_base_swa (default the same) the sliding ones'; rope.dimension_count(_swa) must be
      each type's head length: the full-attention layers' partial ("proportional") rotation is
      the `rope_freqs` tensor the converter writes, a frequency divisor per pair: 1 for the
      first head_dim * partial_rotary_factor / 2 pairs, 1e30 (unrotated) for the rest;
    - the graph: embeddings x sqrt(D), q / k RMS-normed with weights and v without, softmax
      scale 1, sandwich norms, gelu-tanh MLPs; no `attn_v` on a layer (use_alternative_attention)
      means V = K (only the full-attention layers, all of them, are supported so); a router
      `ffn_gate_inp` in a layer means experts beside its MLP (in every layer, or none):
      router input rms_norm(x) / sqrt(D) x `ffn_gate_inp.scale`, softmax, top k renormalised,
      each expert's output x `ffn_down_exps.scale`, experts `ffn_gate_up_exps` (gate rows then
      up rows) or `ffn_gate_exps` + `ffn_up_exps`; `layer_output_scale` (a layer's output
      multiplier), in every layer or none; norm weights stored as their multipliers (the
      converter adds nothing, unlike Gemma 3's)."""
    a = "gemma4."
    src = m.source
    n, hidden, n_heads = common["num_layers"], common["hidden_size"], common["num_heads"]
    m.number(a + "attention.layer_norm_rms_epsilon")  # required by llama.cpp
    window = m.integer(a + "attention.sliding_window", least=1)
    pattern = m.get(a + "attention.sliding_window_pattern")
    if pattern is None:
        raise CheckpointError(f"{src}: GGUF metadata key "
                              f"{a + 'attention.sliding_window_pattern'!r} is missing")
    if isinstance(pattern, bool):
        pattern = [pattern] * n
    if not isinstance(pattern, list) or len(pattern) != n or any(
            not isinstance(x, bool) for x in pattern):
        raise CheckpointError(f"{src}: GGUF metadata key {a + 'attention.sliding_window_pattern'!r}"
                              f" must hold {n} bools (one a layer: sliding), got {_short(pattern)}")
    local = [i for i in range(n) if pattern[i]]
    full = [i for i in range(n) if not pattern[i]]
    g_len = m.integer(a + "attention.key_length", hidden // n_heads, least=1)
    l_len = m.integer(a + "attention.key_length_swa", least=1)
    for key, k_len in (("attention.value_length", g_len), ("attention.value_length_swa", l_len)):
        v_len = m.integer(a + key, g_len if key == "attention.value_length" else _MISSING,
                          least=1)
        if v_len != k_len:
            raise CheckpointError(f"{src}: GGUF metadata key {a + key!r} is {v_len}, must equal "
                                  f"the key length {k_len} (Gemma 4)")
    kv = _per_layer(m, a + "attention.head_count_kv", n, n_heads)
    kv_l, kv_g = {kv[i] for i in local}, {kv[i] for i in full}
    if len(kv_l) > 1 or len(kv_g) > 1:
        raise CheckpointError(f"{src}: attention.head_count_kv {kv}: each layer type must have "
                              f"one count")
    kv_l = kv_l.pop() if local else kv_g.pop()
    kv_g = kv_g.pop() if full else kv_l
    theta = m.number(a + "rope.freq_base", 10_000.0)
    g_rot = m.integer(a + "rope.dimension_count", g_len, least=1)
    l_rot = m.integer(a + "rope.dimension_count_swa", g_rot, least=1)
    if (full and g_rot != g_len) or (local and l_rot != l_len):
        raise CheckpointError(
            f"{src}: rope.dimension_count {g_rot} / rope.dimension_count_swa {l_rot} must be the "
            f"head lengths {g_len} / {l_len} (partial rotation only through rope_freqs)")
    kind = m.string(a + "rope.scaling.type", "none")
    factor = m.number(a + "rope.scaling.factor", 1.0)
    attn_factor = m.number(a + "rope.scaling.attn_factor", 1.0)
    if kind not in ("none", "linear") or factor not in (0.0, 1.0) or attn_factor != 1.0:
        raise CheckpointError(f"{src}: rope scaling {kind!r} (factor {factor}, attn_factor "
                              f"{attn_factor}) is not supported for gemma4")
    scaling = _gemma4_rope_freqs(m, tensors, g_len) if full else None
    shared = m.integer(a + "attention.shared_kv_layers", 0, least=0)
    first = n - shared
    if first < 1:
        raise CheckpointError(f"{src}: attention.shared_kv_layers {shared} leaves no layer of "
                              f"the {n} storing its KV")
    for i in range(first, n):  # llama.cpp's reuse rule vs the last earlier layer of the type
        theirs = first - (2 if pattern[i] else 1)
        ours = next((j for j in range(first - 1, -1, -1) if pattern[j] == pattern[i]), None)
        if theirs != ours:
            raise CheckpointError(
                f"{src}: KV-sharing layer {i} reads layer {theirs} in llama.cpp, not the last "
                f"earlier layer of its type ({ours}); not supported")
    no_v = [i for i in range(first) if f"blk.{i}.attn_v.weight" not in tensors]
    if no_v and no_v != [i for i in full if i < first]:
        raise CheckpointError(f"{src}: layers {no_v} have no attn_v (V = K): only every "
                              f"full-attention layer's may be missing")
    ffn = _per_layer(m, a + "feed_forward_length", n)
    double = any(f != ffn[0] for f in ffn)
    if ffn[:first] != [ffn[0]] * first or ffn[first:] != [ffn[0] * (2 if double else 1)] * shared:
        raise CheckpointError(f"{src}: feed_forward_length {ffn}: the layers must share one "
                              f"length, the KV-sharing ones' doubled or not")
    ple = m.integer(a + "embedding_length_per_layer_input", least=0)
    if ple:
        t = tensors.get("per_layer_token_embd.weight")
        want = [ple * n, common["vocab_size"]]
        if t is None or _ggml_shape([int(x) for x in t.shape]) != want:
            raise CheckpointError(
                f"{src}: embedding_length_per_layer_input {ple} needs a tensor "
                f"'per_layer_token_embd.weight' of ne {want}, "
                + ("missing" if t is None else f"got {[int(x) for x in t.shape]}"))
    scalars = [i for i in range(n) if f"blk.{i}.layer_output_scale.weight" in tensors]
    if scalars and len(scalars) != n:
        raise CheckpointError(f"{src}: layer_output_scale in layers {scalars} only (all or none "
                              f"are supported)")
    routers = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if routers and len(routers) != n:
        raise CheckpointError(f"{src}: experts (ffn_gate_inp) in layers {routers} only (all or "
                              f"none are supported)")
    experts = _gemma4_experts(m, tensors, hidden, n) if routers else {}
    return ModelConfig(
        family="gemma4",
        **(common | dict(head_dim=l_len if local else g_len, num_kv_heads=kv_l,
                         intermediate_size=ffn[0])),
        eos_token_ids=eos,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=m.number(a + "rope.freq_base_swa", theta),
        activation="gelu_tanh",
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
        query_pre_attn_scalar=1.0,
        sliding_window=window,
        layer_types=tuple("local" if s else "global" for s in pattern),
        final_logit_softcap=_opt_float(m.number(a + "final_logit_softcapping", None)),
        global_head_dim=g_len if local and full and g_len != l_len else 0,
        global_kv_heads=kv_g if local and full and kv_g != kv_l else 0,
        global_k_eq_v=bool(no_v),
        v_norm=True,
        kv_shared_layers=shared,
        double_wide_shared_mlp=double,
        per_layer_input_size=ple,
        per_layer_vocab=common["vocab_size"] if ple else 0,
        moe_block=bool(routers),
        layer_scalar=bool(scalars),
        **experts,
    )


def _gemma4_rope_freqs(m: _Meta, tensors: dict, head_dim: int) -> RopeScaling | None:
    """The full-attention layers' proportional rope from `rope_freqs.weight` (see _gemma4)."""
    t = tensors.get("rope_freqs.weight")
    if t is None:
        raise CheckpointError(f"{m.source}: gemma4 needs a 'rope_freqs.weight' tensor (the "
                              f"full-attention layers' rope frequencies)")
    f = np.asarray(_dequantize(t, m.source), np.float64).reshape(-1)
    k = int(np.argmin(f == 1.0)) if not np.all(f == 1.0) else f.size
    if f.size != head_dim // 2 or np.any(f[k:] < 1e29):
        raise CheckpointError(
            f"{m.source}: rope_freqs.weight must hold {head_dim // 2} values, 1 for the rotated "
            f"pairs then 1e30 for the rest; got {f.size} values "
            f"{_short([float(x) for x in f[:8]])}")
    if k == f.size:
        return None
    return RopeScaling(kind="proportional", factor=1.0, partial_rotary_factor=2 * k / head_dim)


def _gemma4_experts(m: _Meta, tensors: dict, hidden: int, n_layers: int) -> dict:
    """Gemma 4's expert fields, checked against every layer's tensors."""
    a = "gemma4."
    src = m.source
    n = m.integer(a + "expert_count", least=1)
    used = m.integer(a + "expert_used_count", least=1)
    f = m.integer(a + "expert_feed_forward_length", least=1)
    implied = f"{a}expert_count {n}, embedding_length {hidden}, expert length {f}"
    for i in range(n_layers):
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in tensors
        want = {"ffn_gate_inp.weight": [hidden, n], "ffn_gate_inp.scale": [hidden],
                "ffn_down_exps.scale": [n], "ffn_down_exps.weight": [f, hidden, n]}
        want |= ({"ffn_gate_up_exps.weight": [hidden, 2 * f, n]} if fused else
                 {"ffn_gate_exps.weight": [hidden, f, n], "ffn_up_exps.weight": [hidden, f, n]})
        for kind, ne in want.items():
            name = f"blk.{i}.{kind}"
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(f"{src}: layer {i} has a router but no {name!r}")
            got = [int(x) for x in t.shape]
            if _ggml_shape(got) != _ggml_shape(ne):
                raise CheckpointError(f"{src}: tensor {name!r} has ne {got}, the metadata "
                                      f"implies {ne} ({implied})")
    return dict(num_experts=n, experts_per_token=used, moe_intermediate_size=f,
                norm_topk_prob=True)


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


def gguf_tensor_plan(cfg: ModelConfig, arch: str, names: frozenset[str] = frozenset()
                     ) -> dict[str, tuple[str, Callable] | list]:
    """GGUF tensor name -> (our param path, transform from the numpy [out, in] layout), or a
    list of them where one tensor holds several params. `names`: the file's tensor names
    (deepseek2: which of its two attention layouts the file has)."""
    if arch == "deepseek2":
        return _deepseek2_plan(cfg, split="blk.0.attn_kv_b.weight" not in names)
    if arch == "gemma4":
        return _gemma4_plan(cfg, names)
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


def _deepseek2_plan(cfg: ModelConfig, split: bool) -> dict[str, tuple[str, Callable] | list]:
    """deepseek2's tensors -> the latent attention's params (runtime/device/mla.py) and the
    routed / shared experts. `split`: `attn_k_b` numpy [H, C, N] and `attn_v_b` numpy [H, V, C]
    (the current converter), else `attn_kv_b` numpy [H * (N + V), C] (HF's kv_b_proj). The rope
    dims of q_b (or q) and kv_a_mqa come interleaved, as in HF's checkpoint, and are reordered
    to evens then odds (see _deepseek2)."""
    d, h, c, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    rope_order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    q_order = np.concatenate([np.arange(n), n + rope_order])
    kv_a_order = np.concatenate([np.arange(c), c + rope_order])
    ident = lambda w: w  # noqa: E731

    def q_out(w):  # numpy [H * (N + R), in] -> [in, H, N + R], rope dims reordered
        return w.T.reshape(w.shape[1], h, n + r)[..., q_order]

    layer = {
        "attn_norm.weight": ("attn_norm", ident),
        "attn_kv_a_mqa.weight": ("wkv_a", lambda w: w.T[:, kv_a_order]),  # [D, C + R]
        "attn_kv_a_norm.weight": ("kv_a_norm", ident),
        "attn_output.weight": ("wo", lambda w: w.T.reshape(h, v, d)),
        "ffn_norm.weight": ("mlp_norm", ident),
    }
    if cfg.q_lora_rank:
        layer |= {"attn_q_a.weight": ("wq_a", lambda w: w.T),
                  "attn_q_a_norm.weight": ("q_a_norm", ident),
                  "attn_q_b.weight": ("wq_b", q_out)}
    else:
        layer["attn_q.weight"] = ("wq", q_out)
    if split:
        layer |= {"attn_k_b.weight": ("w_uk", lambda w: w.transpose(0, 2, 1)),  # [H, N, C]
                  "attn_v_b.weight": ("w_uv", lambda w: w.transpose(0, 2, 1))}  # [H, C, V]
    else:
        layer["attn_kv_b.weight"] = [
            ("w_uk", lambda w: w.reshape(h, n + v, c)[:, :n]),
            ("w_uv", lambda w: w.reshape(h, n + v, c)[:, n:].transpose(0, 2, 1))]
    moe = _EXPERT_PLAN | {"exp_probs_b.bias": ("router_choice_b", ident)}
    if cfg.shared_expert_size:
        moe |= _mlp_plan("_shexp")
    plan = {"token_embd.weight": ("embed", ident), "output_norm.weight": ("final_norm", ident)}
    if not cfg.tie_word_embeddings:
        plan["output.weight"] = ("lm_head", ident)
    for i in range(cfg.num_layers):
        for k, entry in (layer | (moe if cfg.layer_has_experts(i) else _mlp_plan())).items():
            plan[f"blk.{i}.{k}"] = ([(f"layers.{i}.{f}", fn) for f, fn in entry]
                                    if isinstance(entry, list) else (f"layers.{i}.{entry[0]}",
                                                                     entry[1]))
    return plan


def _gemma4_plan(cfg: ModelConfig, names: frozenset[str]
                 ) -> dict[str, tuple[str, Callable] | list]:
    """gemma4's tensors (see _gemma4) -> Gemma 4's params: per layer its type's head length and
    KV heads; the KV-sharing layers have no K / V / k_norm, full-attention layers with V = K no
    V; the experts fused ([E, 2F, D]: gate rows then up rows) or apart ([E, F, D] each)."""
    d, hq, f_e = cfg.hidden_size, cfg.num_heads, cfg.moe_intermediate_size
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    exps = lambda w: w.swapaxes(1, 2)  # noqa: E731  numpy [E, out, in] -> [E, in, out]
    plan = {"token_embd.weight": ("embed", same), "output_norm.weight": ("final_norm", same)}
    if not cfg.tie_word_embeddings:
        plan["output.weight"] = ("lm_head", same)
    if cfg.per_layer_input_size:
        plan |= {"per_layer_token_embd.weight": ("embed_per_layer", same),
                 "per_layer_model_proj.weight": ("ple_model_proj", t),
                 "per_layer_proj_norm.weight": ("ple_proj_norm", same)}
    for i in range(cfg.num_layers):
        dh, hkv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        layer = {
            "attn_norm.weight": ("attn_norm", same),
            "attn_q.weight": ("wq", lambda w, dh=dh: w.T.reshape(-1, hq, dh)),
            "attn_q_norm.weight": ("q_norm", same),
            "attn_output.weight": ("wo", lambda w, dh=dh: w.T.reshape(hq, -1, d)),
            "post_attention_norm.weight": ("post_attn_norm", same),
            "ffn_norm.weight": ("mlp_norm", same),
            "post_ffw_norm.weight": ("post_mlp_norm", same),
            **_mlp_plan(),
        }
        if cfg.layer_scalar:
            layer["layer_output_scale.weight"] = ("scalar", same)
        if cfg.layer_kv_source(i) == i:
            kv = lambda w, dh=dh, hkv=hkv: w.T.reshape(-1, hkv, dh)  # noqa: E731
            layer |= {"attn_k.weight": ("wk", kv), "attn_k_norm.weight": ("k_norm", same)}
            if not cfg.layer_k_eq_v(i):
                layer["attn_v.weight"] = ("wv", kv)
        if cfg.per_layer_input_size:
            layer |= {"inp_gate.weight": ("ple_gate", t), "proj.weight": ("ple_proj", t),
                      "post_norm.weight": ("ple_norm", same)}
        if cfg.moe_block:
            layer |= {
                "ffn_gate_inp.weight": ("router", t),
                "ffn_gate_inp.scale": ("router_scale", same),
                "ffn_down_exps.scale": ("expert_scale", same),
                "ffn_down_exps.weight": ("we_down", exps),
                "post_ffw_norm_1.weight": ("mlp_out_norm", same),
                "pre_ffw_norm_2.weight": ("expert_in_norm", same),
                "post_ffw_norm_2.weight": ("expert_out_norm", same),
            }
            if f"blk.{i}.ffn_gate_up_exps.weight" in names:
                layer["ffn_gate_up_exps.weight"] = [
                    ("we_gate", lambda w: exps(w[:, :f_e])), ("we_up", lambda w: exps(w[:, f_e:]))]
            else:
                layer |= {"ffn_gate_exps.weight": ("we_gate", exps),
                          "ffn_up_exps.weight": ("we_up", exps)}
        for k, entry in layer.items():
            plan[f"blk.{i}.{k}"] = ([(f"layers.{i}.{f}", fn) for f, fn in entry]
                                    if isinstance(entry, list) else (f"layers.{i}.{entry[0]}",
                                                                     entry[1]))
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
    plan = gguf_tensor_plan(cfg, arch, frozenset(t.name for t in reader.tensors))
    # the matmul weights' blocks are decoded once; kept, or widened on the device
    blocks = frozenset(name for name, entry in plan.items()
                       if not isinstance(entry, list) and weight_name(entry[0])
                       in WEIGHT_REDUCE_AXES)
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
