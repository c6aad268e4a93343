"""Model shape (ModelConfig), runtime switches (EngineConfig) and the speculative decoding option
(SpecConfig), with the allowed values of each option.

ModelConfig describes an architecture and nothing else; it is frozen and hashable so it can be a
static argument of jitted functions. EngineConfig holds what the runtime decides (slots, pages,
dtypes, attention backend). The two never mix. Checkpoints translate their own configs into
ModelConfig (an HF `config.json`: checkpoints/hf_config.py).

`ENGINE_OPTIONS` is the one table of engine options (name, type, default, range or choices,
nullable, help, flag): EngineConfig's fields and their checks derive from it (`config_class`),
plus the few rules over several options (`ENGINE_RULES`); so do the command line's flags and
help (serve/engine_args.py). A new option is one row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, make_dataclass
from typing import Any

# Allowed values of the quantization options (runtime/device/quantization.py implements them); kept
# here, JAX-free, so the CLI and the request door check options without importing JAX.
FORMATS = ("int8", "fp8", "int4")  # what weights can be quantized to as they load
# EngineConfig.quantization: None = the weights as the checkpoint stores them (on TPU/GPU a
# GGUF's block formats stay quantized, recorded as "gguf", and a 4-bit HF checkpoint's stay
# int4; on CPU too when its kernels load, else both are dequantized:
# quantization.keeps_gguf_blocks); a FORMAT ("int4" on a
# 4-bit HF checkpoint keeps its weights on any platform); "gguf" = keep a GGUF's blocks on any
# platform; "mxfp4" = keep an HF checkpoint's MXFP4 experts (gpt-oss; None keeps them too, on
# every platform: exact as int8 values x group scales); "dequantize" = every weight in the
# compute dtype.
QUANTIZATIONS = (None, *FORMATS, "gguf", "mxfp4", "dequantize")
MODES = ("w8a8", "weight_only")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # runtime/device/kv_cache.py KV_QUANT
WEIGHT_LAYOUTS = ("auto", "as_loaded", "output_major")  # runtime/device/weight_layout.py
TASKS = ("auto", "generate", "embed")  # runtime/embedding.py


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be served."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (`rope_type: llama3`), linear scaling, or
    YaRN (`rope_type: yarn`: interpolated low frequencies, extrapolated high ones, a linear ramp
    between the dims rotating beta_fast and beta_slow times over the original context, and
    cos / sin scaled by `attention_factor`)."""

    kind: str  # "llama3" | "linear" | "yarn" | "proportional"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dims
    attention_factor: float | None = None  # yarn: None = 0.1 * ln(factor) + 1
    # proportional (Gemma 4's global layers): the first partial_rotary_factor of the head's
    # frequencies (spaced over the whole head_dim) rotate, the rest stay put; all / factor
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.kind not in ("llama3", "linear", "yarn", "proportional"):
            raise ConfigError(f"unsupported rope_scaling type {self.kind!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"rope_scaling factor must be > 0, got {self.factor}")
        if not 0 <= self.partial_rotary_factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in [0, 1], got "
                              f"{self.partial_rotary_factor}")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # multimodal RoPE (Qwen3-VL): frequencies j < 3 * s[1] with j % 3 == 1 turn with a token's
    # height position, j < 3 * s[2] with j % 3 == 2 with its width, the rest with its temporal
    # one (the positions of text tokens are all alike: plain RoPE); () off
    mrope_section: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    # Gemma 3 features (defaults are the Llama family's behaviour)
    qk_norm: bool = False
    sandwich_norms: bool = False  # post-attention and post-FFW norms
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None  # softmax scale = scalar**-0.5 (else head_dim)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "global" | "local" (empty: all global)
    rope_local_theta: float | None = None
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    # mixture of experts in every layer (0 experts: a dense MLP); runtime/device/moe.py
    num_experts: int = 0
    experts_per_token: int = 0  # top-k of the router's softmax
    moe_intermediate_size: int = 0  # each expert's F
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum 1
    # an always-on shared expert beside the routed ones (Qwen2-MoE): a gated MLP of this F in
    # w_gate / w_up / w_down, its output scaled by sigmoid(h . shared_gate) when gated
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead
    # gpt-oss: a learned logit per q head joins every softmax (LayerParams.sinks, its value 0);
    # a bias on the o projection (bo); the router's bias; every expert's biases; the experts'
    # clamped GLU: (clip(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
    attn_sinks: bool = False
    attn_out_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # DeepSeek-V3 routing: sigmoid scores, the experts chosen by score + a per-expert bias
    # (LayerParams.router_choice_b) among the best `router_topk_groups` of `router_groups`
    # groups (a group's worth: its two best), weighted by their unbiased scores (renormalised
    # if norm_topk_prob) x routed_scaling
    router_scoring: str = "softmax"  # "softmax" | "sigmoid"
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling: float = 1.0
    # multi-head latent attention (DeepSeek-V3; runtime/device/mla.py) when kv_lora_rank > 0:
    # per token the cache keeps one "head" of kv_lora_rank latent + qk_rope_head_dim rotated
    # dims (num_kv_heads 1, head_dim their sum) that is both its K and its V
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q projected directly
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Gemma 4 (defaults: every layer alike): global layers' own head_dim / KV heads (0: as the
    # local ones); on global layers V comes from the K projection (no wv); V RMS-normed without
    # a weight; the last kv_shared_layers layers read the KV of the last earlier layer of their
    # type and store none (their MLP twice as wide with double_wide_shared_mlp); per-layer input
    # embeddings of per_layer_input_size (a [per_layer_vocab, L * P] table + a projection of the
    # embedding); experts beside the dense MLP (moe_block: the router reads the RMS-normed
    # residual x router_scale / sqrt(D), its weights x a per-expert scale); a learned scalar
    # on each layer's output
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_k_eq_v: bool = False
    v_norm: bool = False
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    moe_block: bool = False
    layer_scalar: bool = False
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""  # the checkpoint's own name, for messages
    # numerics, set by the engine (EngineConfig.batch_invariant), never by a checkpoint: every
    # row-local computation in fixed blocks of rows, attention one query row at a time
    # (runtime/device/model.py `by_rows`)
    batch_invariant: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        if self.num_experts and not (1 <= self.experts_per_token <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ConfigError(f"{self.num_experts} experts need 1 <= experts_per_token "
                              f"({self.experts_per_token}) <= num_experts and "
                              f"moe_intermediate_size > 0 ({self.moe_intermediate_size})")
        if self.shared_expert_size < 0:
            raise ConfigError(f"shared_expert_size {self.shared_expert_size} must be >= 0")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"router_scoring {self.router_scoring!r}: softmax or sigmoid")
        if self.num_experts and (self.router_groups < 1 or self.num_experts % self.router_groups
                                 or not 1 <= self.router_topk_groups <= self.router_groups):
            raise ConfigError(f"{self.num_experts} experts in {self.router_groups} groups, "
                              f"the best {self.router_topk_groups} kept: groups must divide the "
                              f"experts and 1 <= topk_group <= n_group")
        if self.kv_lora_rank and (self.num_kv_heads != 1 or self.head_dim != self.kv_lora_rank
                                  + self.qk_rope_head_dim or min(
                                      self.qk_nope_head_dim, self.qk_rope_head_dim,
                                      self.v_head_dim) < 1 or self.qk_rope_head_dim % 2):
            raise ConfigError(
                f"latent attention needs num_kv_heads 1, head_dim = kv_lora_rank + "
                f"qk_rope_head_dim, positive even qk_rope_head_dim and positive nope / v dims; "
                f"got kv_lora_rank {self.kv_lora_rank}, qk_rope_head_dim "
                f"{self.qk_rope_head_dim}, qk_nope_head_dim {self.qk_nope_head_dim}, "
                f"v_head_dim {self.v_head_dim}")
        if not 0 <= self.kv_shared_layers < self.num_layers or any(
                self.layer_kv_source(i) is None for i in range(self.num_layers)):
            raise ConfigError(f"kv_shared_layers {self.kv_shared_layers}: each of the last layers "
                              f"needs an earlier layer of its type among the first "
                              f"{self.num_layers - self.kv_shared_layers}")
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of global_kv_heads "
                              f"{self.global_kv_heads}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ConfigError(f"swiglu_limit {self.swiglu_limit} must be > 0")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ConfigError(f"dense_layers {list(self.dense_layers)} outside the "
                              f"{self.num_layers} layers")

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates (latent attention: the decoupled rope part only)."""
        return self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_has_experts(self, i: int) -> bool:
        return bool(self.num_experts) and i not in self.dense_layers

    def layer_is_local(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "local"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_is_local(i) else None

    def layer_head_dim(self, i: int) -> int:
        return self.global_head_dim if self.global_head_dim and not self.layer_is_local(i) \
            else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.global_kv_heads if self.global_kv_heads and not self.layer_is_local(i) \
            else self.num_kv_heads

    def layer_k_eq_v(self, i: int) -> bool:
        return self.global_k_eq_v and not self.layer_is_local(i)

    def layer_kv_source(self, i: int) -> int | None:
        """The layer whose KV pages layer i reads: itself, or (the last kv_shared_layers) the
        last earlier layer of its type that stores its own (None: there is none)."""
        first = self.num_layers - self.kv_shared_layers
        if i < first:
            return i
        kind = self.layer_is_local(i)
        return next((j for j in range(first - 1, -1, -1) if self.layer_is_local(j) == kind), None)

    def layer_intermediate(self, i: int) -> int:
        wide = self.double_wide_shared_mlp and self.layer_kv_source(i) != i
        return self.intermediate_size * (2 if wide else 1)

    def layer_rope_theta(self, i: int) -> float:
        if self.layer_is_local(i) and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, i: int) -> RopeScaling | None:
        """Local layers with their own theta (Gemma 3) rotate unscaled; one rotary for every
        layer (gpt-oss, Mistral) scales them all."""
        if self.layer_is_local(i) and self.rope_local_theta is not None:
            return None
        return self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in _TUPLE_FIELDS:  # JSON lists
            d[name] = list(d[name])
        d.pop("batch_invariant")  # the engine's mode, not the model's
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for name in _TUPLE_FIELDS:
            d[name] = tuple(d.get(name) or ())
        return cls(**d)


# ModelConfig's tuple fields (layer_types, eos_token_ids, ...): lists in its JSON form
_TUPLE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                      if isinstance(f.default, tuple))


# ---- latency targets (runtime/host/admission.py) ----
STARVE_FACTOR = 5.0  # max wait = this x the TTFT budget
DEFAULT_MAX_WAIT_S = 30.0  # ... without one


@dataclass(frozen=True)
class SloConfig:
    """Latency targets of the scheduler's admission (runtime/host/admission.py); seconds."""

    itl_s: float | None = None  # decode steps' time budget
    ttft_s: float | None = None  # time-to-first-token budget
    refuse_late: bool = False  # refuse requests predicted to miss ttft_s
    max_wait_s: float | None = None  # starvation bound (None: STARVE_FACTOR x ttft_s or default)

    def __post_init__(self):
        for name in ("itl_s", "ttft_s", "max_wait_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.refuse_late and self.ttft_s is None:
            raise ValueError("refusing late requests needs a TTFT budget")

    @property
    def active(self) -> bool:
        return self.itl_s is not None or self.ttft_s is not None

    @property
    def starve_s(self) -> float:
        if self.max_wait_s is not None:
            return self.max_wait_s
        return STARVE_FACTOR * self.ttft_s if self.ttft_s is not None else DEFAULT_MAX_WAIT_S


ATTENTION_BACKENDS = (None, "xla", "pallas", "pallas_interpret")
COMPUTE_DTYPES = ("float32", "bfloat16")
# Smallest token-row bucket of a step, by platform. TPU/GPU: 16, one row tile (a bf16 TPU
# sublane tile, a GPU MMA tile), so rows below it cost nothing and steps of 1-16 rows share one
# program (vLLM's TPU runner pads to 16 as well). CPU: 1; every padded row costs a matmul row there.
MIN_TOKEN_BUCKET = {"cpu": 1, "tpu": 16, "gpu": 16}


SPEC_METHODS = ("draft", "ngram")
COMPILE_MODES = ("background", "blocking")  # runtime/device/programs.py
# what Engine.update_weights does with unfinished requests (runtime/weights.py)
UPDATE_POLICIES = ("drain", "abort")


@dataclass(frozen=True)
class SpecConfig:
    method: str
    k: int = 4
    n: int = 3  # n-gram: longest suffix tried
    model: str | None = None  # draft: a path or name load_model understands
    quantization: str | None = None  # draft weights: None | one of FORMATS


# ---- engine options: one table -----------------------------------------------------------------
class OptionError(ValueError):
    """An engine option's value (or combination of values) that cannot run. `option` names it,
    `reason` says why; the message is built from the two."""

    def __init__(self, option: str, reason: str):
        super().__init__(f"{option} {reason}")
        self.option, self.reason = option, reason

    def __reduce__(self):  # crosses processes (Ray replicas) whole
        return type(self), (self.option, self.reason)


@dataclass(frozen=True)
class Option:
    """One engine option: an EngineConfig field, its check, its command-line flag and help
    (serve/engine_args.py derives the flag's style from the row)."""

    name: str
    type: type  # bool | int | float | str (with choices) | a type `parse` returns
    default: object
    lo: float | None = None  # smallest value of an int / float
    lo_open: bool = False  # > lo instead of >= lo
    choices: tuple = ()  # the values of a str option (and None when nullable)
    nullable: bool = False  # None is a value of its own (help says what it means)
    parse: Callable[[Any], Any] | None = None  # checks and converts instead of type / range
    flag: str | None = ""  # "": --name-with-dashes (--no-name: default-True switch); None: none
    cli: str = ""  # "": by type | "pair": --x / --no-x, either or neither | "json": a JSON value
    help: str = ""

    @property
    def annotation(self):
        return self.type | None if self.nullable else self.type

    def check(self, v):
        """The value, checked and normalized; OptionError naming the option otherwise."""
        if v is None:
            if self.nullable:
                return None
            raise OptionError(self.name, "must not be None")
        if self.parse is not None:
            return self.parse(v)
        if self.choices:
            if isinstance(v, str) and v in self.choices:
                return v
            shown = (None, *self.choices) if self.nullable else self.choices
            raise OptionError(self.name, f"must be one of {shown}, got {v!r}")
        if self.type is bool:
            if not isinstance(v, bool):
                allowed = "True, False or None" if self.nullable else "True or False"
                raise OptionError(self.name, f"must be {allowed}, got {v!r}")
            return v
        if self.type is str:
            if not isinstance(v, str):
                raise OptionError(self.name, f"must be a string, got {v!r}")
            return v
        if self.type is int:
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise OptionError(self.name, f"must be an integer, got {v!r}")
            v = int(v)
        else:  # float
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
                raise OptionError(self.name, f"must be a finite number, got {v!r}")
            v = float(v)
        if self.lo is not None and (v < self.lo or self.lo_open and v == self.lo):
            raise OptionError(self.name, f"must be {'>' if self.lo_open else '>='} {self.lo}, "
                                         f"got {v}")
        return v


def _parse_speculative(d: dict | SpecConfig) -> SpecConfig:
    """The `speculative=` option as a SpecConfig; OptionError naming what is wrong."""
    if isinstance(d, SpecConfig):
        return d
    if not isinstance(d, dict):
        raise OptionError("speculative",
                          f"must be a dict like {{'method': 'ngram', 'k': 4}}, got {d!r}")
    allowed = {"method", "k", "n", "model", "quantization"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise OptionError("speculative",
                          f"has unknown option(s) {unknown}; valid: {sorted(allowed)}")
    method = d.get("method")
    if method not in SPEC_METHODS:
        raise OptionError("speculative", f"method must be one of {SPEC_METHODS}, got {method!r}")
    k = d.get("k", 4)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise OptionError("speculative", f"k must be an integer >= 1, got {k!r}")
    n = d.get("n", 3)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise OptionError("speculative", f"n must be an integer >= 1, got {n!r}")
    model = d.get("model")
    if method == "draft" and not model:
        raise OptionError("speculative", "method 'draft' needs 'model': a path or model name")
    if method == "ngram" and model is not None:
        raise OptionError("speculative", "method 'ngram' takes no 'model'")
    q = d.get("quantization")
    if q is not None and q not in FORMATS:
        raise OptionError("speculative",
                          f"quantization must be None or one of {FORMATS}, got {q!r}")
    return SpecConfig(method=method, k=k, n=n, model=None if model is None else str(model),
                      quantization=q)


ENGINE_OPTIONS = (
    Option("dtype", str, "float32", choices=COMPUTE_DTYPES,
           help="activation / weight compute dtype"),
    Option("quantization", str, None, choices=QUANTIZATIONS[1:], nullable=True,
           help="int8 / fp8 / int4: quantize weights as they load (per-channel scales); gguf: "
                "keep a GGUF file's quantized blocks; dequantize: every weight in the compute "
                "dtype (default: the weights as the checkpoint stores them; on TPU/GPU a GGUF's "
                "blocks and a 4-bit checkpoint's int4 stay quantized)"),
    Option("quant_mode", str, None, choices=MODES, nullable=True,
           help="how quantized weights run: w8a8 (int8 weights and activations) or weight_only "
                "(default: by platform and format)"),
    Option("quantize_embeddings", bool, True,
           help="quantize embed / lm_head with the layer weights (else they stay in the "
                "compute dtype)"),
    Option("kv_cache_dtype", str, "auto", choices=KV_CACHE_DTYPES,
           help="KV pages: auto = the compute dtype; int8 or fp8 (e4m3) = per-token-per-head "
                "scales"),
    Option("max_slots", int, 8, lo=1, help="sequences the engine runs at once"),
    Option("logprobs_mode", str, "raw_logprobs", choices=("raw_logprobs", "processed_logprobs"),
           help="logprobs of the model's own distribution, or of the one sampled from (after "
                "penalties, logit_bias, bans and structured-output masks; before temperature "
                "and top-k/p)"),
    Option("page_size", int, 16, lo=1, help="tokens per KV page"),
    Option("num_pages", int, None, lo=2, nullable=True,
           help="KV pages in the pool, the null page 0 included (default: enough for every "
                "slot at max_model_len)"),
    Option("max_model_len", int, 2048, lo=1,
           help="longest prompt + output a sequence may reach (default: the model's context, "
                "at most 2048)"),
    Option("attention_backend", str, None, choices=ATTENTION_BACKENDS[1:], nullable=True,
           help="attention implementation (default: pallas on TPU/GPU, xla on CPU; "
                "pallas_interpret: the kernels in interpret mode, for tests)"),
    Option("prefill_chunk", int, 256, lo=1,
           help="prompt tokens a step takes at most (longer prompts prefill in chunks)"),
    Option("min_token_bucket", int, None, lo=1, nullable=True,
           help="smallest token-row bucket a step pads to (default: env "
                "JAXINFER_MIN_TOKEN_BUCKET, else 16 on TPU/GPU, 1 on CPU)"),
    Option("min_page_bucket", int, None, lo=1, nullable=True,
           help="narrowest page table a step pads to, in pages; wider ones x4 up to every page "
                "(default: env JAXINFER_MIN_PAGE_BUCKET, else every page with the XLA attention "
                "path, which reads only the pages sequences fill; 1 with the Pallas kernels, "
                "which walk the table)"),
    Option("enable_prefix_caching", bool, True, flag="--no-prefix-caching",
           help="share KV pages of common full-page prompt prefixes"),
    Option("kv_host_cache_gb", float, 0.0, lo=0,
           help="GiB of host memory for the prefix cache's second tier: pages the device "
                "evicts are copied there and copied back on a hit (0: off)"),
    Option("limit_mm_per_prompt", int, 4, lo=0,
           help="images a prompt may carry at most (vision models)"),
    Option("mm_cache_gb", float, 0.25, lo=0,
           help="GiB of host memory for the encoder cache: an image's encoder output, kept by "
                "its content digest, so the same image again does not run the encoder"),
    Option("max_image_pixels", int, 40_000_000, lo=1,
           help="largest image (width x height) a request may send; larger ones are refused "
                "before their pixels are decoded (a decompression bomb)"),
    Option("compiled_dir", str, None, nullable=True,
           help="programs compiled ahead by `jaxinfer compile` (runtime/compiled.py), installed "
                "into the compilation cache at start when built for this host; 'auto': the "
                "checkpoint's own (<dir>/compiled or <file>.compiled) when there. Native code: "
                "only from sources you trust (None: none)"),
    Option("mmproj", str, None, nullable=True,
           help="llama.cpp mmproj GGUF with the vision tower of a GGUF text model (Gemma 3)"),
    Option("speculative", SpecConfig, None, nullable=True, parse=_parse_speculative, cli="json",
           help='speculative decoding, e.g. {"method": "ngram", "k": 4, "n": 3} or '
                '{"method": "draft", "model": "PATH", "k": 4}'),
    Option("tensor_parallel", int, 1, lo=1,
           help="devices params and KV cache split over (several hosts: all devices; 1: one "
                "device); default: on CPU, the host's cores where the model's heads split evenly "
                "and it is wide enough to gain (runtime/device/host_devices.py)"),
    Option("weight_layout", str, "auto", choices=WEIGHT_LAYOUTS,
           help="how dense layer weights are stored: auto = output axes first on CPU (faster "
                "small matmuls there), as loaded elsewhere"),
    Option("fuse_projections", bool, None, nullable=True,
           help="Q/K/V and gate/up as one weight each, split after the product (default: yes, "
                "except with CPU's output-major layer weights, where batch-1 decode measured "
                "slower fused)"),
    Option("async_scheduling", bool, True,
           help="plan and launch step n+1 while step n runs (off, with speculative decoding or "
                "on several hosts: each step waits for the previous step's tokens)"),
    Option("task", str, "auto", choices=TASKS,
           help="what start-up prepares for: embed = warm-up compiles the embedding programs "
                "(LLM.embed, POST /v1/embeddings) instead of the generation steps; auto = embed "
                "for an embedding checkpoint (architectures like Qwen3Model / LlamaModel, or a "
                "sentence-transformers modules.json), else generate; both serve either"),
    Option("warmup", bool, False, cli="pair",
           help="compile every step shape before the first request (the command line's default: "
                "on for `serve`, off for one-off commands; the compilation cache makes later "
                "starts load them)"),
    Option("compile_mode", str, None, choices=COMPILE_MODES, nullable=True,
           help="background = a step whose program is not compiled yet runs layer by layer on "
                "small programs (compiled in well under a second) while its own program compiles "
                "in a background thread, and warm-up queues every program there (the server "
                "listens at once); blocking = each new step shape waits for its program "
                "(default: env JAXINFER_COMPILE_MODE, else background)"),
    Option("batch_invariant", bool, False,
           help="a request's logits and logprobs are bitwise the same whatever else is in the "
                "step (batch size, its slot, buckets, chunked prefill, prefix hits, preemption): "
                "row-local math in fixed blocks of rows, attention a row at a time (slower; RL "
                "rollouts whose logprobs must equal the trainer's)"),
    Option("enable_lora", bool, False, help="serve LoRA adapters (implied by --lora-modules)"),
    Option("max_loras", int, 4, lo=1, help="LoRA adapters on the device at once"),
    Option("max_lora_rank", int, 16, lo=1, help="largest LoRA adapter rank served"),
    Option("max_cpu_loras", int, None, lo=1, nullable=True,
           help="LoRA adapters kept in host memory, least recently used out (default: all)"),
    Option("itl_slo_ms", float, None, lo=0, lo_open=True, nullable=True,
           help="inter-token latency budget: steps with decodes carry only as many tokens as the "
                "measured step times fit (admissions and prefill chunks shrink)"),
    Option("ttft_slo_ms", float, None, lo=0, lo_open=True, nullable=True,
           help="time-to-first-token budget: waiting requests go by priority, on-time ones before "
                f"late ones (none waits past {STARVE_FACTOR:g}x the budget)"),
    Option("refuse_late", bool, False,
           help="with ttft_slo_ms: refuse requests predicted to miss it (HTTP 429 / gRPC "
                "RESOURCE_EXHAUSTED with a retry hint) instead of queueing them"),
    Option("distributed", bool, False,
           help="join a multi-host job before loading (jax.distributed.initialize; env "
                "JAXINFER_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID or auto-detected on "
                "TPU pods); process 0 serves, the others follow its steps"),
)

# Rules over several options: (the option at fault, holds(config), reason formatted with c=config)
ENGINE_RULES = (
    ("refuse_late", lambda c: not c.refuse_late or c.ttft_slo_ms is not None,
     "needs ttft_slo_ms (the budget requests are refused against)"),
    ("max_cpu_loras", lambda c: c.max_cpu_loras is None or c.max_cpu_loras >= c.max_loras,
     "must be >= max_loras ({c.max_loras}), got {c.max_cpu_loras}"),
    ("batch_invariant", lambda c: not c.batch_invariant or c.speculative is None
     or c.speculative.method == "ngram",
     "speculates with n-gram proposals only (a draft model's rejection sampling emits other "
     "tokens than the plain sampler would; n-gram proposals accepted while they equal its "
     "draws change no token)"),
    ("batch_invariant", lambda c: not c.batch_invariant or c.tensor_parallel in (None, 1, 2)
     or not c.enable_lora,
     "with LoRA adapters runs on one or two devices (an adapter's products over a split axis "
     "are summed by XLA's all-reduce, whose order more than two devices may change)"),
)


def checked_dataclass(name: str, fields, check: Callable, rules, error: type, *, bases=(),
                      finish: Callable | None = None) -> type:
    """A frozen dataclass of `fields` [(name, annotation, default)] whose construction checks
    every field (`check(name, value)` -> the value to keep), then every rule (field at fault,
    holds(obj), reason formatted with c=obj; `error(field, reason)` when one fails), then runs
    `finish(obj)` (normal forms). The engine options and the request door's sampling fields are
    both tables made into classes this way."""

    def __post_init__(self):
        for n, _, _ in fields:
            object.__setattr__(self, n, check(n, getattr(self, n)))
        for n, holds, reason in rules:
            if not holds(self):
                raise error(n, reason.format(c=self))
        if finish is not None:
            finish(self)

    return make_dataclass(name, [(n, a, dataclasses.field(default=d)) for n, a, d in fields],
                          bases=bases, frozen=True, namespace={"__post_init__": __post_init__})


def config_class(name: str, options=ENGINE_OPTIONS, rules=ENGINE_RULES, bases=()) -> type:
    """A frozen dataclass with one field per option (table order, the option's default) whose
    construction checks every field (Option.check), then every rule."""
    rows = {o.name: o for o in options}
    return checked_dataclass(name, [(o.name, o.annotation, o.default) for o in options],
                             lambda n, v: rows[n].check(v), rules, OptionError, bases=bases)


class _EngineConfigViews:
    @property
    def slo(self) -> SloConfig:
        ms = lambda v: None if v is None else v / 1e3  # noqa: E731
        return SloConfig(itl_s=ms(self.itl_slo_ms), ttft_s=ms(self.ttft_slo_ms),
                         refuse_late=self.refuse_late)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def total_pages(self) -> int:
        """Pool size including the null page 0."""
        if self.num_pages is not None:
            return self.num_pages
        return 1 + self.max_slots * self.pages_per_seq


EngineConfig = config_class("EngineConfig", bases=(_EngineConfigViews,))
EngineConfig.__module__ = __name__
EngineConfig.__doc__ = (
    "Runtime switches: one field per ENGINE_OPTIONS row, checked on construction "
    "(OptionError names the option). `LLM(...)` keyword arguments mirror these field names.\n\n"
    + "\n".join(f"    {o.name} = {o.default!r}: {o.help}" for o in ENGINE_OPTIONS))
