"""POST /v1/embeddings through the official `openai` client against a real server (tiny random
Llama): the vectors equal LLM.embed's in both encodings, every input shape is read, and each bad
field is a 400 naming it while the server serves on, generation included."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from tests.engines import TINY  # noqa: E402
from tests.http_helpers import http_server, post_json  # noqa: E402

MODEL = "tiny-embed"
TEXTS = ["To be, or not to be, that is the question", "Hello", "Once more unto the breach"]


@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    with http_server(llm_for(tiny_dir, tag="embed-server", **TINY), model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                         max_retries=0, timeout=60)


def post(server, body) -> tuple[int, dict]:
    return post_json(server, "/v1/embeddings", body, timeout=60)


def test_vectors_equal_llm_embed_in_both_encodings(client, tiny_llm):
    want = tiny_llm.embed(TEXTS)
    n_tokens = sum(len(tiny_llm.tokenizer.encode(t)) for t in TEXTS)
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and len(r.data) == 3
    assert [(d.object, d.index) for d in r.data] == [("embedding", i) for i in range(3)]
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    np.testing.assert_array_equal(np.asarray([d.embedding for d in r.data], np.float32), want)
    # the client's default: it asks for base64 and decodes the little-endian f32 itself
    r = client.embeddings.create(model=MODEL, input=TEXTS)
    np.testing.assert_array_equal(np.asarray([d.embedding for d in r.data], np.float32), want)
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    got = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in r.data]
    np.testing.assert_array_equal(np.stack(got), want)


def test_every_input_shape(client, tiny_llm):
    ids = [[1, 40, 41, 42], [1, 900, 5], [7]]

    def vectors(inp):
        r = client.embeddings.create(model=MODEL, input=inp, encoding_format="float")
        return np.asarray([d.embedding for d in r.data], np.float32), r.usage.prompt_tokens

    got, n = vectors(ids)
    np.testing.assert_array_equal(got, tiny_llm.embed(ids))
    assert n == 8
    got, n = vectors(ids[0])
    np.testing.assert_array_equal(got, tiny_llm.embed([ids[0]]))
    assert got.shape == (1, 64) and n == 4
    got, _ = vectors(TEXTS[1])
    np.testing.assert_array_equal(got, tiny_llm.embed(TEXTS[1]))


def test_bad_fields_are_400s_naming_them(server, client):
    long = [1] * (TINY["max_model_len"] + 1)
    cases = [
        ({}, "input"), ({"input": []}, "input"), ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input[1]"), ({"input": [[1, 2], []]}, "input[1]"),
        ({"input": [1, 5000]}, "input"), ({"input": [[1], [3, 99999]]}, "input[1]"),
        ({"input": long}, "input"), ({"input": ["a", long]}, "input[1]"),
        ({"input": 5}, "input"), ({"input": [1.5, 2]}, "input"), ({"input": [True]}, "input"),
        ({"input": {"text": "a"}}, "input"), ({"input": [["a"]]}, "input[0]"),
        ({"input": "a", "dimensions": 32}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "encoding_format": 1}, "encoding_format"),
        ({"input": "a", "pooling": "mean"}, "pooling"),
        ({"input": ["a"] * 2049}, "input"),
    ]
    for body, param in cases:
        status, out = post(server, {"model": MODEL, **body})
        assert status == 400, (body, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert out["error"]["param"] == param, (body, out)
    status, out = post(server, {"model": "other", "input": "a"})
    assert status == 404 and out["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="a", dimensions=8)
    assert post(server, {"model": MODEL, "input": "still serving"})[0] == 200


def test_embeddings_run_between_generation_steps(server, client, tiny_llm):
    """A completion generating on the engine thread while embeddings arrive: both answer, the
    vectors unchanged by the steps around them."""
    done = {}

    def complete():
        done["r"] = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=24,
                                              temperature=0, extra_body={"ignore_eos": True})

    t = threading.Thread(target=complete)
    t.start()
    want = tiny_llm.embed(TEXTS[2])
    for _ in range(3):
        r = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
        np.testing.assert_array_equal(np.asarray(r.data[0].embedding, np.float32), want[0])
    t.join(60)
    assert len(done["r"].choices[0].text) > 0 and done["r"].usage.completion_tokens == 24
