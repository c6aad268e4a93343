"""Bounded soak of a `jaxinfer serve` on loopback: mixed traffic at ~2x capacity, then checks.

    python -m jaxinfer.tools.soak --target 127.0.0.1:9000 [--http-target 127.0.0.1:8000] --duration 60
    python -m jaxinfer.tools.soak --model /path/to/model --duration 60     # starts its own server (both)

Traffic (seeded), from 2 x max_slots closed-loop clients, split over gRPC and the OpenAI HTTP
API when both are given: 73 % normal requests (greedy / seeded sampling / stop strings, streamed
or not), 10 % mid-stream client cancellations, 10 % short deadlines, 5 % malformed requests and
2 % hostile ones (top_k past 2**31, NaN, deep JSON, 100 prompts x 8 samples, undecodable
protobuf, a 1 MB prompt, lone surrogates). It stops by itself after --duration seconds or
--max-requests requests, while a monitor polls gRPC health and HTTP /health every 0.25 s.
Afterwards it waits for the server to drain and checks, via the Stats RPC and health: every
request got a complete answer (final message; over gRPC token count == usage) or a clear status
(CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED / 429, INVALID_ARGUMENT / 4xx); nothing hung
(lost = 0); no unexpected errors (no 5xx, no INTERNAL); the KV page pool is 100 % free; health
said serving at every poll and still does. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import sys
import time

import numpy as np

KINDS = ("normal", "cancel", "deadline", "malformed", "hostile")
WEIGHTS = (0.73, 0.10, 0.10, 0.05, 0.02)


def _malformed(vocab: int, max_len: int) -> list[dict]:
    return [
        {}, {"prompt": ""}, {"prompt_token_ids": [vocab]}, {"prompt_token_ids": [-1]},
        {"prompt_token_ids": [5], "max_tokens": 0}, {"prompt_token_ids": [5], "max_tokens": max_len},
        {"prompt_token_ids": [5], "temperature": -1.0}, {"prompt_token_ids": [5], "top_p": 0.0},
        {"prompt_token_ids": [5], "top_k": -2}, {"prompt_token_ids": [5], "logprobs": 99},
        {"prompt_token_ids": [5], "stop": [""]}, {"prompt": "x", "prompt_token_ids": [5]},
    ]


def _hostile_grpc(vocab: int) -> list:
    """Inputs that once took a server down: the serialized GenerateRequest bytes of each."""
    from jaxinfer.serve.proto import jaxinfer_pb2

    msgs = [dict(prompt_token_ids=[5], top_k=2**31 - 1), dict(prompt="x" * (1 << 20)),
            dict(prompt_token_ids=[5], seed=-(2**63)), dict(prompt_token_ids=[vocab - 1] * 3,
                                                            stop_token_ids=[2**31 - 1])]
    out = [jaxinfer_pb2.GenerateRequest(**m).SerializeToString() for m in msgs]
    return out + [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"]  # undecodable


HOSTILE_HTTP = [  # (path, raw body)
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "top_k": 2147483648}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "top_k": 100000000000000000000000}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"model": "%s", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/completions", b'{"model": "%s", "prompt": ["p"' + b', "p"' * 99 + b'], "n": 8}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800 lone", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": '
                             b'[[[[[[[[[[]]]]]]]]]]}]}'),
]
MALFORMED_HTTP = [
    b'{"model": "%s"}', b'{"model": "%s", "prompt": ""}', b'{not json',
    b'{"model": "%s", "prompt": "hi", "max_tokens": -1}', b'{"model": "%s", "prompt": "hi", "n": 0}',
    b'{"model": "%s", "prompt": "hi", "stop": [""]}', b'{"model": "%s", "prompt": [1, 99999999]}',
]


async def _http(target: str, path: str, body: bytes, token: str | None, *, read_events=None,
                timeout=None):
    """One HTTP/1.1 request (Connection: close) -> (status, body bytes); `read_events`: close
    after that many SSE events (a client going away mid-stream)."""
    host, port = target.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if token:
            head += f"Authorization: Bearer {token}\r\n"
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()

        async def read():
            status = int((await reader.readline()).split()[1])
            if read_events is not None:
                seen = 0
                while seen < read_events:
                    line = await reader.readline()
                    if not line:
                        break
                    seen += line.startswith(b"data: ")
                return status, b""
            rest = await reader.read()  # headers, blank line, body (Connection: close)
            return status, rest.split(b"\r\n\r\n", 1)[-1]

        return await asyncio.wait_for(read(), timeout)
    finally:
        writer.close()


async def _http_request(target, kind: str, rng, model: str, max_len: int, token, hang_s: float) -> str:
    if kind in ("malformed", "hostile"):
        table = MALFORMED_HTTP if kind == "malformed" else [b for _, b in HOSTILE_HTTP]
        i = int(rng.integers(len(table)))
        path = HOSTILE_HTTP[i][0] if kind == "hostile" else "/v1/completions"
        body = table[i].replace(b"%s", model.encode()) if b"%s" in table[i] else table[i]
        try:
            status, _ = await _http(target, path, body, token, timeout=hang_s)
        except TimeoutError:
            return "lost"
        if status == 429:
            return "rejected"
        return "invalid" if 400 <= status < 500 else f"error:http-{status}:{kind}"
    long = kind in ("cancel", "deadline")
    stream = kind == "cancel" or bool(rng.integers(2))
    req = {"model": model, "prompt": " ".join(["to be or not"] * int(rng.integers(1, 8))),
           "max_tokens": int(rng.integers(64, 200) if long else rng.integers(1, 48)),
           "temperature": float(rng.choice([0.0, 0.8])), "stream": stream}
    if stream:
        req["stream_options"] = {"include_usage": True}
    body = json.dumps(req).encode()
    try:
        if kind == "cancel":
            await _http(target, "/v1/completions", body, token, read_events=int(rng.integers(1, 4)),
                        timeout=hang_s)
            return "cancelled"
        if kind == "deadline":
            try:
                await _http(target, "/v1/completions", body, token,
                            timeout=float(rng.uniform(0.002, 0.05)))
            except TimeoutError:
                return "deadline"
            return "completed"
        status, out = await _http(target, "/v1/completions", body, token, timeout=hang_s)
    except TimeoutError:
        return "lost"
    if status == 429:
        return "rejected"
    if status != 200:
        return f"error:http-{status}"
    if stream:
        return "completed" if b"data: [DONE]" in out else "error:incomplete"
    resp = json.loads(out)
    ok = resp["choices"][0]["finish_reason"] in ("stop", "length")
    return "completed" if ok else "error:incomplete"


async def _request(stub, kind: str, rng, vocab: int, max_len: int, metadata, hang_s: float) -> str:
    import grpc

    from jaxinfer.serve.proto import jaxinfer_pb2

    ids = rng.integers(3, vocab, size=int(rng.integers(2, 48))).tolist()
    if kind == "hostile":
        raw = _hostile_grpc(vocab)[int(rng.integers(6))]
        call = stub.raw(raw, metadata=metadata, timeout=hang_s)
    elif kind == "malformed":
        bad = _malformed(vocab, max_len)
        req = jaxinfer_pb2.GenerateRequest(**bad[int(rng.integers(len(bad)))])
    else:
        long = kind in ("cancel", "deadline")
        kw = dict(prompt_token_ids=ids, max_tokens=int(rng.integers(64, 200) if long else rng.integers(1, 48)))
        style = int(rng.integers(3))
        if style == 0:
            kw.update(temperature=0.0)
        elif style == 1:
            kw.update(temperature=0.8, top_k=20, top_p=0.9, seed=int(rng.integers(1 << 30)))
        else:
            kw.update(temperature=1.0, stop=["e", "th"], logprobs=2)
        req = jaxinfer_pb2.GenerateRequest(**kw)
    timeout = float(rng.uniform(0.002, 0.05)) if kind == "deadline" else None
    if kind != "hostile":
        call = stub.Generate(req, metadata=metadata, timeout=timeout)
    cancel_after = int(rng.integers(1, 4)) if kind == "cancel" else None

    async def consume() -> str:
        n_msgs, n_tok, final = 0, 0, None
        async for msg in call:
            n_msgs += 1
            n_tok += len(msg.token_ids)
            if msg.HasField("final"):
                final = msg.final
            if cancel_after is not None and n_msgs >= cancel_after and final is None:
                call.cancel()
                return "cancelled"
        if kind == "hostile":
            return "completed"  # e.g. the stop id past the vocabulary: refused or served
        if final is None or final.finish_reason not in ("stop", "length"):
            return "error:incomplete"
        if final.usage.completion_tokens != n_tok:
            return "error:usage-mismatch"
        return "completed"

    try:
        return await asyncio.wait_for(consume(), hang_s)
    except TimeoutError:
        call.cancel()
        return "lost"
    except asyncio.CancelledError:
        if call.cancelled():
            return "cancelled"
        raise
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.CANCELLED and kind == "cancel":
            return "cancelled"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "deadline":
            return "deadline"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "rejected"
        if code == grpc.StatusCode.INVALID_ARGUMENT and kind in ("malformed", "hostile"):
            return "invalid"
        return f"error:{code.name}:{e.details()[:80]}"


async def _get_status(target: str, path: str) -> int:
    host, port = target.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split()[1])
    finally:
        writer.close()


def _check_loopback(target: str) -> None:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"soak runs against loopback only, got {target!r}")


async def run_soak(target: str, *, http_target: str | None = None, model: str = "default",
                   duration_s: float = 30.0, max_requests: int | None = None,
                   concurrency: int | None = None, seed: int = 0, token: str | None = None,
                   hang_s: float = 60.0, drain_s: float = 60.0, weights=WEIGHTS) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc

    for t in (target, http_target):
        if t:
            _check_loopback(t)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(target) as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)
        stub.raw = ch.unary_stream("/jaxinfer.v1.Generation/Generate",
                                   request_serializer=lambda b: b,
                                   response_deserializer=jaxinfer_pb2.GenerateResponse.FromString)
        s0 = await stub.Stats(jaxinfer_pb2.StatsRequest(), metadata=metadata)
        concurrency = concurrency or 2 * s0.max_slots
        counts: dict[str, int] = {}
        by_transport: dict[str, dict[str, int]] = {"grpc": {}, "http": {}}
        health_polls, health_bad = 0, []
        sent_by_kind: dict[str, int] = {}
        sent = 0
        t_end = time.monotonic() + duration_s
        master = np.random.default_rng(seed)
        health_stub = health_pb2_grpc.HealthStub(ch)

        async def worker(i: int, wseed: int):
            nonlocal sent
            rng = np.random.default_rng(wseed)
            transport = "http" if http_target and i % 2 else "grpc"
            while time.monotonic() < t_end and (max_requests is None or sent < max_requests):
                sent += 1
                kind = KINDS[int(rng.choice(len(KINDS), p=weights))]
                sent_by_kind[kind] = sent_by_kind.get(kind, 0) + 1
                if transport == "http":
                    out = await _http_request(http_target, kind, rng, model, s0.max_model_len,
                                              token, hang_s)
                else:
                    out = await _request(stub, kind, rng, s0.vocab_size, s0.max_model_len,
                                         metadata, hang_s)
                counts[out] = counts.get(out, 0) + 1
                tc = by_transport[transport]
                tc[out.split(":")[0]] = tc.get(out.split(":")[0], 0) + 1

        async def monitor():
            nonlocal health_polls
            while not done.is_set():
                r = await health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
                health_polls += 1
                if r.status != health_pb2.HealthCheckResponse.SERVING:
                    health_bad.append(f"grpc:{r.status}")
                if http_target:
                    status = await _get_status(http_target, "/health")
                    if status != 200:
                        health_bad.append(f"http:{status}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.25)

        async def load():
            try:
                await asyncio.gather(*(worker(i, int(master.integers(1 << 31)))
                                       for i in range(concurrency)))
            finally:
                done.set()

        done = asyncio.Event()
        t0 = time.monotonic()
        await asyncio.gather(monitor(), load())
        elapsed = time.monotonic() - t0
        # Drain: every request the server saw must end; then the pool must be whole again.
        deadline = time.monotonic() + drain_s
        while True:
            s1 = await stub.Stats(jaxinfer_pb2.StatsRequest(), metadata=metadata)
            drained = s1.in_flight == 0 and s1.running == 0 and s1.queue_depth == 0
            if (drained and s1.pages_free == s1.pages_total) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        health = await health_stub.Check(health_pb2.HealthCheckRequest(service=""))
        if http_target and await _get_status(http_target, "/health") != 200:
            health_bad.append("http:after")
        live = await jetstream_pb2_grpc.OrchestratorStub(ch).HealthCheck(
            jetstream_pb2.HealthCheckRequest(), metadata=metadata)
    errors = {k: v for k, v in counts.items() if k.startswith("error")}
    accounted = sum(counts.values())
    server = {k: s1.requests.get(k, 0) - s0.requests.get(k, 0) for k in s1.requests}
    summary = {
        "duration_s": round(elapsed, 2), "concurrency": concurrency, "sent": sent,
        "completed": counts.get("completed", 0), "cancelled": counts.get("cancelled", 0),
        "deadline_exceeded": counts.get("deadline", 0), "rejected": counts.get("rejected", 0),
        "invalid": counts.get("invalid", 0), "errors": sum(errors.values()),
        "sent_by_kind": sent_by_kind,
        "error_kinds": errors, "lost": counts.get("lost", 0) + (sent - accounted),
        "drained": drained, "pages_free_after": s1.pages_free, "pages_total": s1.pages_total,
        "serving": health.status == health_pb2.HealthCheckResponse.SERVING and live.is_live,
        "health_polls": health_polls, "health_not_serving": health_bad,
        "engine_faults": s1.requests.get("error", 0) - s0.requests.get("error", 0),
        "by_transport": by_transport, "requests_per_s": round(sent / max(elapsed, 1e-9), 2),
        "server_requests_delta": server,
        "tokens_generated": s1.tokens_generated - s0.tokens_generated,
    }
    summary["ok"] = (summary["lost"] == 0 and summary["errors"] == 0 and drained
                     and s1.pages_free == s1.pages_total and summary["serving"] and not health_bad)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="host:port of a running server (loopback)")
    p.add_argument("--http-target", default=None,
                   help="host:port of the same server's OpenAI HTTP API: half the clients use it")
    p.add_argument("--served-model", default="default", help="the HTTP API's model name")
    p.add_argument("--model", default=None, help="start an in-process server on this model instead")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None, help="default: 2 x max_slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auth-token", default=os.environ.get("JAXINFER_AUTH_TOKEN"),
                   help="bearer token of the server (default: $JAXINFER_AUTH_TOKEN)")
    p.add_argument("--compile-cache", default=".jax_cache", help="with --model: jax cache dir")
    a = p.parse_args(argv)
    server = None
    if a.model:
        import jax

        # Persistent compile cache (as the test suite uses): a rerun skips the compiles of the
        # many shape/sampling variants mixed traffic touches.
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        from jaxinfer.runtime.llm import LLM
        from jaxinfer.serve.grpc_server import ServerConfig, ServerThread

        llm = LLM(a.model, max_slots=a.max_slots, max_model_len=a.max_model_len)
        server = ServerThread(llm, ServerConfig(port=0, http_port=0, auth_token=a.auth_token,
                                                model_name=a.served_model))
        a.target = f"127.0.0.1:{server.port}"
        a.http_target = f"127.0.0.1:{server.http_port}"
    if not a.target:
        p.error("give --target or --model")
    try:
        s = asyncio.run(run_soak(a.target, http_target=a.http_target, model=a.served_model,
                                 duration_s=a.duration, max_requests=a.max_requests,
                                 concurrency=a.concurrency, seed=a.seed, token=a.auth_token))
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(s, indent=2))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
