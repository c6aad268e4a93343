"""`jaxinfer serve`: the gRPC generation service.

Services on one grpc.aio server:
  * jetstream_proto.Orchestrator (Decode, HealthCheck) — JetStream's wire format, so JetStream
    clients and its benchmark_serving.py work unchanged (see serve/proto/jetstream.proto).
  * jaxinfer.v1.Generation (Generate, Stats) — per-request sampling (every row of the request
    door's table), stop strings, logprobs, usage and latency metrics, n samples streamed with
    their `index`; Stats for introspection (pages free, queue, counters).
  * grpc.health.v1.Health and server reflection.
Prometheus metrics on a separate HTTP port (`--metrics-port`). With `--http-port` the
OpenAI-compatible HTTP API (serve/openai_server.py) runs in the same asyncio loop over the same
EngineLoop, so both transports share one engine, its slots, queue limit, auth token and drain.

The engine runs in one thread (serve.engine_loop.EngineLoop); handlers only await its queues.
Status codes: invalid input -> INVALID_ARGUMENT naming the field; full queue ->
RESOURCE_EXHAUSTED at once; draining -> UNAVAILABLE; engine fault -> INTERNAL for the affected
requests, then health NOT_SERVING and UNAVAILABLE for new ones. A client cancel or deadline
cancels the request: its slot and pages are freed at the next engine step.

Auth: with a token (`--auth-token-file F`, `JAXINFER_AUTH_TOKEN`, or `--auth-token T`, which
`ps` shows) every call must carry metadata `authorization: Bearer T` (UNAUTHENTICATED
otherwise), except grpc.health.v1.Health, which stays open for load-balancer and orchestrator
probes (it reveals only SERVING/NOT_SERVING). /metrics takes the same token and TLS unless
`--metrics-public`. A request message that does not parse gets INVALID_ARGUMENT; prompts are
tokenized on a small thread pool (serve/offload.py), never on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from jaxinfer.runtime.host.requests import (SAMPLING_FIELDS, Limits, RequestError, SamplingParams,
                                            check_samples, parse_prompt, sample_params,
                                            sampling_from_json)
from jaxinfer.runtime.config import UPDATE_POLICIES
from jaxinfer.runtime.host.image_prompt import parse_multimodal
from jaxinfer.runtime.host.errors import EngineAsleep, Overloaded, QueueFull
from jaxinfer.serve.engine_loop import EngineFault, EngineLoop, ShuttingDown
from jaxinfer.serve.metrics import ServingMetrics
from jaxinfer.serve.offload import Offload
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", "jetstream_proto.Orchestrator", "jaxinfer.v1.Generation")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9000  # 0: pick a free port
    metrics_port: int | None = None  # None: no metrics endpoint; 0: pick a free port
    max_queue: int | None = 256
    max_samples: int = 8  # JetStream num_samples limit
    tls_cert: str | None = None  # PEM paths
    tls_key: str | None = None
    auth_token: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    drain_timeout_s: float = 30.0  # graceful stop: let in-flight requests finish this long
    model_name: str = ""
    http_port: int | None = None  # OpenAI-compatible HTTP API (serve/openai_server.py); 0: free port
    chat_template: str | None = None  # file (or text) overriding the checkpoint's chat template
    metrics_public: bool = False  # /metrics without the auth token and TLS of the server


# ---- request parsing (runs on the offload pool: it tokenizes) ---------------------------------
def generate_inputs(req, tokenizer, limits: Limits, door=None
                    ) -> tuple[list[int], SamplingParams, list]:
    """GenerateRequest -> (prompt ids, SamplingParams, images [(digest, pixels)]), through the
    request door; RequestError naming the field. Every row of the sampling table that the
    message has a field of the same name for is read (`sampling_fields`); a new row needs that
    field in GenerateRequest (serve/proto/jaxinfer.proto, a wire change), nothing here.
    `door`: the vision model's ImageDoor (None: text only)."""
    has_text, has_ids = req.HasField("prompt"), len(req.prompt_token_ids) > 0
    if has_text and has_ids:
        raise RequestError("prompt", "set exactly one of prompt and prompt_token_ids, got both")
    if not has_text and not has_ids:
        raise RequestError("prompt", "set prompt (text) or prompt_token_ids")
    prompt = {"prompt": req.prompt} if has_text else {
        "prompt_token_ids": list(req.prompt_token_ids)}
    if getattr(req, "images", None):
        prompt["multi_modal_data"] = {"image": [bytes(b) for b in req.images]}
    _, ids, images = parse_multimodal(prompt, tokenizer, door,
                                      lambda p, name: parse_prompt(p, tokenizer, limits, name))
    return ids, sampling_from_json(sampling_fields(req)), images


def sampling_fields(req) -> dict:
    """The sampling table's fields a request message carries, as JSON values: a map as a dict, a
    repeated field as a list (empty: unset, so a nullable row's null), a field with presence
    (`optional`, a message) only when set, a plain scalar as it is (proto3: unset reads as its
    zero value, so a plain scalar suits only a row whose default is that zero, like
    ignore_eos)."""
    out = {}
    on_wire = req.DESCRIPTOR.fields_by_name
    for name in SAMPLING_FIELDS:
        f = on_wire.get(name)
        if f is None:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[name] = dict(getattr(req, name))
        elif f.is_repeated:
            out[name] = list(getattr(req, name)) or None
        elif not f.has_presence:
            out[name] = getattr(req, name)
        elif req.HasField(name):
            v = getattr(req, name)
            out[name] = _FROM_MESSAGE[f.message_type.full_name](v) if f.message_type else v
    return out


def _structured(so) -> dict:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError("structured_outputs", "set one of json, regex, choice, grammar, "
                                                 "json_object")
    value = getattr(so, kind)
    return {kind: list(value.values) if kind == "choice" else value}


# message-typed sampling fields: the message as the row's JSON value
_FROM_MESSAGE = {"jaxinfer.v1.StructuredOutputs": _structured}


def decode_inputs(req, tokenizer, limits: Limits, max_samples: int):
    """JetStream DecodeRequest -> (prompt ids, SamplingParams, n, text_mode). JetStream decodes
    greedily and stops at EOS; num_samples 0 means 1."""
    kind = req.WhichOneof("content")
    if kind is None:
        raise RequestError("content", "set text_content or token_content")
    if kind == "text_content":
        _, ids = parse_prompt(req.text_content.text, tokenizer, limits, "text_content.text")
    else:
        _, ids = parse_prompt(list(req.token_content.token_ids), tokenizer, limits,
                              "token_content.token_ids")
    n = check_samples(max(1, req.num_samples) if req.num_samples >= 0 else req.num_samples,
                      max_samples, "num_samples")
    params = sampling_from_json({"max_tokens": req.max_tokens, "temperature": 0.0})
    return ids, params, n, kind == "text_content"


# ---- servicers ---------------------------------------------------------------------------------
class _Base:
    def __init__(self, loop: EngineLoop, tokenizer, cfg: ServerConfig, offload: Offload):
        self.loop, self.tokenizer, self.cfg, self.offload = loop, tokenizer, cfg, offload

    async def _parse(self, context, fn, *args):
        """fn(*args) on the offload pool (it tokenizes); INVALID_ARGUMENT naming the field."""
        try:
            return await self.offload.run(fn, *args)
        except RequestError as e:
            await self._invalid(context, e)

    async def _invalid(self, context, e: ValueError):
        self.loop.count("invalid")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _submit(self, context, ids, params, n=1, request_id=None, lora="", images=()):
        try:  # lora: a loaded adapter's name ("": the base model), checked by the loop's door
            return self.loop.submit_many([(ids, params, n, list(images))], [request_id or None],
                                         lora=lora or None)[0]
        except ValueError as e:  # counted as invalid by the loop
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineAsleep as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except QueueFull as e:
            if isinstance(e, Overloaded):  # gRPC's retry pushback: when to try again
                context.set_trailing_metadata(
                    (("grpc-retry-pushback-ms", str(max(1, int(e.retry_after_s * 1e3)))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (ShuttingDown, EngineFault) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def _updates(self, context, handle):
        """Async-iterate a handle. However the RPC ends (client cancel, deadline, server stop)
        the done-callback cancels the request, so its slot and pages free at the next step.
        Engine fault -> INTERNAL."""
        context.add_done_callback(lambda _ctx: handle.cancel())
        try:
            async for ups in handle:
                if any(u.finish_reason == "abort" for u in ups) and not context.cancelled():
                    # Not the client's doing: the server cancelled it (drain timeout on stop).
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "request cancelled by the server (shutting down)")
                yield ups
        except EngineFault as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except ShuttingDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


class GenerationServicer(_Base, jaxinfer_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        ids, params, images = await self._parse(context, generate_inputs, request,
                                                 self.tokenizer, self.loop.limits,
                                                 self.loop.engine.image_door())
        try:  # n samples, each streamed with its index (with a seed, sample i uses seed + i)
            n = check_samples(params.n, self.cfg.max_samples)
            if params.best_of not in (None, n):
                raise RequestError("best_of", f"must be unset or n ({n}): every sample is "
                                              f"streamed, got {params.best_of}")
        except RequestError as e:
            await self._invalid(context, e)
        handle = await self._submit(context, ids, sample_params(params, n), n=n,
                                    request_id=request.request_id, lora=request.lora,
                                    images=images)
        async for ups in self._updates(context, handle):
            for u in ups:
                msg = jaxinfer_pb2.GenerateResponse(text=u.text, token_ids=u.token_ids,
                                                    index=u.index)
                for field_, entries in (("logprobs", u.logprobs),
                                        ("prompt_logprobs", (u.prompt_logprobs or [None])[1:])):
                    for lp in entries:
                        getattr(msg, field_).add(
                            token_id=lp["token_id"], logprob=lp["logprob"],
                            top=[jaxinfer_pb2.TopLogprob(token_id=i, logprob=v)
                                 for i, v in lp["top"]])
                if u.finished:
                    out = u.output
                    m = out.metrics
                    msg.final.finish_reason = u.finish_reason or ""
                    msg.final.request_id = handle.request_id
                    msg.final.weight_version = str(out.weight_version)
                    msg.final.usage.prompt_tokens = out.usage["prompt_tokens"]
                    msg.final.usage.completion_tokens = out.usage["completion_tokens"]
                    fm = msg.final.metrics
                    fm.queue_s = m["queue_s"] or 0.0
                    fm.ttft_s = m["ttft_s"] or 0.0
                    fm.itl_s.extend(m["itl_s"])
                    fm.itl_mean_s = m["itl_s_mean"] or 0.0
                    fm.e2e_s = m["e2e_s"] or 0.0
                if u.text or u.token_ids or u.finished:
                    yield msg

    async def Stats(self, request, context):
        s = self.loop.stats()
        return jaxinfer_pb2.StatsResponse(
            **{k: s[k] for k in ("queue_depth", "running", "max_slots", "pages_total", "pages_free",
                                 "pages_used", "tokens_generated", "healthy", "in_flight",
                                 "compile_count", "vocab_size", "max_model_len", "model", "steps")},
            requests=s["requests"],
        )


    async def UpdateWeights(self, request, context):
        policy = request.policy or "drain"
        if not request.path or policy not in UPDATE_POLICIES:
            field = "path" if not request.path else "policy"
            await self._invalid(context, RequestError(
                field, "is required (a checkpoint of the served model)" if field == "path"
                else f"must be one of {list(UPDATE_POLICIES)}"))
        try:
            v = await asyncio.wrap_future(self.loop.update_weights(
                request.path, request.version or None, policy))
        except (ValueError, OSError) as e:  # WeightError, CheckpointError, a missing file
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"weights not updated (the previous version serves on): {e}")
        except (ShuttingDown, EngineFault) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return jaxinfer_pb2.UpdateWeightsResponse(weight_version=str(v))

    async def Sleep(self, request, context):
        level = request.level or 1
        if level not in (1, 2):
            await self._invalid(context, RequestError("level", "must be 1 or 2"))
        try:
            out = await asyncio.wrap_future(self.loop.sleep(level))
        except RuntimeError as e:  # unfinished requests
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return jaxinfer_pb2.SleepResponse(sleep_level=level, **out)

    async def WakeUp(self, request, context):
        out = await asyncio.wrap_future(self.loop.wake_up())
        return jaxinfer_pb2.SleepResponse(sleep_level=0, **out)


class OrchestratorServicer(_Base, jetstream_pb2_grpc.OrchestratorServicer):
    async def Decode(self, request, context):
        ids, params, n, text_mode = await self._parse(
            context, decode_inputs, request, self.tokenizer, self.loop.limits, self.cfg.max_samples)
        handle = await self._submit(context, ids, params, n=n, lora=request.lora_adapter_id)
        Sample = jetstream_pb2.DecodeResponse.StreamContent.Sample
        async for ups in self._updates(context, handle):
            by_index = {u.index: u for u in ups}
            samples = []
            for i in range(n):
                u = by_index.get(i)
                if u is None:
                    samples.append(Sample())
                else:
                    samples.append(Sample(text=u.text if text_mode else "", token_ids=u.token_ids))
            if any(s.token_ids or s.text for s in samples):
                msg = jetstream_pb2.DecodeResponse()
                msg.stream_content.samples.extend(samples)
                yield msg

    async def HealthCheck(self, request, context):
        return jetstream_pb2.HealthCheckResponse(is_live=self.loop.healthy)


# ---- undecodable requests ----------------------------------------------------------------------
class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """A request message that does not parse gets INVALID_ARGUMENT (grpc's own answer is UNKNOWN
    with a logged traceback per request). Unary-request methods only: streaming requests keep
    grpc's handling."""

    def __init__(self, on_refuse=None):
        self._on_refuse = on_refuse  # called once per refused request (e.g. count it invalid)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode, method, on_refuse = handler.request_deserializer, details.method, self._on_refuse

        def safe_decode(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - DecodeError and friends
                return _Undecodable(e)

        def refuse(request) -> str | None:
            if isinstance(request, _Undecodable):
                if on_refuse is not None:
                    on_refuse()
                return f"{method}: the request message does not parse ({type(request.error).__name__})"
            return None

        kw = dict(request_deserializer=safe_decode,
                  response_serializer=handler.response_serializer)
        if handler.response_streaming:
            inner = handler.unary_stream

            async def stream(request, context):
                why = refuse(request)
                if why:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
                async for msg in inner(request, context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        inner = handler.unary_unary

        async def unary(request, context):
            why = refuse(request)
            if why:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **kw)


# ---- auth --------------------------------------------------------------------------------------
class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call needs `authorization: Bearer <token>`; grpc.health.v1.Health is exempt."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        got = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(got.encode(), self._expected):
            return handler
        return _deny(handler)


def _deny(handler):
    msg = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


# ---- the server --------------------------------------------------------------------------------
class GenerationServer:
    """Owns the EngineLoop, the grpc.aio server and the metrics endpoint. Use from one asyncio
    event loop: `port = await s.start()`, ..., `await s.stop()`."""

    def __init__(self, llm, cfg: ServerConfig):
        self.llm, self.cfg = llm, cfg
        self.loop = EngineLoop(llm.engine, max_queue=cfg.max_queue, model_name=cfg.model_name)
        self.metrics = ServingMetrics(self.loop)
        self.offload = Offload()  # tokenization off the event loop, shared by gRPC and HTTP
        self.health = health_aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.http = None  # serve.openai_server.HttpServer when cfg.http_port is set
        self._server: grpc.aio.Server | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.loop.on_fault.append(self._on_fault)

    def _on_fault(self, exc: BaseException) -> None:  # loop thread
        if self._aloop is not None and not self._aloop.is_closed():
            asyncio.run_coroutine_threadsafe(self._set_health(False), self._aloop)

    async def _set_health(self, serving: bool) -> None:
        st = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in HEALTH_SERVICES:
            await self.health.set(name, st)

    async def start(self) -> int:
        cfg = self.cfg
        self._aloop = asyncio.get_running_loop()
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors = [BearerAuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        interceptors.append(DecodeErrorInterceptor(lambda: self.loop.count("invalid")))
        server = grpc.aio.server(options=opts, interceptors=interceptors)
        jaxinfer_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.loop, self.llm.tokenizer, cfg, self.offload), server)
        jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
            OrchestratorServicer(self.loop, self.llm.tokenizer, cfg, self.offload), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (jaxinfer_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                 jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        addr = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("--tls-cert and --tls-key must be given together")
            with open(cfg.tls_key, "rb") as f:
                key = f.read()
            with open(cfg.tls_cert, "rb") as f:
                cert = f.read()
            self.port = server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = server.add_insecure_port(addr)
        if not self.port:
            raise ValueError(f"cannot bind {addr}")
        await self._set_health(self.loop.healthy)
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            guard = {} if cfg.metrics_public else dict(
                auth_token=cfg.auth_token, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
            self.metrics_port = self.metrics.serve_http(cfg.host, cfg.metrics_port, **guard)
        if cfg.http_port is not None:  # same asyncio loop, same EngineLoop
            from jaxinfer.serve.chat_template import resolve_chat_template
            from jaxinfer.serve.openai_server import HttpServer, OpenAIApp

            api = OpenAIApp(self.loop, self.llm.tokenizer, model_name=cfg.model_name or "default",
                            chat_template=resolve_chat_template(self.llm.tokenizer, self.llm.model.cfg,
                                                                cfg.chat_template),
                            auth_token=cfg.auth_token, max_samples=cfg.max_samples,
                            max_body_bytes=cfg.max_message_bytes, offload=self.offload)
            self.http = HttpServer(api)
            self.http_port = await self.http.start(cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
        return self.port

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Graceful: health NOT_SERVING, stop admitting (UNAVAILABLE), let in-flight requests
        finish for up to drain_timeout_s (then cancel them), close the server."""
        t = self.cfg.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.api.closing = True  # /health 503; new requests get 503 from the loop
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.loop.shutdown(drain=t > 0, timeout=t))
        if self._server is not None:
            await self._server.stop(grace=2.0)
        if self.http is not None:
            await self.http.stop()
        self.metrics.stop_http()
        self.offload.close()


class ServerThread:
    """Run a GenerationServer on its own asyncio loop in a background thread (tests, notebooks,
    embedding): `s = ServerThread(llm, ServerConfig(port=0)); s.port; ...; s.stop()`."""

    def __init__(self, llm, cfg: ServerConfig):
        self.aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.aloop.run_forever, name="grpc-server",
                                        daemon=True)
        self._thread.start()
        self.server = GenerationServer(llm, cfg)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.aloop).result(60)
        self.port, self.metrics_port = self.server.port, self.server.metrics_port
        self.http_port = self.server.http_port

    @property
    def loop(self) -> EngineLoop:
        return self.server.loop

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(drain_timeout_s), self.aloop).result(120)
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        self._thread.join(10)


# ---- CLI ---------------------------------------------------------------------------------------
def register(subparsers, engine_args) -> None:
    p = subparsers.add_parser("serve", help="run the gRPC generation service")
    engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics HTTP port (off unless given)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests before RESOURCE_EXHAUSTED")
    p.add_argument("--max-samples", type=int, default=8, help="JetStream num_samples limit")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--auth-token", default=None,
                   help="require 'authorization: Bearer TOKEN' on every call, gRPC, HTTP and "
                        "/metrics (health exempt); visible in `ps`: prefer --auth-token-file or "
                        "JAXINFER_AUTH_TOKEN")
    p.add_argument("--auth-token-file", default=None,
                   help="read the bearer token from this file (first line)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the auth token and TLS of the server")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health) on this port, same engine")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file overriding the checkpoint's (HTTP chat API)")
    p.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before cancelling")
    p.set_defaults(fn=cmd_serve)


def cmd_serve(args) -> int:
    from jaxinfer.serve.engine_args import llm_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = auth_token(args.auth_token, args.auth_token_file)
    except ValueError as e:
        print(f"jaxinfer serve: error: {e}", file=sys.stderr)
        return 2
    cfg = ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                       max_queue=args.max_queue, max_samples=args.max_samples,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=token,
                       metrics_public=args.metrics_public,
                       max_message_bytes=args.max_message_bytes,
                       drain_timeout_s=args.drain_timeout, model_name=args.model,
                       http_port=args.http_port, chat_template=args.chat_template)
    llm = llm_from_args(args)
    return asyncio.run(_serve(llm, cfg))


def auth_token(flag: str | None, path: str | None) -> str | None:
    """The bearer token: --auth-token, else the first line of --auth-token-file, else the
    JAXINFER_AUTH_TOKEN environment variable; None: no auth."""
    import os

    if flag and path:
        raise ValueError("give --auth-token or --auth-token-file, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as e:
            raise ValueError(f"cannot read --auth-token-file {path}: {e.strerror}") from None
        if not token:
            raise ValueError(f"--auth-token-file {path} is empty")
        return token
    return flag or os.environ.get("JAXINFER_AUTH_TOKEN") or None


def banner(cfg: ServerConfig, server: GenerationServer) -> str:
    web = "https" if cfg.tls_cert else "http"
    metrics_web = "http" if cfg.metrics_public or not cfg.tls_cert else "https"
    out = f"jaxinfer serve: listening on {cfg.host}:{server.port}{' (TLS)' if cfg.tls_cert else ''}"
    if server.metrics_port:
        out += f", metrics on {metrics_web}://{cfg.host}:{server.metrics_port}/metrics"
    if server.http_port:
        out += f", OpenAI API on {web}://{cfg.host}:{server.http_port}/v1"
    return out


async def _serve(llm, cfg: ServerConfig) -> int:
    server = GenerationServer(llm, cfg)
    await server.start()
    print(banner(cfg, server), flush=True)
    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("jaxinfer serve: draining", file=sys.stderr, flush=True)
    await server.stop()
    print("jaxinfer serve: stopped", file=sys.stderr, flush=True)
    return 0
