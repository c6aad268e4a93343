"""The engine options' one table (runtime/config.py ENGINE_OPTIONS): EngineConfig's fields and
checks, the command line's flags and help, and the LLM keyword arguments `llm_from_args` passes
all derive from it. No model loads: flags are parsed and EngineConfigs built; LLM is a fake."""

import argparse
import dataclasses
import json
import pickle
import sys
import types

import pytest

from jaxinfer.runtime.config import (ENGINE_OPTIONS, ENGINE_RULES, EngineConfig, Option,
                                     OptionError, SloConfig, SpecConfig, config_class)
from jaxinfer.serve.engine_args import engine_args, engine_kwargs, llm_from_args

# EngineConfig's fields and defaults as written by hand before the table (the oracle; a row
# added since needs no line here)
DEFAULTS = dict(
    dtype="float32", quantization=None, quant_mode=None, quantize_embeddings=True,
    kv_cache_dtype="auto", max_slots=8, page_size=16, num_pages=None, max_model_len=2048,
    attention_backend=None, prefill_chunk=256, min_token_bucket=None, min_page_bucket=None,
    enable_prefix_caching=True, speculative=None, tensor_parallel=1, weight_layout="auto",
    fuse_projections=None, async_scheduling=True, warmup=False, enable_lora=False, max_loras=4,
    max_lora_rank=16, max_cpu_loras=None, itl_slo_ms=None, ttft_slo_ms=None, refuse_late=False,
    distributed=False)

# every engine flag of the command line before the table, and what it meant (+ the two new ones)
FLAGS = [
    (["--dtype", "bfloat16"], dict(dtype="bfloat16")),
    (["--max-slots", "3"], dict(max_slots=3)),
    (["--page-size", "8"], dict(page_size=8)),
    (["--num-pages", "40"], dict(num_pages=40)),
    (["--max-model-len", "96"], dict(max_model_len=96)),
    (["--attention-backend", "pallas_interpret"], dict(attention_backend="pallas_interpret")),
    (["--quantization", "int8"], dict(quantization="int8")),
    (["--quantization", "dequantize"], dict(quantization="dequantize")),
    (["--kv-cache-dtype", "int8"], dict(kv_cache_dtype="int8")),
    (["--prefill-chunk", "64"], dict(prefill_chunk=64)),
    (["--min-token-bucket", "4"], dict(min_token_bucket=4)),
    (["--min-page-bucket", "2"], dict(min_page_bucket=2)),
    (["--no-prefix-caching"], dict(enable_prefix_caching=False)),
    (["--no-async-scheduling"], dict(async_scheduling=False)),
    (["--speculative", '{"method": "ngram", "k": 2, "n": 2}'],
     dict(speculative={"method": "ngram", "k": 2, "n": 2})),
    (["--enable-lora"], dict(enable_lora=True)),
    (["--max-loras", "2"], dict(max_loras=2)),
    (["--max-lora-rank", "8"], dict(max_lora_rank=8)),
    (["--max-cpu-loras", "6"], dict(max_cpu_loras=6)),
    (["--itl-slo-ms", "12.5"], dict(itl_slo_ms=12.5)),
    (["--ttft-slo-ms", "250"], dict(ttft_slo_ms=250.0)),
    (["--ttft-slo-ms", "250", "--refuse-late"], dict(ttft_slo_ms=250.0, refuse_late=True)),
    (["--warmup"], dict(warmup=True)),
    (["--no-warmup"], dict(warmup=False)),
    (["--tensor-parallel", "2"], dict(tensor_parallel=2)),
    (["--weight-layout", "output_major"], dict(weight_layout="output_major")),
    (["--fuse-projections"], dict(fuse_projections=True)),
    (["--no-fuse-projections"], dict(fuse_projections=False)),
    (["--distributed"], dict(distributed=True)),
    (["--quant-mode", "weight_only"], dict(quant_mode="weight_only")),  # new
    (["--no-quantize-embeddings"], dict(quantize_embeddings=False)),  # new
]


@pytest.fixture(scope="module")
def cli():
    from jaxinfer.serve.cli import build_parser

    return build_parser()


def _parser(options=ENGINE_OPTIONS) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    engine_args(p, options)
    return p


def test_the_table_and_engine_config_fields_are_one_set():
    fields = dataclasses.fields(EngineConfig)
    assert [f.name for f in fields] == [o.name for o in ENGINE_OPTIONS]
    assert {f.name: f.default for f in fields if f.name in DEFAULTS} == DEFAULTS
    assert dataclasses.asdict(EngineConfig()) == {o.name: o.default for o in ENGINE_OPTIONS}
    assert all(o.help for o in ENGINE_OPTIONS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_slots = 2
    with pytest.raises(TypeError, match="max_slot"):
        EngineConfig(max_slot=2)
    assert EngineConfig.__module__ == "jaxinfer.runtime.config"
    assert pickle.loads(pickle.dumps(EngineConfig(max_slots=3))) == EngineConfig(max_slots=3)
    assert hash(EngineConfig(max_slots=3)) == hash(EngineConfig(max_slots=3))


def test_properties_and_speculative_parsing():
    c = EngineConfig(max_slots=3, max_model_len=100, page_size=16)
    assert c.pages_per_seq == 7 and c.total_pages == 1 + 3 * 7  # ceil(100 / 16) = 7
    assert EngineConfig(num_pages=5).total_pages == 5
    slo = EngineConfig(itl_slo_ms=20, ttft_slo_ms=500, refuse_late=True).slo
    assert slo == SloConfig(itl_s=0.02, ttft_s=0.5, refuse_late=True)
    assert not EngineConfig().slo.active
    spec = EngineConfig(speculative={"method": "draft", "model": "m", "k": 2}).speculative
    assert spec == SpecConfig(method="draft", k=2, n=3, model="m")
    assert dataclasses.replace(EngineConfig(speculative=spec), max_slots=2).speculative == spec


@pytest.mark.parametrize("kw,option,message", [
    (dict(max_slots=0), "max_slots", "max_slots must be >= 1, got 0"),
    (dict(max_slots=2.0), "max_slots", "max_slots must be an integer, got 2.0"),
    (dict(max_slots=True), "max_slots", "max_slots must be an integer, got True"),
    (dict(num_pages=1), "num_pages", "num_pages must be >= 2, got 1"),
    (dict(itl_slo_ms=0), "itl_slo_ms", "itl_slo_ms must be > 0, got 0.0"),
    (dict(ttft_slo_ms=float("inf")), "ttft_slo_ms", "ttft_slo_ms must be a finite number, got inf"),
    (dict(dtype="float16"), "dtype", "dtype must be one of ('float32', 'bfloat16'), got 'float16'"),
    (dict(dtype=None), "dtype", "dtype must not be None"),
    (dict(quant_mode="fast"), "quant_mode",
     "quant_mode must be one of (None, 'w8a8', 'weight_only'), got 'fast'"),
    (dict(enable_lora="yes"), "enable_lora", "enable_lora must be True or False, got 'yes'"),
    (dict(fuse_projections=1), "fuse_projections",
     "fuse_projections must be True, False or None, got 1"),
    (dict(refuse_late=True), "refuse_late",
     "refuse_late needs ttft_slo_ms (the budget requests are refused against)"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras",
     "max_cpu_loras must be >= max_loras (4), got 2"),
    (dict(speculative={"method": "ngram", "k": 0}), "speculative",
     "speculative k must be an integer >= 1, got 0"),
])
def test_a_bad_value_names_the_option(kw, option, message):
    with pytest.raises(OptionError) as e:
        EngineConfig(**kw)
    assert str(e.value) == message and e.value.option == option
    assert str(pickle.loads(pickle.dumps(e.value))) == message  # Ray replicas send it whole


def test_every_flag_keeps_its_spelling_and_meaning(cli):
    assert engine_kwargs(_parser().parse_args([])) == {}  # nothing given: LLM's defaults hold
    for argv, want in FLAGS:
        assert engine_kwargs(_parser().parse_args(argv)) == want, argv
        for cmd in (["generate", "hi"], ["serve"], ["batch", "--input", "i", "--output", "o"]):
            assert engine_kwargs(cli.parse_args(cmd + argv)) == want, (cmd, argv)
        config = EngineConfig(**want)
        for k, v in want.items():
            assert getattr(config, k) == (SpecConfig(**v) if k == "speculative" else v)
    # a flag per option of before (rows added since: the round trip below); together in one line
    assert {k for _, want in FLAGS for k in want} == set(DEFAULTS)
    argv = [a for flags, _ in FLAGS[:14] for a in flags]
    assert engine_kwargs(_parser().parse_args(argv)) == {
        k: v for _, want in FLAGS[:14] for k, v in want.items()}


def _spelled(o: Option) -> str:
    """The flag spelling rule, written out here: --name-with-dashes, --no-name for a switch on
    by default, unless the row spells it."""
    dashed = o.name.replace("_", "-")
    return o.flag or (f"--no-{dashed}" if o.default is True else f"--{dashed}")


def _sample(o: Option):
    """A value other than the row's default, and its command-line text."""
    if o.cli == "json":
        return {"method": "ngram", "k": 3}, '{"method": "ngram", "k": 3}'
    if o.choices:
        v = [c for c in o.choices if c != o.default][-1]
        return v, v
    if o.type is int:
        return (o.lo or 0) + 5, str((o.lo or 0) + 5)
    if o.type is float:
        return 37.5, "37.5"
    if o.type is str:  # a path (mmproj)
        return "x.gguf", "x.gguf"
    raise AssertionError(o)


def test_every_row_round_trips_from_its_flag(cli):
    for o in ENGINE_OPTIONS:
        if o.type is bool:
            pairs = [([_spelled(o)], not o.default if o.default is not None else True)]
            if o.nullable or o.cli == "pair":
                pairs.append(([f"--no-{o.name.replace('_', '-')}"], False))
        else:
            v, text = _sample(o)
            pairs = [([_spelled(o), text], v)]
        for argv, v in pairs:
            kw = engine_kwargs(cli.parse_args(["serve", *argv]))
            assert kw == {o.name: v}, (argv, kw)
            if o.name not in ("refuse_late",):  # refuse_late needs ttft_slo_ms: its own rule
                assert getattr(EngineConfig(**kw), o.name) == o.check(v)


def test_bad_flags_name_the_option(capsys):
    for argv, flag in [(["--dtype", "float16"], "--dtype"), (["--max-slots", "x"], "--max-slots"),
                       (["--speculative", "{bad"], "--speculative"),
                       (["--speculative", "[" * 5000 + "]" * 5000], "--speculative"),  # deep
                       (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
                       (["--itl-slo-ms", "nan"], None)]:
        p = argparse.ArgumentParser()
        engine_args(p)
        if flag is None:  # parses; the config refuses it, naming the option
            with pytest.raises(OptionError, match="^itl_slo_ms must be a finite number"):
                EngineConfig(**engine_kwargs(p.parse_args(argv)))
            continue
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert f"argument {flag}" in capsys.readouterr().err
    # values of the right type out of range: the config names the option
    with pytest.raises(OptionError, match="^max_slots must be >= 1, got 0$"):
        EngineConfig(**engine_kwargs(_parser().parse_args(["--max-slots", "0"])))
    with pytest.raises(OptionError, match="^refuse_late needs ttft_slo_ms"):
        EngineConfig(**engine_kwargs(_parser().parse_args(["--refuse-late"])))


def test_help_comes_from_the_table(cli, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "4000")  # no wrapping: the help text as written
    for cmd in ("serve", "batch", "generate"):
        with pytest.raises(SystemExit):
            cli.parse_args([cmd, "--help"])
        out = capsys.readouterr().out
        for o in ENGINE_OPTIONS:
            assert _spelled(o) in out and o.help in out, (cmd, o.name)
    assert "--no-prefix-caching   turn off (on by default): share KV pages" in out
    assert "--max-slots INT       sequences the engine runs at once (default: 8)" in out


class FakeEngine:
    def __init__(self, leader: bool):
        self.leader, self.calls = leader, []

    def follow(self):
        self.calls.append("follow")

    def release_followers(self):
        self.calls.append("release")

    def add_lora(self, name, path):
        self.calls.append((name, path))


@pytest.fixture
def fake_llm(monkeypatch):
    """LLM replaced by a recorder of its arguments (llm_from_args imports it when called)."""
    made = []

    class LLM:
        def __init__(self, model, **options):
            self.model, self.options = model, options
            self.engine = FakeEngine(leader=options.get("distributed") != "follower")
            made.append(self)

    monkeypatch.setitem(sys.modules, "jaxinfer.runtime.llm", types.SimpleNamespace(LLM=LLM))
    return made


def test_llm_from_args_passes_the_given_flags(cli, fake_llm, tmp_path):
    args = cli.parse_args(["generate", "--model", "m", "--max-slots", "2", "--no-prefix-caching",
                           "hi"])
    llm = llm_from_args(args)
    assert llm.model == "m"
    assert llm.options == dict(max_slots=2, enable_prefix_caching=False, warmup=False)
    # serve warms up unless told not to; the other commands only when told to
    assert llm_from_args(cli.parse_args(["serve"])).options == dict(warmup=True)
    assert llm_from_args(cli.parse_args(["serve", "--no-warmup"])).options == dict(warmup=False)
    assert llm_from_args(cli.parse_args(["generate", "--warmup", "x"])).options == dict(warmup=True)
    # --lora-modules implies --enable-lora and loads each adapter
    llm = llm_from_args(cli.parse_args(["serve", "--lora-modules", "a=/p/a", "b=/p/b"]))
    assert llm.options == dict(enable_lora=True, warmup=True)
    assert llm.engine.calls == [("a", "/p/a"), ("b", "/p/b")]
    # Ray replicas rebuild the LLM from `jaxinfer batch`'s flags as a dict
    args = cli.parse_args(["batch", "--input", "i", "--output", "o", "--max-model-len", "64",
                           "--speculative", '{"method": "ngram"}'])
    replica = llm_from_args(argparse.Namespace(**json.loads(json.dumps(
        {k: v for k, v in vars(args).items() if k != "fn"}))))
    assert replica.options == dict(max_model_len=64, speculative={"method": "ngram"}, warmup=False)
    assert replica.options == llm_from_args(args).options


def test_distributed_joins_and_a_follower_follows(cli, fake_llm, monkeypatch):
    import atexit

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    leader = llm_from_args(cli.parse_args(["serve", "--distributed"]))
    assert leader.options == dict(distributed=True, warmup=True)
    assert registered == [leader.engine.release_followers] and leader.engine.calls == []
    args = argparse.Namespace(model="m", distributed="follower")  # the fake's follower
    with pytest.raises(SystemExit) as e:
        llm_from_args(args)
    assert e.value.code == 0 and fake_llm[-1].engine.calls == ["follow"]


def test_a_new_row_is_a_flag_a_validated_field_and_help():
    """What adding an option takes: one row (and, for a rule over several, one rule)."""
    row = Option("example_cache_gb", float, None, lo=0, nullable=True,
                 help="host memory for KV pages moved off the device")
    quiet = Option("example_trace", bool, False, flag=None, help="not a command-line option")
    table = (*ENGINE_OPTIONS, row, quiet)
    rules = (*ENGINE_RULES, ("example_cache_gb", lambda c: not c.example_cache_gb or
                             c.enable_prefix_caching, "needs prefix caching"))
    Config = config_class("Config", table, rules)
    p = _parser(table)
    kw = engine_kwargs(p.parse_args(["--example-cache-gb", "1.5", "--max-slots", "2"]), table)
    assert kw == dict(example_cache_gb=1.5, max_slots=2)
    c = Config(**kw)
    assert (c.example_cache_gb, c.max_slots, c.example_trace) == (1.5, 2, False)
    assert "--example-cache-gb FLOAT" in p.format_help() and row.help in p.format_help()
    assert p.parse_known_args(["--example-trace"])[1] == ["--example-trace"]  # flag=None: no flag
    assert Config(example_trace=True).example_trace is True
    with pytest.raises(OptionError, match="^example_cache_gb must be >= 0, got -1.0$"):
        Config(example_cache_gb=-1)
    with pytest.raises(OptionError, match="^example_cache_gb needs prefix caching$"):
        Config(example_cache_gb=2, enable_prefix_caching=False)
    with pytest.raises(OptionError, match="^max_slots must be >= 1"):
        Config(max_slots=0)  # the table's other rows still checked
