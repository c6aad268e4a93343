"""Weights in place through the servers: HTTP POST /v1/update_weights (drain: a request under
way finishes on the old weights, the next runs on the new ones), a bad checkpoint refused with
the old version serving on, /sleep, /wake_up, /is_sleeping, all behind the auth token; the
same through gRPC (UpdateWeights, Sleep, WakeUp)."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import jax
import pytest

from jaxinfer import LLM, SamplingParams
from tests.engines import TINY
from tests.http_helpers import call as http_call

TOKEN = "tok"
PROMPT = "To be, or not to be, that is the question"


def call(server, method, path, body=None, token=TOKEN):
    return http_call(server, method, path, body, token)


def complete(server, max_tokens=8):
    status, body = call(server, "POST", "/v1/completions", dict(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return status, body["choices"][0]["text"] if status == 200 else body


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    """(server, new checkpoint dir, {(version, max_tokens): reference text})."""
    from jaxinfer.checkpoints.orbax_io import save_converted
    from jaxinfer.serve.grpc_server import ServerConfig, ServerThread

    llm = LLM(str(tiny_dir), **TINY)
    old = llm.get_weights()
    new = jax.tree.map(lambda x: x * 1.1, old)
    d = save_converted(tmp_path_factory.mktemp("w") / "new", llm.model.cfg, new, source="test",
                       tokenizer_dir=Path(llm.model.source))
    ref = {}
    for version, w in (("new", new), ("old", old)):
        llm.update_weights(w)
        for n in (8, 200):
            ref[version, n] = llm.generate(PROMPT, SamplingParams(
                max_tokens=n, temperature=0, ignore_eos=True))[0].text
    assert ref["old", 8] != ref["new", 8]
    s = ServerThread(llm, ServerConfig(port=0, http_port=0, max_queue=64, auth_token=TOKEN,
                                       model_name="tiny"))
    yield s, str(d), ref
    s.stop()


def test_update_weights_drains_then_serves_the_new_version(setup):
    server, d, ref = setup
    assert call(server, "POST", "/v1/update_weights", {"path": d}, token=None)[0] == 401
    status, body = call(server, "POST", "/v1/update_weights", {"path": d + "-missing"})
    assert status == 400 and body["error"]["param"] == "path"
    assert "previous version serves on" in body["error"]["message"]
    status, body = call(server, "POST", "/v1/update_weights", {"path": d, "policy": "later"})
    assert status == 400 and body["error"]["param"] == "policy"
    assert complete(server) == (200, ref["old", 8])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(complete, server, 200)
        while server.loop.stats()["running"] == 0 and not long.done():
            time.sleep(0.001)  # the long request is under way
        under_way = not long.done()
        status, body = call(server, "POST", "/v1/update_weights", {"path": d, "version": "v2"})
        assert status == 200 and body == {"weight_version": "v2"}
        assert under_way  # it finished on the old weights (drained first):
        assert long.result() == (200, ref["old", 200])
    assert complete(server) == (200, ref["new", 8])


def test_sleep_refuses_requests_until_woken(setup):
    server, _, _ = setup
    before = complete(server)
    assert call(server, "POST", "/sleep", {"level": 3})[0] == 400
    status, body = call(server, "POST", "/sleep", {"level": 1})
    assert status == 200 and body["device_bytes_after"] < body["device_bytes_before"]
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True, "sleep_level": 1})
    status, body = complete(server)
    assert status == 503 and body["error"]["code"] == "asleep"
    assert call(server, "POST", "/wake_up")[0] == 200
    assert call(server, "GET", "/is_sleeping")[1]["is_sleeping"] is False
    assert complete(server) == before


def test_grpc_update_weights_sleep_and_wake(setup):
    import grpc

    from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc

    server, d, ref = setup
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)

        def generate():
            final = [m.final for m in stub.Generate(jaxinfer_pb2.GenerateRequest(
                prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True), metadata=auth)
                if m.HasField("final")]
            return final[0]

        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(jaxinfer_pb2.UpdateWeightsRequest(path=d + "-missing"),
                               metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "previous version serves on" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(jaxinfer_pb2.UpdateWeightsRequest(path=d))  # no token
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        r = stub.UpdateWeights(jaxinfer_pb2.UpdateWeightsRequest(path=d, version="g1"),
                               metadata=auth)
        assert r.weight_version == "g1" and generate().weight_version == "g1"
        s = stub.Sleep(jaxinfer_pb2.SleepRequest(level=2), metadata=auth)
        assert s.sleep_level == 2 and s.device_bytes_after < s.device_bytes_before
        with pytest.raises(grpc.RpcError) as e:
            generate()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stub.WakeUp(jaxinfer_pb2.WakeUpRequest(), metadata=auth).sleep_level == 0
        assert generate().finish_reason == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/update_weights", {"path": 7}, "path"),
    ("/v1/update_weights", {"path": ""}, "path"),
    ("/v1/update_weights", {"path": "x", "version": [1]}, "version"),
    ("/v1/update_weights", {"path": "x", "version": 1.5}, "version"),
    ("/v1/update_weights", {"path": "x", "policy": None}, "policy"),
    ("/v1/update_weights", {"path": "x", "extra": 1}, "extra"),
    ("/v1/update_weights", [1, 2], None),
    ("/v1/update_weights", {"path": "/" * 100_000}, None),  # over the body limit: 413
    ("/sleep", {"level": "2"}, "level"),
    ("/sleep", {"level": True}, "level"),
    ("/sleep", {"level": -1}, "level"),
    ("/sleep", {"level": float("nan")}, "level"),
])
def test_hostile_admin_bodies_refused_and_serving_goes_on(setup, path, body, param):
    server, _, ref = setup
    status, out = call(server, "POST", path, body)
    assert status in (400, 413), (status, out)
    if param is not None and status == 400:
        assert out["error"]["param"] == param, out
    assert call(server, "GET", "/is_sleeping")[1]["is_sleeping"] is False
    assert complete(server)[0] == 200


def test_deeply_nested_body_refused(setup):
    server, _, _ = setup
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", "/v1/update_weights", b"[" * 50_000 + b"]" * 50_000,
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status in (400, 413)
    assert complete(server)[0] == 200
