"""Hostile input at the front door (loopback only): every defect found by trying the server as a
hostile client would, one test each. No request, line or model may take the engine down: bad
input gets a 4xx / INVALID_ARGUMENT naming the field, and the server keeps serving with every
slot and page back."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer import SamplingParams
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc

ENGINE = dict(max_slots=4, page_size=8, max_model_len=256)
MODEL = "tiny"
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    s = ServerThread(llm_for(tiny_dir, tag="server", **ENGINE),
                     ServerConfig(port=0, http_port=0, max_queue=16, max_samples=8,
                                  max_message_bytes=BODY_LIMIT, model_name=MODEL))
    yield s
    s.stop()


def post(server, path, body=None, *, data=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    payload = data if data is not None else json.dumps(body).encode()
    conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out else None


def health(server) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def assert_serving(server):
    """Health 200 / SERVING, a plain request completes, and every slot and page is back."""
    assert health(server) == 200
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "To be", "max_tokens": 3,
                                                    "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
    t = time.monotonic() + 15
    while True:
        s = server.loop.stats()
        if s["in_flight"] == 0 and s["running"] == 0 and s["queue_depth"] == 0:
            break
        assert time.monotonic() < t, s
        time.sleep(0.02)
    assert s["pages_free"] == s["pages_total"] and s["healthy"]


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_huge_top_k_is_400_not_a_dead_engine(server, top_k):
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                    "top_k": top_k})
    assert status == 400 and body["error"]["param"] == "top_k", body
    assert_serving(server)


def test_one_huge_request_gets_429_alone(server):
    prompts = [f"prompt number {i}" for i in range(100)]
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "n": 8,
                                                    "max_tokens": 2})
    assert status == 429 and body["error"]["code"] == "queue_full", body
    # 16 sequences exactly fill the queue: 2 prompts x 8 samples are taken as one request
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts[:2], "n": 8,
                                                    "max_tokens": 2, "temperature": 0})
    assert status == 200 and len(body["choices"]) == 16
    status, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts[:3], "n": 8,
                                                 "max_tokens": 2})
    assert status == 429
    assert_serving(server)


def test_queue_depth_counts_sequences_and_comes_back_to_zero(server):
    """Fill the engine (4 slots) and the queue, cancel everything: the depth returns to 0 while
    idle, and a new request is admitted (a stale depth would keep refusing it)."""
    loop = server.loop
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    running = [loop.submit([5, 6, 7], long) for _ in range(4)]
    t = time.monotonic() + 15
    while loop.stats()["running"] < 4 or loop.stats()["queue_depth"]:  # depth: as of the last step
        assert time.monotonic() < t
        time.sleep(0.01)
    queued = [loop.submit([5, 6], long, n=8), loop.submit([7, 8], long, n=8)]
    assert loop.stats()["queue_depth"] == 16
    with pytest.raises(Exception, match="queue"):
        loop.submit([5], long)
    for h in running + queued:
        h.cancel()
    t = time.monotonic() + 15
    while loop.stats()["queue_depth"] or loop.stats()["running"]:
        assert time.monotonic() < t, loop.stats()
        time.sleep(0.01)
    assert_serving(server)


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
def test_deeply_nested_json_is_400(server, data):
    status, body = post(server, "/v1/completions", data=data)
    assert status == 400 and "error" in body
    assert_serving(server)


def test_chunked_body_is_refused_at_the_limit_not_buffered_whole(server):
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    sent, answer = 0, b""
    sock.settimeout(0.02)
    try:  # keep sending up to 8x the limit: the server must answer 413 long before that
        while sent < 8 * BODY_LIMIT and not answer:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            try:
                answer = sock.recv(4096)
            except TimeoutError:
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    if not answer:
        sock.settimeout(10)
        answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
    assert sent <= 2 * BODY_LIMIT
    assert_serving(server)


def test_health_tells_nothing_about_the_model(server, tiny_dir):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/health")
    body = conn.getresponse().read().decode()
    conn.close()
    assert json.loads(body) == {"status": "ok"}
    assert str(tiny_dir) not in body and MODEL not in body


def test_undecodable_protobuf_is_invalid_argument(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        raw = ch.unary_stream("/jaxinfer.v1.Generation/Generate",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        invalid0 = server.loop.stats()["requests"]["invalid"]
        for junk in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05\x01"):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(junk, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        unary = ch.unary_unary("/jaxinfer.v1.Generation/Stats",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            unary(b"\xff\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert server.loop.stats()["requests"]["invalid"] == invalid0 + 4
    assert_serving(server)


def test_a_huge_prompt_does_not_stall_the_event_loop(tiny_dir, llm_for):
    """Tokenizing a ~12 MB prompt takes seconds; meanwhile health and small requests on the same
    event loop answer at once (tokenization runs on the offload pool)."""
    # a second server beside the module's: the untagged engine (the module's is tagged)
    s = ServerThread(llm_for(tiny_dir, **ENGINE), ServerConfig(port=0, http_port=0,
                                                               model_name=MODEL))
    try:
        text = "To be or not to be, that is the question. " * 280_000  # ~12 MB
        result = {}

        def big():
            with grpc.insecure_channel(f"127.0.0.1:{s.port}",
                                       options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    list(jaxinfer_pb2_grpc.GenerationStub(ch).Generate(
                        jaxinfer_pb2.GenerateRequest(prompt=text, max_tokens=2), timeout=120))
                result["code"], result["s"] = e.value.code(), time.monotonic() - t0

        t = threading.Thread(target=big)
        t.start()
        lat = []
        while t.is_alive():
            t0 = time.monotonic()
            assert health(s) == 200
            lat.append(time.monotonic() - t0)
            time.sleep(0.02)
        t.join()
        assert result["code"] == grpc.StatusCode.INVALID_ARGUMENT  # longer than max_model_len
        assert result["s"] > 1.0 and len(lat) >= 5
        assert max(lat) < 0.5 * result["s"], (max(lat), result["s"])
    finally:
        s.stop()


def test_an_engine_fault_fails_its_request_and_the_server_keeps_serving(server):
    """A step that raises inside the engine: that request gets 500 / INTERNAL, health stays
    honest (still serving), the next request works and no page leaks."""
    eng = server.loop.engine
    from tests.faults import fail_once

    real = eng._step
    fail_once(eng, 2)
    errors0 = server.loop.stats()["requests"]["error"]
    try:
        status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                        "max_tokens": 8, "ignore_eos": True})
        assert status == 500 and "injected device failure" in body["error"]["message"], body
    finally:
        eng._step = real
    assert_serving(server)
    assert server.loop.stats()["requests"]["error"] == errors0 + 1 and eng.faults == 1


def test_soak_over_grpc_and_http_with_hostile_traffic_loses_nothing(server):
    import asyncio

    from jaxinfer.tools.soak import run_soak

    s = asyncio.run(run_soak(f"127.0.0.1:{server.port}",
                             http_target=f"127.0.0.1:{server.http_port}", model=MODEL,
                             duration_s=60.0, max_requests=24, seed=3, hang_s=120,
                             weights=(0.5, 0.1, 0.1, 0.1, 0.2)))
    assert s["lost"] == 0 and s["errors"] == 0, s
    parts = ("completed", "cancelled", "deadline_exceeded", "rejected", "invalid", "errors", "lost")
    assert sum(s[k] for k in parts) == s["sent"] == 24, s
    assert s["sent_by_kind"]["hostile"] >= 3 and s["invalid"] > 0 and s["completed"] > 0, s
    assert all(v.get("completed") for v in s["by_transport"].values()), s
    # health polled all along (every 0.25 s: a soak of ~1 s polls 4-5 times)
    assert s["health_polls"] >= min(5, 2 + int(s["duration_s"] / 0.5)), s
    assert not s["health_not_serving"] and s["engine_faults"] == 0, s
    assert s["pages_free_after"] == s["pages_total"] and s["drained"] and s["serving"], s
    assert s["ok"]


def test_auth_token_from_file_or_environment(tmp_path, monkeypatch):
    from jaxinfer.serve.grpc_server import auth_token

    monkeypatch.delenv("JAXINFER_AUTH_TOKEN", raising=False)
    assert auth_token(None, None) is None
    monkeypatch.setenv("JAXINFER_AUTH_TOKEN", "from-env")
    assert auth_token(None, None) == "from-env"
    assert auth_token("from-flag", None) == "from-flag"
    f = tmp_path / "token"
    f.write_text("  from-file \nsecond line\n")
    assert auth_token(None, str(f)) == "from-file"  # the first line, stripped; beats the env
    with pytest.raises(ValueError, match="not both"):
        auth_token("from-flag", str(f))
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth_token(None, str(f))
    with pytest.raises(ValueError, match="cannot read"):
        auth_token(None, str(tmp_path / "missing"))
