"""OpenAI-compatible HTTP API over the same EngineLoop as the gRPC service.

    POST /v1/completions        prompt: str | [str] | [int] | [[int]]
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    POST /v1/embeddings         input: str | [str] | [int] | [[int]]; encoding_format float | base64
    GET  /v1/models             the served model and its adapters (cards with max_model_len)
    GET  /v1/models/{id}        one card (404 for an id not served)
    POST /tokenize              vLLM's: {"prompt"} or {"messages"} -> {"count", "max_model_len",
                                "tokens", "token_strs"}
    POST /detokenize            vLLM's: {"tokens"} -> {"prompt"}
    GET  /health                200 while the engine is healthy and admitting, else 503

Streaming is server-sent events (`stream: true`; `data: {...}` chunks, then `data: [DONE]`);
`stream_options.include_usage` adds a last chunk with empty `choices` and the usage, and vLLM's
`stream_options.continuous_usage_stats` puts the usage so far in every chunk (stream_options
without `stream: true` is a 400, as OpenAI answers). Sampling fields: every row of the request
door's table (max_tokens / max_completion_tokens, temperature, top_p, n, stop, seed,
presence_penalty, frequency_penalty, logit_bias with decimal-string keys, ...), logprobs /
top_logprobs, and vLLM's extensions as VLLM_EXTENSIONS below takes them (the openai client sends
them with `extra_body`); a vLLM field this server does not implement is a 400 "'X' is not
supported by this server", as is suffix.
`best_of` (at least n, at most --max-samples, not streamed) generates best_of
samples and returns the n with the highest cumulative logprob. `use_beam_search` with
`length_penalty` (completions, vLLM's fields; not streamed) returns n = beam width beams, best
first (runtime/beam_search.py; sampling fields other than max_tokens, ignore_eos, temperature
and seed are refused with it). Tools: `tools` + `tool_choice` on chat (serve/tool_calls.py). Structured output: `response_format` {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} or {"type": "json_object"} (both endpoints), or vLLM's
`structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object": ...}; other unknown fields are refused too (as OpenAI does),
so nothing is silently ignored. With n > 1 and a seed, sample i uses seed + i, so the samples
differ yet every one is reproducible (and equals `LLM.generate` with that seed).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 bad fields
(param names the field), 401 missing/wrong bearer token when the server has `--auth-token`
(/health stays open, as gRPC health does), 404 unknown model or route, 405 wrong method, 413 body
too large, 429 queue full, 503 shutting down or engine down, 500 engine fault mid-request.

Cancellation: when the client goes away (a stream closed early, or a non-streamed request whose
connection drops) the handle is cancelled, so the slot and its KV pages are freed at the next
engine step.

Serving: Starlette app under uvicorn, started inside the caller's asyncio loop (the one grpc.aio
runs in) — one event loop for both transports, so EngineLoop handles are consumed on the loop
that submitted them and SIGTERM drains both together; uvicorn's own signal handling is off.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import math
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from jaxinfer.runtime.beam_search import BeamSearch, BeamSearchParams, rounds
from jaxinfer.runtime.config import UPDATE_POLICIES
from jaxinfer.runtime.host.requests import (MAX_LOGPROBS, SAMPLING_FIELDS, RequestError, SamplingParams,
                                            check_field, check_ids, check_samples,
                                            check_structured, parse_prompt,
                                            sample_params, sampling_from_json)
from jaxinfer.runtime.host.structured import StructuredOutputs
from jaxinfer.runtime.host.image_prompt import decode_images, expand, mark_text
from jaxinfer.serve.tool_calls import (ToolPlan, check_tool_calls, parse_tools, plain_turns,
                                       tool_result, with_tools)
from jaxinfer.serve.chat_template import ChatTemplate, ChatTemplateError
from jaxinfer.runtime.host.errors import (AdapterInUse, EngineAsleep, Overloaded, QueueFull,
                                          UnknownAdapter)
from jaxinfer.runtime.host.outputs import RequestOutput, best_of
from jaxinfer.serve.engine_loop import EngineFault, EngineLoop, ShuttingDown
from jaxinfer.serve.offload import Offload

log = logging.getLogger(__name__)

FINGERPRINT = "jaxinfer"

# Fields accepted and ignored: they carry no meaning for a local engine.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Both endpoints: every field of the request door's sampling table (runtime/host/requests.py;
# a new row is accepted here with no line of its own) and these OpenAI ones.
_COMMON = {"model", "stream", "stream_options", "n", "presence_penalty", "frequency_penalty",
           "logit_bias", "logprobs", "response_format"} | set(SAMPLING_FIELDS) | _IGNORED
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "use_beam_search",
                                "length_penalty"}
# sampling fields a beam search takes (temperature and seed: accepted, no effect on the search)
_BEAM_SAMPLING = {"max_tokens", "ignore_eos", "temperature", "seed", "n", "best_of"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                          "tool_choice", "functions", "function_call", "modalities"}
_ROLES = ("system", "developer", "user", "assistant", "tool")

# vLLM's request extensions: field -> how /v1/completions and /v1/chat/completions take it
# ("sampling": a row of the request door's table; "honoured": read by the endpoint; "refused":
# a 400 "'X' is not supported by this server" unless null or false; None: no field there).
_S, _H, _R = "sampling", "honoured", "refused"
VLLM_EXTENSIONS: dict[str, tuple[str | None, str | None]] = {
    "use_beam_search": (_H, None), "length_penalty": (_H, None),  # beam search: completions
    **{k: (_S, _S) for k in ("top_k", "min_p", "repetition_penalty", "stop_token_ids",
                             "include_stop_str_in_output", "ignore_eos", "min_tokens",
                             "skip_special_tokens", "spaces_between_special_tokens",
                             "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
                             "bad_words", "seed", "priority", "structured_outputs")},
    "echo": (_H, _R),  # completions: the prompt before the text
    "add_special_tokens": (_H, _H),  # BOS on the prompt (completions: true; chat: false)
    "add_generation_prompt": (None, _H), "continue_final_message": (None, _H),
    "chat_template_kwargs": (None, _H),  # more variables for the chat template
    "documents": (None, _R), "chat_template": (None, _R), "mm_processor_kwargs": (_R, _R),
    # vLLM's older names of structured_outputs' kinds; the backend is llguidance
    "guided_json": (_H, _H), "guided_regex": (_H, _H), "guided_choice": (_H, _H),
    "guided_grammar": (_H, _H), "guided_decoding_backend": (_H, _H),
    "request_id": (_H, _H),  # the response's id: cmpl-<request_id> / chatcmpl-<request_id>
    "logits_processors": (_R, _R), "return_tokens_as_token_ids": (_R, _R), "cache_salt": (_R, _R),
    "kv_transfer_params": (_R, _R), "vllm_xargs": (_R, _R),
}
assert all(k in SAMPLING_FIELDS for k, v in VLLM_EXTENSIONS.items() if _S in v)
_COMPLETION_FIELDS = _COMPLETION_FIELDS | {k for k, (c, _) in VLLM_EXTENSIONS.items()
                                           if c in (_S, _H)}
_CHAT_FIELDS = _CHAT_FIELDS | {k for k, (_, c) in VLLM_EXTENSIONS.items() if c in (_S, _H)}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_GUIDED_BACKENDS = ("auto", "guidance", "llguidance")
_TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message",
                         "add_special_tokens", "chat_template_kwargs", "return_token_strs"}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions"} | _IGNORED
MAX_EMBEDDING_INPUTS = 2048  # inputs of one embeddings request (OpenAI's limit)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.counted = False  # already counted as "invalid" by the EngineLoop
        self.headers: dict[str, str] = {}

    def response(self) -> JSONResponse:
        r = error_response(self.status, self.message, self.param, self.type, self.code)
        r.headers.update(self.headers)
        return r


def _dumps(obj) -> bytes:
    """JSON as UTF-8; \\u escapes when some text (a lone surrogate echoed from a request) has no
    UTF-8 form."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj).encode("ascii")


class JSONResponse(_StarletteJSON):
    def render(self, content) -> bytes:
        return _dumps(content)


def _brief(v) -> str:
    """A bounded rendering of a client's value for an error message."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# ---- request parsing ---------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Body:
    """Typed getters over the JSON body; each raises a 400 naming the field."""

    def __init__(self, body: dict):
        self.d = body

    def has(self, k: str) -> bool:
        return self.d.get(k) is not None

    def int(self, k: str, default, lo: int | None = None, hi: int | None = None):
        v = self.d.get(k)
        if v is None:
            return default
        if not _is_int(v):
            raise bad(f"'{k}' must be an integer, got {_brief(v)}", k)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise bad(f"'{k}' must be {rng}, got {v}", k)
        return v

    def bool(self, k: str, default: bool) -> bool:
        v = self.d.get(k)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(f"'{k}' must be a boolean, got {_brief(v)}", k)
        return v


@dataclass
class _Job:
    """A parsed request: one or more prompts, each with n samples."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: list[list[SamplingParams]]  # per prompt, per sample
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool = False
    model: str = ""
    tools: ToolPlan | None = None  # chat with tools: replies may be tool calls
    # vLLM's `prompt_logprobs` field was sent: each choice (chat: the response) carries them
    prompt_logprobs: bool = False
    best_of: int | None = None  # samples generated per prompt, the n best returned (None: n)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    request_id: str | None = None  # vLLM's request_id: the response's id
    images: list | None = None  # per prompt: [(digest, pixels)] of its images (chat image parts)

    @property
    def samples(self) -> int:
        return self.best_of or self.n


def _check_fields(body: dict, allowed: set[str]) -> None:
    """Every field is one the endpoint takes; a vLLM extension it does not is refused as such
    (null or false: as if absent)."""
    for k in sorted(set(body) - allowed):
        v = body[k]
        if k not in VLLM_EXTENSIONS:
            raise bad(f"Unrecognized request argument supplied: {k}", k)
        if not (v is None or v is False):
            raise bad(f"'{k}' is not supported by this server", k)


def _structured(body: dict, limits) -> StructuredOutputs | None:
    """`response_format` (OpenAI: json_schema / json_object / text) or vLLM's
    `structured_outputs` -> the constraint, checked here so errors name the field sent."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _GUIDED_BACKENDS:
        raise bad(f"'guided_decoding_backend' must be one of {', '.join(_GUIDED_BACKENDS)} "
                  f"(this server's is llguidance), got {_brief(backend)}",
                  "guided_decoding_backend")
    sent = [k for k in ("response_format", "structured_outputs", *_GUIDED)
            if body.get(k) is not None]
    if len(sent) > 1:
        raise bad(f"set one of {', '.join(sent)}, not several", sent[-1])
    field_, kind = "structured_outputs", None
    if sent and sent[0] in _GUIDED:  # vLLM's older fields: one kind of structured_outputs
        so, field_ = {_GUIDED[sent[0]]: body[sent[0]]}, sent[0]
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            so, field_ = {"json_object": True}, "response_format"
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise bad("'response_format.json_schema.schema' must be a JSON schema object",
                          "response_format.json_schema.schema")
            so, field_ = {"json": js["schema"]}, "response_format.json_schema.schema"
        else:
            raise bad("'response_format.type' must be one of text, json_object, json_schema",
                      "response_format.type")
    if so is None:
        return None
    try:
        out = StructuredOutputs.from_json(so)
        check_structured(out, limits)
    except RequestError as e:
        where = e.field if field_ == "structured_outputs" else field_
        raise bad(f"{where}: {e.reason}", where) from None
    return out


def _sampling(b: _Body, *, max_tokens_key: str, default_max_tokens: int, logprobs: int | None,
              n: int, limits, prompt_logprobs: int | None = None) -> list[SamplingParams]:
    """The n samples' SamplingParams: fields and ranges from the request door (an error names
    the field as the body sent it: max_completion_tokens, logit_bias.<id>, ...)."""
    fields = {k: v for k, v in b.d.items() if k not in ("max_tokens", "logprobs")}
    fields["max_tokens"] = b.d.get(max_tokens_key)
    fields["structured_outputs"] = _structured(b.d, limits)
    try:
        sp = sampling_from_json(fields, {"max_tokens": default_max_tokens, "logprobs": logprobs,
                                         "prompt_logprobs": prompt_logprobs})
    except RequestError as e:  # named as the body names it
        field_ = max_tokens_key if e.field == "max_tokens" else e.field
        raise bad(f"{field_}: {e.reason}" if field_ else e.reason, field_) from None
    return sample_params(sp, n)  # with a seed, sample i uses seed + i


_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _stream_opts(b: _Body, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of `stream_options` (only with stream: true)."""
    so = b.d.get("stream_options")
    if so is None:
        return False, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    for k in so:
        if k not in _STREAM_OPTIONS:
            raise bad(f"'stream_options.{_brief(k)[1:-1][:40]}' is not a stream option (known: "
                      f"{', '.join(_STREAM_OPTIONS)})", f"stream_options.{k}")
    out = []
    for k in _STREAM_OPTIONS:
        v = so.get(k)
        if v is not None and not isinstance(v, bool):
            raise bad(f"'stream_options.{k}' must be a boolean", f"stream_options.{k}")
        out.append(bool(v))
    return out[0], out[1]


def _request_id(b: _Body) -> str | None:
    """vLLM's `request_id`: 1-128 printable ASCII characters."""
    v = b.d.get("request_id")
    if v is not None and not (isinstance(v, str) and 0 < len(v) <= 128 and v.isascii()
                              and v.isprintable()):
        raise bad("'request_id' must be a string of 1-128 printable ASCII characters",
                  "request_id")
    return v


def _truncated(b: _Body, prompts: list[list[int]], texts: list) -> tuple[list, list]:
    """The prompts as the engine runs them (`truncate_prompt_tokens`); a cut prompt's text is
    its ids' (echo)."""
    try:
        k = check_field("truncate_prompt_tokens", b.d.get("truncate_prompt_tokens"))
    except RequestError as e:
        raise bad(str(e), e.field) from None
    if k is None:
        return prompts, texts
    cut = [len(p) > k for p in prompts]
    return [p[-k:] for p in prompts], [None if c else t for c, t in zip(cut, texts)]


class _NoSpecials:
    """A tokenizer's encode without BOS (`add_special_tokens: false`)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def _chat_options(b: _Body) -> dict:
    """vLLM's chat rendering fields -> ChatTemplate.render keywords and the encoding's."""
    gen = b.bool("add_generation_prompt", True)
    cont = b.bool("continue_final_message", False)
    if gen and cont:
        raise bad("'continue_final_message' needs 'add_generation_prompt': false",
                  "continue_final_message")
    kw = b.d.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for k in kw:
        if not k.isidentifier() or k in ("messages", "bos_token", "eos_token", "tools",
                                         "add_generation_prompt", "continue_final_message"):
            raise bad(f"'chat_template_kwargs' cannot set {_brief(k)}",
                      f"chat_template_kwargs.{k}")
    return {"add_generation_prompt": gen, "continue_final_message": cont, "kwargs": kw,
            "add_special_tokens": b.bool("add_special_tokens", False)}


_IMAGE_PARTS = ("image_url", "input_image")  # chat's and the Responses API's


def _message_content(m: dict, i: int, images: list):
    """A message's content: its text, or (with image parts) a list of {"type": "text"} /
    {"type": "image"} parts; each image part's value and field name go to `images`."""
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            where = f"messages[{i}].content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif kind in _IMAGE_PARTS:
                url = p.get(kind)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise bad(f"{where}.{kind}: must hold a 'url' string (a data: URL)",
                              f"{where}.{kind}")
                images.append((url, f"{where}.{kind}"))
                parts.append({"type": "image"})
            else:
                raise bad(f"{where}: only text and image_url parts are supported",
                          f"messages[{i}].content")
        if all(p["type"] == "text" for p in parts):
            return "\n".join(p["text"] for p in parts)
        return parts
    raise bad(f"messages[{i}].content must be a string or a list of text / image parts",
              f"messages[{i}].content")


def _flat_content(parts, mark: str) -> str:
    """Image parts written as the model's image mark, for a template that renders text only."""
    if isinstance(parts, str):
        return parts
    return "".join(mark if p["type"] == "image" else p["text"] for p in parts)


def _messages(body: dict, images: list | None = None) -> list[dict]:
    """The body's messages, checked; image parts' (value, field name) go to `images`."""
    images = [] if images is None else images
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    calls: dict[str, str] = {}  # the latest assistant tool calls: id -> function name
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {list(_ROLES)}, got {_brief(role)}",
                      f"messages[{i}].role")
        if m.get("function_call"):
            raise bad(f"messages[{i}].function_call (deprecated) is not supported: use "
                      "tool_calls", f"messages[{i}].function_call")
        # "developer" is OpenAI's newer name for the system role.
        msg = {"role": "system" if role == "developer" else role,
               "content": _message_content(m, i, images)}
        try:
            if role == "tool":
                msg.update(tool_result(m, calls, f"messages[{i}]"))
            elif m.get("tool_calls") is not None:
                if role != "assistant":
                    raise RequestError(f"messages[{i}].tool_calls", "only assistant messages "
                                                                    "carry tool calls")
                msg["tool_calls"] = check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        except RequestError as e:
            raise bad(str(e), e.field) from None
        if role != "tool":
            calls = {c["id"]: c["function"]["name"] for c in msg.get("tool_calls", ())}
        out.append(msg)
    return out


# ---- token text for logprobs -------------------------------------------------------------------
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class _TokenText:
    """The text one token contributes, with its leading space (decoding a lone sentencepiece
    token drops it): decode([anchor, t]) minus decode([anchor]). Cached per id. `bytes_of`
    gives the token's raw bytes: a byte-fallback piece (`<0xE6>`) is one byte of a multi-byte
    character, whose text alone is U+FFFD."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        enc = tokenizer.encode("a", add_special_tokens=False)
        self.anchor = enc[-1:] if enc else []
        self.anchor_text = tokenizer.decode(self.anchor, skip_special_tokens=False)
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            full = self.tok.decode(self.anchor + [t], skip_special_tokens=False)
            s = full[len(self.anchor_text):] if full.startswith(self.anchor_text) else \
                self.tok.decode([t], skip_special_tokens=False)
            if len(self.cache) < 200_000:
                self.cache[t] = s
        return s

    def bytes_of(self, t: int, text: str) -> list[int]:
        m = _BYTE_PIECE.match(self.tok.id_to_piece(t)) if "\ufffd" in text else None
        return [int(m.group(1), 16)] if m else list(text.encode("utf-8"))


# ---- the app -----------------------------------------------------------------------------------
class OpenAIApp:
    """The ASGI app (`.app`) over one EngineLoop."""

    def __init__(self, loop: EngineLoop, tokenizer, *, model_name: str,
                 chat_template: ChatTemplate | None = None, auth_token: str | None = None,
                 max_samples: int = 8, max_body_bytes: int = 16 * 1024 * 1024,
                 offload: Offload | None = None):
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.offload = offload or Offload()  # tokenization and chat templates, off the loop
        self.chat_template = chat_template
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        self.max_samples, self.max_body_bytes = max_samples, max_body_bytes
        self.created = int(time.time())
        self.token_text = _TokenText(tokenizer)
        self.closing = False  # set by the owner when draining: /health answers 503
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
            Route("/v1/update_weights", self.update_weights, methods=["POST"]),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                Exception: self._internal_error})

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}", None,
                              "server_error", "internal_error")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error_response(exc.status_code, msg, None, "invalid_request_error", code)

    # ---- common ---------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self._expected is None:
            return
        got = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(got, self._expected):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <token>'",
                           None, "invalid_request_error", "invalid_api_key")

    async def _body(self, request: Request, need_model: bool = True) -> dict:
        self._auth(request)
        too_big = ApiError(413, f"request body exceeds {self.max_body_bytes} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked bodies too: refused at the limit
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object")
        model = body.get("model")
        if model is None and not need_model:
            return body
        if not isinstance(model, str) or not model:
            raise bad("'model' is required (a string)", "model")
        if model != self.model_name and model not in self._adapter_names():
            raise ApiError(404, f"The model {_brief(model)} does not exist; this server serves "
                                f"{[self.model_name] + self._adapter_names()}", "model",
                           "invalid_request_error", "model_not_found")
        return body

    def _adapter_names(self) -> list[str]:
        return list(self.loop.lora_adapters() or ())

    def _lora_of(self, job: _Job) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return None if job.model == self.model_name else job.model

    async def _guard(self, fn, request: Request) -> Response:
        try:
            return await fn(request)
        except ApiError as e:
            if e.status == 400 and not e.counted:
                self.loop.count("invalid")
            return e.response()

    # ---- endpoints ------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.closing or not self.loop.healthy:
            why = "shutting down" if self.loop.healthy else "engine is down"
            return error_response(503, why, None, "service_unavailable", "unavailable")
        return JSONResponse({"status": "ok"})  # nothing about the model or the load

    def _model_card(self, name: str | None = None) -> dict:
        """The base model's card, or (name) a LoRA adapter's, with its base as `parent`."""
        card = {"id": name or self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxinfer", "max_model_len": self.loop.limits.max_model_len}
        if name is not None:
            card |= {"parent": self.model_name, "root": self.loop.lora_adapters()[name]}
        return card

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        cards = [self._model_card()] + [self._model_card(n) for n in self._adapter_names()]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        name = request.path_params["model"]
        if name != self.model_name and name not in self._adapter_names():
            return error_response(404, f"The model '{name}' does not exist",
                                  "model", "invalid_request_error", "model_not_found")
        return JSONResponse(self._model_card(None if name == self.model_name else name))

    async def tokenize(self, request: Request) -> Response:
        return await self._guard(self._tokenize, request)

    async def detokenize(self, request: Request) -> Response:
        return await self._guard(self._detokenize, request)

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's ids (add_special_tokens, default true) or a chat's as
        /v1/chat/completions renders it (add_generation_prompt, default true)."""
        body = await self._body(request, need_model=False)
        b = _Body(body)
        if "messages" in body:
            _check_fields(body, _TOKENIZE_CHAT_FIELDS)
            ids, _ = await self._chat_ids(b, None)
        else:
            _check_fields(body, _TOKENIZE_FIELDS)
            p = body.get("prompt")
            if not isinstance(p, str):
                raise bad("'prompt' (a string) or 'messages' is required", "prompt")
            tok = (self.tokenizer if b.bool("add_special_tokens", True)
                   else _NoSpecials(self.tokenizer))
            try:
                ids = await self.offload.run(tok.encode, p)
            except Exception as e:  # noqa: BLE001 - e.g. lone surrogates
                raise bad(f"'prompt' cannot be tokenized: {type(e).__name__}", "prompt") from None
        strs = self.tokenizer.convert_ids_to_tokens(ids) if b.bool("return_token_strs", False) \
            else None
        return JSONResponse({"count": len(ids), "max_model_len": self.loop.limits.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def _detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: ids -> text, special tokens kept (as HF's decode does)."""
        body = await self._body(request, need_model=False)
        _check_fields(body, {"model", "tokens"})
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise bad("'tokens' must be a list of token ids", "tokens")
        try:
            check_ids(ids, self.loop.limits, "tokens")
        except RequestError as e:
            raise bad(str(e), e.field) from None
        text = await self.offload.run(self.tokenizer.decode, ids, False)
        return JSONResponse({"prompt": text})

    async def _admin_body(self, request: Request, fields: set[str]) -> dict:
        """The body of an administrative endpoint (behind the auth token): a small JSON object
        of `fields` only; an empty body is {}."""
        self._auth(request)
        raw = await request.body()
        if len(raw) > 64 * 1024:
            raise ApiError(413, "request body exceeds 65536 bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise bad("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object")
        _check_fields(body, fields)
        return body

    async def _lora_body(self, request: Request, fields: tuple[str, ...]) -> dict:
        """vLLM's adapter endpoints: {"lora_name": ..., "lora_path": ...} (no `model`)."""
        self._auth(request)
        if self.loop.lora_adapters() is None:
            raise bad("this server serves no LoRA adapters (start it with --enable-lora)",
                      "lora_name")
        body = await self._admin_body(request, set(fields))
        for f in fields:
            if not isinstance(body.get(f), str) or not body[f]:
                raise bad(f"'{f}' is required (a non-empty string)", f)
        if body["lora_name"] == self.model_name:
            raise bad("'lora_name' must differ from the base model's name", "lora_name")
        return body

    # ---- RL rollouts: weights in place, sleep / wake (runtime/weights.py) ---------------------
    async def update_weights(self, request: Request) -> Response:
        """{"path": a checkpoint of the served model, "version"?: str | int, "policy"?: "drain"
        | "abort"} -> {"weight_version"} once the new weights serve (after the drain)."""
        async def run(request):
            body = await self._admin_body(request, {"path", "version", "policy"})
            path, version = body.get("path"), body.get("version")
            if not isinstance(path, str) or not path:
                raise bad("'path' is required (a checkpoint dir or file)", "path")
            if version is not None and not (isinstance(version, str) or _is_int(version)):
                raise bad("'version' must be a string or an integer", "version")
            policy = body.get("policy", "drain")
            if policy not in UPDATE_POLICIES:
                raise bad(f"'policy' must be one of {list(UPDATE_POLICIES)}", "policy")
            try:
                v = await asyncio.wrap_future(self.loop.update_weights(path, version, policy))
            except (ValueError, OSError) as e:  # WeightError, CheckpointError, a missing file
                raise bad(f"weights not updated (the previous version serves on): {e}",
                          "path") from None
            except (ShuttingDown, EngineFault) as e:
                raise ApiError(503, str(e), None, "service_unavailable", "unavailable") from None
            return JSONResponse({"weight_version": v})
        return await self._guard(run, request)

    async def sleep(self, request: Request) -> Response:
        """{"level"?: 1 | 2} -> the device bytes before / after; 409 with unfinished requests."""
        async def run(request):
            body = await self._admin_body(request, {"level"})
            level = body.get("level", 1)
            if level not in (1, 2) or not _is_int(level):
                raise bad("'level' must be 1 (the KV cache) or 2 (and the weights)", "level")
            try:
                out = await asyncio.wrap_future(self.loop.sleep(level))
            except RuntimeError as e:
                raise ApiError(409, str(e), None, "invalid_request_error", "busy") from None
            return JSONResponse({"sleep_level": level, **out})
        return await self._guard(run, request)

    async def wake_up(self, request: Request) -> Response:
        async def run(request):
            await self._admin_body(request, set())
            out = await asyncio.wrap_future(self.loop.wake_up())
            return JSONResponse({"sleep_level": 0, **out})
        return await self._guard(run, request)

    async def is_sleeping(self, request: Request) -> Response:
        async def run(request):
            self._auth(request)
            level = self.loop.sleep_level
            return JSONResponse({"is_sleeping": level > 0, "sleep_level": level})
        return await self._guard(run, request)

    async def load_lora(self, request: Request) -> Response:
        async def run(request):
            body = await self._lora_body(request, ("lora_name", "lora_path"))
            try:  # the adapter is read and checked off the event loop
                a = await self.offload.run(self.loop.load_lora, body["lora_name"],
                                           body["lora_path"])
            except ValueError as e:
                raise bad(str(e), "lora_path") from None
            return JSONResponse({"lora_name": a.name, "lora_path": a.path, "rank": a.rank,
                                 "target_modules": list(a.targets)})
        return await self._guard(run, request)

    async def unload_lora(self, request: Request) -> Response:
        async def run(request):
            body = await self._lora_body(request, ("lora_name",))
            try:
                await asyncio.wrap_future(self.loop.unload_lora(body["lora_name"]))
            except UnknownAdapter as e:
                raise ApiError(404, str(e), "lora_name", "invalid_request_error",
                               "model_not_found") from None
            except AdapterInUse as e:
                raise ApiError(409, str(e), "lora_name", "invalid_request_error",
                               "adapter_in_use") from None
            except ShuttingDown as e:
                raise ApiError(503, str(e), None, "service_unavailable", "unavailable") from None
            return JSONResponse({"lora_name": body["lora_name"], "unloaded": True})
        return await self._guard(run, request)

    async def embeddings(self, request: Request) -> Response:
        return await self._guard(self._embeddings, request)

    async def _embeddings(self, request: Request) -> Response:
        """The inputs' embeddings (LLM.embed: the model's default pooling, L2-normalized), run
        on the engine thread between two steps. `encoding_format` "base64": each vector's
        little-endian f32 bytes. `dimensions` is refused: no served model shortens its vectors.
        A LoRA adapter's name is refused as `model` (embeddings run on the base model)."""
        body = await self._body(request)
        _check_fields(body, _EMBEDDING_FIELDS)
        if body["model"] != self.model_name:
            raise bad("embeddings run on the base model, not on a LoRA adapter", "model")
        fmt = body.get("encoding_format")
        if fmt not in (None, "float", "base64"):
            raise bad(f"'encoding_format' must be \"float\" or \"base64\", got {_brief(fmt)}",
                      "encoding_format")
        if body.get("dimensions") is not None:
            raise bad("'dimensions' is not supported: this model's embeddings have one size",
                      "dimensions")
        ids = await self._embedding_inputs(body.get("input"))
        try:
            vecs = await asyncio.wrap_future(self.loop.embed(ids))
        except RequestError as e:  # checked above already; named as the body names it
            field_ = e.field.replace("prompt", "input", 1) if e.field else None
            raise bad(f"{field_}: {e.reason}" if field_ else e.reason, field_) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), None, "service_unavailable", "unavailable") from None
        except Exception as e:  # noqa: BLE001 - the engine failed this call; it serves on
            log.error("embeddings failed", exc_info=e)
            return error_response(500, f"embedding failed: {type(e).__name__}: {e}", None,
                                  "server_error", "engine_fault")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                 if fmt == "base64" else v.tolist()} for i, v in enumerate(vecs)]
        n = sum(map(len, ids))
        return JSONResponse({"object": "list", "data": data, "model": body["model"],
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def _embedding_inputs(self, x) -> list[list[int]]:
        """`input` -> token id lists (tokenized off the event loop); 400 naming `input` or
        `input[i]`: wrong type, empty, ids out of the vocabulary, longer than max_model_len."""
        if isinstance(x, str) or (isinstance(x, list) and x and all(_is_int(t) for t in x)):
            items, names = [x], ["input"]
        elif isinstance(x, list) and x and all(isinstance(i, (str, list)) for i in x):
            items, names = x, [f"input[{i}]" for i in range(len(x))]
        else:
            raise bad("'input' must be a non-empty string, list of strings, list of token ids, "
                      "or list of token id lists", "input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise bad(f"'input' has {len(items)} items; at most {MAX_EMBEDDING_INPUTS}", "input")
        limits = self.loop.limits

        def parse() -> list[list[int]]:
            out = []
            for item, name in zip(items, names):
                ids = parse_prompt(item, self.tokenizer, limits, name)[1]
                if len(ids) > limits.max_model_len:
                    raise RequestError(name, f"{len(ids)} tokens exceed max_model_len "
                                             f"{limits.max_model_len}")
                out.append(ids)
            return out

        try:
            return await self.offload.run(parse)
        except RequestError as e:
            raise bad(str(e), e.field) from None

    async def completions(self, request: Request) -> Response:
        return await self._guard(self._completions, request)

    async def chat(self, request: Request) -> Response:
        return await self._guard(self._chat, request)

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request)
        _check_fields(body, _COMPLETION_FIELDS)
        b = _Body(body)
        if body.get("suffix") not in (None, ""):
            raise bad("'suffix' is not supported by this server", "suffix")
        prompts, texts = await self._prompts(body.get("prompt"),
                                             b.bool("add_special_tokens", True))
        prompts, texts = _truncated(b, prompts, texts)
        n = self._n(b)
        stream = b.bool("stream", False)
        best_of = self._best_of(b, n, stream)
        include_usage, continuous = _stream_opts(b, stream)
        logprobs = b.int("logprobs", None, 0, MAX_LOGPROBS)
        echo = b.bool("echo", False)
        longest = max(len(p) for p in prompts)
        beam = b.bool("use_beam_search", False)
        if b.has("length_penalty") and not beam:
            raise bad("'length_penalty' applies only with 'use_beam_search'", "length_penalty")
        count = n if beam else best_of
        # echo with logprobs scores the prompt too: its logprobs come from the prefill; best_of
        # ranks the samples by their tokens' logprobs, computed even when not asked for
        params = _sampling(b, max_tokens_key="max_tokens", n=count, limits=self.loop.limits,
                           logprobs=0 if logprobs is None and count > n else logprobs,
                           default_max_tokens=min(16, self.loop.limits.max_new_tokens(longest)),
                           prompt_logprobs=logprobs if echo else None)
        job = _Job(prompts, texts, [params] * len(prompts), n, stream, include_usage, logprobs,
                   echo, body["model"], prompt_logprobs=b.d.get("prompt_logprobs") is not None,
                   best_of=count if count > n else None)
        job.continuous_usage, job.request_id = continuous, _request_id(b)
        if beam:
            return await self._run(request, job, chat=False, searches=self._searches(b, job))
        return await self._run(request, job, chat=False)

    def _best_of(self, b: _Body, n: int, stream: bool) -> int:
        """Samples to generate per prompt: `best_of` (at least n, checked by the request door;
        at most max_samples; above n not streamed), else n."""
        best_of = b.int("best_of", None, 1)
        if best_of is None:
            return n
        if best_of > self.max_samples:
            raise bad(f"'best_of' must be at most {self.max_samples}", "best_of")
        if stream and best_of > n:
            raise bad("'best_of' above n cannot be streamed", "best_of")
        return best_of

    def _searches(self, b: _Body, job: _Job) -> list[BeamSearch]:
        """A completion's beam searches (one per prompt), or a 400 naming the field."""
        sp, default = job.params[0][0], SamplingParams()
        if job.stream or job.logprobs is not None:
            raise bad("'use_beam_search' cannot be combined with 'stream' or 'logprobs'",
                      "stream" if job.stream else "logprobs")
        if b.d.get("best_of") not in (None, job.n):
            raise bad("'best_of' must equal n with 'use_beam_search' (n is the beam width)",
                      "best_of")
        for name in SAMPLING_FIELDS:
            if name not in _BEAM_SAMPLING and getattr(sp, name) != getattr(default, name):
                raise bad(f"'{name}' does not apply to beam search", name)
        try:
            params = BeamSearchParams(beam_width=job.n, max_tokens=sp.max_tokens,
                                      ignore_eos=sp.ignore_eos,
                                      length_penalty=b.d.get("length_penalty", 1.0))
            return [BeamSearch(ids, params, self.loop.limits, text)
                    for ids, text in zip(job.prompts, job.prompt_texts)]
        except RequestError as e:
            raise bad(str(e), "n" if e.field == "beam_width" else e.field) from None

    async def _beams(self, searches: list[BeamSearch], job: _Job) -> list:
        """Run the searches' rounds through the serving loop: every beam's completions."""
        gen = rounds(searches)
        try:
            asks = next(gen)
            while True:
                step = _Job([ids for ids, _ in asks], [None] * len(asks),
                            [[sp] for _, sp in asks], 1, False, False, None, model=job.model)
                outs = await self._collect(self._submit(step), step)
                if any(o is None or o.finish_reason == "abort" for o in outs):
                    raise ShuttingDown("request cancelled by the server (shutting down)")
                asks = gen.send(outs)
        except StopIteration:
            pass
        return [c for s in searches for c in s.output(self.tokenizer).outputs]

    async def _prompts(self, p, add_special_tokens: bool = True
                       ) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = p
        else:
            raise bad("'prompt' must be a non-empty string, list of strings, list of token ids, "
                      "or list of token id lists", "prompt")
        mq = self.loop.max_queue
        if mq is not None and len(items) > mq:  # refused before any tokenization work
            self.loop.count("rejected")
            raise ApiError(429, f"{len(items)} prompts exceed the queue limit of {mq} sequences",
                           None, "rate_limit_exceeded", "queue_full")
        limits = self.loop.limits
        tok = self.tokenizer if add_special_tokens else _NoSpecials(self.tokenizer)
        try:
            parsed = await self.offload.run(
                lambda: [parse_prompt(x, tok, limits) for x in items])
        except RequestError as e:
            raise bad(str(e), e.field) from None
        return [ids for _, ids in parsed], [text for text, _ in parsed]

    async def _chat(self, request: Request) -> Response:
        body = await self._body(request)
        _check_fields(body, _CHAT_FIELDS)
        b = _Body(body)
        if body.get("functions") or body.get("function_call") not in (None, "none"):
            raise bad("'functions' / 'function_call' (deprecated) are not supported: use 'tools'",
                      "functions" if body.get("functions") else "function_call")
        try:
            tools = parse_tools(body)
        except RequestError as e:
            raise bad(str(e), e.field) from None
        mod = body.get("modalities")
        if mod is not None and mod != ["text"]:
            raise bad("'modalities' supports only [\"text\"]", "modalities")
        ids, images = await self._chat_ids(b, tools)
        (ids,), _ = _truncated(b, [ids], [None])
        n = self._n(b)
        stream = b.bool("stream", False)
        count = self._best_of(b, n, stream)
        include_usage, continuous = _stream_opts(b, stream)
        want_lp = b.bool("logprobs", False)
        top = b.int("top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        key = "max_completion_tokens" if b.has("max_completion_tokens") else "max_tokens"
        params = _sampling(b, max_tokens_key=key, n=count, limits=self.loop.limits,
                           logprobs=(top or 0) if want_lp or count > n else None,
                           default_max_tokens=self.loop.limits.max_new_tokens(len(ids)))
        forced = tools.constraint if tools is not None else None
        if forced is not None:  # a required call: its JSON is the constraint
            if params[0].structured_outputs is not None:
                raise bad("a required tool call cannot be combined with response_format or "
                          "structured_outputs", "tool_choice")
            try:
                check_structured(forced, self.loop.limits)
            except RequestError as e:
                raise bad(f"tools: {e.reason}", "tools") from None
            params = [dataclasses.replace(p, structured_outputs=forced) for p in params]
        lp = (top or 0) if want_lp else None  # logprobs: true alone is the chosen token's
        job = _Job([ids], [None], [params], n, stream, include_usage, lp,
                   model=body["model"], tools=tools if tools and tools.mode != "none" else None,
                   prompt_logprobs=b.d.get("prompt_logprobs") is not None,
                   best_of=count if count > n else None)
        job.continuous_usage, job.request_id = continuous, _request_id(b)
        job.images = [images]
        return await self._run(request, job, chat=True)

    async def _chat_ids(self, b: _Body, tools: ToolPlan | None) -> tuple[list[int], list]:
        """The body's messages rendered by the chat template (with vLLM's rendering fields,
        `_chat_options`) and tokenized, off the event loop; with image parts, each image's
        token run expanded: (ids, [(digest, pixels)])."""
        raw: list = []  # image parts' (value, field name)
        messages, opts = _messages(b.d, raw), _chat_options(b)
        if self.chat_template is None:
            raise bad("this model has no chat template (none in the checkpoint): use "
                      "/v1/completions, or start the server with --chat-template FILE", "messages")
        door = self.loop.engine.image_door()
        spec = None if door is None else door.spec
        images = []
        if raw:
            if door is None:
                raise bad("this model takes no images (it is text only)", raw[0][1])
            if len(raw) > door.limit:
                raise bad(f"{len(raw)} images exceed limit_mm_per_prompt ({door.limit})",
                          raw[-1][1])
            images = await self.offload.run(self._decode_images, raw, door)
        if "image" not in self.chat_template.source:  # a template that renders text only
            mark = spec.mark if spec is not None else ""
            messages = [m | {"content": _flat_content(m["content"], mark)} for m in messages]
        extra = {}
        if "tool_calls" not in self.chat_template.source:  # calls and results as plain turns
            messages = plain_turns(messages)
        if tools is not None:
            messages, extra = with_tools(messages, tools, self.chat_template)
        try:
            ids = await self.offload.run(self._render, messages, extra, opts,
                                         spec if images else None)
            return (expand(ids, images, spec, "messages")[0] if images else ids), images
        except RequestError as e:
            raise bad(str(e), e.field) from None
        except ChatTemplateError as e:
            raise bad(f"chat template: {e}", "messages") from None
        except (RecursionError, UnicodeError, ValueError) as e:
            raise bad(f"messages cannot be rendered or tokenized: {type(e).__name__}",
                      "messages") from None

    @staticmethod
    def _decode_images(raw: list, door) -> list:
        """[(value, field name)] -> [ImageInput], each checked at the image door."""
        try:
            return [decode_images(v, door.spec, door.max_pixels, name)[0] for v, name in raw]
        except RequestError as e:
            raise bad(str(e), e.field) from None

    def _render(self, messages: list[dict], extra: dict, opts: dict, spec=None) -> list[int]:
        t = self.chat_template
        text = t.render(messages, opts["add_generation_prompt"], **opts["kwargs"], **extra)
        if spec is not None:
            text = mark_text(text, spec)
        if opts["continue_final_message"]:  # open: the text ends with the last message's
            last = messages[-1]["content"]
            ends = [text.rfind(c) + len(c) for c in (last, last.strip()) if c and c in text]
            if not ends:
                raise ApiError(400, "the chat template does not render the final message's "
                                    "content: it cannot be continued", "continue_final_message")
            text = text[:ends[0]]
        return t.tokenizer.encode(text, add_special_tokens=opts["add_special_tokens"])

    # ---- running a job --------------------------------------------------------------------
    def _n(self, b: _Body) -> int:
        try:
            return check_samples(b.d.get("n", 1) if b.has("n") else 1, self.max_samples)
        except RequestError as e:
            raise bad(str(e), "n") from None

    def _submit(self, job: _Job) -> list:
        """All prompts x samples of the request are queued, or none (one door, one verdict)."""
        try:
            images = job.images or [[]] * len(job.prompts)
            return self.loop.submit_many([(ids, params, job.samples, ims) for ids, params, ims
                                          in zip(job.prompts, job.params, images)],
                                         lora=self._lora_of(job))
        except RequestError as e:
            err = bad(str(e), e.field)
            err.counted = True  # EngineLoop.submit_many counted it
            raise err from None
        except EngineAsleep as e:
            raise ApiError(503, str(e), None, "service_unavailable", "asleep") from None
        except QueueFull as e:
            err = ApiError(429, str(e), None, "rate_limit_exceeded",
                           "overloaded" if isinstance(e, Overloaded) else "queue_full")
            if isinstance(e, Overloaded):  # when the queue is predicted to have room
                err.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
            raise err from None
        except (ShuttingDown, EngineFault) as e:
            raise ApiError(503, str(e), None, "service_unavailable", "unavailable") from None

    async def _run(self, request: Request, job: _Job, chat: bool,
                   searches: list[BeamSearch] | None = None) -> Response:
        handles = self._submit(job) if searches is None else []
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id or uuid.uuid4().hex}"
        if job.stream:
            return StreamingResponse(self._sse(handles, job, chat, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(self._collect(handles, job) if searches is None
                                        else self._beams(searches, job))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this task was cancelled)
                collect.cancel()
                for h in handles:
                    h.cancel()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody reads it
        try:
            choices = collect.result()
        except EngineFault as e:
            return error_response(500, str(e), None, "server_error", "engine_fault")
        except ShuttingDown as e:
            return error_response(503, str(e), None, "service_unavailable", "unavailable")
        if any(c is None or c.finish_reason == "abort" for c in choices):
            return error_response(503, "request cancelled by the server (shutting down)", None,
                                  "service_unavailable", "unavailable")
        if job.samples > job.n:  # best_of: each prompt's n samples of highest cumulative logprob
            s = job.samples
            choices = [c for i in range(0, len(choices), s) for c in best_of(choices[i:i + s], job.n)]
        return JSONResponse(self._final(job, choices, chat, rid))

    async def _collect(self, handles, job: _Job) -> list[RequestOutput | None]:
        """Each choice's RequestOutput (its last delta carries it; None: cancelled unseen)."""
        choices: list[RequestOutput | None] = [None] * (len(handles) * job.samples)
        try:
            async for hi, deltas in _merge(handles):
                for d in deltas:
                    if d.finished:
                        choices[hi * job.samples + d.index] = d.output
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return choices

    def _usage(self, job: _Job, completion_tokens: int, cached: int | None = None) -> dict:
        """`cached`: prompt tokens the prefix cache served (prompt_tokens_details, as OpenAI
        reports them; None while unknown: a stream's chunks before its end)."""
        prompt = sum(len(p) for p in job.prompts)  # counted once per prompt, whatever n is
        usage = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                 "total_tokens": prompt + completion_tokens}
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    @staticmethod
    def _cached(output) -> int:
        """Its prompt tokens the prefix cache served (beam search's outputs carry no count)."""
        return int((getattr(output, "metrics", None) or {}).get("cached_tokens", 0))

    def _final(self, job: _Job, choices: list[RequestOutput], chat: bool, rid: str) -> dict:
        out = []
        for i, c in enumerate(choices):
            if chat:
                msg, reason = _reply(job, c.text, c.finish_reason)
                out.append({"index": i, "message": msg,
                            "logprobs": self._chat_logprobs(c.logprobs) if job.logprobs is not None else None,
                            "finish_reason": reason})
            else:
                prefix = self._echo(job, i) if job.echo else ""
                lp = None
                if job.logprobs is not None:
                    lp = self._completion_logprobs(
                        self._echo_entries(job, i, c.prompt_logprobs) + c.logprobs, 0)
                out.append({"index": i, "text": prefix + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
                if job.prompt_logprobs:
                    out[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(c.prompt_logprobs)
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": job.model, "system_fingerprint": FINGERPRINT,
                "choices": out, "usage": self._usage(
                    job, sum(len(c.token_ids) for c in choices),  # a prompt's first sample's
                    sum(self._cached(c) for c in choices[::job.n]))}
        if chat and job.prompt_logprobs:
            resp["prompt_logprobs"] = self._vllm_prompt_logprobs(choices[0].prompt_logprobs)
        return resp

    def _echo(self, job: _Job, i: int) -> str:
        """The prompt text of choice i, as echoed."""
        pi = i // job.n
        text = job.prompt_texts[pi]
        return text if text is not None else self.tokenizer.decode(job.prompts[pi])

    def _echo_entries(self, job: _Job, i: int, prompt_lp: list[dict | None] | None) -> list[dict]:
        """Choice i's echoed prompt as logprob entries (the first token's logprob and top
        null: nothing predicts it), top-n cut to the request's `logprobs`; none without echo."""
        if not job.echo or prompt_lp is None:
            return []
        first = job.prompts[i // job.n][0]
        return [{"token_id": first, "logprob": None, "top": None} if e is None else
                {**e, "top": e["top"][:job.logprobs]} for e in prompt_lp]

    def _vllm_prompt_logprobs(self, entries: list[dict | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`: None, then {token id: {logprob, decoded_token}} per prompt
        token (the token itself and its top-n)."""
        if entries is None:
            return None
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {str(t): {"logprob": v, "decoded_token": self.token_text(t)} for t, v in e["top"]}
            d[str(e["token_id"])] = {"logprob": e["logprob"],
                                     "decoded_token": self.token_text(e["token_id"])}
            out.append(d)
        return out

    def _chat_logprobs(self, entries: list[dict]) -> dict:
        def one(tid, lp):
            s = self.token_text(tid)
            return {"token": s, "logprob": lp, "bytes": self.token_text.bytes_of(tid, s)}

        content = []
        for e in entries:
            d = one(e["token_id"], e["logprob"])
            d["top_logprobs"] = [one(t, v) for t, v in e["top"]]
            content.append(d)
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries: list[dict], offset: int) -> dict:
        """The legacy logprobs object (an echoed prompt's first entry: logprob and top null)."""
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            s = self.token_text(e["token_id"])
            tokens.append(s)
            lps.append(e["logprob"])
            if e["top"] is None:
                tops.append(None)
            else:
                top: dict[str, float] = {}
                for t, v in e["top"]:
                    top.setdefault(self.token_text(t), v)
                tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def _sse(self, handles, job: _Job, chat: bool, rid: str) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_null = {"usage": None} if job.include_usage else {}

        def chunk(choices: list[dict]) -> bytes:
            d = {"id": rid, "object": obj, "created": created, "model": job.model,
                 "system_fingerprint": FINGERPRINT, "choices": choices, **usage_null}
            if job.continuous_usage:  # the tokens generated so far, all choices together
                d["usage"] = self._usage(job, so_far)
            return b"data: " + _dumps(d) + b"\n\n"

        total = len(handles) * job.n
        offsets = [0] * total
        held = [""] * total  # chat with tools: the reply is known to be a call or text at its end
        held_lp: list[list[dict]] = [[] for _ in range(total)]
        completion_tokens = so_far = 0
        cached: dict[int, int] = {}  # prompt -> its prompt tokens the prefix cache served
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(total)])
            elif job.echo and job.logprobs is None:  # with logprobs: with the first tokens
                yield chunk([{"index": i, "text": self._echo(job, i), "logprobs": None,
                              "finish_reason": None} for i in range(total)])
            async for hi, ups in _merge(handles):
                out = []
                for u in ups:
                    i = hi * job.n + u.index
                    if u.finish_reason == "abort":
                        raise ShuttingDown("request cancelled by the server (shutting down)")
                    if u.finished and u.output is not None:
                        completion_tokens += len(u.output.token_ids)
                        cached.setdefault(hi, self._cached(u.output))  # a prompt's first
                    so_far += len(u.token_ids)
                    if not (u.text or u.token_ids or u.finished):
                        continue
                    if job.tools is not None:
                        held[i] += u.text
                        held_lp[i] += u.logprobs
                        if not u.finished:
                            continue
                        msg, fr = _reply(job, held[i], u.finish_reason)
                        delta = {k: v for k, v in msg.items() if k in ("content", "tool_calls")}
                        if delta.get("tool_calls"):
                            delta["tool_calls"] = [{"index": k, **tc}
                                                   for k, tc in enumerate(delta["tool_calls"])]
                        lp = self._chat_logprobs(held_lp[i]) if job.logprobs is not None else None
                        out.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr})
                        continue
                    lp, text = None, u.text
                    if job.logprobs is not None:
                        if chat:
                            lp = self._chat_logprobs(u.logprobs)
                        elif job.echo and u.prompt_logprobs is not None:  # the first update
                            text = self._echo(job, i) + u.text
                            lp = self._completion_logprobs(
                                self._echo_entries(job, i, u.prompt_logprobs) + u.logprobs, 0)
                        else:
                            lp = self._completion_logprobs(u.logprobs, offsets[i])
                    offsets[i] += len(text)
                    fr = u.finish_reason if u.finished else None
                    if chat:
                        delta = {"content": text} if text else {}
                        out.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr})
                    else:
                        out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": fr})
                    if job.prompt_logprobs and u.prompt_logprobs is not None:
                        out[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(u.prompt_logprobs)
                if out:
                    yield chunk(out)
            if job.include_usage:
                d = {"id": rid, "object": obj, "created": created, "model": job.model,
                     "system_fingerprint": FINGERPRINT, "choices": [],
                     "usage": self._usage(job, completion_tokens, sum(cached.values()))}
                yield b"data: " + _dumps(d) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (EngineFault, ShuttingDown) as e:
            status, type_ = (500, "server_error") if isinstance(e, EngineFault) else (503, "service_unavailable")
            err = {"error": {"message": str(e), "type": type_, "param": None, "code": status}}
            yield b"data: " + _dumps(err) + b"\n\n"
        finally:  # client disconnect (the task is cancelled) or normal end: cancel is idempotent
            for h in handles:
                h.cancel()


def _reply(job: _Job, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason: text, or tool calls when the request has
    tools and the model's text is a call."""
    calls = job.tools.calls(text) if job.tools is not None and finish_reason == "stop" else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls,
                "refusal": None}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, finish_reason


async def _merge(handles) -> AsyncIterator[tuple[int, list]]:
    """Interleave the update batches of several handles as (handle index, updates)."""
    if len(handles) == 1:
        async for ups in handles[0]:
            yield 0, ups
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, h):
        try:
            async for ups in h:
                await q.put((i, ups))
            await q.put((i, done))
        except Exception as e:  # EngineFault / ShuttingDown: forwarded to the consumer, re-raised
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# ---- uvicorn inside an existing event loop -----------------------------------------------------
class _Uvicorn(uvicorn.Server):
    def capture_signals(self):  # the owner (jaxinfer serve) handles SIGTERM/SIGINT for both servers
        return nullcontext()


class HttpServer:
    """Serve an OpenAIApp with uvicorn as a task of the running asyncio loop:
    `port = await s.start(host, port)`, ..., `await s.stop()`."""

    def __init__(self, api: OpenAIApp):
        self.api = api
        self.port: int | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self, host: str, port: int, tls_cert: str | None = None,
                    tls_key: str | None = None) -> int:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.api.app, lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5,
                                ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = None
