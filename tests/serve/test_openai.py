"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real server
on 127.0.0.1 (random free ports, tiny random Llama), sharing one engine with the gRPC service."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

openai = pytest.importorskip("openai")

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.serve.chat_template import GEMMA_TEMPLATE, ChatTemplate, ChatTemplateError  # noqa: E402
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread, banner  # noqa: E402
from jaxinfer.serve.metrics import parse_text  # noqa: E402
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc  # noqa: E402

ENGINE = dict(max_slots=4, page_size=8, max_model_len=1024)
TOKEN = "test-token"
MODEL = "tiny-llama"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = "To be, or not to be, that is the question"

# A ChatML-like template in the checkpoint's tokenizer_config.json: exercises bos_token,
# add_generation_prompt, raise_exception, loop variables and filters as HF renders them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.first %}"
    "{{ raise_exception('the conversation must not start with the assistant') }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tiny_dir, tmp_path_factory):
    """The session's tiny Llama, copied: this one gets a chat template."""
    d = tmp_path_factory.mktemp("tiny_openai") / "tiny"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def ref_llm(tiny_dir):
    return LLM(str(tiny_dir), **ENGINE)


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = ServerThread(LLM(str(tiny_dir), **ENGINE),
                     ServerConfig(port=0, http_port=0, metrics_port=0, max_queue=6, max_samples=8,
                                  auth_token=TOKEN, model_name=MODEL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=TOKEN,
                         max_retries=0, timeout=60)


def raw(server, method, path, body=None, *, token=TOKEN, data=None):
    """(status, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    payload = data if data is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=payload, headers=headers)
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out else None


def grpc_stats(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        return jaxinfer_pb2_grpc.GenerationStub(ch).Stats(jaxinfer_pb2.StatsRequest(), metadata=AUTH)


def wait_idle(server, timeout=15.0):
    t = time.monotonic() + timeout
    while True:
        s = grpc_stats(server)
        if s.in_flight == 0 and s.running == 0 and s.pages_free == s.pages_total:
            return s
        assert time.monotonic() < t, f"server did not go idle: {s}"
        time.sleep(0.02)


def assert_error_shape(body, status):
    assert set(body) == {"error"}, body
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"], e
    assert isinstance(e["type"], str) and e["type"], e


def token_text(tok, t):
    a = tok.encode("a", add_special_tokens=False)[-1:]
    return tok.decode(a + [t], skip_special_tokens=False)[len(tok.decode(a, skip_special_tokens=False)):]


# ---- completions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(max_tokens=24, temperature=0.0),
    dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234),
    dict(max_tokens=20, temperature=1.0, seed=7, logprobs=3),
])
def test_completion_matches_llm_generate(client, ref_llm, kw):
    want = ref_llm.generate([PROMPT], SamplingParams(**kw))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, **kw)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if kw.get("logprobs"):
        lp = c.logprobs
        assert lp.token_logprobs == pytest.approx([d["logprob"] for d in want.logprobs], abs=1e-4)
        assert lp.tokens == [token_text(ref_llm.tokenizer, t) for t in want.token_ids]
        assert all(len(top) <= 3 and max(top.values()) >= v - 1e-5
                   for top, v in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    else:
        assert c.logprobs is None


def test_completion_n_stop_seed_streamed_and_not(client, ref_llm):
    kw = dict(max_tokens=30, temperature=0.8, stop=["e", "th"])
    want = ref_llm.generate([PROMPT, PROMPT], [SamplingParams(seed=11, **kw),
                                               SamplingParams(seed=12, **kw)])
    assert want[0].text != want[1].text or want[0].token_ids != want[1].token_ids
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    for c, w in zip(r.choices, want):
        assert (c.text, c.finish_reason) == (w.text, w.finish_reason)
        assert "e" not in c.text and "th" not in c.text
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    texts, reasons, usage, n_chunks = ["", ""], [None, None], None, 0
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=11, stream=True,
                                        stream_options={"include_usage": True}, **kw):
        n_chunks += 1
        if not ch.choices:
            usage = ch.usage
            continue
        assert ch.usage is None
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == [w.text for w in want] and reasons == [w.finish_reason for w in want]
    assert n_chunks > 2
    assert usage is not None and usage.model_dump() == r.usage.model_dump()


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): 0 for a prompt first seen,
    then its full pages (page_size 8) when the same prompt comes again; streamed too (the
    include_usage chunk), and once per prompt whatever n is."""
    prompt = [int(t) for t in range(40, 40 + 45)]  # a prompt no other test sends: 45 tokens
    kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    first = client.completions.create(**kw).usage
    assert first.prompt_tokens == 45 and first.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**kw, n=2, seed=1).usage
    # 5 full pages of 8 cached (the page with the last prompt token is computed again)
    assert again.prompt_tokens_details.cached_tokens == 40
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_seed_reproducible_and_matters(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0)
    a = client.completions.create(seed=5, **kw).choices[0].text
    b = client.completions.create(seed=5, **kw).choices[0].text
    c = client.completions.create(seed=6, **kw).choices[0].text
    assert a == b and a != c


def test_completion_token_prompts_batch_and_echo(client, ref_llm):
    ids = ref_llm.tokenizer.encode("Now is the winter of our discontent")
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    want_ids = ref_llm.generate([ids], sp)[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == want_ids.text
    assert r.usage.prompt_tokens == len(ids)
    prompts = [PROMPT, "Friends, Romans, countrymen"]
    want = ref_llm.generate(prompts, sp)
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [p + w.text for p, w in zip(prompts, want)]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)

    # echo + logprobs: the prompt's tokens are scored too (first: null), streamed and not;
    # vLLM's `prompt_logprobs` field adds {token id: {logprob, decoded_token}} per prompt token
    scored = ref_llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0,
                                                       logprobs=2, prompt_logprobs=2))[0]
    n_prompt = len(scored.prompt_token_ids)
    want_lps = [None] + [e["logprob"] for e in scored.prompt_logprobs[1:]] + \
        [e["logprob"] for e in scored.logprobs]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  echo=True, logprobs=2, extra_body={"prompt_logprobs": 1})
    c = r.choices[0]
    assert c.text == PROMPT + scored.text
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 4 and lp.top_logprobs[0] is None
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want_lps[1:], abs=1e-5)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    vllm = c.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n_prompt
    for j in range(1, n_prompt):
        tid = str(scored.prompt_token_ids[j])
        assert vllm[j][tid]["logprob"] == pytest.approx(want_lps[j], abs=1e-5)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, echo=True, logprobs=2, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert text == PROMPT + scored.text
    assert streamed[0] is None and streamed[1:] == pytest.approx(want_lps[1:], abs=1e-5)


# ---- chat ----------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "  Tell me of the king.  "}]


def test_chat_template_renders_as_transformers(ref_llm):
    from transformers.utils.chat_template_utils import render_jinja_template

    from jaxinfer.serve.chat_template import resolve_chat_template

    tpl = resolve_chat_template(ref_llm.tokenizer, ref_llm.model.cfg)
    assert tpl.origin == "checkpoint" and tpl.bos_token == "<s>" and tpl.eos_token == "</s>"
    convos = [MESSAGES, MESSAGES + [{"role": "assistant", "content": "Aye."},
                                    {"role": "user", "content": "More."}]]
    for conv in convos:
        for gen in (True, False):
            want = render_jinja_template([conv], chat_template=CHAT_TEMPLATE, add_generation_prompt=gen,
                                         bos_token="<s>", eos_token="</s>")[0][0]
            assert tpl.render(conv, add_generation_prompt=gen) == want
    assert tpl.render(MESSAGES) == ("<s><|system|>\nYou are terse.<|end|>\n<|user|>\n"
                                    "Tell me of the king.<|end|>\n<|assistant|>\n")
    # BOS is in the text, so it is not added again; "<s>" maps to the BOS id
    ids = tpl.encode(MESSAGES)
    assert ids == ref_llm.tokenizer.encode(tpl.render(MESSAGES), add_special_tokens=False)
    assert ids[0] == ref_llm.tokenizer.bos_id and ids.count(ref_llm.tokenizer.bos_id) == 1
    with pytest.raises(ChatTemplateError, match="must not start with the assistant"):
        tpl.render([{"role": "assistant", "content": "hi"}])


def test_builtin_gemma_template_matches_transformers(ref_llm):
    from transformers.utils.chat_template_utils import render_jinja_template

    tpl = ChatTemplate(GEMMA_TEMPLATE, "builtin:gemma3", "<bos>", "<eos>", ref_llm.tokenizer)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    want = ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
            "<end_of_turn>\n<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert tpl.render(conv) == want
    ref = render_jinja_template([conv], chat_template=GEMMA_TEMPLATE, add_generation_prompt=True,
                                bos_token="<bos>", eos_token="<eos>")[0][0]
    assert ref == want
    assert tpl.render(conv[1:2], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    with pytest.raises(ChatTemplateError, match="alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chat_matches_llm_generate(client, ref_llm):
    from jaxinfer.serve.chat_template import resolve_chat_template

    ids = resolve_chat_template(ref_llm.tokenizer, ref_llm.model.cfg).encode(MESSAGES)
    kw = dict(max_tokens=16, temperature=0.9, logprobs=2)
    want = ref_llm.generate([ids, ids], [SamplingParams(seed=21, **kw), SamplingParams(seed=22, **kw)])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=21, temperature=0.9,
                                       max_completion_tokens=16, logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    for c, w in zip(r.choices, want):
        assert c.message.role == "assistant"
        assert (c.message.content, c.finish_reason) == (w.text, w.finish_reason)
        got = c.logprobs.content
        assert [e.logprob for e in got] == pytest.approx([d["logprob"] for d in w.logprobs], abs=1e-4)
        assert [e.token for e in got] == [token_text(ref_llm.tokenizer, t) for t in w.token_ids]
        assert all(len(e.top_logprobs) == 2 for e in got)
    # streamed: role first, then content deltas; same text
    texts, reasons, roles = ["", ""], [None, None], set()
    for ch in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=21,
                                             temperature=0.9, max_tokens=16, stream=True):
        for c in ch.choices:
            if c.delta.role:
                roles.add((c.index, c.delta.role))
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert texts == [w.text for w in want] and reasons == [w.finish_reason for w in want]


def test_chat_greedy_stop_and_length(client, ref_llm):
    from jaxinfer.serve.chat_template import resolve_chat_template

    ids = resolve_chat_template(ref_llm.tokenizer, ref_llm.model.cfg).encode(MESSAGES)
    free = ref_llm.generate([ids], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stop = free.text[len(free.text) // 2:][:2]
    assert stop.strip()
    want = ref_llm.generate([ids], SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))[0]
    assert want.finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                       stop=stop)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_response_format_json_schema_streamed_and_not(client, ref_llm):
    """The official client's response_format: the server's JSON equals LLM.generate under the
    same constraint, parses and fits the schema, streamed or not; vLLM's structured_outputs
    (extra_body) on completions likewise."""
    import jsonschema

    from jaxinfer.serve.chat_template import resolve_chat_template

    schema = {"type": "object", "additionalProperties": False, "required": ["who", "n"],
              "properties": {"who": {"enum": ["Hamlet", "Ophelia"]},
                             "n": {"type": "integer", "minimum": 1, "maximum": 9}}}
    ids = resolve_chat_template(ref_llm.tokenizer, ref_llm.model.cfg).encode(MESSAGES)
    want = ref_llm.generate([ids], SamplingParams(max_tokens=40, temperature=0.0,
                                                  structured_outputs={"json": schema}))[0]
    rf = {"type": "json_schema", "json_schema": {"name": "line", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                       max_tokens=40, response_format=rf)
    got = r.choices[0].message.content
    assert got == want.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, response_format=rf,
        stream=True) if c.choices)
    assert streamed == got
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.8, seed=3,
                                       max_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}


def test_tool_calls_named_required_and_auto_streamed_and_not(client):
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK],
                                       tool_choice=named, temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the client's deltas assemble into the same call
    name, args, reasons = "", "", set()
    for ch in client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK],
                                             tool_choice=named, temperature=0, max_tokens=60,
                                             stream=True):
        for d in ch.choices:
            reasons.add(d.finish_reason)
            for tc in d.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert (name, args) == (call.function.name, call.function.arguments)
    assert "tool_calls" in reasons
    # required, sampled: every call names one of the tools with valid arguments
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK],
                                       tool_choice="required", temperature=1.0, seed=2, n=3,
                                       max_tokens=80, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        for tc in c.message.tool_calls:
            spec = {"get_weather": WEATHER, "get_time": CLOCK}[tc.function.name]["function"]
            jsonschema.validate(json.loads(tc.function.arguments), spec["parameters"])
    # auto: the model decides; an untrained model writes text, which stays content
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                       temperature=0, max_tokens=8)
    c = r.choices[0]
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
    if not c.message.tool_calls:
        assert isinstance(c.message.content, str)


def test_tool_call_texts_the_models_write():
    from jaxinfer.serve.tool_calls import parse_tools

    plan = parse_tools({"tools": [WEATHER, CLOCK]})
    for text in ('{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # the prompted format
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                 '{"name": "get_weather", "parameters": {"city": "Oslo"}}'):  # Llama 3.x
        (call,) = plan.calls(text)
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}, text
    two = plan.calls('[{"name": "get_time"}, {"name": "get_weather", "arguments": {"city": "A"}}]')
    assert [c["function"]["name"] for c in two] == ["get_time", "get_weather"]
    assert len({c["id"] for c in two}) == 2
    for text in ('{"name": "nope", "arguments": {}}', "Sunny.", '{"name": "get_time", '
                 '"arguments": [1]}', "[]", "[" * 100_000):
        assert plan.calls(text) is None, text


def test_tool_results_continue_the_conversation(client):
    """A call and its result sent back (role "tool" answering the call's id): this template
    renders no tool_calls, so the call is the assistant's JSON answer and the result a user
    turn, as the plain turns written out by hand here."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    turns = ask + [r.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"}]
    got = client.chat.completions.create(model=MODEL, messages=turns, temperature=0,
                                         max_tokens=8)
    answer = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    plain = ask + [{"role": "assistant", "content": answer}, {
        "role": "user", "content": f"Result of get_weather (call {call.id}): 18C and sunny"}]
    want = client.chat.completions.create(model=MODEL, messages=plain, temperature=0,
                                          max_tokens=8)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.choices[0].message.content == want.choices[0].message.content


# ---- models, health, auth, errors ----------------------------------------------------------------
def test_models_health_and_auth(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, body = raw(server, "GET", "/health", token=None)  # health needs no token
    assert status == 200 and body["status"] == "ok"
    for token in (None, "wrong"):
        status, body = raw(server, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "hi", "max_tokens": 2}, token=token)
        assert status == 401
        assert_error_shape(body, 401)
        status, body = raw(server, "GET", "/v1/models", token=token)
        assert status == 401
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="nope",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"


C, CH = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CH = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MALFORMED = [  # (path, body or raw bytes, status, param)
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {"prompt": "hi"}, 400, "model"),
    (C, {**OK_C, "model": "nope"}, 404, "model"),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, {**OK_C, "prompt": ""}, 400, "prompt"),
    (C, {**OK_C, "prompt": [1, 10 ** 6]}, 400, "prompt"),
    (C, {**OK_C, "max_tokens": -1}, 400, "max_tokens"),
    (C, {**OK_C, "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {**OK_C, "max_tokens": 5000}, 400, "max_tokens"),
    (C, {**OK_C, "temperature": 5}, 400, "temperature"),
    (C, {**OK_C, "top_p": 0}, 400, "top_p"),
    (C, {**OK_C, "n": 0}, 400, "n"),
    (C, {**OK_C, "n": 99}, 400, "n"),
    (C, {**OK_C, "stop": 12}, 400, "stop"),
    (C, {**OK_C, "stop": [""]}, 400, "stop"),
    (C, {**OK_C, "logprobs": 50}, 400, "logprobs"),
    (C, {**OK_C, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {**OK_C, "frequency_penalty": "1"}, 400, "frequency_penalty"),
    (CH, {**OK_CH, "presence_penalty": True}, 400, "presence_penalty"),
    (C, {**OK_C, "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    (CH, {**OK_CH, "logit_bias": {"7": "high"}}, 400, "logit_bias.7"),
    (C, {**OK_C, "logit_bias": {"five": 1}}, 400, "logit_bias"),
    (C, {**OK_C, "logit_bias": [5, 1]}, 400, "logit_bias"),
    (C, {**OK_C, "seed": 1.5}, 400, "seed"),
    (C, {**OK_C, "stream": "yes"}, 400, "stream"),
    (C, {**OK_C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**OK_C, "frobnicate": 1}, 400, "frobnicate"),
    (CH, {**OK_CH, "messages": []}, 400, "messages"),
    (CH, {**OK_CH, "messages": "hi"}, 400, "messages"),
    (CH, {**OK_CH, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CH, {**OK_CH, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].image_url"),  # (no url)
    (CH, {**OK_CH, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content[0].image_url"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400,
     "messages[0].content"),
    (CH, {**OK_CH, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),
    (CH, {**OK_CH, "top_logprobs": 3}, 400, "top_logprobs"),
    (CH, {**OK_CH, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CH, {**OK_CH, "tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    (CH, {**OK_CH, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),
    (CH, {**OK_CH, "tool_choice": "required"}, 400, "tool_choice"),
    (CH, {**OK_CH, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"maximum": float("nan")}}}]}, 400,
     "tools[0].function.parameters"),
    (CH, {**OK_CH, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": "hi"}, {
        "role": "tool", "tool_call_id": "call_1", "content": "18C"}]}, 400,
     "messages[1].tool_call_id"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{not json"}}]}, {"role": "user", "content": "go"}]}, 400,
     "messages[1].tool_calls[0].function.arguments"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, 400,
     "messages[0].tool_calls"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100_000}}]}, {"role": "user", "content": "go"}]},
     400, "messages[1].tool_calls[0].function.arguments"),
    (CH, {**OK_CH, "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": ["a_property_name_of_many_tokens"],
                                "properties": {"a_property_name_of_many_tokens": {
                                    "type": "string", "minLength": 30}}}}}}, 400, "max_tokens"),
    (CH, {**OK_CH, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CH, {**OK_CH, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    (CH, {**OK_CH, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, 400, "response_format.json_schema.schema"),
    (C, {**OK_C, "structured_outputs": {"regex": "a("}}, 400, "structured_outputs.regex"),
    (C, {**OK_C, "structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
     400, "structured_outputs"),
    (CH, {**OK_CH, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/audio/speech", OK_C, 404, None),
]


def test_malformed_requests_get_openai_errors(client, server):
    invalid_before = grpc_stats(server).requests["invalid"]
    n400 = 0
    for path, body, status, param in MALFORMED:
        got, resp = raw(server, "POST", path, data=body if isinstance(body, bytes) else None,
                        body=None if isinstance(body, bytes) else body)
        assert got == status, (path, body, resp)
        assert_error_shape(resp, status)
        assert resp["error"]["param"] == param, (body, resp)
        n400 += got == 400
    status, resp = raw(server, "GET", C)
    assert status == 405
    assert_error_shape(resp, 405)
    assert len(MALFORMED) >= 12
    assert grpc_stats(server).requests["invalid"] - invalid_before == n400
    # the client surfaces them as BadRequestError with the field named
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", presence_penalty=-2.5)
    assert ei.value.body["param"] == "presence_penalty"
    # ... and the server keeps serving
    wait_idle(server)
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    status, _ = raw(server, "POST", CH, OK_CH)
    assert status == 200


def test_penalties_and_logit_bias_in_range_are_accepted(client):
    """Sampling table rows now: a value in range is served (their effect: tests/runtime)."""
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, presence_penalty=0.5,
                                  frequency_penalty=-1.0, logit_bias={"5": 10, "7": -100})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, presence_penalty=2, frequency_penalty=0.25,
                                       logit_bias={"42": 1.5})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1


def test_queue_full_is_429(client, server):
    # max_queue=6: seven samples cannot be queued at once (n <= max_samples=8 passes validation)
    with pytest.raises(openai.RateLimitError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=7)
    assert ei.value.status_code == 429 and ei.value.body["code"] == "queue_full"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=6).usage.total_tokens


# ---- one engine, cancellation --------------------------------------------------------------------
def test_grpc_and_http_share_the_engine(client, server, ref_llm):
    want = ref_llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.7, seed=9))[0]
    steps_before = grpc_stats(server).steps
    got = {}

    def via_grpc():
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            req = jaxinfer_pb2.GenerateRequest(prompt=PROMPT, max_tokens=24, temperature=0.7, seed=9)
            got["grpc"] = "".join(m.text for m in jaxinfer_pb2_grpc.GenerationStub(ch).Generate(
                req, metadata=AUTH, timeout=60))

    t = threading.Thread(target=via_grpc)
    t.start()
    got["http"] = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=0.7, seed=9).choices[0].text
    t.join(60)
    assert got == {"grpc": want.text, "http": want.text}
    assert grpc_stats(server).steps > steps_before


def _open_stream(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", body.pop("_path"), body=json.dumps(body).encode(),
                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    return conn


def test_disconnect_mid_stream_frees_pages(server):
    idle = wait_idle(server)
    cancelled0 = idle.requests["cancelled"]
    conn = _open_stream(server, {"_path": C, "model": MODEL, "prompt": PROMPT, "max_tokens": 900,
                                 "ignore_eos": True, "temperature": 0, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = 0
    while events < 3:
        line = resp.fp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            assert line != b"data: [DONE]\n"
            events += 1
    busy = grpc_stats(server)
    assert busy.running == 1 and busy.pages_used > 0 and busy.in_flight == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    s = wait_idle(server)
    assert s.requests["cancelled"] == cancelled0 + 1
    assert s.pages_free == s.pages_total
    # the Prometheus view agrees
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as e:  # behind the server's token too
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    m = parse_text(urllib.request.urlopen(req, timeout=10).read().decode())
    assert m["jaxinfer_kv_pages_used"] == 0 and m["jaxinfer_running_slots"] == 0


def test_disconnect_non_streamed_request_cancels_it(server):
    cancelled0 = wait_idle(server).requests["cancelled"]
    conn = _open_stream(server, {"_path": C, "model": MODEL, "prompt": PROMPT, "max_tokens": 900,
                                 "ignore_eos": True, "temperature": 0})
    t = time.monotonic() + 15
    while grpc_stats(server).running == 0:
        assert time.monotonic() < t
        time.sleep(0.01)
    conn.sock.close()
    conn.close()
    s = wait_idle(server)
    assert s.requests["cancelled"] == cancelled0 + 1 and s.pages_free == s.pages_total


def test_sse_wire_format(server):
    conn = _open_stream(server, {"_path": CH, **OK_CH, "stream": True,
                                 "stream_options": {"include_usage": True}})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_tls_applies_to_http_too(ref_llm, tmp_path):
    from tests.serve.test_grpc import _self_signed

    key, cert = _self_signed(tmp_path)
    cfg = ServerConfig(port=0, http_port=0, metrics_port=0, tls_cert=str(cert), tls_key=str(key),
                       model_name=MODEL)
    s = ServerThread(ref_llm, cfg)
    try:
        shown = banner(cfg, s.server)
        assert f"https://127.0.0.1:{s.http_port}/v1" in shown
        assert f"https://127.0.0.1:{s.metrics_port}/metrics" in shown and "http://" not in shown
        tls = ssl.create_default_context(cafile=str(cert))
        m = urllib.request.urlopen(f"https://localhost:{s.metrics_port}/metrics", context=tls,
                                   timeout=10).read().decode()
        assert "jaxinfer_kv_pages_total" in parse_text(m)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10)
        c = openai.OpenAI(base_url=f"https://localhost:{s.http_port}/v1", api_key="x", max_retries=0,
                          http_client=openai.DefaultHttpxClient(
                              verify=ssl.create_default_context(cafile=str(cert))))
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        plain = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
    finally:
        s.stop()


# Keep last: it stops the module's engine loop.
def test_shutting_down_is_503(server):
    server.loop.shutdown(drain=True, timeout=5)
    status, body = raw(server, "GET", "/health", token=None)
    assert status == 503
    assert_error_shape(body, 503)
    status, body = raw(server, "POST", C, OK_C)
    assert status == 503 and body["error"]["code"] == "unavailable"
