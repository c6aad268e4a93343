"""The step in tiers (runtime/device/programs.py): the layer-by-layer body and the fast head give
the tokens and logprobs of the whole programs; the background compiler takes over; a first token
does not wait for the decode step's programs; warm-up in the background; exit with a compile
under way."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.runtime.device import programs
from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.llm import LLM
from tests.engines import TINY

PROMPTS = [[5, 17, 300, 41, 9, 77, 1200, 8, 3], [9, 4, 250], list(range(40, 75))]
SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def _tokens_and_logprobs(llm, prompts=PROMPTS, sp=SP):
    outs = llm.generate(prompts, sp)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[e["logprob"] for e in o.outputs[0].logprobs] + [t for e in o.outputs[0].logprobs
                                                            for _, t in e["top"]]
           for o in outs]
    return toks, np.array(lps)


@pytest.fixture(scope="module")
def blocking(tiny_dir):
    llm = LLM(str(tiny_dir), compile_mode="blocking", **TINY)
    return llm, _tokens_and_logprobs(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_layer_by_layer_equals_the_whole_programs(tiny_dir, blocking, stalled,
                                                  async_scheduling):
    llm = LLM(str(tiny_dir), compile_mode="background", async_scheduling=async_scheduling,
              **TINY)
    toks, lps = _tokens_and_logprobs(llm)
    step = llm.engine._step
    assert step.layerwise_steps > 0 and not step.body.launched  # no whole body ever ran
    assert step.fast_head_steps == step.layerwise_steps  # ... nor the optimized head
    assert toks == blocking[1][0]
    np.testing.assert_allclose(lps, blocking[1][1], atol=1e-5)
    assert blocking[0].engine._step.layerwise_steps == 0  # blocking mode never splits


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from jaxinfer.checkpoints.hf import load_hf
    from tests.gemma_fixtures import tiny_gemma3_hf

    path = tmp_path_factory.mktemp("tiny_gemma3_programs")
    tiny_gemma3_hf(path)
    return load_hf(path)


def test_layer_by_layer_gemma_kinds_share_programs(tiny_gemma, tiny_dir):
    """Gemma 3's sliding and global layers: one program per kind (2), not per layer (6); the
    layer-by-layer tokens equal the whole body's."""
    from jaxinfer.runtime.build import prepare
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.device.model import layer_kind
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.host.tokenizer import load_tokenizer

    cfg, params = tiny_gemma
    assert sorted({layer_kind(cfg, i) for i in range(cfg.num_layers)}) == [0, 2]
    tok = load_tokenizer(str(tiny_dir))
    out = {}
    for mode in ("blocking", "background"):
        eng = Engine(prepare(cfg, params, tok, EngineConfig(compile_mode=mode, **TINY)))
        if mode == "background":  # no compiler thread: bodies stay layer by layer
            eng._step.body.call = lambda *a, **k: None
        rid = eng.add_request([3, 9, 40, 7, 100, 2, 55, 31, 8, 19, 4, 60],
                              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        toks = []
        while eng.has_work:
            toks += [t for d in eng.step() if d.request_id == rid for t in d.token_ids]
        out[mode] = toks
    assert eng._step.layerwise_steps > 0
    assert out["background"] == out["blocking"] and len(out["blocking"]) == 10


def test_background_compiles_take_over(tiny_dir, blocking):
    programs._table.cache_clear()
    # no prefix cache: the second run plans the same step shapes as the first
    llm = LLM(str(tiny_dir), compile_mode="background", enable_prefix_caching=False, **TINY)
    step = llm.engine._step
    step.patience = 0  # every whole program queued at its first use (see the test below)
    toks, lps = _tokens_and_logprobs(llm)
    assert step.settle(timeout=300)  # every program it asked for is compiled
    before = step.layerwise_steps
    toks2, lps2 = _tokens_and_logprobs(llm)
    assert step.layerwise_steps == before  # the same shapes now run the whole programs
    assert step.body.launched
    assert toks == toks2 == blocking[1][0]
    np.testing.assert_allclose(lps2, blocking[1][1], atol=1e-5)


def test_a_step_runs_padded_to_a_larger_ready_bucket(tiny_dir, blocking):
    """A request alone whose bodies are compiling runs the ready whole bodies of a 4-request
    batch on padded rows (prefill: token bucket and q-length bound 4 -> the batch's 16; decode:
    1 -> 4): the same tokens and logprobs as its own programs, no step layer by layer; its own
    programs are queued after `patience`."""
    programs._table.cache_clear()
    llm = LLM(str(tiny_dir), compile_mode="background", enable_prefix_caching=False,
              min_token_bucket=1, **TINY)
    step = llm.engine._step
    four = [[7, 8, 9], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
    llm.generate(four, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert step.settle(timeout=300)  # the 4-row decode body is ready
    compiling = []
    # queued ones are only recorded: none gets compiled meanwhile
    programs.compiler().submit = lambda job, *a, **k: compiling.append(job) or False
    choices, choose = [], step._choose
    step._choose = lambda *a: choices.append(a[2]) or choose(*a)
    try:
        before, step.patience = step.layerwise_steps, 3600
        toks, lps = _tokens_and_logprobs(llm, [PROMPTS[1]])
        assert step.padded_steps == 12 and step.layerwise_steps == before  # 1 prefill, 11 decodes
        # the engine asks whether a step compiles, then runs it: the stand-in is chosen once a
        # shape (the q-length bounds: the prefill's, the decodes'), until a program lands
        assert choices == [4, 1]
        # padded onto a whole body, it runs about as fast: its own programs wait their patience
        assert not compiling
        step.patience = 1e-9  # ... once the shapes have been in use that long, they are asked for
        _tokens_and_logprobs(llm, [PROMPTS[1]])
        assert compiling and step.padded_steps == 24
    finally:
        del programs.compiler().submit
    assert toks[0] == blocking[1][0][1]
    ref = np.array([[e["logprob"] for e in o.outputs[0].logprobs]
                    for o in blocking[0].generate([PROMPTS[1]], SP)])
    np.testing.assert_allclose(lps[0][:len(ref[0])], ref[0], atol=1e-5)


def test_pad_tokens_pads_only_the_token_rows():
    arrays = {"token_ids": np.array([5, 6], np.int32), "prompt_targets": np.array([7, -1]),
              "feed_rows": np.array([-1, 0], np.int32), "rope_positions": np.ones((2, 3), np.int32),
              "kv_lens": np.array([3, 4], np.int32)}
    out = programs.pad_tokens(arrays, 4)
    assert out["token_ids"].tolist() == [5, 6, 0, 0]
    assert out["prompt_targets"].tolist() == [7, -1, -1, -1]  # PLAN_FIELDS' pad values
    assert out["feed_rows"].tolist() == [-1, 0, -1, -1]
    assert out["rope_positions"].shape == (4, 3) and not out["rope_positions"][2:].any()
    assert out["kv_lens"] is arrays["kv_lens"]  # per-sequence rows untouched
    assert out["token_ids"].dtype == np.int32


def test_the_compiler_takes_the_best_job_queued_by_the_time_it_may_start():
    """A warm-up program queued first, a needed one queued while a step's compile holds the
    thread back: the needed one compiles first."""
    c, order = programs.Compiler(), []
    job = lambda name: programs._Job(lambda: order.append(name))  # noqa: E731
    warm, needed, owner = job("warm-up"), job("needed"), programs.AheadOfTime.__new__(
        programs.AheadOfTime)
    with c.foreground():
        c.submit(warm, programs.WARMUP, owner)
        c.submit(needed, programs.DECODE, owner)
    warm.future.result(timeout=30), needed.future.result(timeout=30)
    c.stop()
    assert order == ["needed", "warm-up"]


def test_a_stand_in_as_fast_waits_its_patience_before_the_whole_program(tiny_dir):
    """On CPU a prefill of > 16 rows runs level-1 layers (as fast as its whole body) and a head
    the fast one: their whole programs are queued only once the shape has been in use for
    `patience` seconds; the 1-row decode (level-0 layers) has its body queued at once."""
    programs._table.cache_clear()
    llm = LLM(str(tiny_dir), compile_mode="background", enable_prefix_caching=False, **TINY)
    step = llm.engine._step
    assert step.patience == programs.PATIENCE_S["cpu"] > 0
    step.patience = 3600
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = [list(range(40, 75))]  # 35 tokens: token bucket 64
    done = lambda t: sum(j.future.done() for j in t.table.values())  # noqa: E731
    llm.generate(prompt, sp)
    assert step.settle(timeout=300)
    assert done(step.body) == 1 and done(step.head) == 0  # the decode body only
    step.patience = 1e-9  # the shapes have now been in use for longer
    llm.generate(prompt, sp)
    assert step.settle(timeout=300)
    assert done(step.body) == 2 and done(step.head) == 1
    before = step.layerwise_steps, step.fast_head_steps
    llm.generate(prompt, sp)
    assert (step.layerwise_steps, step.fast_head_steps) == before


class Failing(programs.Compiler):
    """A background compiler whose every compile raises (out of memory, an XLA error)."""

    def submit(self, job, priority, owner=None):
        if job.claim():
            job.future.set_exception(RuntimeError("injected compile failure"))
        return True


def test_a_failed_background_compile_leaves_the_shape_layer_by_layer(tiny_dir, blocking,
                                                                     monkeypatch):
    programs._table.cache_clear()
    monkeypatch.setattr(programs, "compiler", lambda: Failing())
    monkeypatch.setitem(programs.PATIENCE_S, "cpu", 0)
    llm = LLM(str(tiny_dir), compile_mode="background", **TINY)
    toks, lps = _tokens_and_logprobs(llm)
    step = llm.engine._step
    assert step.body.failed and not step.body.launched and llm.engine.faults == 0
    assert toks == blocking[1][0]
    np.testing.assert_allclose(lps, blocking[1][1], atol=1e-5)
    programs._table.cache_clear()


def test_first_token_is_handed_out_before_the_decode_steps_compile(tiny_dir, stalled):
    llm = LLM(str(tiny_dir), compile_mode="background", async_scheduling=True, **TINY)
    eng = llm.engine
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0,
                                                     ignore_eos=True))
    first = None
    while first is None:
        first = next((d for d in eng.step() if d.request_id == rid and d.token_ids), None)
    # only the prefill step's body has run: the decode step (q_len 1, a new signature) is
    # planned and held, launched by the next call
    assert len(eng._step.layerwise) == 1 and eng._held is not None
    while eng.has_work:
        eng.step()
    assert len(eng._step.layerwise) == 2 and eng._held is None


def test_warmup_in_the_background_returns_at_once(tiny_dir):
    programs._table.cache_clear()
    llm = LLM(str(tiny_dir), compile_mode="background", warmup=True, **TINY)
    assert llm.warmup_stats["programs"] == 0  # queued, not waited for
    step = llm.engine._step
    assert step.settle(timeout=600)
    prompts = [list(np.random.RandomState(i).randint(3, 2000, size=n)) for i, n in
               enumerate((1, 5, 30, 70))]
    llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert step.layerwise_steps == 0 and step.fast_head_steps == 0  # all were ready


def test_warmup_that_waits_in_background_mode_compiles_the_whole_programs(tiny_dir):
    programs._table.cache_clear()
    llm = LLM(str(tiny_dir), compile_mode="background", **TINY)
    stats = llm.warmup()  # wait=True
    step = llm.engine._step
    assert stats["programs"] > 0 and step.layerwise_steps == 0 and step.mode == "background"
    prompts = [list(np.random.RandomState(i).randint(3, 2000, size=n)) for i, n in
               enumerate((1, 5, 30, 70))]
    llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert step.layerwise_steps == 0 and step.fast_head_steps == 0


def test_blocking_warmup_still_compiles_everything(tiny_dir):
    llm = LLM(str(tiny_dir), compile_mode="blocking", warmup=True, **TINY)
    assert llm.warmup_stats["programs"] == llm.engine.compile_count > 0


def test_exit_with_a_background_compile_under_way(tiny_dir):
    """The process ends cleanly while the compiler thread holds a program (the interpreter
    waits for it; without that, XLA aborts the process)."""
    code = ("from jaxinfer.runtime.llm import LLM; import sys;"
            f"llm = LLM({str(tiny_dir)!r}, compile_mode='background', warmup=True,"
            " max_slots=4, page_size=8, max_model_len=256); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


def test_unknown_compile_mode_is_an_option_error():
    from jaxinfer.runtime.config import EngineConfig, OptionError

    with pytest.raises(OptionError, match="compile_mode"):
        EngineConfig(compile_mode="eager")


def test_the_compiler_skips_programs_no_engine_wants_any_more():
    import gc

    class Owner:
        pass

    c = programs.Compiler()
    ran = []
    gone, kept = programs._Job(lambda: ran.append("gone")), programs._Job(lambda: ran.append("kept"))
    owner = Owner()
    with c.foreground():  # the thread holds off meanwhile
        c.submit(gone, programs.WARMUP, Owner())  # its owner is dropped at once
        gc.collect()
        c.submit(kept, programs.WARMUP, owner)
    kept.future.result(timeout=60)
    assert ran == ["kept"] and not gone.future.done() and gone.priority is None
    assert c.submit(gone, programs.NEEDED, owner)  # wanted again: queued again, and compiled
    gone.future.result(timeout=60)
    assert ran == ["kept", "gone"]
    c.stop()


def test_the_default_mode_comes_from_the_environment(monkeypatch):
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.engine import compile_mode

    monkeypatch.delenv("JAXINFER_COMPILE_MODE", raising=False)
    assert compile_mode(EngineConfig()) == "background"
    monkeypatch.setenv("JAXINFER_COMPILE_MODE", "blocking")
    assert compile_mode(EngineConfig()) == "blocking"
    assert compile_mode(EngineConfig(compile_mode="background")) == "background"
    monkeypatch.setenv("JAXINFER_COMPILE_MODE", "lazy")
    with pytest.raises(ValueError, match="JAXINFER_COMPILE_MODE"):
        compile_mode(EngineConfig())


def test_frozen_keys_hash_once_and_compare_by_value():
    """A program table's fixed-argument key: equal values are one key (engines sharing a
    model's programs find each other's), and its hash is not recomputed per lookup."""
    from jaxinfer.runtime.device.programs import Frozen

    class Counted:
        hashes = 0

        def __hash__(self):
            Counted.hashes += 1
            return 7

        def __eq__(self, other):
            return isinstance(other, Counted)

    a, b = Frozen((1, Counted())), Frozen((1, Counted()))
    table = {(a, "sig"): "program"}
    before = Counted.hashes
    for _ in range(5):
        assert table[(a, "sig")] == "program"
    assert Counted.hashes == before  # looked up 5 times, hashed at construction only
    assert table[(b, "sig")] == "program" and a == b and hash(a) == hash(b)
    assert Frozen((2, Counted())) != a and a != (1, Counted())
