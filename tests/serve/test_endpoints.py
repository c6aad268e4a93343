"""The HTTP API's vLLM-shaped extras against a real server on the tiny Llama: /tokenize and
/detokenize (oracle: transformers' tokenizer and chat templating of the same files), the model
cards, `stream_options.continuous_usage_stats` (per-chunk usage against the chunks' own tokens),
the vLLM request-extension table (each field honoured or refused naming it) and the text
controls end to end (oracle: the same request without them, or the tiny engine itself)."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from jaxinfer import SamplingParams
from jaxinfer.runtime.host.requests import SAMPLING_FIELDS
from jaxinfer.serve import openai_server
from tests.engines import TINY

transformers = pytest.importorskip("transformers")

MODEL, TOKEN = "tiny", "secret"
# no newlines: sentencepiece itself turns "\n" into a space where transformers keeps its byte
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}"
            "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if mood %}[{{ mood }}]{% endif %}")
TEXT = "To be, or not to be, that is the question"
CHAT = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, "}]


@pytest.fixture(scope="module")
def server(tiny_dir, llm_for):
    from jaxinfer.serve.grpc_server import ServerConfig, ServerThread

    s = ServerThread(llm_for(tiny_dir, tag="server", **TINY),
                     ServerConfig(port=0, http_port=0, max_queue=32, model_name=MODEL,
                                  auth_token=TOKEN, chat_template=TEMPLATE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return transformers.LlamaTokenizer.from_pretrained(str(tiny_dir))


def call(server, method, path, body=None, token=TOKEN):
    """(status, JSON body, or the SSE events' JSON objects for a stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    r = conn.getresponse()
    out = r.read().decode()
    conn.close()
    if out.startswith("data: "):
        events = [e[len("data: "):] for e in out.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return r.status, [json.loads(e) for e in events[:-1]]
    return r.status, json.loads(out)


def error(status, body, want_status, param):
    assert status == want_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


# ---- /tokenize, /detokenize ----------------------------------------------------------------------
def test_tokenize_and_detokenize_as_hf(server, hf):
    status, got = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert status == 200 and got["tokens"] == hf(TEXT).input_ids and got["tokens"][0] == 1
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == TINY["max_model_len"]
    assert got["token_strs"] is None
    status, plain = call(server, "POST", "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                                        "return_token_strs": True})
    assert plain["tokens"] == hf(TEXT, add_special_tokens=False).input_ids == got["tokens"][1:]
    assert plain["token_strs"] == hf.convert_ids_to_tokens(plain["tokens"])
    ids = plain["tokens"]
    for tokens in (ids, ids[:4] + [hf.eos_token_id] + ids[4:]):  # a special token kept
        status, back = call(server, "POST", "/detokenize", {"model": MODEL, "tokens": tokens})
        assert status == 200 and back["prompt"] == hf.decode(tokens)
    assert call(server, "POST", "/detokenize", {"tokens": ids})[1]["prompt"] == TEXT
    assert call(server, "POST", "/tokenize", {"prompt": ""})[1]["tokens"] == [1]
    # wrong: 400 naming the field, 404 for a model not served, 401 without the token
    error(*call(server, "POST", "/detokenize", {"tokens": [5, 2000]}), 400, "tokens")
    error(*call(server, "POST", "/detokenize", {"tokens": [-1]}), 400, "tokens")
    error(*call(server, "POST", "/detokenize", {"tokens": "5 6"}), 400, "tokens")
    error(*call(server, "POST", "/tokenize", {"prompt": 5}), 400, "prompt")
    error(*call(server, "POST", "/tokenize", {"prompt": "a", "stream": True}), 400, "stream")
    error(*call(server, "POST", "/tokenize", {"prompt": "a", "model": "gpt"}), 404, "model")
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        assert call(server, "POST", path, body, token=None)[0] == 401


def test_tokenize_messages_as_hf_renders_the_template(server, hf):
    def hf_ids(messages, **kw):
        return hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True,
                                      return_dict=False, **kw)

    first = CHAT[:1]
    for body, want in [
        ({"messages": first}, hf_ids(first, add_generation_prompt=True)),
        ({"messages": first, "add_generation_prompt": False}, hf_ids(first)),
        ({"messages": first, "chat_template_kwargs": {"mood": "calm"}},
         hf_ids(first, add_generation_prompt=True, mood="calm")),
        ({"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
         hf_ids(CHAT, continue_final_message=True)),
    ]:
        status, got = call(server, "POST", "/tokenize", body)
        assert status == 200 and got["tokens"] == want, body
    assert hf.decode(hf_ids(CHAT, continue_final_message=True)).endswith("Nay,")
    error(*call(server, "POST", "/tokenize", {"messages": CHAT, "continue_final_message": True}),
          400, "continue_final_message")
    error(*call(server, "POST", "/tokenize", {"messages": first,
                                              "chat_template_kwargs": {"messages": []}}),
          400, "chat_template_kwargs.messages")
    error(*call(server, "POST", "/tokenize", {"messages": [{"role": "x"}]}), 400,
          "messages[0].role")


def test_model_cards(server):
    status, got = call(server, "GET", "/v1/models")
    assert status == 200 and [c["id"] for c in got["data"]] == [MODEL]
    assert got["data"][0]["max_model_len"] == TINY["max_model_len"]
    status, card = call(server, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and card == got["data"][0]
    status, body = call(server, "GET", "/v1/models/gpt-4o")
    assert error(status, body, 404, "model") and body["error"]["code"] == "model_not_found"
    assert call(server, "GET", f"/v1/models/{MODEL}", token="wrong")[0] == 401


# ---- stream_options.continuous_usage_stats -------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_counts_the_chunks_tokens(server, hf, chat):
    body = {"model": MODEL, "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body |= {"messages": CHAT[:1], "logprobs": True}
        prompt_tokens = len(hf.apply_chat_template(CHAT[:1], chat_template=TEMPLATE,
                                                   add_generation_prompt=True, return_dict=False))
    else:
        body |= {"prompt": TEXT, "logprobs": 0}
        prompt_tokens = len(hf(TEXT).input_ids)
    status, events = call(server, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                          body)
    assert status == 200
    *chunks, last = events
    cached = last["usage"].pop("prompt_tokens_details")["cached_tokens"]  # known at the end
    assert 0 <= cached < prompt_tokens and cached % TINY["page_size"] == 0
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 9, "total_tokens": prompt_tokens + 9}
    seen = 0  # tokens in the chunks so far, by their logprob entries
    for c in chunks:
        for ch in c["choices"]:
            lp = ch["logprobs"]
            seen += len(lp["content"] if chat else lp["tokens"]) if lp else 0
        assert c["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": seen,
                              "total_tokens": prompt_tokens + seen}
    assert chunks[-1]["usage"] == last["usage"] and len(chunks) >= 3
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    # only continuous: usage in every chunk, no usage-only chunk at the end
    body["stream_options"] = {"continuous_usage_stats": True}
    _, events = call(server, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    assert all(e["choices"] for e in events) and events[-1]["usage"] == last["usage"]


@pytest.mark.parametrize("opts,stream,param", [
    ({"include_usage": True, "bogus": 1}, True, "stream_options.bogus"),
    ({"continuous_usage_stats": "yes"}, True, "stream_options.continuous_usage_stats"),
    ({"include_usage": 1}, True, "stream_options.include_usage"),
    ([True], True, "stream_options"),
    ({"continuous_usage_stats": True}, False, "stream_options"),  # as OpenAI: stream only
])
def test_bad_stream_options_name_the_key(server, opts, stream, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream,
            "stream_options": opts}
    error(*call(server, "POST", "/v1/completions", body), 400, param)


# ---- vLLM's request extensions -------------------------------------------------------------------
def test_every_extension_is_taken_or_refused_by_name(server):
    ext = openai_server.VLLM_EXTENSIONS
    for name, (comp, chat) in ext.items():
        for how, fields in ((comp, openai_server._COMPLETION_FIELDS),
                            (chat, openai_server._CHAT_FIELDS)):
            assert (how in ("sampling", "honoured")) == (name in fields), name
            assert (how == "sampling") == (name in SAMPLING_FIELDS and how is not None), name
    ok = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    for path, col, base in (("/v1/completions", 0, {"prompt": "hi"}),
                            ("/v1/chat/completions", 1, {"messages": CHAT[:1]})):
        refused = [k for k, v in ext.items() if v[col] in ("refused", None)]
        assert len(refused) >= 7
        for k in refused:
            msg = error(*call(server, "POST", path, {**ok, **base, k: {"a": 1}}), 400, k)
            assert msg == f"'{k}' is not supported by this server"
        # null or false: as if absent
        status, _ = call(server, "POST", path, {**ok, **base, **{k: None for k in refused},
                                                **{k: False for k in refused[:3]}})
        assert status == 200
        msg = error(*call(server, "POST", path, {**ok, **base, "frobnicate": 1}), 400, "frobnicate")
        assert msg.startswith("Unrecognized request argument")


def test_request_id_add_special_tokens_and_add_generation_prompt(server, hf):
    ok = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    status, r = call(server, "POST", "/v1/completions", {**ok, "prompt": TEXT, "request_id": "r-1"})
    assert status == 200 and r["id"] == "cmpl-r-1"
    assert r["usage"]["prompt_tokens"] == len(hf(TEXT).input_ids)
    _, r = call(server, "POST", "/v1/completions", {**ok, "prompt": TEXT,
                                                    "add_special_tokens": False})
    assert r["usage"]["prompt_tokens"] == len(hf(TEXT, add_special_tokens=False).input_ids)
    _, r = call(server, "POST", "/v1/chat/completions",
                {**ok, "messages": CHAT[:1], "request_id": "c", "add_generation_prompt": False})
    assert r["id"] == "chatcmpl-c" and r["usage"]["prompt_tokens"] == len(
        hf.apply_chat_template(CHAT[:1], chat_template=TEMPLATE, return_dict=False))
    error(*call(server, "POST", "/v1/completions", {**ok, "prompt": "a", "request_id": 5}), 400,
          "request_id")
    error(*call(server, "POST", "/v1/chat/completions", {**ok, "messages": CHAT[:1],
                                                         "echo": True}), 400, "echo")


def test_guided_fields_are_structured_outputs(server):
    ok = {"model": MODEL, "max_tokens": 12, "temperature": 0, "prompt": "The answer:"}
    _, r = call(server, "POST", "/v1/completions", {**ok, "guided_choice": ["yes", "no"]})
    assert r["choices"][0]["text"] in ("yes", "no")
    _, r = call(server, "POST", "/v1/completions", {**ok, "guided_regex": "[0-9]{3}",
                                                    "guided_decoding_backend": "llguidance"})
    assert re.fullmatch("[0-9]{3}", r["choices"][0]["text"])
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    _, r = call(server, "POST", "/v1/completions", {**ok, "max_tokens": 20,
                                                    "guided_json": json.dumps(schema)})
    assert isinstance(json.loads(r["choices"][0]["text"])["a"], bool)
    for extra, param in [({"guided_regex": "a("}, "guided_regex"),
                         ({"guided_choice": "yes"}, "guided_choice"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                         ({"guided_regex": "a", "structured_outputs": {"regex": "a"}},
                          "guided_regex"),
                         ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
                          "guided_decoding_backend")]:
        error(*call(server, "POST", "/v1/completions", {**ok, **extra}), 400, param)


# ---- text controls and truncation end to end ---------------------------------------------------
def test_include_stop_str_and_truncate_prompt_tokens(server, tiny_llm):
    ok = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, r = call(server, "POST", "/v1/completions", {**ok, "prompt": TEXT})
    free = r["choices"][0]["text"]
    stop = free[4:7]
    cut = free.find(stop)
    for include, want in ((False, free[:cut]), (True, free[:cut + len(stop)])):
        _, r = call(server, "POST", "/v1/completions", {**ok, "prompt": TEXT, "stop": [stop],
                                                        "include_stop_str_in_output": include})
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (want, "stop")
    ids = tiny_llm.tokenizer.encode(TEXT * 24)
    assert len(ids) > TINY["max_model_len"]
    want = tiny_llm.generate([ids[-30:]], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True))[0]
    for prompt in (ids, TEXT * 24):  # ids, text: the last 30 tokens run
        status, r = call(server, "POST", "/v1/completions", {**ok, "prompt": prompt,
                                                             "truncate_prompt_tokens": 30})
        assert status == 200 and r["usage"]["prompt_tokens"] == 30
        assert r["choices"][0]["text"] == want.text
    error(*call(server, "POST", "/v1/completions", {**ok, "prompt": ids}), 400, "prompt")
    error(*call(server, "POST", "/v1/completions", {**ok, "prompt": "a",
                                                    "truncate_prompt_tokens": 0}), 400,
          "truncate_prompt_tokens")


# ---- gRPC: n samples, each streamed with its index -----------------------------------------------
def test_grpc_streams_n_samples_by_index(server, tiny_llm):
    import grpc

    from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc

    auth = (("authorization", f"Bearer {TOKEN}"),)
    ids = tiny_llm.tokenizer.encode(TEXT)
    kw = dict(max_tokens=5, temperature=1.0, ignore_eos=True, seed=7)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(jaxinfer_pb2.GenerateRequest(prompt_token_ids=ids, n=3, **kw),
                                  metadata=auth, timeout=60))
        for bad, field in ((dict(n=2, best_of=3), "best_of"), (dict(n=99), "n")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(jaxinfer_pb2.GenerateRequest(prompt_token_ids=ids, **bad),
                                   metadata=auth, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{field}: ")
    for i in range(3):  # sample i is the request alone with seed + i
        mine = [m for m in msgs if m.index == i]
        want = tiny_llm.generate([ids], SamplingParams(**{**kw, "seed": 7 + i}))[0]
        assert [t for m in mine for t in m.token_ids] == want.token_ids
        assert [m.HasField("final") for m in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].final.usage.completion_tokens == 5
    assert {m.index for m in msgs} == {0, 1, 2}
