"""Images through the serving front ends, on the tiny random-init Gemma 3 vision model
(tests/vision_models.py): the official `openai` client's chat with a data-URL image part, the
gRPC `Generate` with `images`, a JSONL batch with `multi_modal_data`, each held against
`LLM.generate` of the same prompt on another engine; hostile image parts answered 400 naming the
field (HTTP), INVALID_ARGUMENT (gRPC) or an error record (JSONL), with the server serving on;
a text-only model refusing images; and a derandomized fuzz of chat image parts."""

from __future__ import annotations

import base64
import http.client
import io
import json
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

openai = pytest.importorskip("openai")

from jaxinfer import SamplingParams  # noqa: E402
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread  # noqa: E402
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc  # noqa: E402
from tests.vision_models import (BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID,  # noqa: E402
                                 MM_TOKENS_PER_IMAGE, random_image)

N = MM_TOKENS_PER_IMAGE
MODEL = "gemma3-vision"
MARK = "<start_of_image>"
# the engine of test_gemma3_vision, at most two images a prompt (the limit is tested)
VISION = dict(max_slots=2, page_size=8, max_model_len=256, prefill_chunk=N,
              max_image_pixels=100_000, limit_mm_per_prompt=2)
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def encoded(arr: np.ndarray, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format=fmt)
    return b.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


IMG_A = random_image(11, (40, 50, 3))
IMG_B = random_image(12, (90, 30, 3))
PNG_A, PNG_B = encoded(IMG_A), encoded(IMG_B)
JPEG_B = encoded(IMG_B, "JPEG")


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vision_dir(gemma3_vision_dir):
    return gemma3_vision_dir[0]


@pytest.fixture(scope="module")
def ref(vision_dir, llm_for):
    """The reference engine: the test steps it itself (never the server's)."""
    return llm_for(vision_dir, **VISION)


@pytest.fixture(scope="module")
def server(vision_dir, llm_for):
    s = ServerThread(llm_for(vision_dir, tag="server", **VISION),
                     ServerConfig(port=0, http_port=0, max_queue=16, model_name=MODEL,
                                  max_message_bytes=1 << 20))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x",
                         max_retries=0, timeout=60)


def post(server, body, path="/v1/chat/completions") -> tuple[int, dict]:
    try:
        data = json.dumps(body).encode()
    except ValueError:
        data = json.dumps(body, allow_nan=True).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out else {}


def assert_error(resp, param):
    assert set(resp) == {"error"}, resp
    e = resp["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"], e
    assert e["param"] == param, e


def wait_idle(server, timeout=15.0):
    t = time.monotonic() + timeout
    while (s := server.loop.stats())["in_flight"] or s["running"]:
        assert time.monotonic() < t, s
        time.sleep(0.02)
    assert s["healthy"] and s["pages_free"] == s["pages_total"], s
    return s


def chat_body(parts, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}],
            "max_tokens": 2, "temperature": 0, **kw}


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


GOOD_PARTS = [{"type": "text", "text": "What is it?"}, image_part(data_url(PNG_B))]


def assert_good_image_request_served(server):
    status, resp = post(server, chat_body(GOOD_PARTS))
    assert status == 200, resp
    assert resp["usage"]["completion_tokens"] == 2
    wait_idle(server)


def reference_chat_ids(llm, text: str) -> list[int]:
    """The ids the server should run for one user message [text part, image part]: the chat
    template rendered with the image part as its mark, the blank lines around the mark,
    tokenized without special tokens (expanded by the engine's door)."""
    from jaxinfer.runtime.host.image_prompt import mark_text
    from jaxinfer.serve.chat_template import resolve_chat_template

    t = resolve_chat_template(llm.tokenizer, llm.model.cfg)
    rendered = t.render([{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image"}]}], True)
    # what the checkpoint's template (tests/byte_tokenizer.py) writes, by hand
    assert rendered == (f"<bos><start_of_turn>user\n{text}{MARK}<end_of_turn>\n"
                        "<start_of_turn>model\n"), rendered
    return llm.tokenizer.encode(mark_text(rendered, llm.engine.images.spec),
                                add_special_tokens=False)


# ---- 1. the openai client, chat with an image --------------------------------------------------
def test_openai_chat_with_an_image_equals_llm_generate_and_hits_the_caches(server, client, ref):
    text = "Describe this picture:"
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    ids = reference_chat_ids(ref, text)
    assert ids.count(BOI_TOKEN_ID) == 1 and IMAGE_TOKEN_ID not in ids
    (want,) = ref.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": PNG_A}}, sp)
    assert want.prompt_token_ids.count(IMAGE_TOKEN_ID) == N
    assert len(want.prompt_token_ids) == len(ids) + N + 1  # + the image tokens and <eoi>
    # the image reaches the model: another image gives other logprobs
    (other,) = ref.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": PNG_B}}, sp)
    assert abs(other.logprobs[0]["logprob"] - want.logprobs[0]["logprob"]) > 1e-4

    engine = server.loop.engine
    messages = [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": data_url(PNG_A)}}]}]
    runs0 = engine.images.runs
    cached0 = engine.scheduler.prefix_cache_stats()["cached_tokens"]

    def ask():
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                              temperature=0, logprobs=True,
                                              extra_body={"ignore_eos": True})

    r1 = ask()
    assert r1.choices[0].message.content == want.text
    assert r1.choices[0].finish_reason == "length"
    assert r1.usage.completion_tokens == len(want.token_ids) == 8
    assert r1.usage.prompt_tokens == len(want.prompt_token_ids)  # the 16 image tokens counted
    got_lp = [c.logprob for c in r1.choices[0].logprobs.content]
    np.testing.assert_allclose(got_lp, [e["logprob"] for e in want.logprobs], atol=1e-4)
    assert engine.images.runs == runs0 + 1  # one encoder call for the one image
    wait_idle(server)

    # the same request again: its prompt pages through the image come from the prefix cache
    # and the encoder is not run (its cache, or no image row computed at all)
    cached1 = engine.scheduler.prefix_cache_stats()["cached_tokens"]
    r2 = ask()
    assert r2.choices[0].message.content == want.text
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens) == (
        r1.usage.prompt_tokens, r1.usage.completion_tokens)
    end = want.prompt_token_ids.index(EOI_TOKEN_ID)
    assert engine.scheduler.prefix_cache_stats()["cached_tokens"] - cached1 >= end - 8
    assert cached1 - cached0 <= want.prompt_token_ids.index(IMAGE_TOKEN_ID)  # first: no hit
    assert engine.images.runs == runs0 + 1
    # the encoder's work in the metrics: calls, images, hits (counters), cache bytes (a gauge)
    from prometheus_client import generate_latest

    from jaxinfer.serve.metrics import ServingMetrics

    text = generate_latest(ServingMetrics(server.loop).registry).decode()
    stats = server.loop.stats()
    assert f"jaxinfer_encoder_calls_total {float(stats['encoder_runs'])}" in text
    assert f"jaxinfer_images_encoded_total {float(stats['images_encoded'])}" in text
    assert stats["encoder_runs"] >= 1 and stats["encoder_cache_bytes"] > 0
    assert "jaxinfer_encoder_cache_hits_total" in text and "jaxinfer_encoder_cache_bytes" in text
    wait_idle(server)


# ---- 2. hostile image parts over HTTP ----------------------------------------------------------
P1 = "messages[0].content[1].image_url"
HOSTILE = [
    ("undecodable bytes", [{"type": "text", "text": "x"},
                           image_part(data_url(b"definitely not an image" * 4))], P1, "decodable"),
    ("bad base64", [{"type": "text", "text": "x"}, image_part("data:image/png;base64,@@@!")],
     P1, "base64"),
    ("truncated png", [{"type": "text", "text": "x"}, image_part(data_url(PNG_A[:60]))], P1,
     "image"),
    ("text data url", [{"type": "text", "text": "x"},
                       image_part("data:text/plain;base64," + base64.b64encode(b"hi").decode())],
     P1, "media type"),
    ("remote url", [{"type": "text", "text": "x"}, image_part("https://example.com/cat.png")],
     P1, "remote"),
    ("file url", [{"type": "text", "text": "x"}, image_part("file:///etc/passwd")], P1, "file"),
    ("too many", [{"type": "text", "text": "x"}] + [image_part(data_url(PNG_A))] * 3,
     "messages[0].content[3].image_url", "limit_mm_per_prompt"),
    ("too large", [{"type": "text", "text": "x"},
                   image_part(data_url(encoded(np.zeros((300, 400, 3), np.uint8))))], P1,
     "too large"),
    ("url not a string", [{"type": "text", "text": "x"}, {"type": "image_url",
                                                          "image_url": {"url": 5}}], P1, "url"),
    ("no url", [{"type": "text", "text": "x"}, {"type": "image_url"}], P1, "url"),
    ("unknown part", [{"type": "text", "text": "x"},
                      {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
     "messages[0].content", "content[1]"),
]


def test_hostile_image_parts_get_400_naming_the_field_and_the_server_serves_on(server):
    engine = server.loop.engine
    runs0 = engine.images.runs
    for name, parts, param, why in HOSTILE:
        status, resp = post(server, chat_body(parts))
        assert status == 400, (name, resp)
        assert_error(resp, param)
        assert why in resp["error"]["message"], (name, resp)
    assert engine.images.runs == runs0  # nothing refused reached the encoder
    wait_idle(server)
    assert_good_image_request_served(server)


# ---- 3. a text-only model ----------------------------------------------------------------------
def test_a_text_only_model_refuses_image_parts(tiny_dir, llm_for):
    s = ServerThread(llm_for(tiny_dir, tag="server", max_slots=4, page_size=8,
                             max_model_len=256),
                     ServerConfig(port=0, http_port=0, model_name=MODEL,
                                  chat_template="{% for m in messages %}{{ m['content'] }}\n"
                                                "{% endfor %}"))
    try:
        status, resp = post(s, chat_body(GOOD_PARTS))
        assert status == 400, resp
        assert_error(resp, P1)
        assert "text only" in resp["error"]["message"]
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(jaxinfer_pb2_grpc.GenerationStub(ch).Generate(jaxinfer_pb2.GenerateRequest(
                    prompt="hi", max_tokens=2, images=[PNG_A]), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "multi_modal_data.image" in e.value.details()
        status, resp = post(s, chat_body([{"type": "text", "text": "hi"}]))
        assert status == 200, resp
        wait_idle(s)
    finally:
        s.stop()


# ---- 4. gRPC -----------------------------------------------------------------------------------
def _generate(server, **kw):
    text, ids, finals = "", [], []
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        for m in jaxinfer_pb2_grpc.GenerationStub(ch).Generate(
                jaxinfer_pb2.GenerateRequest(**kw), timeout=60):
            text += m.text
            ids += list(m.token_ids)
            if m.HasField("final"):
                finals.append(m.final)
    return text, ids, finals


def test_grpc_generate_with_images_equals_llm_generate(server, ref):
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = f"Compare {MARK} with {MARK} please."
    want_one, want_two = ref.generate([
        {"prompt": f"Look: {MARK} what is it?", "multi_modal_data": {"image": PNG_A}},
        {"prompt": prompt, "multi_modal_data": {"image": [PNG_A, JPEG_B]}}], sp)
    assert want_two.prompt_token_ids[0] == 2  # a text prompt gets BOS
    assert want_two.prompt_token_ids.count(IMAGE_TOKEN_ID) == 2 * N
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    text, ids, (final,) = _generate(server, prompt=f"Look: {MARK} what is it?", images=[PNG_A],
                                    **kw)
    assert ids == want_one.token_ids and text == want_one.text
    assert final.usage.prompt_tokens == len(want_one.prompt_token_ids)
    text, ids, (final,) = _generate(server, prompt=prompt, images=[PNG_A, JPEG_B], **kw)
    assert ids == want_two.token_ids and text == want_two.text
    assert final.usage.prompt_tokens == len(want_two.prompt_token_ids)
    # the prompt as ids, marked with <boi>: the same run
    text, ids, _ = _generate(server, prompt_token_ids=want_one.prompt_token_ids[:1] + [
        t for t in want_one.prompt_token_ids[1:] if t not in (IMAGE_TOKEN_ID, EOI_TOKEN_ID)],
        images=[PNG_A], **kw)
    assert ids == want_one.token_ids

    for bad, why in (([b"not an image"], "multi_modal_data.image[0]"),
                     ([PNG_A[:50]], "multi_modal_data.image[0]"),
                     ([PNG_A], "more image marks")):  # two marks, one image
        with pytest.raises(grpc.RpcError) as e:
            _generate(server, prompt=prompt, images=bad, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert why in e.value.details(), e.value.details()
    wait_idle(server)
    text, ids, _ = _generate(server, prompt=f"Look: {MARK} what is it?", images=[PNG_A], **kw)
    assert ids == want_one.token_ids



def test_grpc_more_images_than_the_limit_is_invalid_argument(server):
    try:
        with pytest.raises(grpc.RpcError) as e:
            _generate(server, prompt=MARK * 3, images=[PNG_A] * 3, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "limit_mm_per_prompt" in e.value.details()
    finally:
        wait_idle(server)


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_images_with_truncate_prompt_tokens_are_refused_as_bad_requests(server, door):
    try:
        if door == "http":
            status, resp = post(server, chat_body(GOOD_PARTS, truncate_prompt_tokens=100))
            assert status == 400, resp
            assert "truncate_prompt_tokens" in resp["error"]["message"], resp
        else:
            with pytest.raises(grpc.RpcError) as e:
                _generate(server, prompt=MARK, images=[PNG_A], max_tokens=2,
                          truncate_prompt_tokens=100)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    finally:
        wait_idle(server)
        assert_good_image_request_served(server)


# ---- 5. a JSONL batch ----------------------------------------------------------------------------
def test_jsonl_batch_with_images(ref, tmp_path):
    common = {"max_tokens": 6, "ignore_eos": True}
    lines = [
        {"id": "one", "prompt": f"Look: {MARK} what is it?",
         "multi_modal_data": {"image": data_url(PNG_A)}, **common},
        {"id": "two", "prompt": f"{MARK} versus {MARK}",
         "multi_modal_data": {"image": [base64.b64encode(PNG_B).decode(),
                                        data_url(JPEG_B, "image/jpeg")]}, **common},
        {"id": "bad", "prompt": MARK, "multi_modal_data": {"image": "data:image/png;base64,@@"},
         **common},
        {"id": "bad2", "prompt": MARK, "multi_modal_data": {"image": [data_url(PNG_A),
                                                                      "%%%"]}, **common},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = ref.generate_jsonl(src, dst)
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(recs) == {"one", "two", "bad", "bad2"}
    assert summary["requests"] == 2 and summary["errors"] == 2, summary
    want = ref.generate([{"prompt": x["prompt"], "multi_modal_data": {"image": im}} for x, im in
                         ((lines[0], PNG_A), (lines[1], [PNG_B, JPEG_B]))],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for rid, w in zip(("one", "two"), want):
        assert "error" not in recs[rid], recs[rid]
        assert recs[rid]["text"] == w.text and recs[rid]["token_ids"] == w.token_ids
        assert recs[rid]["usage"]["prompt_tokens"] == len(w.prompt_token_ids)
    assert recs["two"]["usage"]["prompt_tokens"] > 2 * N
    assert recs["bad"]["line"] == 3 and "multi_modal_data.image" in recs["bad"]["error"]
    assert recs["bad2"]["line"] == 4 and "multi_modal_data.image[1]" in recs["bad2"]["error"]
    assert ref.engine.num_unfinished == 0


# ---- 6. fuzz: random image parts ---------------------------------------------------------------
def _mutated(data: bytes, cuts: list[tuple[int, int]]) -> bytes:
    b = bytearray(data)
    for pos, val in cuts:
        b[pos % len(b)] = val
    return bytes(b)


JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
IMAGE_BYTES = (st.binary(max_size=64)
               | st.integers(1, len(PNG_A) - 1).map(lambda k: PNG_A[:k])
               | st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                          max_size=4).map(lambda c: _mutated(PNG_A, c))
               | st.just(PNG_A) | st.just(JPEG_B))
URLS = (IMAGE_BYTES.map(data_url)
        | IMAGE_BYTES.map(lambda b: base64.b64encode(b).decode())
        | st.sampled_from(["", "data:", "data:image/png,abc", "data:image/png;base64,",
                           "http://127.0.0.1/x.png", "ftp://x", "data:;base64,AAAA",
                           "data:image/png;base64," + "A" * 5, "\x00", "🙂"])
        | JUNK)
PARTS = st.one_of(
    URLS.map(lambda u: {"type": "image_url", "image_url": {"url": u}}),
    URLS.map(lambda u: {"type": "image_url", "image_url": u}),
    URLS.map(lambda u: {"type": "input_image", "input_image": u}),
    st.builds(lambda t, v: {"type": t, "image_url": v},
              st.sampled_from(["image_url", "image", "IMAGE_URL", None, 3]), JUNK),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12) | JUNK
                           | st.sampled_from([MARK, "<image_soft_token>", "<end_of_image>",
                                              MARK * 3, "<bos><eos>"])}),
    JUNK,
)


STATUSES: dict[int, int] = {}


@settings(FUZZ, max_examples=120)
@given(parts=st.lists(PARTS, min_size=1, max_size=4), role=st.sampled_from(["user", "system"]))
def test_fuzzed_image_parts_never_500(server, parts, role):
    body = {"model": MODEL, "messages": [{"role": role, "content": parts}], "max_tokens": 1,
            "temperature": 0}
    status, resp = post(server, body)
    assert status in (200, 400), (status, resp, body)
    STATUSES[status] = STATUSES.get(status, 0) + 1
    if status == 400:
        assert set(resp) == {"error"} and resp["error"]["message"], resp
        p = resp["error"]["param"]
        assert p is None or p.startswith("messages"), resp


def test_fuzzed_server_is_healthy(server):
    assert STATUSES.get(400, 0) >= 20 and STATUSES.get(200, 0) >= 5, STATUSES  # both paths
    wait_idle(server)
    assert_good_image_request_served(server)


# ---- 7. the command line ------------------------------------------------------------------------
def test_cli_generate_with_image_files(vision_dir, ref, tmp_path, capsys):
    """`jaxinfer generate --image FILE`: the same tokens as LLM.generate of the prompt with the
    image; without a mark in the prompt the image goes first; a missing file or a text-only
    model is an error naming --image."""
    from jaxinfer.serve.cli import main

    png = tmp_path / "a.png"
    png.write_bytes(PNG_A)
    flags = ["--model", str(vision_dir), "--max-slots", "2", "--page-size", "8",
             "--max-model-len", "256", "--prefill-chunk", str(N), "--max-image-pixels",
             "100000", "--max-tokens", "4", "--ignore-eos", "--no-stream"]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (want,) = ref.generate({"prompt": "<start_of_image>Describe.",
                            "multi_modal_data": {"image": PNG_A}}, sp)
    assert main(["generate", *flags, "--image", str(png), "Describe."]) == 0
    assert capsys.readouterr().out == "Describe." + want.text + "\n"
    assert main(["generate", *flags, "--image", str(tmp_path / "none.png"), "x"]) != 0
    assert "--image" in capsys.readouterr().err
