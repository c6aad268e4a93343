"""The request door's one table of sampling fields (runtime/host/requests.py SAMPLING_FIELDS):
SamplingParams' fields and checks, and every door's reading of them (JSONL `sampling_from_json`,
the HTTP body, the gRPC GenerateRequest, the `batch` and `generate` flags) derive from it, so a
field's value means one thing and a bad one gets one error, whichever door it came through; a row
added to the table is taken by every door with no other line (gRPC: once the message has the
field). No model loads: the doors' parsers are called directly."""

import argparse
import dataclasses
import importlib.util
import json
import pickle
import re
import sys

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from jaxinfer.runtime.host import requests
from jaxinfer.runtime.host.requests import (INT32_MAX, SAMPLING_FIELDS, Field, Limits,
                                            RequestError, SamplingParams, sampling_class,
                                            sampling_from_json)
from jaxinfer.runtime.host.structured import StructuredOutputs
from jaxinfer.serve import grpc_server, openai_server
from jaxinfer.serve.engine_args import sampling_args, sampling_kwargs
from jaxinfer.serve.proto import jaxinfer_pb2

# SamplingParams' fields and defaults as written by hand before the table (the oracle; a row
# added since needs no line here)
BEFORE = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, stop=(),
              stop_token_ids=(), logprobs=None, prompt_logprobs=None, ignore_eos=False,
              priority=0, structured_outputs=None)

# every sampling flag of `batch` and `generate` before the table, and what it meant
OLD_FLAGS = [
    (["--max-tokens", "5"], dict(max_tokens=5)),
    (["--temperature", "0.7"], dict(temperature=0.7)),
    (["--top-k", "40"], dict(top_k=40)),
    (["--top-p", "0.9"], dict(top_p=0.9)),
    (["--seed", "7"], dict(seed=7)),
    (["--stop", "ab", "--stop", "\n"], dict(stop=("ab", "\n"))),
]
OLD_BATCH_FLAGS = OLD_FLAGS + [
    (["--min-p", "0.05"], dict(min_p=0.05)),
    (["--logprobs", "2"], dict(logprobs=2)),
    (["--prompt-logprobs", "1"], dict(prompt_logprobs=1)),
    (["--ignore-eos"], dict(ignore_eos=True)),
]
COMMAND_DEFAULTS = dict(max_tokens=64, temperature=0.0)  # both commands', before and now


class _AnyGrammar:
    def check(self, so):  # every constraint compiles: the door's parsing is what is tested
        pass


LIMITS = Limits(vocab_size=2048, text_vocab=2000, max_model_len=256, page_size=8, num_pages=64,
                grammars=_AnyGrammar())
BATCH = ["batch", "--input", "in.jsonl", "--output", "out.jsonl"]
GENERATE = ["generate", "a prompt"]


@pytest.fixture(scope="module")
def cli():
    from jaxinfer.serve.cli import build_parser

    return build_parser()


def _flag(name: str, f: Field) -> str:
    """The flag spelling rule, written out here: --name-with-dashes (--no-x: a row on by
    default)."""
    return f"--{'no-' if f.default is True else ''}{name.replace('_', '-')}"


def _sample(name: str, f: Field):
    """A value other than the row's default: (its JSON, its flag's argv, the field after the
    door), by the row's kind and range."""
    if f.kind == "int":
        lo = max(int(f.lo), 0)  # small and >= 0: HTTP takes a seed mod 2**32
        v = lo + 3 if lo + 3 != f.default else lo + 4
        return v, [_flag(name, f), str(v)], v
    if f.kind == "float":
        v = f.lo + (f.hi - f.lo) / 4  # a power-of-two fraction: exact in gRPC's float32
        return v, [_flag(name, f), str(v)], v
    if f.kind == "bool":
        return not f.default, [_flag(name, f)], not f.default
    if f.kind == "strings":
        return ["ab", "c d"], [_flag(name, f), "ab", _flag(name, f), "c d"], ("ab", "c d")
    if f.kind == "ids":
        return [3, 5], [_flag(name, f), "3", _flag(name, f), "5"], (3, 5)
    if f.kind == "bias":  # JSON keys are decimal strings; kept as (id, value) pairs by id
        v = {"7": f.lo / 4, "3": f.hi / 2}  # exact in gRPC's float32
        return v, [_flag(name, f), json.dumps(v)], ((3, f.hi / 2), (7, f.lo / 4))
    assert f.kind == "structured", f.kind
    v = {"choice": ["yes", "no"]}
    return v, [_flag(name, f), json.dumps(v)], StructuredOutputs(choice=("yes", "no"))


def _bad(name: str, f: Field):
    """A value of the right type outside the row's range: (its JSON, its flag's argv); None for a
    row without a range (a bool; ids, whose range is the served vocabulary: `_too_many`)."""
    if f.kind == "int":
        v = int(f.lo) - 1
    elif f.kind == "float":
        v = f.hi + 1.0
    elif f.kind == "strings":
        return [""], [_flag(name, f), ""]  # a string shorter than 1 character
    elif f.kind == "bias":
        v = {"5": f.hi * 2}  # out of range: the error names the entry, logit_bias.5
        return v, [_flag(name, f), json.dumps(v)]
    elif f.kind == "structured":
        v = {"regex": ""}
        return v, [_flag(name, f), json.dumps(v)]
    else:
        return None
    return v, [_flag(name, f), str(v)]


def _too_many(name: str, f: Field):
    """One item more than the row's cap (`Field.most`): (its JSON, its flag's argv); None for a
    row without items."""
    if f.kind == "strings":
        v = [f"w{i}" for i in range(f.most + 1)]
        return v, [a for w in v for a in (_flag(name, f), w)]
    if f.kind == "ids":
        v = list(range(f.most + 1))
        return v, [a for t in v for a in (_flag(name, f), str(t))]
    if f.kind == "bias":
        v = {str(i): 1.0 for i in range(f.most + 1)}
        return v, [_flag(name, f), json.dumps(v)]
    return None


# ---- the doors: each turns one field's value, as it sends it, into SamplingParams -------------
def _jsonl(name, v):
    return sampling_from_json({"id": "x", "prompt": "p", name: v})


def _http(name, v, *, chat=False, http=openai_server):
    """The body check and `_sampling`; the OpenAI names where the API has its own (chat's
    max_completion_tokens; logprobs, which the endpoints read themselves and pass in)."""
    key = "max_completion_tokens" if chat and name == "max_tokens" else name
    body = {"model": "m", ("messages" if chat else "prompt"): "p", key: v}
    http._check_fields(body, http._CHAT_FIELDS if chat else http._COMPLETION_FIELDS)
    lp = body.pop("logprobs", None)
    return http._sampling(http._Body(body), max_tokens_key=key if name == "max_tokens" else
                          "max_tokens", default_max_tokens=16, logprobs=lp, n=1, limits=LIMITS)[0]


def _wire(name, v):
    """A field's JSON as the proto's JSON (a choice is a Choices message)."""
    if name == "structured_outputs" and "choice" in v:
        return {"choice": {"values": v["choice"]}}
    return v


def _grpc(name, v, message=jaxinfer_pb2.GenerateRequest):
    req = json_format.ParseDict({"prompt_token_ids": [5, 6, 7], name: _wire(name, v)}, message())
    return grpc_server.generate_inputs(req, None, LIMITS)[1]


def _flags(cli, command, argv):
    return SamplingParams(**sampling_kwargs(cli.parse_args(command + argv)))


# ---- the table is SamplingParams' fields ------------------------------------------------------
def test_sampling_params_fields_are_the_table():
    fields = dataclasses.fields(SamplingParams)
    assert [f.name for f in fields] == list(SAMPLING_FIELDS)
    assert {f.name: f.default for f in fields if f.name in BEFORE} == BEFORE
    assert set(BEFORE) <= set(SAMPLING_FIELDS)
    assert dataclasses.asdict(SamplingParams()) == {n: f.default for n, f in SAMPLING_FIELDS.items()}
    assert all(f.doc for f in SAMPLING_FIELDS.values())
    assert SamplingParams.__module__ == "jaxinfer.runtime.host.requests"
    p = SamplingParams(max_tokens=3, temperature=1e-6, top_k=-1, stop="x", seed=9,
                       structured_outputs={"choice": ["a", "b"]})
    # checked and normalized on construction: a str stop is one string, under 1e-5 is greedy,
    # top_k -1 is off, a structured_outputs dict is parsed
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.seed) == (3, 0.0, 0, ("x",), 9)
    assert p.greedy and not SamplingParams().greedy
    assert p.structured_outputs == StructuredOutputs(choice=("a", "b"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 4
    with pytest.raises(TypeError, match="max_token"):
        SamplingParams(max_token=3)
    assert pickle.loads(pickle.dumps(p)) == p  # Ray sends them
    assert hash(SamplingParams(max_tokens=3, stop=["x"])) == hash(SamplingParams(max_tokens=3,
                                                                                stop=("x",)))
    q = dataclasses.replace(p, seed=10, temperature=0.5)
    assert (q.seed, q.temperature, q.stop, q.greedy) == (10, 0.5, ("x",), False)
    with pytest.raises(RequestError, match="^top_p: must be in"):
        dataclasses.replace(p, top_p=0.0)  # replace checks too
    # the rule over two fields
    with pytest.raises(RequestError) as e:
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})
    assert e.value.field == "ignore_eos" and "structured_outputs" in e.value.reason


# ---- every door reads every row into the same SamplingParams ----------------------------------
@pytest.mark.parametrize("name", list(SAMPLING_FIELDS))
def test_every_field_round_trips_through_every_door(name, cli):
    f = SAMPLING_FIELDS[name]
    v, argv, want = _sample(name, f)
    assert want != f.default
    expect = dataclasses.replace(SamplingParams(), **{name: want})
    assert getattr(expect, name) == want
    assert _jsonl(name, v) == expect
    assert _http(name, v) == expect
    assert _http(name, v, chat=True) == expect
    assert name in jaxinfer_pb2.GenerateRequest.DESCRIPTOR.fields_by_name, (
        f"gRPC sends no {name}: add it to GenerateRequest (serve/proto/jaxinfer.proto; "
        f"`optional` for a scalar) and regenerate the stubs (tools/gen_proto.sh)")
    assert _grpc(name, v) == expect
    cmd_expect = dataclasses.replace(SamplingParams(**COMMAND_DEFAULTS), **{name: want})
    assert _flags(cli, BATCH, argv) == cmd_expect
    if name != "priority":  # `generate` runs one request: nothing to be ahead of
        assert _flags(cli, GENERATE, argv) == cmd_expect


def test_an_absent_field_is_its_default_in_every_door(cli):
    assert _jsonl("unrelated", 1) == SamplingParams()
    assert _http("user", "u") == SamplingParams()
    assert _grpc("lora", "") == SamplingParams()
    assert _flags(cli, BATCH, []) == SamplingParams(**COMMAND_DEFAULTS)
    assert _flags(cli, GENERATE, []) == SamplingParams(**COMMAND_DEFAULTS)
    with pytest.raises(SystemExit):  # no --priority on `generate`
        cli.parse_args([*GENERATE, "--priority", "1"])


@pytest.mark.parametrize("command,flags", [(BATCH, OLD_BATCH_FLAGS), (GENERATE, OLD_FLAGS)])
def test_every_old_flag_keeps_its_spelling_default_and_meaning(cli, command, flags):
    args = cli.parse_args(command)
    assert sampling_kwargs(args) == COMMAND_DEFAULTS
    for argv, meant in flags:
        assert _flags(cli, command, argv) == SamplingParams(**{**COMMAND_DEFAULTS, **meant}), argv
    together = [a for argv, _ in flags for a in argv]
    assert _flags(cli, command, together) == SamplingParams(
        **{**COMMAND_DEFAULTS, **{k: v for _, m in flags for k, v in m.items()}})


# ---- a bad value gets one error, naming the field, in every door -------------------------------
@pytest.mark.parametrize("name", [n for n, f in SAMPLING_FIELDS.items() if _bad(n, f)])
def test_an_out_of_range_value_gets_one_error_in_every_door(name, cli):
    _one_error_in_every_door(name, *_bad(name, SAMPLING_FIELDS[name]), cli)


@pytest.mark.parametrize("name", [n for n, f in SAMPLING_FIELDS.items() if _too_many(n, f)])
def test_one_item_past_a_rows_cap_gets_one_error_in_every_door(name, cli, monkeypatch):
    f = SAMPLING_FIELDS[name]
    if f.most > 1000:  # the real cap at the door; every door with a smaller one in its row (a
        #                flag repeated 2**18 times takes argparse most of an hour)
        with pytest.raises(RequestError, match=f"^{name}: takes at most {f.most} "):
            SamplingParams(**{name: _too_many(name, f)[0]})
        monkeypatch.setitem(SAMPLING_FIELDS, name, dataclasses.replace(f, max_items=1000))
        f = SAMPLING_FIELDS[name]
    v, argv = _too_many(name, f)
    assert SamplingParams(**{name: v[:-1] if isinstance(v, list) else
                             dict(list(v.items())[:-1])})  # the cap itself is taken
    _one_error_in_every_door(name, v, argv, cli)
    with pytest.raises(RequestError, match=f"^{name}: takes at most {f.most} "):
        SamplingParams(**{name: v})


def _one_error_in_every_door(name, v, argv, cli):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{name: v})
    want = e.value
    assert want.field == name or want.field.startswith(f"{name}.")
    doors = [_jsonl, _grpc, lambda n, x: _flags(cli, BATCH, argv)]
    if name != "priority":  # not a flag of `generate`
        doors.append(lambda n, x: _flags(cli, GENERATE, argv))
    for door in doors:
        try:
            door(name, v)
        except json_format.ParseError:  # the proto's own type cannot carry the value
            assert name in ("seed", "priority") and door is _grpc
            continue
        except RequestError as got:
            assert (str(got), got.field) == (str(want), want.field), door
        else:
            raise AssertionError(f"{door} took {name}={v!r}")
    for chat in (False, True):  # named as the body names it (chat: max_completion_tokens)
        field = "max_completion_tokens" if chat and name == "max_tokens" else want.field
        with pytest.raises(openai_server.ApiError) as got:
            _http(name, v, chat=chat)
        assert (got.value.status, got.value.message, got.value.param) == (
            400, f"{field}: {want.reason}", field)


def test_out_of_range_messages_by_hand(cli):
    cases = [("max_tokens", 0, "max_tokens: must be in [1, 2147483647], got 0"),
             ("top_p", 0.0, "top_p: must be in (0.0, 1.0], got 0.0"),
             ("temperature", 3.0, "temperature: must be in [0.0, 2.0], got 3.0"),
             ("logprobs", 21, "logprobs: must be in [0, 20], got 21"),
             ("stop", [""], "stop: strings must be 1..256 characters"),
             ("structured_outputs", {"regex": ""},
              "structured_outputs.regex: must be a non-empty string, got str")]
    for name, v, message in cases:
        for door in (_jsonl, _grpc):
            with pytest.raises(RequestError) as e:
                door(name, v)
            assert str(e.value) == message
    # chat's max_completion_tokens: the error names the field the body sent
    with pytest.raises(openai_server.ApiError) as e:
        _http("max_tokens", 0, chat=True)
    assert e.value.message == "max_completion_tokens: must be in [1, 2147483647], got 0"
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(RequestError, match=r"^max_tokens: must be in \[1, 2147483647\], got 0$"):
        _flags(cli, GENERATE, ["--max-tokens", "0"])


# ---- a new row: every door takes it with no other line -----------------------------------------
def _fresh_module(name: str, monkeypatch):
    """`name` imported anew (what it builds at import from the table, built from the table as it
    is now), in place of the loaded one for this test only."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _request_with(name: str):
    """GenerateRequest with one more `optional int32` field: the wire change gRPC needs."""
    fd = descriptor_pb2.FileDescriptorProto()
    jaxinfer_pb2.DESCRIPTOR.CopyToProto(fd)
    msg = next(m for m in fd.message_type if m.name == "GenerateRequest")
    msg.oneof_decl.add(name=f"_{name}")  # proto3 `optional`: a synthetic oneof of its own
    msg.field.add(name=name, number=1000, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                  oneof_index=len(msg.oneof_decl) - 1, proto3_optional=True)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jaxinfer.v1.GenerateRequest"))


def test_a_new_row_is_taken_by_every_door(monkeypatch):
    """What adding a sampling field takes: one row (gRPC: and the message's field)."""
    row = Field("int", 0, 0, INT32_MAX, doc="generate at least this many tokens")
    monkeypatch.setitem(SAMPLING_FIELDS, "example_min_tokens", row)
    Params = sampling_class()
    monkeypatch.setattr(requests, "SamplingParams", Params)
    want = Params(example_min_tokens=5, max_tokens=20)
    assert [f.name for f in dataclasses.fields(Params)][-1] == "example_min_tokens"
    assert Params().example_min_tokens == 0
    bad = "example_min_tokens: must be in [0, 2147483647], got -1"
    # JSONL
    assert sampling_from_json({"example_min_tokens": 5, "max_tokens": 20}) == want
    with pytest.raises(RequestError, match=f"^{re.escape(bad)}$"):
        sampling_from_json({"example_min_tokens": -1})
    # HTTP: its accepted fields are built from the table as the module loads
    http = _fresh_module("jaxinfer.serve.openai_server", monkeypatch)
    for chat in (False, True):
        body = {"example_min_tokens": 5, "max_tokens": 20}
        assert _http("max_tokens", 20, chat=chat, http=http) == Params(max_tokens=20)
        http._check_fields({"model": "m", "prompt": "p", **body}, http._COMPLETION_FIELDS)
        http._check_fields({"model": "m", "messages": [], **body}, http._CHAT_FIELDS)
        assert http._sampling(http._Body({"model": "m", **body}), max_tokens_key="max_tokens",
                              default_max_tokens=16, logprobs=None, n=1,
                              limits=LIMITS)[0] == want
        with pytest.raises(http.ApiError) as e:
            http._sampling(http._Body({"example_min_tokens": -1}), max_tokens_key="max_tokens",
                           default_max_tokens=16, logprobs=None, n=1, limits=LIMITS)
        assert (e.value.message, e.value.param) == (bad, "example_min_tokens")
    # gRPC: a message with the field is read with no other line; one without it sends none
    Request = _request_with("example_min_tokens")
    req = Request(prompt_token_ids=[5], example_min_tokens=5, max_tokens=20)
    assert grpc_server.generate_inputs(req, None, LIMITS)[1] == want
    unset = Request(prompt_token_ids=[5], max_tokens=20)
    assert grpc_server.generate_inputs(unset, None, LIMITS)[1] == Params(max_tokens=20)
    with pytest.raises(RequestError, match="^example_min_tokens: must be in"):
        grpc_server.generate_inputs(Request(prompt_token_ids=[5], example_min_tokens=-1), None,
                                    LIMITS)
    assert _grpc("max_tokens", 20) == Params(max_tokens=20)
    # the command line: a flag in both commands, spelled and typed from the row
    from jaxinfer.serve.cli import build_parser

    cli = build_parser()
    for command in (BATCH, GENERATE):
        args = cli.parse_args([*command, "--example-min-tokens", "5", "--max-tokens", "20"])
        assert Params(**sampling_kwargs(args)) == dataclasses.replace(want, temperature=0.0)
        args = cli.parse_args([*command, "--example-min-tokens", "-1"])
        with pytest.raises(RequestError, match="^example_min_tokens: must be in"):
            Params(**sampling_kwargs(args))
    p = argparse.ArgumentParser()
    sampling_args(p)
    assert "--example-min-tokens INT" in p.format_help() and row.doc in p.format_help()


def test_sampling_args_from_a_given_table():
    """A table of one's own: each kind's flag style (the engine_args table's `given as`)."""
    table = {"n_best": Field("int", 1, 1, 8, doc="best of n"),
             "warm": Field("bool", True, doc="keep warm"),
             "words": Field("strings", (), 1, 9, doc="words"),
             "ids": Field("ids", (), doc="ids"),
             "nudge": Field("bias", (), -1, 1, doc="nudges"),
             "shape": Field("structured", None, nullable=True, doc="a shape")}
    p = argparse.ArgumentParser()
    sampling_args(p, table=table, n_best=2)
    assert sampling_kwargs(p.parse_args([]), table) == {"n_best": 2}
    args = p.parse_args(["--n-best", "3", "--no-warm", "--words", "a", "--ids", "4", "--ids", "2",
                         "--shape", '{"regex": "x"}', "--words", "b", "--nudge", '{"4": 0.5}'])
    assert sampling_kwargs(args, table) == dict(n_best=3, warm=False, words=("a", "b"),
                                                ids=(4, 2), shape={"regex": "x"},
                                                nudge={"4": 0.5})
    Params = sampling_class("Params", {**SAMPLING_FIELDS, "n_best": table["n_best"]})
    assert Params(n_best=3).n_best == 3
    with pytest.raises(RequestError, match=r"^n_best: must be in \[1, 8\], got 9$"):
        Params(n_best=9)
