"""LoRA adapters through the servers (HTTP, jaxinfer.v1, JetStream Decode) and JSONL, on the tiny
Llama with two PEFT adapters: the tokens of LLM.generate with the same LoRARequest, adapters
loaded and unloaded while requests run, bad names refused at the door."""

from __future__ import annotations

import concurrent.futures
import copy
import json

import grpc
import pytest

from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.serve.grpc_server import ServerConfig, ServerThread
from jaxinfer.serve.proto import jaxinfer_pb2, jaxinfer_pb2_grpc, jetstream_pb2, jetstream_pb2_grpc
from tests.http_helpers import call as http_call

peft = pytest.importorskip("peft")

ENGINE = dict(max_slots=4, page_size=8, max_model_len=128, enable_lora=True, max_loras=1,
              max_lora_rank=8)
MODEL, TOKEN = "tiny", "tok"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = "To be, or not to be, that is the question"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    import torch
    import transformers

    root = tmp_path_factory.mktemp("lora_serving")
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_dir)
    out = {}
    for i, (name, targets) in enumerate((("poet", ["q_proj", "v_proj"]),
                                         ("clerk", ["o_proj", "up_proj", "down_proj"]))):
        torch.manual_seed(i)
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        pm.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def ref(tiny_dir, adapters):
    """name -> the greedy RequestOutput of PROMPT through LLM.generate (None: the base model)."""
    llm = LLM(str(tiny_dir), **ENGINE)
    out = {}
    for name in (None, "poet", "clerk"):
        req = None if name is None else LoRARequest(name, 1, adapters[name])
        out[name] = llm.generate([PROMPT], GREEDY, lora_request=req)[0]
    assert len({tuple(v.token_ids) for v in out.values()}) == 3  # each adapter changes it
    return out


@pytest.fixture(scope="module")
def server(tiny_dir, adapters):
    llm = LLM(str(tiny_dir), **ENGINE)
    llm.engine.add_lora("poet", adapters["poet"])  # as --lora-modules poet=PATH does
    s = ServerThread(llm, ServerConfig(port=0, http_port=0, max_queue=64, auth_token=TOKEN,
                                       model_name=MODEL))
    s.llm = llm
    yield s
    s.stop()


def call(server, method, path, body=None, token=TOKEN):
    return http_call(server, method, path, body, token)


def complete(server, model):
    status, body = call(server, "POST", "/v1/completions", dict(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True))
    return status, body


def test_adapters_served_by_name_loaded_and_unloaded_under_load(server, adapters, ref):
    status, models = call(server, "GET", "/v1/models")
    assert status == 200
    assert [(m["id"], m.get("parent")) for m in models["data"]] == [(MODEL, None), ("poet", MODEL)]
    # requests on the base model and on "poet" run throughout; "clerk" is loaded, used and
    # unloaded meanwhile (one device slot: the two adapters take turns in it)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        load = [pool.submit(complete, server, m) for m in [MODEL, "poet"] * 6]
        status, card = call(server, "POST", "/v1/load_lora_adapter",
                            dict(lora_name="clerk", lora_path=adapters["clerk"]))
        assert status == 200 and card["rank"] == 4, card
        clerk = [pool.submit(complete, server, "clerk") for _ in range(3)]
        load += [pool.submit(complete, server, m) for m in [MODEL, "poet"] * 6]
        results = [f.result() for f in load + clerk]
    assert all(s == 200 for s, _ in results), [b for s, b in results if s != 200]
    got = [b["choices"][0]["text"] for _, b in results]
    text = {k: v.text for k, v in ref.items()}
    assert got == [text[None], text["poet"]] * 12 + [text["clerk"]] * 3
    assert call(server, "POST", "/v1/unload_lora_adapter", dict(lora_name="clerk"))[0] == 200
    status, body = complete(server, "clerk")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, models = call(server, "GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL, "poet"]


def test_unload_in_use_is_refused_and_bad_adapter_requests_name_the_field(server, adapters):
    # a long request holds "poet": unloading it is refused (409) until the request is done
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(call, server, "POST", "/v1/completions", dict(
            model="poet", prompt=PROMPT, max_tokens=100, temperature=0, ignore_eos=True))
        import time

        deadline = time.monotonic() + 30
        while server.llm.engine.scheduler.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        status, body = call(server, "POST", "/v1/unload_lora_adapter", dict(lora_name="poet"))
        assert status == 409 and "in use" in body["error"]["message"]
        assert long.result()[0] == 200
    cases = [
        (dict(lora_name="x", lora_path="/nonexistent"), 400, "not a directory"),
        (dict(lora_name="", lora_path=adapters["poet"]), 400, "lora_name"),
        (dict(lora_name="x"), 400, "lora_path"),
        (dict(lora_name="x", lora_path=adapters["poet"], extra=1), 400, "extra"),
        (dict(lora_name=MODEL, lora_path=adapters["poet"]), 400, "base model"),
    ]
    for body, status, msg in cases:
        got, out = call(server, "POST", "/v1/load_lora_adapter", body)
        assert got == status and msg in out["error"]["message"], (body, out)
    assert call(server, "POST", "/v1/load_lora_adapter",
                dict(lora_name="y", lora_path=adapters["poet"]), token=None)[0] == 401
    got, out = call(server, "POST", "/v1/unload_lora_adapter", dict(lora_name="nope"))
    assert got == 404
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = jaxinfer_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(jaxinfer_pb2.GenerateRequest(prompt=PROMPT, max_tokens=4,
                                                            lora="nope"), metadata=AUTH))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora: unknown LoRA adapter 'nope'" in e.value.details()


def test_grpc_services_take_the_adapter_name(server, ref):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        gen = jaxinfer_pb2_grpc.GenerationStub(ch)
        for name in (None, "poet"):
            msgs = list(gen.Generate(jaxinfer_pb2.GenerateRequest(
                prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True,
                lora=name or ""), metadata=AUTH))
            assert [t for m in msgs for t in m.token_ids] == ref[name].token_ids
        js = jetstream_pb2_grpc.OrchestratorStub(ch)
        req = jetstream_pb2.DecodeRequest(max_tokens=8, lora_adapter_id="poet")
        req.token_content.token_ids.extend(server.llm.tokenizer.encode(PROMPT))
        msgs = list(js.Decode(req, metadata=AUTH))
        got = [t for m in msgs for s in m.stream_content.samples for t in s.token_ids]
        assert got == ref["poet"].token_ids  # JetStream Decode is greedy


def test_jsonl_lines_name_their_adapter(tiny_dir, adapters, ref, tmp_path):
    llm = LLM(str(tiny_dir), **ENGINE)
    llm.engine.add_lora("poet", adapters["poet"])
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": 1, "prompt": PROMPT, "lora": "poet"}, {"id": 2, "prompt": PROMPT},
             {"id": 3, "prompt": PROMPT, "lora": "nope"}, {"id": 4, "prompt": PROMPT, "lora": 5}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    llm.generate_jsonl(src, dst, sampling=dict(max_tokens=8, temperature=0.0, ignore_eos=True),
                       ordered=True)
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert recs[1]["token_ids"] == ref["poet"].token_ids
    assert recs[2]["token_ids"] == ref[None].token_ids
    assert "unknown LoRA adapter 'nope'" in recs[3]["error"]
    assert "'lora'" in recs[4]["error"]
