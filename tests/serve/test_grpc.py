"""The gRPC service against real servers on 127.0.0.1 (random free ports), tiny random Llama."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer import LLM, SamplingParams
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread
from jaxinfer.serve.metrics import parse_text
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc

ENGINE = dict(max_slots=4, page_size=8, max_model_len=1024)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ref_llm(tiny_dir, llm_for):
    return llm_for(tiny_dir, **ENGINE)


@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    s = ServerThread(llm_for(tiny_dir, tag="server", **ENGINE),
                     ServerConfig(port=0, metrics_port=0, max_queue=64, max_samples=4))
    yield s
    s.stop()


@pytest.fixture()
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def gen_stub(ch):
    return jaxinfer_pb2_grpc.GenerationStub(ch)


def stats(ch, metadata=()):
    return gen_stub(ch).Stats(jaxinfer_pb2.StatsRequest(), metadata=metadata)


def wait_idle(ch, timeout=10.0):
    t = time.monotonic() + timeout
    while True:
        s = stats(ch)
        if s.in_flight == 0 and s.running == 0 and s.pages_free == s.pages_total:
            return s
        assert time.monotonic() < t, f"server did not go idle: {s}"
        time.sleep(0.02)


def collect(responses):
    text, ids, lps, finals = "", [], [], []
    for m in responses:
        text += m.text
        ids += list(m.token_ids)
        lps += list(m.logprobs)
        if m.HasField("final"):
            finals.append(m.final)
    return text, ids, lps, finals


# ---- Generate vs LLM.generate ------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(max_tokens=24, temperature=0.0),
    dict(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, seed=1234),
    dict(max_tokens=20, temperature=1.0, min_p=0.05, seed=7, logprobs=3, prompt_logprobs=2),
])
def test_generate_matches_llm_generate(channel, ref_llm, kw):
    prompt = "To be, or not to be, that is the question"
    want = ref_llm.generate([prompt], SamplingParams(**kw))[0]
    req = jaxinfer_pb2.GenerateRequest(prompt=prompt, **kw)
    text, ids, lps, finals = collect(gen_stub(channel).Generate(req, timeout=30))
    assert ids == want.token_ids and text == want.text
    assert len(finals) == 1
    f = finals[0]
    assert f.finish_reason == want.finish_reason
    assert f.usage.prompt_tokens == len(want.prompt_token_ids)
    assert f.usage.completion_tokens == len(ids)
    m = f.metrics
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
    assert len(m.itl_s) == len(ids) - 1 and m.itl_mean_s > 0
    if kw.get("logprobs"):
        assert [lp.token_id for lp in lps] == ids
        assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in lps)
        want_lp = [d["logprob"] for d in want.logprobs]
        assert [lp.logprob for lp in lps] == pytest.approx(want_lp, abs=1e-4)
    if kw.get("prompt_logprobs"):  # on the first message, one per prompt token after the first
        ms = list(gen_stub(channel).Generate(req, timeout=30))
        got = [list(m.prompt_logprobs) for m in ms]
        assert len(got[0]) == len(want.prompt_token_ids) - 1 and not any(got[1:])
        assert [e.token_id for e in got[0]] == want.prompt_token_ids[1:]
        assert [e.logprob for e in got[0]] == pytest.approx(
            [e["logprob"] for e in want.prompt_logprobs[1:]], abs=1e-5)
        assert all(len(e.top) == 2 for e in got[0])


def test_generate_structured_outputs(channel, ref_llm):
    prompt = "To be, or not to be, that is the question"
    for so, kw in (({"choice": ["yes", "no", "maybe"]}, dict(choice=jaxinfer_pb2.Choices(
            values=["yes", "no", "maybe"]))), ({"regex": "[0-9]{2}-[a-z]{2}"},
                                               dict(regex="[0-9]{2}-[a-z]{2}"))):
        want = ref_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.7, seed=5,
                                                         structured_outputs=so))[0]
        req = jaxinfer_pb2.GenerateRequest(
            prompt=prompt, max_tokens=12, temperature=0.7, seed=5,
            structured_outputs=jaxinfer_pb2.StructuredOutputs(**kw))
        text, ids, _, finals = collect(gen_stub(channel).Generate(req, timeout=30))
        assert (text, ids) == (want.text, want.token_ids) and finals[0].finish_reason == "stop"


def test_generate_token_ids_stop_strings_and_ignore_eos(channel, ref_llm):
    ids_in = ref_llm.tokenizer.encode("Now is the winter of our discontent")
    sp = SamplingParams(max_tokens=40, temperature=0.7, seed=3, stop=("e",), ignore_eos=True)
    want = ref_llm.generate([ids_in], sp)[0]
    req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=ids_in, max_tokens=40, temperature=0.7,
                                       seed=3, stop=["e"], ignore_eos=True)
    text, ids, _, finals = collect(gen_stub(channel).Generate(req, timeout=30))
    assert (text, ids, finals[0].finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert "e" not in text


# ---- JetStream wire compatibility (hand-encoded protobuf) --------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    return _varint(num << 3 | wire) + payload


def _len_field(num: int, data: bytes) -> bytes:
    return _field(num, 2, _varint(len(data)) + data)


def decode_request_bytes(*, max_tokens, text=None, token_ids=None, num_samples=None) -> bytes:
    """DecodeRequest from JetStream's field numbers: max_tokens=4, text_content=5 {text=1},
    token_content=6 {repeated int32 token_ids=1 (packed)}, num_samples=8."""
    out = _field(4, 0, _varint(max_tokens))
    if text is not None:
        out += _len_field(5, _len_field(1, text.encode()))
    if token_ids is not None:
        out += _len_field(6, _len_field(1, b"".join(_varint(t) for t in token_ids)))
    if num_samples is not None:
        out += _field(8, 0, _varint(num_samples))
    return out


def _parse(buf: bytes) -> list[tuple[int, int, object]]:
    """Generic protobuf parse: [(field, wire_type, value)] (varint -> int, len -> bytes)."""
    out, i = [], 0

    def varint():
        nonlocal i
        shift = val = 0
        while True:
            b = buf[i]
            i += 1
            val |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return val

    while i < len(buf):
        key = varint()
        num, wire = key >> 3, key & 7
        if wire == 0:
            out.append((num, wire, varint()))
        elif wire == 2:
            n = varint()
            out.append((num, wire, buf[i:i + n]))
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wire}")
    return out


def parse_decode_response(buf: bytes) -> list[tuple[str, list[int]]]:
    """DecodeResponse: must be stream_content=3 (never initial_content=2) with samples=1, each
    Sample {text=1, token_ids=2}. Returns [(text, token_ids)] per sample."""
    fields = _parse(buf)
    assert [f[0] for f in fields] == [3], f"not exactly one stream_content: {fields}"
    samples = []
    for num, wire, sample in _parse(fields[0][2]):
        assert (num, wire) == (1, 2)
        text, ids = "", []
        for sn, sw, v in _parse(sample):
            if sn == 1:
                text += v.decode()
            elif sn == 2 and sw == 2:  # packed
                j = 0
                while j < len(v):
                    shift = val = 0
                    while True:
                        b = v[j]
                        j += 1
                        val |= (b & 0x7F) << shift
                        shift += 7
                        if not b & 0x80:
                            break
                    ids.append(val)
            elif sn == 2:
                ids.append(v)
            else:
                raise AssertionError(f"unknown Sample field {sn}")
        samples.append((text, ids))
    return samples


def raw_decode(ch, body: bytes, timeout=30):
    call = ch.unary_stream("/jetstream_proto.Orchestrator/Decode")  # bytes in, bytes out
    return [parse_decode_response(m) for m in call(body, timeout=timeout)]


def test_decode_text_content_wire(channel, ref_llm):
    prompt = "What light through yonder window breaks?"
    want = ref_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    msgs = raw_decode(channel, decode_request_bytes(max_tokens=16, text=prompt))
    assert msgs and all(len(m) == 1 for m in msgs)
    assert all(m[0][1] for m in msgs)  # every message carries >= 1 token id
    assert [t for m in msgs for t in m[0][1]] == want.token_ids
    assert "".join(m[0][0] for m in msgs) == want.text


def test_decode_token_content_wire_and_num_samples(channel, ref_llm):
    ids = ref_llm.tokenizer.encode("All the world's a stage")
    want = ref_llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    msgs = raw_decode(channel, decode_request_bytes(max_tokens=12, token_ids=ids))
    assert [t for m in msgs for t in m[0][1]] == want.token_ids
    assert all(len(m) == 1 and m[0][0] == "" for m in msgs)  # token content: ids only
    for n_req, n in ((0, 1), (2, 2)):
        msgs = raw_decode(channel, decode_request_bytes(max_tokens=12, token_ids=ids,
                                                        num_samples=n_req))
        assert msgs and all(len(m) == n for m in msgs)
        for k in range(n):  # greedy: every sample is the reference
            assert [t for m in msgs for t in m[k][1]] == want.token_ids
    # the generated stubs agree with the hand encoding
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    req = jetstream_pb2.DecodeRequest(max_tokens=12, token_content={"token_ids": ids}, num_samples=2)
    assert req.SerializeToString() == decode_request_bytes(max_tokens=12, token_ids=ids, num_samples=2)
    out = list(stub.Decode(req, timeout=30))
    assert all(m.WhichOneof("content") == "stream_content" and len(m.stream_content.samples) == 2
               for m in out)


# ---- health, stats, metrics --------------------------------------------------------------------
def test_health(channel):
    h = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "jaxinfer.v1.Generation", "jetstream_proto.Orchestrator"):
        assert h.Check(health_pb2.HealthCheckRequest(service=svc)).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        h.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert jetstream_pb2_grpc.OrchestratorStub(channel).HealthCheck(
        jetstream_pb2.HealthCheckRequest()).is_live


def test_reflection_lists_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"jaxinfer.v1.Generation", "jetstream_proto.Orchestrator", "grpc.health.v1.Health"} <= names


def test_cancellation_frees_pages(server, channel):
    idle = wait_idle(channel)
    before = stats(channel)
    req = jaxinfer_pb2.GenerateRequest(prompt="Cry havoc, and let slip the dogs of war",
                                       max_tokens=1000, temperature=0.0, ignore_eos=True)
    call = gen_stub(channel).Generate(req, timeout=60)
    got = 0
    for m in call:
        got += len(m.token_ids)
        if got >= 3:
            break
    busy = stats(channel)
    assert busy.pages_used > 0 and busy.running == 1
    call.cancel()
    after = wait_idle(channel)
    assert after.pages_free == after.pages_total == idle.pages_total
    assert after.requests["cancelled"] == before.requests["cancelled"] + 1
    assert after.requests["length"] == before.requests["length"]  # it did not run to the end
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    m = parse_text(body)
    assert m["jaxinfer_kv_pages_free"] == m["jaxinfer_kv_pages_total"] == after.pages_total
    assert m['jaxinfer_requests_total{outcome="cancelled"}'] >= 1
    assert m["jaxinfer_ttft_seconds_count"] >= 1 and m["jaxinfer_itl_seconds_count"] >= 1


def test_deadline_frees_pages(channel):
    before = wait_idle(channel)
    req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=1000,
                                       temperature=0.0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as e:
        collect(gen_stub(channel).Generate(req, timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_idle(channel)
    assert after.requests["cancelled"] == before.requests["cancelled"] + 1


# ---- malformed requests ------------------------------------------------------------------------
BAD_GENERATE = [
    ({}, "prompt"),
    (dict(prompt="hi", structured_outputs=jaxinfer_pb2.StructuredOutputs(regex="a(")),
     "structured_outputs.regex"),
    (dict(prompt="hi", structured_outputs=jaxinfer_pb2.StructuredOutputs()), "structured_outputs"),
    (dict(prompt="hi", structured_outputs=jaxinfer_pb2.StructuredOutputs(json="{no")),
     "structured_outputs.json"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[5]), "prompt"),
    (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5, 2000]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5], max_tokens=0), "max_tokens"),
    (dict(prompt_token_ids=[5], max_tokens=-3), "max_tokens"),
    (dict(prompt_token_ids=[5], max_tokens=1024), "max_tokens"),
    (dict(prompt_token_ids=[5] * 1024, max_tokens=1), "prompt"),
    (dict(prompt_token_ids=[5], temperature=-0.5), "temperature"),
    (dict(prompt_token_ids=[5], temperature=float("nan")), "temperature"),
    (dict(prompt_token_ids=[5], temperature=float("inf")), "temperature"),
    (dict(prompt_token_ids=[5], top_p=0.0), "top_p"),
    (dict(prompt_token_ids=[5], top_p=1.5), "top_p"),
    (dict(prompt_token_ids=[5], top_k=-2), "top_k"),
    (dict(prompt_token_ids=[5], top_k=2**31 - 1), "top_k"),
    (dict(prompt_token_ids=[5], temperature=2.5), "temperature"),
    (dict(prompt_token_ids=[5], min_p=-0.1), "min_p"),
    (dict(prompt_token_ids=[5], min_p=1.5), "min_p"),
    (dict(prompt_token_ids=[5], logprobs=-1), "logprobs"),
    (dict(prompt_token_ids=[5], logprobs=21), "logprobs"),
    (dict(prompt_token_ids=[5], stop=["ok", ""]), "stop"),
    (dict(prompt_token_ids=[5], stop=["s"] * 17), "stop"),
    (dict(prompt_token_ids=[5], stop=["x" * 300]), "stop"),
    (dict(prompt_token_ids=[5], stop_token_ids=[4000]), "stop_token_ids"),
    (dict(prompt_token_ids=[5], stop_token_ids=[-2]), "stop_token_ids"),
]
BAD_DECODE = [
    (dict(max_tokens=4), "content"),
    (dict(max_tokens=4, text_content={"text": ""}), "text_content"),
    (dict(max_tokens=4, token_content={"token_ids": []}), "token_content"),
    (dict(max_tokens=4, token_content={"token_ids": [2000]}), "token_content"),
    (dict(max_tokens=0, text_content={"text": "hi"}), "max_tokens"),
    (dict(max_tokens=-1, text_content={"text": "hi"}), "max_tokens"),
    (dict(max_tokens=5000, text_content={"text": "hi"}), "max_tokens"),
    (dict(max_tokens=4, text_content={"text": "hi"}, num_samples=-1), "num_samples"),
    (dict(max_tokens=4, text_content={"text": "hi"}, num_samples=5), "num_samples"),
]


def test_malformed_requests_invalid_argument_then_server_still_serves(channel):
    assert len(BAD_GENERATE) + len(BAD_DECODE) >= 30
    gen, dec = gen_stub(channel), jetstream_pb2_grpc.OrchestratorStub(channel)
    good = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=3, temperature=0.0)
    before = stats(channel)
    calls = [(lambda kw=kw: collect(gen.Generate(jaxinfer_pb2.GenerateRequest(**kw), timeout=10)), f)
             for kw, f in BAD_GENERATE]
    calls += [(lambda kw=kw: list(dec.Decode(jetstream_pb2.DecodeRequest(**kw), timeout=10)), f)
              for kw, f in BAD_DECODE]
    for i, (call, field) in enumerate(calls):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (i, e.value)
        assert field in e.value.details(), (i, field, e.value.details())
        _, ids, _, finals = collect(gen.Generate(good, timeout=10))
        assert len(ids) == 3 and finals[0].finish_reason == "length"
    after = wait_idle(channel)
    assert after.requests["invalid"] - before.requests["invalid"] == len(calls)
    assert after.healthy


def test_short_soak_loses_nothing(server):
    from jaxinfer.tools.soak import run_soak

    # a stream silent for hang_s counts as lost; the server compiles step shapes on first use,
    # which on a loaded CI machine can take tens of seconds
    s = asyncio.run(run_soak(f"127.0.0.1:{server.port}", duration_s=4.0, seed=1, hang_s=120))
    assert s["lost"] == 0 and s["errors"] == 0, s
    parts = ("completed", "cancelled", "deadline_exceeded", "rejected", "invalid", "errors", "lost")
    assert sum(s[k] for k in parts) == s["sent"] >= 8, s
    assert s["completed"] > 0 and s["invalid"] + s["cancelled"] + s["deadline_exceeded"] > 0, s
    assert s["pages_free_after"] == s["pages_total"] and s["drained"] and s["serving"], s
    assert s["ok"]


def test_bench_serving_writes_json_and_plot(server, tmp_path):
    import json

    from jaxinfer.tools.bench_serving import main

    out = tmp_path / "bench"
    rc = main(["--target", f"127.0.0.1:{server.port}", "--rates", "50,inf", "--num-requests", "8",
               "--input-len", "4:32", "--output-len", "4:16", "--out", str(out), "--no-warmup"])
    assert rc == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [r["completed"] for r in rep["results"]] == [8, 8]
    r = rep["results"][0]
    assert r["output_token_throughput"] > 0 and r["ttft_ms"]["p50"] > 0
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
    assert out.with_suffix(".png").stat().st_size > 1000


# ---- back-pressure, auth + TLS, engine fault (their own servers) --------------------------------
@pytest.fixture(scope="module")
def aux_llm(tiny_dir, llm_for):
    return llm_for(tiny_dir, max_slots=1, page_size=8, max_model_len=1024)


def test_full_queue_resource_exhausted_at_once(aux_llm):
    s = ServerThread(aux_llm, ServerConfig(port=0, max_queue=1))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            long = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=1000,
                                                temperature=0.0, ignore_eos=True)
            a = gen_stub(ch).Generate(long, timeout=60)
            next(a)  # a holds the only slot
            b = gen_stub(ch).Generate(long, timeout=60)
            t = time.monotonic() + 10
            while stats(ch).queue_depth < 1:
                assert time.monotonic() < t
                time.sleep(0.005)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                collect(gen_stub(ch).Generate(long, timeout=60))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t0 < 0.5  # at once, not after a slot frees
            a.cancel()
            b.cancel()
            st = wait_idle(ch)
            assert st.requests["rejected"] == 1
    finally:
        s.stop()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        return key, cert
    import ipaddress

    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                        critical=False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
         .sign(k, hashes.SHA256()))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    return key, cert


def test_auth_and_tls(aux_llm, tmp_path):
    key, cert = _self_signed(tmp_path)
    s = ServerThread(aux_llm, ServerConfig(port=0, tls_cert=str(cert), tls_key=str(key),
                                           auth_token="s3cret"))
    target = f"localhost:{s.port}"
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        good = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=4, temperature=0.0)
        with grpc.secure_channel(target, creds) as ch:
            stub = gen_stub(ch)
            for md in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                with pytest.raises(grpc.RpcError) as e:
                    collect(stub.Generate(good, metadata=md, timeout=10))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    stats(ch, metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    jetstream_pb2_grpc.OrchestratorStub(ch).HealthCheck(
                        jetstream_pb2.HealthCheckRequest(), metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = (("authorization", "Bearer s3cret"),)
            _, ids, _, finals = collect(stub.Generate(good, metadata=ok, timeout=10))
            assert len(ids) == 4 and finals[0].usage.completion_tokens == 4
            assert stats(ch, metadata=ok).healthy
            # grpc.health.v1 stays open (probes carry no credentials)
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(target) as ch:  # plaintext to a TLS port fails
            with pytest.raises(grpc.RpcError) as e:
                stats(ch, metadata=(("authorization", "Bearer s3cret"),))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.stop()


def test_engine_fault_internal_not_serving_no_hang(tiny_dir):
    llm = LLM(str(tiny_dir), max_slots=2, page_size=8, max_model_len=256)
    s = ServerThread(llm, ServerConfig(port=0))
    real_step, calls = llm.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected device failure")
        return real_step()

    llm.engine.step = flaky_step
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=100,
                                               temperature=0.0, ignore_eos=True)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                collect(gen_stub(ch).Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "injected device failure" in e.value.details()
            assert time.monotonic() - t0 < 10
            t = time.monotonic() + 5
            h = health_pb2_grpc.HealthStub(ch)
            while h.Check(health_pb2.HealthCheckRequest()).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < t
                time.sleep(0.01)
            assert not jetstream_pb2_grpc.OrchestratorStub(ch).HealthCheck(
                jetstream_pb2.HealthCheckRequest()).is_live
            with pytest.raises(grpc.RpcError) as e:  # new work is refused, not hung
                collect(gen_stub(ch).Generate(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            st = stats(ch)
            assert not st.healthy and st.requests["error"] == 1
    finally:
        s.stop()


# ---- the CLI: `jaxinfer serve`, graceful SIGTERM -----------------------------------------------
def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def test_cli_serve_sigterm_drains_and_exits_zero(tiny_dir):
    port, mport = _free_port(), _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.serve.cli", "serve", "--model", str(tiny_dir), "--port", str(port),
         "--metrics-port", str(mport), "--max-slots", "2", "--page-size", "8",
         "--max-model-len", "512"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = []  # serve compiles every step shape before it listens (--warmup by default)
        while f"listening on 127.0.0.1:{port}" not in (line := proc.stdout.readline()):
            assert line, "".join(before)
            before.append(line)
        assert any(re.search(r"warm-up: \d+ step programs ready", b) for b in before), before
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=300,
                                               temperature=0.0, ignore_eos=True)
            call = gen_stub(ch).Generate(req, timeout=60)
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            _, ids, _, finals = collect(call)  # in-flight request finishes during the drain
            assert len(first.token_ids) + len(ids) == 300 and finals[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_without_drain_cancels_in_flight_with_unavailable(aux_llm):
    s = ServerThread(aux_llm, ServerConfig(port=0))
    stopped = False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            req = jaxinfer_pb2.GenerateRequest(prompt_token_ids=[5, 6], max_tokens=1000,
                                               temperature=0.0, ignore_eos=True)
            call = gen_stub(ch).Generate(req, timeout=60)
            next(call)
            t0 = time.monotonic()
            s.stop(drain_timeout_s=0)
            stopped = True
            with pytest.raises(grpc.RpcError) as e:
                collect(call)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert time.monotonic() - t0 < 10
        sch = aux_llm.engine.scheduler
        assert sch.free_pages == sch.allocator.num_total and not aux_llm.engine.num_unfinished
    finally:
        if not stopped:
            s.stop()
