"""The LLM API over the continuous-batching engine, on a random-init tiny Llama + sentencepiece."""

import numpy as np
import pytest
import torch

from jaxinfer import LLM, RequestError, SamplingParams

PROMPTS = [
    "To be, or not to be", "Hello", "The king is dead; long live the king. " * 6,
    "Now is the winter of our discontent", "A", "What light through yonder window breaks?",
    "Friends, Romans, countrymen, lend me your ears; " * 4, "Good night, sweet prince",
    "Double, double toil and trouble", "Is this a dagger which I see before me " * 3,
    "O Romeo", "All the world's a stage", "Out, damned spot!", "Brevity is the soul of wit " * 5,
    "Cry havoc", "Et tu, Brute?",
]


@pytest.fixture(scope="session")
def llm(tiny_llm):
    return tiny_llm


@pytest.fixture(scope="session")
def hf(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def _hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_log_softmax(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1).numpy()


def test_batched_greedy_with_chunking_and_preemption_equals_alone_and_hf(tiny_dir, llm_for, hf):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # every third request also scores its prompt (prompt logprobs, top 3)
    scored = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    # 4 slots, 19 usable pages of 8 tokens: the long prompts need up to 14 pages each ->
    # preemption; a 16-token budget chunks every prompt longer than that.
    # its own: its preemptions are this test's
    small = LLM(str(tiny_dir), max_slots=4, page_size=8, num_pages=20, max_model_len=128,
                prefill_chunk=16)
    batched = small.generate(PROMPTS, [scored if i % 3 == 0 else greedy
                                       for i in range(len(PROMPTS))])
    assert small.engine.scheduler.num_preemptions > 0
    # one slot: each request runs alone (its max_model_len, test_grpc's, only bounds lengths)
    alone = llm_for(tiny_dir, max_slots=1, page_size=8, max_model_len=1024)
    for i, (p, out) in enumerate(zip(PROMPTS, batched)):
        single = alone.generate([p], greedy)[0]
        assert out.token_ids == single.token_ids, p
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 24), p
        assert out.finish_reason == "length"
        if i % 3:
            assert out.prompt_logprobs is None
            continue
        # computed in the (chunked, possibly preempted and recomputed) prefill steps: equal to
        # HF's log-softmax over the same prompt, the token's own and the top 3
        ids, lp = out.prompt_token_ids, _hf_log_softmax(hf, out.prompt_token_ids)
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for j in range(1, len(ids)):
            e, want = out.prompt_logprobs[j], lp[j - 1]
            assert e["token_id"] == ids[j]
            assert abs(e["logprob"] - want[ids[j]]) < 1e-4, (p, j)
            assert [t for t, _ in e["top"]] == list(np.argsort(-want)[:3]), (p, j)
            np.testing.assert_allclose([v for _, v in e["top"]], np.sort(want)[::-1][:3],
                                       atol=1e-4)
    assert small.engine.scheduler.free_pages == 19  # nothing leaked


def test_async_scheduling_gives_the_sync_outputs(tiny_dir, llm_for):
    """One plan ahead (decode inputs fed on the device) vs every step waiting for the last:
    same tokens, texts and finish reasons under chunking, preemption, seeded sampling, stop
    tokens (each finishing run has a dropped row after its stop) and stop strings."""
    kw = dict(max_slots=4, page_size=8, num_pages=20, max_model_len=128, prefill_chunk=16)
    sync = llm_for(tiny_dir, async_scheduling=False, **kw)
    free = sync.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        if i % 3 == 0:  # stops at its 5th token
            params.append(SamplingParams(max_tokens=24, temperature=0.0,
                                         stop_token_ids=[out.token_ids[4]]))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True,
                                         stop=[out.text[3:5]] if len(out.text) > 6 else None))
        else:
            params.append(SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True))
    want = sync.generate(PROMPTS, params)
    assert not sync.engine.async_scheduling
    fast = LLM(str(tiny_dir), **kw)  # its own: its scheduler is patched, its preemptions counted
    assert fast.engine.async_scheduling
    fed, schedule = [], fast.engine.scheduler.schedule

    def counting():
        plan = schedule()
        fed.append(0 if plan is None else int((plan.feed_rows >= 0).sum()))
        return plan

    fast.engine.scheduler.schedule = counting
    got = fast.generate(PROMPTS, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    assert sum(o.finish_reason == "stop" for o in got) >= 5
    assert sum(fed) > 0 and fast.engine.scheduler.num_preemptions > 0
    assert fast.engine.scheduler.free_pages == 19


def test_seeded_sampling_identical_alone_and_in_batch(llm):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                        ignore_eos=True)
    alone = llm.generate(["All the world's a stage"], sp)[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    batch = llm.generate(PROMPTS[:3] + ["All the world's a stage"] + PROMPTS[3:6],
                         [others] * 3 + [sp] + [others] * 3)
    assert batch[3].token_ids == alone.token_ids
    # and a different seed gives a different draw (16 tokens from a 2000-token vocab)
    other = llm.generate(["All the world's a stage"], SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_stop_strings_never_streamed_and_stream_equals_final(llm):
    free = llm.generate(["Now is the winter"], SamplingParams(max_tokens=40, temperature=0,
                                                              ignore_eos=True))[0]
    assert len(free.text) > 12
    stop = free.text[8:12]  # a string the greedy continuation is known to contain
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    final = llm.generate(["Now is the winter"], sp)[0]
    assert final.finish_reason == "stop"
    assert stop not in final.text
    assert final.text == free.text[: free.text.find(stop)]
    pieces = list(llm.stream("Now is the winter", sp))
    streamed = "".join(d.text for d in pieces)
    assert streamed == final.text
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop"


def test_stream_concatenation_equals_generate(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    final = llm.generate(["O Romeo, Romeo"], sp)[0]
    deltas = list(llm.stream("O Romeo, Romeo", sp))
    assert "".join(d.text for d in deltas) == final.text
    assert sum((d.token_ids for d in deltas), []) == final.token_ids


def test_metrics_present(llm):
    out = llm.generate(["Cry havoc"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"]
    assert len(m["itl_s"]) == 4 and all(x >= 0 for x in m["itl_s"])
    # the prompt is shorter than one page: nothing can come from the prefix cache
    assert out.usage == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 5,
                         "cached_tokens": 0}


def test_logprobs(llm):
    out = llm.generate(["Cry havoc"], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                     ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp["token_id"] == tok and len(lp["top"]) == 3
        # greedy: the chosen token is the top-1 and its logprob equals the top value
        assert lp["top"][0][0] == tok and abs(lp["top"][0][1] - lp["logprob"]) < 1e-5
        assert lp["top"][0][1] >= lp["top"][1][1] >= lp["top"][2][1]
        assert lp["logprob"] <= 0


def test_no_new_compilations_after_warmup(tiny_dir):
    llm = LLM(str(tiny_dir), max_slots=4, page_size=8, max_model_len=128, prefill_chunk=32,
              warmup=True, compile_mode="blocking")  # (background: tests/runtime/test_programs)
    rng = np.random.RandomState(0)

    def workload(n):
        prompts = [rng.randint(3, 2000, size=rng.randint(1, 60)).tolist() for _ in range(n)]
        sps = [SamplingParams(max_tokens=int(rng.randint(1, 40)), temperature=0, ignore_eos=True)
               for _ in range(n)]
        return prompts, sps

    assert llm.warmup_stats["programs"] == llm.engine.compile_count > 0  # at construction
    warm = llm.engine.compile_count
    llm.generate(*workload(50))
    assert llm.engine.compile_count == warm


def test_min_token_bucket_sets_the_smallest_step_and_changes_no_output(tiny_dir, llm_for,
                                                                       monkeypatch):
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.engine import min_token_bucket

    kw = dict(max_slots=4, page_size=8, max_model_len=64, prefill_chunk=16)
    small = llm_for(tiny_dir, min_token_bucket=1, **kw)
    big = llm_for(tiny_dir, min_token_bucket=16, **kw)
    assert small.engine.scheduler.token_buckets == (1, 2, 4, 8, 16)
    assert big.engine.scheduler.token_buckets == (16,)
    prompts = ["To be, or not to be", "Hello", "Now is the winter of our discontent"]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ([o.token_ids for o in small.generate(prompts, sp)]
            == [o.token_ids for o in big.generate(prompts, sp)])
    # the field, then env JAXINFER_MIN_TOKEN_BUCKET, then the platform's (CPU: 1)
    monkeypatch.setenv("JAXINFER_MIN_TOKEN_BUCKET", "8")
    assert min_token_bucket(EngineConfig(min_token_bucket=2)) == 2
    assert min_token_bucket(EngineConfig()) == 8
    monkeypatch.delenv("JAXINFER_MIN_TOKEN_BUCKET")
    assert min_token_bucket(EngineConfig()) == 1
    for bad in ("0", "x"):
        monkeypatch.setenv("JAXINFER_MIN_TOKEN_BUCKET", bad)
        with pytest.raises(ValueError, match="JAXINFER_MIN_TOKEN_BUCKET"):
            min_token_bucket(EngineConfig())
    with pytest.raises(ValueError, match="min_token_bucket"):
        EngineConfig(min_token_bucket=0)


def test_min_page_bucket_sets_the_narrowest_page_table_and_changes_no_output(tiny_dir, llm_for,
                                                                              monkeypatch):
    """Page tables of 1, 4 and 8 pages (and 1, 4, 9 for the draft model's shadows, k = 4 past
    max_model_len) against one width: same tokens, plain and speculative."""
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.engine import page_buckets

    kw = dict(max_slots=4, page_size=8, max_model_len=64, prefill_chunk=16,
              speculative={"method": "draft", "model": str(tiny_dir), "k": 4})
    narrow = llm_for(tiny_dir, min_page_bucket=1, **kw)
    wide = llm_for(tiny_dir, min_page_bucket=8, **kw)
    assert narrow.engine.scheduler.page_buckets == (1, 4, 8)
    assert narrow.engine.proposer.page_buckets == (1, 4, 9)
    assert wide.engine.scheduler.page_buckets == (8,) and wide.engine.proposer.page_buckets == (8, 9)
    prompts = ["To be, or not to be", "Hello " * 12, "Now is the winter of our discontent " * 3]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a, b = narrow.generate(prompts, sp), wide.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in a)  # draft = target
    # the field, then env JAXINFER_MIN_PAGE_BUCKET, then the backend's (XLA: one width, the
    # attention reads only filled chunks; Pallas: from 1); capped at the most pages
    monkeypatch.delenv("JAXINFER_MIN_PAGE_BUCKET")
    assert page_buckets(EngineConfig(), 40) == (40,)
    assert page_buckets(EngineConfig(), 40, "pallas_tpu") == (1, 4, 16, 40)
    monkeypatch.setenv("JAXINFER_MIN_PAGE_BUCKET", "16")
    assert page_buckets(EngineConfig(min_page_bucket=2), 40) == (2, 8, 32, 40)
    assert page_buckets(EngineConfig(), 40) == (16, 40) and page_buckets(EngineConfig(), 5) == (5,)
    for bad in ("0", "-3"):
        monkeypatch.setenv("JAXINFER_MIN_PAGE_BUCKET", bad)
        with pytest.raises(ValueError, match="JAXINFER_MIN_PAGE_BUCKET"):
            page_buckets(EngineConfig(), 8)
    with pytest.raises(ValueError, match="min_page_bucket"):
        EngineConfig(min_page_bucket=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2**40), "max_tokens"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=["s"] * 17), "stop"),
    (dict(stop_token_ids=[1] * 65), "stop_token_ids"),
    (dict(stop_token_ids=["1"]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(RequestError, match=match) as e:
        SamplingParams(**kwargs)
    assert e.value.field == match and isinstance(e.value, ValueError)


def test_sampling_params_normalize_like_vllm():
    assert SamplingParams(top_k=-1).top_k == 0  # -1 and 0 both mean "off"
    assert SamplingParams(temperature=1e-7).greedy  # below 1e-5: greedy, not a 1e7x scale
    assert SamplingParams(stop="x").stop == ("x",)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len|too long"):
        llm.generate(["word " * 400], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 5, 10 ** 6]], SamplingParams(max_tokens=4))
    # a failing batch admits nothing: the engine still serves the next good request
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and not llm.engine.num_unfinished


def test_unknown_options(tiny_dir):
    with pytest.raises(ValueError, match="quantization must be one of .*'gguf', 'mxfp4', 'dequantize'"):
        LLM(str(tiny_dir), quantization="nf4")
    # "gguf" keeps a GGUF file's blocks: refused for an HF dir before anything loads
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tiny_dir), quantization="gguf")
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(str(tiny_dir), max_slot=3)


def test_gguf_blocks_kept_serve_the_same_tokens(tiny_dir, hf, tmp_path):
    """The tiny model as a Q8_0 GGUF: quantization="gguf" keeps its blocks (run by the CPU
    kernels where they load), "dequantize" widens them at load; both serve the same greedy
    tokens. The CPU default keeps them where the kernels load. Block weights run weight-only."""
    from gguf import GGMLQuantizationType as QT

    from jaxinfer.runtime.device import cpu_kernels
    from jaxinfer.runtime.device.quantization import QuantizationError, QuantizedArray
    from tests.gemma_fixtures import write_gguf_like_llama_cpp

    path = write_gguf_like_llama_cpp(hf, tmp_path / "tiny.gguf", "llama", qtype=QT.Q8_0,
                                     sp_model=tiny_dir / "tokenizer.model")
    kw = dict(max_slots=2, page_size=8, max_model_len=64)
    kept, dense = LLM(str(path), quantization="gguf", **kw), \
        LLM(str(path), quantization="dequantize", **kw)
    assert kept.config.quantization == "gguf" and dense.config.quantization == "dequantize"
    wq = kept.get_weights().layers[0].wq  # the model's own layout (the engine's: the kernels')
    assert isinstance(wq, QuantizedArray) and wq.fmt == "gguf" and wq.group_size == 32
    assert not isinstance(dense.get_weights().layers[0].wq, QuantizedArray)
    # o_proj's 32-weight groups span two 16-wide heads: that weight alone is dequantized
    assert not isinstance(kept.get_weights().layers[0].wo, QuantizedArray)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[3]]
    assert [o.token_ids for o in kept.generate(prompts, sp)] == \
        [o.token_ids for o in dense.generate(prompts, sp)]
    default = LLM(str(path), **kw)
    assert default.config.quantization == ("gguf" if cpu_kernels.load() else None)
    with pytest.raises(QuantizationError, match="weight-only"):
        LLM(str(path), quantization="gguf", quant_mode="w8a8", **kw)


def test_live_rows_head_gives_the_all_rows_tokens(tiny_llm, tiny_dir, monkeypatch):
    """The vocabulary projection on the live sequences' rows only (1, S/2 or S of them; on for
    large vocabularies, forced on here) samples what the head over every slot row samples,
    for 1 to S live sequences, greedy and seeded."""
    from jaxinfer.runtime.device import steps

    prompts = [[5 + i, 17, 9 * i + 3] for i in range(4)]
    sps = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
           SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)]
    want = {(n, i): [o.token_ids for o in tiny_llm.generate(prompts[:n], sp)]
            for n in (1, 2, 3, 4) for i, sp in enumerate(sps)}
    monkeypatch.setattr(steps, "ONE_ROW_HEAD_MIN", 0)
    # the shared engine's slots and pages, another page-table width: new programs, traced with
    # the live-rows head
    llm = LLM(str(tiny_dir), max_slots=4, page_size=8, max_model_len=248)
    for (n, i), w in want.items():
        assert [o.token_ids for o in llm.generate(prompts[:n], sps[i])] == w, (n, i)


def test_engine_times_each_step_from_call_to_call_by_rows_and_decode_batch(llm):
    """The latency targets' measurements: while work remains, a step() is timed from its start
    to the next call's (a caller that takes 60 ms between calls makes those steps at least
    60 ms), the last one by itself; by the token rows of the plan it waited for, and the
    all-decode steps also by their live sequence count."""
    import time

    from jaxinfer.runtime.host.slo import StepTimes

    class Log(StepTimes):
        def __init__(self):
            super().__init__()
            self.log = []

        def record(self, n, seconds):
            super().record(n, seconds)
            self.log.append((n, seconds))

    eng = llm.engine
    sched = eng.scheduler

    def run(pause):
        ids = [eng.add_request([5, 6, 7, 8 + i], SamplingParams(max_tokens=6, ignore_eos=True))
               for i in range(3)]
        steps, done = 0, {}
        while eng.num_unfinished:
            done |= {d.request_id: d.output for d in eng.step() if d.finished}
            steps += 1
            time.sleep(pause)
        for rid in ids:
            assert len(done[rid].token_ids) == 6
        return steps

    run(0)  # compiles what this needs (steps that compile are not timed)
    keep = sched.step_times, sched.decode_times
    sched.step_times, sched.decode_times = Log(), Log()
    try:
        steps = run(0.06)
        rows, seqs = sched.step_times.log, sched.decode_times.log
    finally:
        sched.step_times, sched.decode_times = keep
    # one prefill and 5 decode steps' results; async: the first call waits for nothing
    assert len(rows) == 6 and steps == 7
    assert {n for n, _ in rows} <= set(sched.token_buckets)
    assert [n for n, _ in seqs] == [3] * 5  # the three decode together
    assert min(t for _, t in rows[:-1]) >= 0.06 and rows[-1][1] < 0.06


def test_mxfp4_option_needs_mxfp4_weights(tiny_dir):
    """quantization="mxfp4" keeps an HF checkpoint's MXFP4 experts; a model without them is
    refused with an error naming the option."""
    with pytest.raises(ValueError, match="quantization='mxfp4'.*no such"):
        LLM(str(tiny_dir), quantization="mxfp4", max_slots=2, max_model_len=64)
