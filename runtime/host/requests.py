"""The request door: every front end turns its input into (prompt ids, SamplingParams, n) here.

One table of sampling fields with their types and ranges (`SAMPLING_FIELDS`: `SamplingParams`'
fields and checks derive from it, and so do the doors' readers: JSON, the HTTP body, the gRPC
message, the command line's flags; a new field is one row), one prompt parser (`parse_prompt`),
one length / page budget and vocab check against the served model (`check_request`), one typed
error naming the field (`RequestError`, runtime/host/errors.py); results come out of the
output processor (runtime/host/outputs.py). `LLM`, gRPC (jaxinfer.v1 Generate and JetStream
Decode), the OpenAI HTTP API and JSONL batch all call these and re-implement none of them;
`Engine.add_request` runs `check_request` again, so nothing reaches a step that did not pass the
door.

    limits = Limits.of(engine)
    params = sampling_from_json(obj, defaults)       # JSON values -> SamplingParams
    text, ids = parse_prompt(obj["prompt"], tokenizer, limits)
    check_request(ids, params, limits)               # vocab, top_k, length, pages

No JAX here: the host scheduler imports SamplingParams.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from jaxinfer.runtime.config import checked_dataclass
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.structured import StructuredOutputs

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI caps logit_bias
MAX_BAD_WORDS = 32  # strings; each may not be completed as its tokens (with and without a space)
MAX_ALLOWED_IDS = 1 << 18
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's epsilon)


# ---- the sampling field table ------------------------------------------------------------------
KIND_TYPES = {"int": int, "float": float, "bool": bool, "strings": tuple[str, ...],
              "ids": tuple[int, ...], "bias": tuple[tuple[int, float], ...],
              "structured": StructuredOutputs}
MAX_ITEMS = {"strings": MAX_STOP_STRINGS, "ids": MAX_STOP_TOKEN_IDS, "bias": MAX_LOGIT_BIAS}


@dataclass(frozen=True)
class Field:
    """One sampling field: SamplingParams' field and its check, and how every door reads it
    (JSON as it is; gRPC the message field of the same name; HTTP the body field; the command
    line a flag, serve/engine_args.py `sampling_args`) derive from the row."""

    kind: str  # "int" | "float" | "bool" | "strings" (str or list of str) | "ids" (list of int)
    #            | "bias" ({token id: value}, ids as ints or decimal strings; kept as sorted
    #            (id, value) pairs) | "structured" (a StructuredOutputs or its JSON object;
    #            runtime/host/structured.py)
    default: object
    lo: float | None = None  # strings: characters a string; bias: a value's range
    hi: float | None = None
    lo_open: bool = False  # (lo, hi] instead of [lo, hi]
    nullable: bool = False  # None is a value of its own (not "the default")
    doc: str = ""
    max_items: int | None = None  # strings, ids, bias: entries at most (None: MAX_ITEMS[kind])

    @property
    def most(self) -> int:
        return self.max_items or MAX_ITEMS[self.kind]

    @property
    def annotation(self):
        t = KIND_TYPES[self.kind]
        return t | None if self.nullable else t


# A new field is one row here (and, for gRPC only, a field of that name in GenerateRequest,
# serve/proto/jaxinfer.proto: a wire change). Every door then takes it with no other line: JSONL
# lines, the HTTP body, gRPC, and the `batch` / `generate` flags (--name-with-dashes).
SAMPLING_FIELDS: dict[str, Field] = {
    "max_tokens": Field("int", 16, 1, INT32_MAX,
                        doc="tokens to generate; prompt + max_tokens <= max_model_len"),
    "temperature": Field("float", 1.0, 0.0, 2.0, doc="0 (or < 1e-5) is greedy"),
    "top_k": Field("int", 0, -1, INT32_MAX, doc="0 or -1: off; at most the vocabulary"),
    "top_p": Field("float", 1.0, 0.0, 1.0, lo_open=True,
                   doc="sample from the most likely tokens holding this much probability"),
    "min_p": Field("float", 0.0, 0.0, 1.0,
                   doc="drop tokens less likely than min_p x the most likely one; 0: off"),
    "seed": Field("int", None, -(2**63), 2**64 - 1, nullable=True,
                  doc="reproducible sampling (taken mod 2**32); null: random"),
    "stop": Field("strings", (), 1, MAX_STOP_CHARS,
                  doc=f"at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters"),
    "stop_token_ids": Field("ids", (), doc=f"at most {MAX_STOP_TOKEN_IDS} ids in the vocabulary"),
    "logprobs": Field("int", None, 0, MAX_LOGPROBS, nullable=True,
                      doc="top-n logprobs per generated token; null: none"),
    "prompt_logprobs": Field("int", None, 0, MAX_LOGPROBS, nullable=True,
                             doc="logprob and top-n of each prompt token after the first "
                                 "(computed in prefill); null: none"),
    "ignore_eos": Field("bool", False, doc="keep generating past EOS"),
    "min_tokens": Field("int", 0, 0, INT32_MAX,
                        doc="EOS and stop_token_ids cannot end the output (nor a stop string "
                            "match) before this many tokens"),
    "repetition_penalty": Field("float", 1.0, 0.0, 10.0, lo_open=True,
                                doc="HF/vLLM's: a token already in the prompt or output has its "
                                    "logit divided by this (multiplied if negative); 1: off"),
    "presence_penalty": Field("float", 0.0, -2.0, 2.0,
                              doc="OpenAI's: subtracted from the logit of every token already "
                                  "in the output; 0: off"),
    "frequency_penalty": Field("float", 0.0, -2.0, 2.0,
                               doc="OpenAI's: subtracted once per earlier occurrence in the "
                                   "output; 0: off"),
    "logit_bias": Field("bias", (), -100.0, 100.0,
                        doc=f"{{token id: bias in [-100, 100]}} added to the logits, at most "
                            f"{MAX_LOGIT_BIAS} entries"),
    "bad_words": Field("strings", (), 1, 256, max_items=MAX_BAD_WORDS,
                       doc=f"at most {MAX_BAD_WORDS} words whose tokens (with and without a "
                           "leading space) may not be completed"),
    "allowed_token_ids": Field("ids", None, nullable=True, max_items=MAX_ALLOWED_IDS,
                               doc="sample only these ids; null: any"),
    "n": Field("int", 1, 1, 128, doc="completions returned for the prompt (they share its "
                                     "prefix pages)"),
    "best_of": Field("int", None, 1, 128, nullable=True,
                     doc="completions generated, the n with the highest cumulative logprob "
                         "returned; null: n"),
    "include_stop_str_in_output": Field("bool", False,
                                        doc="keep the matched stop string at the end of the text"),
    "skip_special_tokens": Field("bool", True, doc="leave special tokens out of the text"),
    "spaces_between_special_tokens": Field("bool", True,
                                           doc="a space between special tokens in the text "
                                               "(when they are kept)"),
    "truncate_prompt_tokens": Field("int", None, 1, INT32_MAX, nullable=True,
                                    doc="keep only the prompt's last k tokens; null: all"),
    "priority": Field("int", 0, -(2**31), 2**31 - 1,
                      doc="scheduling priority, lower first (vLLM's convention)"),
    "structured_outputs": Field("structured", None, nullable=True,
                                doc='the output must match one of {"json": schema}, '
                                    '{"regex": r}, {"choice": [s, ...]}, {"grammar": lark}, '
                                    '{"json_object": true}; null: free'),
}

# Rules over several fields: (the field at fault, holds(params), reason)
SAMPLING_RULES = (
    ("ignore_eos", lambda p: not (p.ignore_eos and p.structured_outputs is not None),
     "cannot be combined with structured_outputs (a constrained output ends at the grammar's "
     "end)"),
    ("min_tokens", lambda p: p.min_tokens <= p.max_tokens, "must be at most max_tokens"),
    ("best_of", lambda p: p.best_of is None or p.best_of >= p.n, "must be at least n"),
)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _range_text(f: Field) -> str:
    return f"in {'(' if f.lo_open else '['}{f.lo}, {f.hi}]"


def check_field(name: str, v, table: Mapping[str, Field] = SAMPLING_FIELDS):
    """One field's value, type-checked, range-checked and normalized; RequestError otherwise."""
    f = table[name]
    if v is None:
        if f.nullable or f.kind in ("strings", "ids", "bias"):
            return f.default
        raise RequestError(name, "must not be null")
    if f.kind == "structured":
        return StructuredOutputs.from_json(v)
    if f.kind == "bool":
        if not isinstance(v, bool):
            raise RequestError(name, f"must be a boolean, got {_show(v)}")
        return v
    if f.kind == "int":
        if not _is_int(v):
            raise RequestError(name, f"must be an integer, got {_show(v)}")
        v = int(v)
        if not f.lo <= v <= f.hi:
            raise RequestError(name, f"must be {_range_text(f)}, got {v}")
        return v
    if f.kind == "float":
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RequestError(name, f"must be a number, got {_show(v)}")
        v = float(v)
        if not math.isfinite(v) or v > f.hi or v < f.lo or (f.lo_open and v == f.lo):
            raise RequestError(name, f"must be {_range_text(f)}, got {v}")
        return v
    if f.kind == "strings":
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise RequestError(name, f"must be a string or a list of strings, got {_show(v)}")
        if len(items) > f.most:
            raise RequestError(name, f"takes at most {f.most} strings, got {len(items)}")
        if any(not f.lo <= len(s) <= f.hi for s in items):
            raise RequestError(name, f"strings must be {int(f.lo)}..{int(f.hi)} characters")
        return tuple(items)
    if f.kind == "bias":
        return _check_bias(name, v, f)
    # "ids"
    if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
        raise RequestError(name, f"must be a list of integers, got {_show(v)}")
    if len(v) > f.most:
        raise RequestError(name, f"takes at most {f.most} ids, got {len(v)}")
    if f.nullable and not v:
        raise RequestError(name, "must not be empty (null: no restriction)")
    return tuple(int(t) for t in v)


def _check_bias(name: str, v, f: Field) -> tuple[tuple[int, float], ...]:
    """{id: value} (JSON keys are strings) or (id, value) pairs -> sorted (id, value) pairs."""
    if isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2
                                              for e in v):
        items = [tuple(e) for e in v]
    else:
        raise RequestError(name, f"must be an object of token id -> bias, got {_show(v)}")
    if len(items) > f.most:
        raise RequestError(name, f"takes at most {f.most} entries, got {len(items)}")
    out = {}
    for k, b in items:
        if isinstance(k, str) and k.strip().lstrip("-").isdecimal() and len(k) <= 12:
            k = int(k)
        if not _is_int(k) or not 0 <= k <= INT32_MAX:
            raise RequestError(name, f"keys must be token ids, got {_show(k)}")
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) \
                or not f.lo <= b <= f.hi:
            raise RequestError(f"{name}.{k}", f"must be a number {_range_text(f)}, got {_show(b)}")
        out[int(k)] = float(b)
    return tuple(sorted(out.items()))


def _show(v) -> str:
    s = repr(v)
    return f"{type(v).__name__} {s[:40]}{'...' if len(s) > 40 else ''}"


class _SamplingViews:
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_class(name: str = "SamplingParams", table: Mapping[str, Field] = SAMPLING_FIELDS,
                   rules=SAMPLING_RULES) -> type:
    """A frozen dataclass with one field per row (table order, the row's default) whose
    construction checks every field (check_field), then every rule, then writes the normal forms
    (temperature under GREEDY_BELOW: 0; top_k -1: 0)."""

    def normal_forms(self):
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            object.__setattr__(self, "top_k", 0)

    return checked_dataclass(name, [(n, f.annotation, f.default) for n, f in table.items()],
                             lambda n, v: check_field(n, v, table), rules, RequestError,
                             bases=(_SamplingViews,), finish=normal_forms)


SamplingParams = sampling_class()
SamplingParams.__module__ = __name__  # pickled by name: Ray sends them
SamplingParams.__doc__ = (
    "Per-request sampling: one field per SAMPLING_FIELDS row, checked on construction (bad "
    "values raise RequestError, a ValueError, naming the field). temperature 0 is greedy; `seed` "
    "makes sampling reproducible (the key of each token derives from (seed, position) only).\n\n"
    + "\n".join(f"    {n} = {f.default!r}: {f.doc}" for n, f in SAMPLING_FIELDS.items()))


def sampling_from_json(obj: Mapping, defaults: Mapping | None = None) -> SamplingParams:
    """SamplingParams from the sampling fields of a JSON object (other keys ignored; null means
    the default). Raises RequestError naming the field."""
    kw = dict(defaults or {})
    for name in SAMPLING_FIELDS:
        if name in obj and obj[name] is not None:
            kw[name] = obj[name]
    return SamplingParams(**kw)


def check_samples(n, max_samples: int, name: str = "n") -> int:
    """The number of samples of one prompt, in [1, max_samples]."""
    if not _is_int(n) or not 1 <= n <= max_samples:
        raise RequestError(name, f"must be an integer in [1, {max_samples}], got {_show(n)}")
    return int(n)


def sample_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """The params of `count` samples of one prompt: with a seed, sample i uses seed + i (mod
    2**32), so the samples differ and each is reproducible alone (sample 0 is the request)."""
    if params.seed is None:
        return [params] * count
    return [replace(params, seed=(params.seed + i) & 0xFFFFFFFF) for i in range(count)]


# ---- what the served model allows --------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    vocab_size: int  # ids the model has rows for
    text_vocab: int  # ids the tokenizer can decode (<= vocab_size): prompts and samples stay below
    max_model_len: int
    page_size: int
    num_pages: int  # usable KV pages of the pool
    grammars: object = None  # runtime.host.structured.Grammars: checks structured_outputs
    eos_ids: tuple[int, ...] = ()  # the served model's EOS ids (beam search ends beams on them)

    @classmethod
    def of(cls, engine) -> Limits:
        sch = engine.scheduler
        return cls(vocab_size=engine.cfg.vocab_size, text_vocab=engine.text_vocab,
                   max_model_len=sch.max_model_len, page_size=sch.page_size,
                   num_pages=sch.allocator.num_total, grammars=engine.grammars,
                   eos_ids=tuple(engine.eos_ids))

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a prompt of this length can still generate (>= 1 when it fits)."""
        by_len = self.max_model_len - prompt_len
        by_pages = self.num_pages * self.page_size - prompt_len + 1
        return max(1, min(by_len, by_pages))


def parse_prompt(prompt, tokenizer, limits: Limits, name: str = "prompt") -> tuple[str | None, list[int]]:
    """A prompt given as text (tokenized here) or as token ids -> (text or None, ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(name, "must not be empty")
        try:
            ids = tokenizer.encode(prompt)
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
            raise RequestError(name, f"cannot be tokenized: {type(e).__name__}") from None
        if not ids:
            raise RequestError(name, "encodes to no tokens")
        return prompt, ids
    if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise RequestError(name, "token id list must not be empty")
        ids = [int(t) for t in prompt]
        check_ids(ids, limits, name)
        return None, ids
    raise RequestError(name, f"must be a string or a list of token ids, got {_show(prompt)}")


def check_ids(ids: Sequence[int], limits: Limits, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < limits.text_vocab]
    if bad:
        raise RequestError(name, f"token ids out of range [0, {limits.text_vocab}): {bad[:5]}")


def truncate_prompt(prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The prompt the engine runs: its last `truncate_prompt_tokens` ids (all when unset)."""
    k, ids = params.truncate_prompt_tokens, list(prompt_ids)
    return ids if k is None or len(ids) <= k else ids[-k:]


def check_request(prompt_ids: Sequence[int], params: SamplingParams, limits: Limits,
                  prompt_name: str = "prompt") -> None:
    """What depends on the served model: ids in the vocabulary, top_k, the length and page
    budget of prompt + max_tokens, and that a structured-output constraint compiles. The prompt
    is checked as the engine will run it (`truncate_prompt`)."""
    prompt_ids = truncate_prompt(prompt_ids, params)
    n, m = len(prompt_ids), params.max_tokens
    if n == 0:
        raise RequestError(prompt_name, "empty (no tokens)")
    check_ids(prompt_ids, limits, prompt_name)
    check_ids(params.stop_token_ids, limits, "stop_token_ids")
    check_ids(params.allowed_token_ids or (), limits, "allowed_token_ids")
    check_ids([t for t, _ in params.logit_bias], limits, "logit_bias")
    if params.top_k > limits.vocab_size:
        raise RequestError("top_k", f"must be at most the vocabulary size {limits.vocab_size}, "
                                    f"got {params.top_k}")
    if n >= limits.max_model_len:
        raise RequestError(prompt_name, f"{n} tokens leave no room in max_model_len "
                                        f"{limits.max_model_len}")
    if n + m > limits.max_model_len:
        raise RequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({m}) exceeds "
                                         f"max_model_len {limits.max_model_len}")
    if -(-(n + m - 1) // limits.page_size) > limits.num_pages:
        raise RequestError("max_tokens", f"prompt + max_tokens needs more KV pages than the pool "
                                         f"holds ({limits.num_pages} pages of {limits.page_size} "
                                         f"tokens)")
    if params.structured_outputs is not None:
        so = params.structured_outputs
        check_structured(so, limits)
        need = limits.grammars.min_tokens(so)
        if need > m:
            raise RequestError("max_tokens", f"{m} tokens cannot hold any output "
                                             f"structured_outputs.{so.kind} allows: it needs at "
                                             f"least {need}")


def check_structured(so: StructuredOutputs, limits: Limits) -> None:
    """The constraint compiles for the served vocabulary (RequestError naming it otherwise)."""
    if limits.grammars is None:
        raise RequestError("structured_outputs", "not supported by this model's tokenizer")
    limits.grammars.check(so)


# ---- adapters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, as vLLM names it: `lora_name` is how requests and the API
    refer to it, `lora_path` a PEFT adapter dir (adapter_config.json +
    adapter_model.safetensors), `lora_int_id` the caller's id for it (> 0)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
