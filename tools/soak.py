"""Bounded soak of a `jaxinfer serve` on loopback: mixed traffic at ~2x capacity, then checks.

    python -m tools.soak --target 127.0.0.1:9000 --duration 60
    python -m tools.soak --model /path/to/model --duration 30     # starts its own server

Traffic (seeded): normal streams (greedy / seeded sampling / stop strings), mid-stream client
cancellations, short deadlines, and malformed requests, from 2 x max_slots closed-loop clients.
It stops by itself after --duration seconds or --max-requests requests. Afterwards it waits for
the server to drain and checks, via the Stats RPC and health: every request got a complete
answer (final message, token count == usage) or a clear status (CANCELLED, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED, INVALID_ARGUMENT); nothing hung (lost = 0); no unexpected errors; the KV page
pool is 100 % free; the server is still SERVING. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time

import numpy as np

KINDS = ("normal", "cancel", "deadline", "malformed")
WEIGHTS = (0.5, 0.2, 0.15, 0.15)


def _malformed(vocab: int, max_len: int) -> list[dict]:
    return [
        {}, {"prompt": ""}, {"prompt_token_ids": [vocab]}, {"prompt_token_ids": [-1]},
        {"prompt_token_ids": [5], "max_tokens": 0}, {"prompt_token_ids": [5], "max_tokens": max_len},
        {"prompt_token_ids": [5], "temperature": -1.0}, {"prompt_token_ids": [5], "top_p": 0.0},
        {"prompt_token_ids": [5], "top_k": -2}, {"prompt_token_ids": [5], "logprobs": 99},
        {"prompt_token_ids": [5], "stop": [""]}, {"prompt": "x", "prompt_token_ids": [5]},
    ]


async def _request(stub, kind: str, rng, vocab: int, max_len: int, metadata, hang_s: float) -> str:
    import grpc

    from serve.proto import jaxinfer_pb2

    ids = rng.integers(3, vocab, size=int(rng.integers(2, 48))).tolist()
    if kind == "malformed":
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
        if final is None or final.finish_reason not in ("stop", "length"):
            return "error:incomplete"
        if final.usage.completion_tokens != n_tok:
            return "error:usage-mismatch"
        return "completed"

    try:
        return await asyncio.wait_for(consume(), hang_s)
    except asyncio.TimeoutError:
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
        if code == grpc.StatusCode.INVALID_ARGUMENT and kind == "malformed":
            return "invalid"
        return f"error:{code.name}:{e.details()[:80]}"


async def run_soak(target: str, *, duration_s: float = 30.0, max_requests: int | None = None,
                   concurrency: int | None = None, seed: int = 0, metadata=(),
                   hang_s: float = 60.0, drain_s: float = 60.0) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc

    host = target.rsplit(":", 1)[0].strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"soak runs against loopback only, got {target!r}")
    async with grpc.aio.insecure_channel(target) as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)
        s0 = await stub.Stats(jaxinfer_pb2.StatsRequest(), metadata=metadata)
        concurrency = concurrency or 2 * s0.max_slots
        counts: dict[str, int] = {}
        sent = 0
        t_end = time.monotonic() + duration_s
        master = np.random.default_rng(seed)

        async def worker(wseed: int):
            nonlocal sent
            rng = np.random.default_rng(wseed)
            while time.monotonic() < t_end and (max_requests is None or sent < max_requests):
                sent += 1
                kind = KINDS[int(rng.choice(len(KINDS), p=WEIGHTS))]
                out = await _request(stub, kind, rng, s0.vocab_size, s0.max_model_len, metadata,
                                     hang_s)
                counts[out] = counts.get(out, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(int(master.integers(1 << 31))) for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
        # Drain: every request the server saw must end; then the pool must be whole again.
        deadline = time.monotonic() + drain_s
        while True:
            s1 = await stub.Stats(jaxinfer_pb2.StatsRequest(), metadata=metadata)
            drained = s1.in_flight == 0 and s1.running == 0 and s1.queue_depth == 0
            if (drained and s1.pages_free == s1.pages_total) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
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
        "error_kinds": errors, "lost": counts.get("lost", 0) + (sent - accounted),
        "drained": drained, "pages_free_after": s1.pages_free, "pages_total": s1.pages_total,
        "serving": health.status == health_pb2.HealthCheckResponse.SERVING and live.is_live,
        "server_requests_delta": server,
        "tokens_generated": s1.tokens_generated - s0.tokens_generated,
    }
    summary["ok"] = (summary["lost"] == 0 and summary["errors"] == 0 and drained
                     and s1.pages_free == s1.pages_total and summary["serving"])
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="host:port of a running server (loopback)")
    p.add_argument("--model", default=None, help="start an in-process server on this model instead")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None, help="default: 2 x max_slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auth-token", default=None)
    p.add_argument("--compile-cache", default=".jax_cache", help="with --model: jax cache dir")
    a = p.parse_args(argv)
    server = None
    if a.model:
        import jax

        # Persistent compile cache (as the test suite uses): a rerun skips the compiles of the
        # many shape/sampling variants mixed traffic touches.
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        from runtime import LLM
        from serve.grpc_server import ServerConfig, ServerThread

        llm = LLM(a.model, max_slots=a.max_slots, max_model_len=a.max_model_len)
        server = ServerThread(llm, ServerConfig(port=0, auth_token=a.auth_token))
        a.target = f"127.0.0.1:{server.port}"
    if not a.target:
        p.error("give --target or --model")
    md = (("authorization", f"Bearer {a.auth_token}"),) if a.auth_token else ()
    try:
        s = asyncio.run(run_soak(a.target, duration_s=a.duration, max_requests=a.max_requests,
                                 concurrency=a.concurrency, seed=a.seed, metadata=md))
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(s, indent=2))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
