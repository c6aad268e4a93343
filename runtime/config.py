"""Model shape (ModelConfig), runtime switches (EngineConfig) and the speculative decoding option
(SpecConfig), with the allowed values of each option.

ModelConfig describes an architecture and nothing else; it is frozen and hashable so it can be a
static argument of jitted functions. EngineConfig holds what the runtime decides (slots, pages,
dtypes, attention backend). The two never mix. Checkpoints translate their own configs into
ModelConfig (an HF `config.json`: checkpoints/hf_config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Allowed values of the quantization options (runtime/device/quantization.py implements them); kept
# here, JAX-free, so the CLI and the request door check options without importing JAX.
FORMATS = ("int8", "fp8", "int4")  # what weights can be quantized to as they load
# EngineConfig.quantization: None = the weights as the checkpoint stores them (on TPU/GPU a
# GGUF's block formats stay quantized, recorded as "gguf", and a 4-bit HF checkpoint's stay
# int4; on CPU both are dequantized: quantization.keeps_gguf_blocks); a FORMAT ("int4" on a
# 4-bit HF checkpoint keeps its weights on any platform); "gguf" = keep a GGUF's blocks on any
# platform; "dequantize" = every weight in the compute dtype.
QUANTIZATIONS = (None, *FORMATS, "gguf", "dequantize")
MODES = ("w8a8", "weight_only")
KV_CACHE_DTYPES = ("auto", "int8")
WEIGHT_LAYOUTS = ("auto", "as_loaded", "output_major")  # runtime/device/weight_layout.py


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be served."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (`rope_type: llama3`) or linear scaling."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""  # the checkpoint's own name, for messages

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
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ConfigError(f"dense_layers {list(self.dense_layers)} outside the "
                              f"{self.num_layers} layers")

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_has_experts(self, i: int) -> bool:
        return bool(self.num_experts) and i not in self.dense_layers

    def layer_is_local(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "local"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_is_local(i) else None

    def layer_rope_theta(self, i: int) -> float:
        if self.layer_is_local(i) and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, i: int) -> RopeScaling | None:
        return None if self.layer_is_local(i) else self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["dense_layers"] = tuple(d.get("dense_layers") or ())
        return cls(**d)


# ---- latency targets (runtime/host/slo.py) ----
STARVE_FACTOR = 5.0  # max wait = this x the TTFT budget
DEFAULT_MAX_WAIT_S = 30.0  # ... without one


@dataclass(frozen=True)
class SloConfig:
    """Latency targets of the scheduler's admission (runtime/host/slo.py); seconds."""

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


@dataclass(frozen=True)
class SpecConfig:
    method: str
    k: int = 4
    n: int = 3  # n-gram: longest suffix tried
    model: str | None = None  # draft: a path or name load_model understands
    quantization: str | None = None  # draft weights: None | one of FORMATS


def _parse_speculative(d: dict | SpecConfig | None) -> SpecConfig | None:
    """The `speculative=` option as a SpecConfig; clear errors for anything wrong."""
    if d is None or isinstance(d, SpecConfig):
        return d
    if not isinstance(d, dict):
        raise ValueError(f"speculative must be a dict like {{'method': 'ngram', 'k': 4}}, got {d!r}")
    allowed = {"method", "k", "n", "model", "quantization"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"unknown speculative option(s) {unknown}; valid: {sorted(allowed)}")
    method = d.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {method!r}")
    k = d.get("k", 4)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative k must be an integer >= 1, got {k!r}")
    n = d.get("n", 3)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"speculative n must be an integer >= 1, got {n!r}")
    model = d.get("model")
    if method == "draft" and not model:
        raise ValueError("speculative method 'draft' needs 'model': a path or model name")
    if method == "ngram" and model is not None:
        raise ValueError("speculative method 'ngram' takes no 'model'")
    q = d.get("quantization")
    if q is not None and q not in FORMATS:
        raise ValueError(f"speculative quantization must be None or one of {FORMATS}, got {q!r}")
    return SpecConfig(method=method, k=k, n=n, model=None if model is None else str(model),
                      quantization=q)


@dataclass(frozen=True)
class EngineConfig:
    """Runtime switches. `LLM(...)` keyword arguments mirror these field names."""

    dtype: str = "float32"  # activation/weight compute dtype: float32 | bfloat16
    quantization: str | None = None  # one of QUANTIZATIONS
    quant_mode: str | None = None  # None = by platform | "w8a8" (int8 only) | "weight_only"
    quantize_embeddings: bool = True  # False keeps embed / lm_head in the compute dtype
    kv_cache_dtype: str = "auto"  # "auto" = the compute dtype | "int8" (per-token-head scales)
    max_slots: int = 8
    page_size: int = 16
    num_pages: int | None = None  # None: enough for every slot at max_model_len
    max_model_len: int = 2048  # longest prompt + output a sequence may reach
    attention_backend: str | None = None  # None = by platform
    prefill_chunk: int = 256  # per-step prompt token budget
    # a step's token rows are padded to a power-of-two bucket from this one up. None: the
    # platform's (MIN_TOKEN_BUCKET; env JAXINFER_MIN_TOKEN_BUCKET overrides it)
    min_token_bucket: int | None = None
    # a step's page-table width (pages per sequence) is padded to a power-of-4 bucket from this
    # one up (capped at pages_per_seq). None: env JAXINFER_MIN_PAGE_BUCKET, else one width
    # (pages_per_seq) with the XLA attention path, 1 with the Pallas kernels
    min_page_bucket: int | None = None
    enable_prefix_caching: bool = True  # share KV pages of common full-page prompt prefixes
    # a dict like {"method": "ngram", "k": 4} is parsed into a SpecConfig on construction
    speculative: SpecConfig | None = None
    # devices the model splits over; LLM on CPU picks one per host core where that gains, unless
    # given (runtime/device/host_devices.py)
    tensor_parallel: int = 1
    # how dense layer weights are stored: "auto" (output axes first on CPU, where it makes the
    # matmuls of a few rows up to 1.5x faster; as loaded elsewhere) | "as_loaded" |
    # "output_major" (runtime/device/weight_layout.py)
    weight_layout: str = "auto"
    # Q/K/V and gate/up as one weight each, split after the product (runtime/device/fused_projections.py);
    # None: fused unless the layer weights are stored output-major (CPU), where Gemma 3 270M
    # batch-1 decode measured 4 % slower fused and batch 16 the same
    fuse_projections: bool | None = None
    # plan and launch step n+1 while step n runs (decode inputs fed on the device); off, or
    # with speculative decoding or several hosts, every step waits for the previous one's tokens
    async_scheduling: bool = True
    # compile every step shape at construction (Engine.warmup; the persistent compilation cache
    # makes later starts load them), so no request waits on a compile
    warmup: bool = False
    # LoRA adapters (runtime/device/lora.py): max_loras device slots of rank <= max_lora_rank; up to
    # max_cpu_loras adapters (None: unbounded) stay read on the host, least recently used out
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # latency targets (runtime/host/slo.py): steps with decodes fit itl_slo_ms by the measured step
    # times; waiting requests go by priority, on-time before late for ttft_slo_ms; refuse_late
    # refuses requests predicted to miss ttft_slo_ms instead of queueing them
    itl_slo_ms: float | None = None
    ttft_slo_ms: float | None = None
    refuse_late: bool = False
    # join a multi-host job before loading (runtime/device/distributed.py): process 0 serves,
    # the others follow its steps
    distributed: bool = False

    def __post_init__(self):
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("max_slots", "page_size", "max_model_len", "prefill_chunk", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fuse_projections not in (None, True, False):
            raise ValueError("fuse_projections must be True, False or None (auto), "
                             f"got {self.fuse_projections!r}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {self.weight_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quant_mode is not None and self.quant_mode not in MODES:
            raise ValueError(f"quant_mode must be None or one of {MODES}, got {self.quant_mode!r}")
        object.__setattr__(self, "speculative", _parse_speculative(self.speculative))
        if self.min_token_bucket is not None and self.min_token_bucket < 1:
            raise ValueError(f"min_token_bucket must be >= 1, got {self.min_token_bucket}")
        self.slo  # noqa: B018 - checks the latency targets
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.min_page_bucket is not None and self.min_page_bucket < 1:
            raise ValueError(f"min_page_bucket must be >= 1, got {self.min_page_bucket}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")

    @property
    def slo(self):
        ms = lambda v: None if v is None else v / 1e3  # noqa: E731
        try:
            return SloConfig(itl_s=ms(self.itl_slo_ms), ttft_s=ms(self.ttft_slo_ms),
                             refuse_late=self.refuse_late)
        except ValueError as e:
            raise ValueError(str(e).replace("_s ", "_slo_ms ").replace("a TTFT budget",
                                                                        "ttft_slo_ms")) from None

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def total_pages(self) -> int:
        """Pool size including the null page 0."""
        if self.num_pages is not None:
            return self.num_pages
        return 1 + self.max_slots * self.pages_per_seq
