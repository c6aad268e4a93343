"""`runtime.host.batch` driven by a fake engine (no JAX): admission, reorder window, and bounded memory
on a 20,000-line input.

The 20k-line memory test runs the real reader, parser, admission loop, reorder logic and
writer of `runtime.host.batch.run_batch` in a subprocess, but with `FakeEngine` instead of the JAX
engine: a real-engine run of 20k lines would take minutes on this 2-core machine, and the
memory question is about the batch layer (does it hold the file or the results?), not the
engine, whose memory is fixed by its page pool.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.runtime.host.errors import Overloaded, QueueFull, RequestError, UnknownAdapter
from jaxinfer.runtime.host.interface import missing_members
from jaxinfer.runtime.host.outputs import RequestDelta, RequestOutput
from jaxinfer.runtime.host.requests import Limits
from jaxinfer.runtime.host.batch import run_batch

REPO = Path(__file__).resolve().parents[2]


def fake_metrics(n_tokens: int) -> dict:
    itl = [0.001] * max(0, n_tokens - 1)
    return {"queue_s": 0.0, "ttft_s": 0.01, "itl_s": itl, "itl_s_mean": 0.001 if itl else None,
            "e2e_s": 0.01 + 0.001 * len(itl), "cached_tokens": 0}


class FakeTokenizer:
    vocab_size = 1000

    def encode(self, text):
        return [ord(c) % 1000 for c in text[:64]]


class FakeEngine:
    """Implements runtime.host.interface.EngineInterface. Runs the first `max_slots` unfinished
    requests (FIFO) one token per step. Token k of a request is (sum(prompt) + k) % 1000; its
    text is `text_len` characters derived from the prompt, so every record can be checked.
    Records every step's number of unfinished requests."""

    leader = True

    def __init__(self, max_slots=8, text_len=16, max_model_len=4096):
        self.limits = Limits(vocab_size=1000, text_vocab=1000, max_model_len=max_model_len,
                             page_size=16, num_pages=10**6)
        self.max_slots, self.text_len, self.max_model_len = max_slots, text_len, max_model_len
        self.requests = {}  # unfinished: id -> (prompt ids, params, token ids)
        self.queue = []  # unfinished, FIFO
        self.adds = 0
        self.live_per_step = []

    def add_request(self, prompt_ids, params, request_id=None, *, lora=None, refuse_late=True,
                    prompt=None, images=()):
        if images:
            self.check_images(images, params)
        if request_id in self.requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                                             f"exceeds max_model_len {self.max_model_len}")
        self.check_lora(lora)
        self.requests[request_id] = (list(prompt_ids), params, [])
        self.queue.append(request_id)
        self.adds += 1
        return request_id

    def image_door(self):  # a text-only model
        return None

    def check_images(self, images, params):
        raise RequestError("multi_modal_data.image", "this model takes no images (it is text "
                                                     "only)")

    def _output(self, rid, reason, text=""):
        prompt_ids, _, toks = self.requests.pop(rid)
        self.queue.remove(rid)
        return RequestOutput(rid, None, prompt_ids, text, toks, reason,
                             metrics=fake_metrics(len(toks)))

    def step(self):
        self.live_per_step.append(len(self.queue))
        deltas = []
        for rid in self.queue[:self.max_slots]:
            prompt_ids, params, toks = self.requests[rid]
            toks.append((sum(prompt_ids) + len(toks)) % 1000)
            d = RequestDelta(rid, token_ids=toks[-1:])
            if len(toks) >= params.max_tokens:
                d.finished, d.finish_reason = True, "length"
                d.output = self._output(rid, "length", expected_text(prompt_ids, self.text_len))
            deltas.append(d)
        return deltas

    @property
    def has_work(self):
        return bool(self.queue)

    @property
    def num_waiting(self):
        return max(0, len(self.queue) - self.max_slots)

    @property
    def num_unfinished(self):
        return len(self.queue)

    def abort(self, request_id):
        return self._output(request_id, "abort") if request_id in self.requests else None

    def check_admission(self, prompt_len, priority=0):
        pass

    def stats(self):
        return {"running": min(len(self.queue), self.max_slots), "waiting": self.num_waiting,
                "max_slots": self.max_slots, "pages_total": 0, "pages_free": 0,
                "compile_count": 0, "faults": 0, "consecutive_faults": 0, "spec_proposed": 0,
                "spec_accepted": 0, "ttft_target_s": None, "itl_target_s": None}

    def add_lora(self, name, path):
        raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")

    def remove_lora(self, name):
        raise UnknownAdapter(f"unknown LoRA adapter {name!r}")

    def check_lora(self, name):
        if name is not None:
            raise RequestError("lora", "this engine serves no LoRA adapters")

    def lora_adapters(self):
        return None

    def embed(self, prompts, pooling=None, normalize=True):
        raise RequestError(None, "the fake engine embeds nothing")

    def update_weights(self, weights, *, version=None, policy="drain"):
        raise ValueError("the fake engine has no weights")

    @property
    def weights_pending(self):
        return False

    @property
    def weight_version(self):
        return 0

    def sleep(self, level=1):
        raise RuntimeError("the fake engine does not sleep")

    def wake_up(self):
        return {"device_bytes_before": 0, "device_bytes_after": 0}

    @property
    def sleep_level(self):
        return 0

    def warmup(self):
        return 0

    def follow(self):
        raise RuntimeError("a lone engine has no leader to follow")

    def release_followers(self):
        pass


def expected_text(prompt_ids, n):
    return (str(sum(prompt_ids)) + ":" + "abcdefghij" * (n // 10 + 1))[:n]


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_continuous_admission_keeps_the_batch_full_and_bounded(tmp_path):
    """No static chunks: while input remains, every step sees at least max_slots unfinished
    requests, and never more than max_inflight admitted-but-unfinished."""
    rows = [{"id": i, "prompt": f"p{i}", "max_tokens": 1 + (i * 7) % 13} for i in range(300)]
    _write(tmp_path / "in.jsonl", rows)
    eng = FakeEngine(max_slots=8)
    seen_inflight = []
    s = run_batch(eng, FakeTokenizer(), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                  progress=False, on_step=lambda e, inflight: seen_inflight.append(len(inflight)))
    assert s["requests"] == 300 and s["errors"] == 0
    assert max(seen_inflight) == 2 * 8 + 4  # the default cap, reached
    steady = eng.live_per_step[: len(eng.live_per_step) // 2]  # well before the input runs out
    assert min(steady) >= 8, steady
    out = _read(tmp_path / "out.jsonl")
    assert sorted(r["id"] for r in out) == list(range(300))
    for r in out:
        assert len(r["token_ids"]) == rows[r["id"]]["max_tokens"]
        assert r["text"] == expected_text(FakeTokenizer().encode(f"p{r['id']}"), 16)


def test_ordered_reorder_window_stops_admission_until_head_finishes(tmp_path):
    # Line 0 needs 200 steps; the rest need 1. With a window of 10 the job must stall: at most
    # 10 requests can be admitted before the head is written.
    rows = [{"id": 0, "prompt": "head", "max_tokens": 200}]
    rows += [{"id": i, "prompt": f"p{i}", "max_tokens": 1} for i in range(1, 60)]
    _write(tmp_path / "in.jsonl", rows)
    eng = FakeEngine(max_slots=4)
    adds_while_head_live = []

    def hook(e, inflight):
        if any(j.line == 1 for j in inflight.values()):
            adds_while_head_live.append(e.adds)

    s = run_batch(eng, FakeTokenizer(), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                  ordered=True, reorder_window=10, progress=False, on_step=hook)
    assert s["requests"] == 60
    assert len(adds_while_head_live) == 200
    assert max(adds_while_head_live) == 10  # window full -> admission stopped
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == list(range(60))

    # unordered, the same input does not stall: the short ones stream past the head
    eng2 = FakeEngine(max_slots=4)
    run_batch(eng2, FakeTokenizer(), str(tmp_path / "in.jsonl"), str(tmp_path / "out2.jsonl"),
              progress=False)
    ids = [r["id"] for r in _read(tmp_path / "out2.jsonl")]
    assert ids[-1] == 0 and sorted(ids) == list(range(60))


def test_the_fake_engine_implements_the_interface():
    assert missing_members(FakeEngine) == []
    assert missing_members(FakeEngine()) == []

    class Lacking(FakeEngine):  # the check can fail: a member gone, a signature changed
        step = None

        def abort(self, rid):
            return None

    got = missing_members(Lacking())
    assert "step" in got and any(m.startswith("abort(self, rid)") for m in got), got
    no_limits = FakeEngine()
    del no_limits.limits
    assert missing_members(no_limits) == ["limits"]


def test_queue_full_is_retried_not_an_error(tmp_path):
    class Limited(FakeEngine):
        def add_request(self, prompt_ids, params, request_id=None, **kw):
            if len(self.queue) >= 3:
                raise QueueFull("waiting queue is full")
            return super().add_request(prompt_ids, params, request_id, **kw)

    _write(tmp_path / "in.jsonl", [{"id": i, "prompt": f"q{i}", "max_tokens": 2} for i in range(25)])
    s = run_batch(Limited(max_slots=2), FakeTokenizer(), str(tmp_path / "in.jsonl"),
                  str(tmp_path / "out.jsonl"), ordered=True, progress=False)
    assert s["requests"] == 25 and s["errors"] == 0
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == list(range(25))


def test_overloaded_lines_are_held_then_taken_never_lost(tmp_path):
    """An engine that refuses every late request (Overloaded: latency targets with refuse_late)
    whenever anything of the job is in flight: each line is held back until the engine is free,
    then taken; the job ends with every id once and no error."""
    refused = []

    class Refusing(FakeEngine):
        def add_request(self, prompt_ids, params, request_id=None, *, refuse_late=True, **kw):
            if refuse_late and self.queue:
                refused.append(request_id)
                raise Overloaded("predicted time to first token 9.99 s exceeds the 0.00 s "
                                 "budget", retry_after_s=1.0)
            return super().add_request(prompt_ids, params, request_id, refuse_late=refuse_late,
                                       **kw)

    _write(tmp_path / "in.jsonl", [{"id": i, "prompt": f"o{i}", "max_tokens": 3}
                                   for i in range(40)])
    s = run_batch(Refusing(max_slots=4), FakeTokenizer(), str(tmp_path / "in.jsonl"),
                  str(tmp_path / "out.jsonl"), progress=False)
    assert s["requests"] == 40 and s["errors"] == 0
    assert sorted(r["id"] for r in _read(tmp_path / "out.jsonl")) == list(range(40))
    assert len(refused) >= 39  # every line after the first met a busy engine at least once


_MEM_SCRIPT = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[4])
from jaxinfer.runtime.host.batch import run_batch
from tests.runtime.test_batch_fake import FakeEngine, FakeTokenizer
s = run_batch(FakeEngine(max_slots=32, text_len=1500), FakeTokenizer(), sys.argv[1], sys.argv[2],
              sampling={"max_tokens": int(sys.argv[3])}, progress=False)
# VmHWM is this process's own peak RSS; ru_maxrss would also count the parent's peak at
# fork time (Linux keeps it across exec), which here is pytest with JAX and torch loaded.
try:
    with open("/proc/self/status") as f:
        peak_kb = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
except OSError:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rss_kb": peak_kb, "requests": s["requests"]}))
"""


def _mem_run(tmp_path, n):
    inp, out = tmp_path / f"in{n}.jsonl", tmp_path / f"out{n}.jsonl"
    pad = "lorem ipsum dolor sit amet " * 20  # ~540 characters per prompt
    with open(inp, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"id-{i:06d}", "prompt": f"{i} {pad}"}) + "\n")
    r = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, str(inp), str(out), "2", str(REPO)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["requests"] == n
    with open(out, "rb") as f:
        assert sum(1 for _ in f) == n
    return res["rss_kb"] / 1024, (os.path.getsize(inp) + os.path.getsize(out)) / 2**20


def test_20k_lines_run_in_bounded_memory(tmp_path):
    """Peak RSS of a 20,000-line job (fake engine, real batch layer; see the module docstring)
    against a 1,000-line job. 20k lines are ~11 MB in and ~33 MB out; holding either in Python
    objects would add far more than the allowed 8 MB (the 8 MB covers the id set, ~100 B/id)."""
    rss_1k, _ = _mem_run(tmp_path, 1_000)
    rss_20k, io_mb = _mem_run(tmp_path, 20_000)
    print(f"\npeak RSS: 1k lines {rss_1k:.1f} MiB, 20k lines {rss_20k:.1f} MiB "
          f"(20k in+out files {io_mb:.0f} MiB)")
    assert io_mb > 40
    assert rss_20k - rss_1k < 8, (rss_1k, rss_20k)


@pytest.mark.parametrize("ordered", [False, True])
def test_error_records_are_written_in_order_and_counted(tmp_path, ordered):
    rows = [{"id": 0, "prompt": "a", "max_tokens": 5}, "not json", {"id": 2, "prompt": ""},
            {"id": 3, "prompt": "b", "max_tokens": 1}]
    _write(tmp_path / "in.jsonl", rows)
    s = run_batch(FakeEngine(max_slots=2), FakeTokenizer(), str(tmp_path / "in.jsonl"),
                  str(tmp_path / "out.jsonl"), ordered=ordered, progress=False)
    out = _read(tmp_path / "out.jsonl")
    assert s["errors"] == 2 and s["requests"] == 2
    assert sorted(r.get("line", 0) for r in out) == [0, 0, 2, 3]
    if ordered:
        assert [r.get("line") or r["id"] + 1 for r in out] == [1, 2, 3, 4]


_BAR_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from jaxinfer.runtime.host.batch import run_batch
from tests.runtime.test_batch_fake import FakeEngine, FakeTokenizer
run_batch(FakeEngine(max_slots=4), FakeTokenizer(), sys.argv[1], sys.argv[2],
          sampling={"max_tokens": 3})
"""


def test_progress_bar_only_on_a_terminal(tmp_path):
    _write(tmp_path / "in.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(50)])
    argv = [sys.executable, "-c", _BAR_SCRIPT, str(tmp_path / "in.jsonl")]
    master, slave = os.openpty()  # stderr on a terminal (subprocess, not a fork of pytest)
    p = subprocess.Popen(argv + [str(tmp_path / "tty.jsonl"), str(REPO)], stdin=slave,
                         stdout=slave, stderr=slave, cwd=REPO)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(timeout=60) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "50/50" in shown and "line/s" in shown and "tok/s" in shown  # total known: ETA
    r = subprocess.run(argv + [str(tmp_path / "pipe.jsonl"), str(REPO)], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 0 and "line/s" not in r.stderr and "\r" not in r.stderr
