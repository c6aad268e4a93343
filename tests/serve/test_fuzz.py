"""Property-based fuzzing of the front door (hypothesis): random JSON / protobuf field values
(wrong types, extreme ranges, sizes, nesting, unicode) thrown at the request door itself, the
HTTP app, the JSONL line parser and the gRPC service. Every outcome is a result or a typed error
(RequestError, 4xx, an error record, INVALID_ARGUMENT), never a 5xx or an escaped exception;
after each batch of cases a plain request still works and every page is back.

Derandomized (the same cases every run) so CI is reproducible; each property keeps its case
count small enough for the whole module to stay well under a minute."""

from __future__ import annotations

import http.client
import json
import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.runtime.host.requests import (SAMPLING_FIELDS, Limits, RequestError, check_request, parse_prompt,
                              sampling_from_json)
from jaxinfer.runtime.host.batch import LineError, _Parser
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc

MODEL = "fuzz"
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

EXTREME_INTS = st.sampled_from([0, 1, -1, 2, 20, 21, 255, 2**31 - 1, 2**31, -(2**31) - 1, 2**63,
                                2**64, -(2**63) - 1, 10**30])
EXTREME_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 1e-6, 0.5, 1.0, 2.0, 2.0000001, 1e308,
                                  float("inf"), float("-inf"), float("nan")])
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", "\x00", "\ud800", "🙂" * 50, "a" * 300, "</s>", "<s>"])
SCALARS = (st.none() | st.booleans() | EXTREME_INTS | st.integers() | EXTREME_FLOATS
           | st.floats() | TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
FIELDS = sorted(SAMPLING_FIELDS) + ["n", "stream", "logprobs", "echo", "best_of", "stop",
                                    "stream_options", "frobnicate", "suffix", "logit_bias",
                                    "presence_penalty", "top_logprobs", "request_id",
                                    "add_special_tokens", "guided_regex", "cache_salt"]


def _nested(depth: int):
    v = ["w"]
    for _ in range(depth):
        v = [v]
    return v


BIG = 10**5  # entries of the biggest hostile maps and lists
# the sampling rows added with the logits processors: hostile values of their own kinds
NEW_ROWS = {
    **{k: EXTREME_FLOATS | st.floats() | SCALARS
       for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")},
    "logit_bias": st.dictionaries(
        st.integers(-5, 2100).map(str) | st.sampled_from(["", " 7", "-1", "1e3", "٣", "²", "0x5",
                                                          "9" * 13]),
        EXTREME_FLOATS | SCALARS, max_size=6)
    | st.sampled_from([{str(i): 1.0 for i in range(BIG)}, {str(i): 0.5 for i in range(300)},
                       [[5, 1.0]], [[5]], {"5": float("nan")}]),
    "bad_words": st.lists(TEXT, max_size=40) | st.integers(1, 900).map(_nested)
    | st.sampled_from([["a"] * 33, ["x" * 257], [""]]),
    "allowed_token_ids": st.lists(EXTREME_INTS, max_size=4)
    | st.sampled_from([list(range(BIG)), [], [1999], [2000], [-1], [2**31], [1.5]]),
    **{k: EXTREME_INTS | SCALARS for k in ("min_tokens", "truncate_prompt_tokens", "best_of")},
    **{k: SCALARS for k in ("include_stop_str_in_output", "skip_special_tokens",
                            "spaces_between_special_tokens")},
}
assert set(NEW_ROWS) <= set(SAMPLING_FIELDS)
NEW_ROW_VALUES = st.sampled_from(sorted(NEW_ROWS)).flatmap(
    lambda k: NEW_ROWS[k].map(lambda v: {k: v}))


GOOD = {  # values a client would send: bodies mix them with hostile ones
    "temperature": st.floats(0, 2), "top_k": st.integers(-1, 50), "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**32), "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "logprobs": st.integers(0, 5),
    "stop_token_ids": st.lists(st.integers(0, 1999), max_size=3), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "echo": st.booleans(),
}


def request_bodies(prompt_key: str):
    """A body a client would send (model, prompt, good field values) with 0-2 fields replaced by
    hostile values (any JSON: wrong types, extremes, nesting, unicode)."""
    prompt = st.sampled_from(["To be", "hi", [5, 6, 7]])
    good = st.fixed_dictionaries({"model": st.just(MODEL), prompt_key: prompt,
                                  "max_tokens": st.integers(1, 4)}, optional=GOOD)
    hostile = st.dictionaries(st.sampled_from(FIELDS + ["model", prompt_key]), JSON, max_size=2)
    new = st.lists(NEW_ROW_VALUES, max_size=2)
    return st.builds(lambda g, h, n: {**g, **h, **{k: v for d in n for k, v in d.items()}},
                     good, hostile, new)


# ---- the door itself ---------------------------------------------------------------------------
class _Tok:
    vocab_size = 2000

    def encode(self, text):
        text.encode("utf-8")  # lone surrogates raise here, as real tokenizers do
        return [ord(c) % 2000 for c in text[:300]]


LIMITS = Limits(vocab_size=2048, text_vocab=2000, max_model_len=256, page_size=8, num_pages=64)


@settings(FUZZ, max_examples=400)
@given(obj=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8), prompt=JSON,
       new=st.lists(NEW_ROW_VALUES, max_size=3))
def test_door_raises_only_request_error(obj, prompt, new):
    for d in new:
        obj.update(d)
    try:
        params = sampling_from_json(obj)
        _, ids = parse_prompt(prompt, _Tok(), LIMITS)
        check_request(ids, params, LIMITS)
    except RequestError as e:
        assert e.field is None or isinstance(e.field, str)
        return
    # accepted: everything the engine will build a plan from is in range
    assert 1 <= params.max_tokens and len(ids) + params.max_tokens <= LIMITS.max_model_len
    assert 0 <= params.top_k <= LIMITS.vocab_size and 0 < params.top_p <= 1
    assert 0 <= params.temperature <= 2 and all(0 <= t < 2000 for t in ids)
    assert all(math.isfinite(v) and -100 <= v <= 100 for _, v in params.logit_bias)
    assert len(params.logit_bias) <= 300 and len(params.bad_words) <= 32
    for k in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert math.isfinite(getattr(params, k)), k


# ---- the JSONL line parser ---------------------------------------------------------------------
@settings(FUZZ, max_examples=300)
@given(line=request_bodies("prompt").map(lambda d: {"id": "x", **d}).map(json.dumps).map(str.encode)
       | st.binary(max_size=60))
def test_jsonl_line_is_a_job_or_a_line_error(line):
    parser = _Parser(_Tok(), {"temperature": 0.0}, LIMITS)
    try:
        obj, uid, key = parser.decode(line)
        parser.job(obj, 1, uid, key)
    except LineError:
        pass


# ---- the servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    s = ServerThread(llm_for(tiny_dir, tag="server", max_slots=4, page_size=8, max_model_len=256),
                     ServerConfig(port=0, http_port=0, max_queue=32, model_name=MODEL,
                                  max_message_bytes=1 << 20))
    yield s
    s.stop()


def _post(port, path, body) -> tuple[int, dict]:
    try:
        data = json.dumps(body).encode()
    except ValueError:  # NaN/inf are JSON extensions the stdlib writes; keep them
        data = json.dumps(body, allow_nan=True).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out and not out.startswith(b"data:") else {}


def _still_serving(server):
    status, body = _post(server.http_port, "/v1/completions",
                         {"model": MODEL, "prompt": "To be", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    t = time.monotonic() + 15
    while (s := server.loop.stats())["in_flight"] or s["running"]:
        assert time.monotonic() < t, s
        time.sleep(0.02)
    assert s["healthy"] and s["pages_free"] == s["pages_total"]


CASES = {"http": 0, "grpc": 0}
STATUSES: dict[int, int] = {}


@settings(FUZZ, max_examples=160)
@given(body=request_bodies("prompt"), chat=st.booleans())
def test_http_answers_every_body_with_a_result_or_a_4xx(server, body, chat):
    if chat:
        body = {**{k: v for k, v in body.items() if k != "prompt"},
                "messages": [{"role": "user", "content": body.get("prompt")}]}
    status, resp = _post(server.http_port, "/v1/chat/completions" if chat else "/v1/completions",
                         body)
    assert status in (200, 400, 404, 413, 429), (status, resp)
    STATUSES[status] = STATUSES.get(status, 0) + 1
    if status != 200:
        assert set(resp) == {"error"} and resp["error"]["message"]
    CASES["http"] += 1
    if CASES["http"] % 40 == 0:
        _still_serving(server)


GRPC_FIELDS = dict(max_tokens=st.integers(-(2**31), 2**31 - 1),
                   temperature=EXTREME_FLOATS | st.floats(width=32),
                   top_k=st.integers(-(2**31), 2**31 - 1), top_p=EXTREME_FLOATS,
                   min_p=EXTREME_FLOATS, seed=st.integers(-(2**63), 2**63 - 1),
                   logprobs=st.integers(-(2**31), 2**31 - 1),
                   stop=st.lists(TEXT.filter(lambda t: "\ud800" not in t), max_size=20),
                   stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70),
                   ignore_eos=st.booleans(),
                   **{k: EXTREME_FLOATS | st.floats(width=32)
                      for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")},
                   logit_bias=st.dictionaries(st.integers(-(2**31), 2**31 - 1),
                                              EXTREME_FLOATS | st.floats(width=32), max_size=5)
                   | st.just({i: 1.0 for i in range(BIG)}),
                   bad_words=st.lists(TEXT.filter(lambda t: "\ud800" not in t), max_size=40),
                   allowed_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5)
                   | st.just(list(range(BIG))),
                   **{k: st.integers(-(2**31), 2**31 - 1)
                      for k in ("min_tokens", "truncate_prompt_tokens", "n", "best_of")},
                   **{k: st.booleans() for k in ("include_stop_str_in_output",
                                                 "skip_special_tokens",
                                                 "spaces_between_special_tokens")})


@settings(FUZZ, max_examples=80)
@given(fields=st.fixed_dictionaries({}, optional=GRPC_FIELDS),
       prompt=st.sampled_from(["To be", ""]) | st.lists(st.integers(-(2**31), 2**31 - 1),
                                                        max_size=5),
       junk=st.none() | st.binary(max_size=40))
def test_grpc_answers_every_request_with_a_result_or_invalid_argument(server, fields, prompt, junk):
    if "max_tokens" in fields and 0 < fields["max_tokens"]:
        fields["max_tokens"] = min(fields["max_tokens"], 4)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        if junk is not None:
            call = ch.unary_stream("/jaxinfer.v1.Generation/Generate",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
            req = junk
        else:
            call = jaxinfer_pb2_grpc.GenerationStub(ch).Generate
            kw = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
            req = jaxinfer_pb2.GenerateRequest(**kw, **fields)
        try:
            list(call(req, timeout=60))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.RESOURCE_EXHAUSTED), e
    CASES["grpc"] += 1
    if CASES["grpc"] % 40 == 0:
        _still_serving(server)


HUGE = [("logit_bias", {str(i): 1.0 for i in range(BIG)}), ("allowed_token_ids", list(range(BIG))),
        ("allowed_token_ids", list(range(1, 2000, 3))), ("bad_words", _nested(900)),
        ("bad_words", ["w"] * BIG), ("logit_bias", {"5": float("nan")}),
        ("presence_penalty", float("inf")), ("repetition_penalty", -1.0)]


@pytest.mark.parametrize("name,value", HUGE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(HUGE)])
def test_huge_and_deep_values_through_every_door(server, name, value):
    """The hostile sizes the strategies above may not draw: every door answers, and serves on."""
    try:
        sampling_from_json({name: value})
    except RequestError as e:
        assert e.field.split(".")[0].split("[")[0] == name
    chat = {"messages": [{"role": "user", "content": "a"}]}
    for path, prompt in (("/v1/completions", {"prompt": "To be"}), ("/v1/chat/completions", chat)):
        status, resp = _post(server.http_port, path, {"model": MODEL, "max_tokens": 2, **prompt,
                                                      name: value})
        assert status in (200, 400, 413), (status, resp)  # 413: over the 1 MiB body limit
        if status == 400:
            assert resp["error"]["param"].split(".")[0].split("[")[0] in (name, "messages"), resp
    wire = {"logit_bias": {int(k): v for k, v in value.items()}} if name == "logit_bias" else \
        {name: value} if name != "bad_words" or all(isinstance(w, str) for w in value) else {}
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        try:
            list(jaxinfer_pb2_grpc.GenerationStub(ch).Generate(
                jaxinfer_pb2.GenerateRequest(prompt="To be", max_tokens=2, **wire), timeout=60))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.RESOURCE_EXHAUSTED), e
    _still_serving(server)


def test_fuzzed_server_still_serves(server):
    assert CASES["http"] >= 100 and CASES["grpc"] >= 60, CASES

    assert STATUSES.get(200, 0) >= 25 and STATUSES.get(400, 0) >= 25, STATUSES  # both paths
    _still_serving(server)
