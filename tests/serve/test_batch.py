"""`jaxinfer batch` / `llm.generate_jsonl` on a random-init tiny Llama: error records, ordering,
resume after a torn write, and SIGKILL-and-resume of the real CLI in a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.host.batch import BatchError, run_batch, scan_output

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(max_slots=4, page_size=8, max_model_len=128)
ENGINE_FLAGS = ["--max-slots", "4", "--page-size", "8", "--max-model-len", "128"]
WORDS = ("To be or not to be that is the question whether tis nobler in the mind to suffer "
         "the slings and arrows of outrageous fortune").split()


@pytest.fixture(scope="module")
def llm(tiny_dir, llm_for):
    return llm_for(tiny_dir, **ENGINE)


def _prompt(i):
    n = 1 + (i * 5) % 17
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def _write(path, rows):
    with open(path, "wb") as f:
        for r in rows:
            if isinstance(r, bytes):
                f.write(r + b"\n")
            else:
                f.write(((r if isinstance(r, str) else json.dumps(r)) + "\n").encode())


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _by_id(records):
    return {r["id"]: r for r in records if "error" not in r}


# ------------------------------------------------------------------------------ error records

def test_malformed_lines_become_error_records_and_good_lines_complete(llm, tmp_path):
    good = [{"id": f"g{i}", "prompt": _prompt(i), "max_tokens": 6} for i in range(5)]
    good.append({"id": 99, "prompt_token_ids": [1, 40, 41, 42], "max_tokens": 3,
                 "temperature": 0, "stop": ["\n"], "seed": 1, "logprobs": 2,
                 "prompt_logprobs": 1})
    good.append({"id": "pen", "prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1.3,
                 "logit_bias": {"5": 2.5}, "bad_words": ["the"], "min_tokens": 2})
    good.append({"id": "json", "prompt": "Hello", "max_tokens": 30, "temperature": 0,
                 "ignore_eos": False, "structured_outputs": {"choice": ["Hamlet", "Lear"]}})
    bad = {  # line content -> a word the error must contain
        "{not json": "invalid JSON",
        json.dumps(["a", "list"]): "JSON object",
        json.dumps({"prompt": "no id"}): "missing field 'id'",
        json.dumps({"id": 1.5, "prompt": "x"}): "'id'",
        json.dumps({"id": True, "prompt": "x"}): "'id'",
        json.dumps({"id": "g0", "prompt": "again"}): "duplicate id",
        json.dumps({"id": "u", "prompt": "x", "max_token": 3}): "unknown field",
        json.dumps({"id": "t", "prompt": "x", "max_tokens": "ten"}): "max_tokens",
        json.dumps({"id": "v", "prompt": "x", "temperature": -1}): "temperature",
        json.dumps({"id": "tp", "prompt": "x", "top_p": 0}): "top_p",
        json.dumps({"id": "e", "prompt": ""}): "empty",
        json.dumps({"id": "b", "prompt": "x", "prompt_token_ids": [3]}): "not both",
        json.dumps({"id": "n"}): "missing field 'prompt'",
        json.dumps({"id": "l", "prompt_token_ids": [5] * 200}): "max_model_len",
        json.dumps({"id": "r", "prompt_token_ids": [5, 10**6]}): "out of range",
        json.dumps({"id": "s", "prompt": "x", "stop": [1]}): "stop",
        json.dumps({"id": "p", "prompt": 7}): "'prompt'",
        json.dumps({"id": "so", "prompt": "x", "structured_outputs": {"regex": "a("},
                    "ignore_eos": False}):
            "'structured_outputs.regex'",
        json.dumps({"id": "so2", "prompt": "x", "structured_outputs": {"choice": ["a"]},
                    "ignore_eos": True}): "'ignore_eos'",
        b'{"id": "utf", "prompt": "\xff\xfe"}': "UTF-8",
        # hostile: each of these stopped the whole job before the request door
        json.dumps({"id": "k", "prompt": "x", "top_k": 2**31}): "top_k",
        json.dumps({"id": "k2", "prompt": "x", "top_k": 10**40}): "top_k",
        json.dumps({"id": "sd", "prompt": "x", "seed": 2**70}): "seed",
        json.dumps({"id": "mt", "prompt": "x", "max_tokens": 2**63}): "max_tokens",
        json.dumps({"id": "sur", "prompt": "\ud800 lone surrogate"}): "prompt",
        b'{"id": "deep", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}": "nested",
        b"[" * 200_000: "nested",
        json.dumps({"id": "nn", "prompt": "x", "n": 3}): "'n'",
        json.dumps({"id": "bo", "prompt": "x", "best_of": 2}): "'best_of'",
        json.dumps({"id": "rp", "prompt": "x", "repetition_penalty": 0}): "repetition_penalty",
        json.dumps({"id": "lb", "prompt": "x", "logit_bias": {"5": 101}}): "logit_bias",
    }
    rows, expect = [], {}
    for i, g in enumerate(good):
        rows.append(g)
        rows.append("")  # blank lines are ignored, but still count for line numbers
        b = list(bad)[i * 3: i * 3 + 3]
        for line in b:
            rows.append(line)
            expect[len(rows)] = bad[line]
    for line in list(bad)[len(good) * 3:]:
        rows.append(line)
        expect[len(rows)] = bad[line]
    assert len(expect) == len(bad) >= 20
    _write(tmp_path / "in.jsonl", rows)
    s = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False,
                           sampling={"ignore_eos": True})
    out = _read(tmp_path / "out.jsonl")
    errors = {r["line"]: r for r in out if "error" in r}
    assert sorted(errors) == sorted(expect)
    for line, word in expect.items():
        assert word in errors[line]["error"], (line, errors[line])
    assert next(r for r in errors.values() if "invalid JSON" in r["error"])["id"] is None
    assert next(r for r in errors.values() if "temperature" in r["error"])["id"] == "v"
    dup = next(r for r in errors.values() if "duplicate" in r["error"])
    assert dup["id"] == "g0"
    assert s["errors"] == len(bad) and s["requests"] == len(good)

    results = _by_id(out)
    assert set(results) == {g["id"] for g in good}
    ref = llm.generate([g["prompt"] for g in good[:5]],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for g, r in zip(good, ref):
        rec = results[g["id"]]
        assert rec["token_ids"] == r.token_ids and rec["text"] == r.text
        assert rec["finish_reason"] == "length"
        assert rec["usage"]["prompt_tokens"] == len(r.prompt_token_ids)
        assert rec["usage"]["completion_tokens"] == 6
        assert set(rec["metrics"]) >= {"queue_s", "ttft_s", "itl_s_mean", "e2e_s"}
    assert results["json"]["text"] in ("Hamlet", "Lear")
    assert results["json"]["finish_reason"] == "stop"
    tok = results[99]
    assert tok["usage"] == {**tok["usage"], "prompt_tokens": 4, "completion_tokens": 3}
    assert len(tok["logprobs"]) == 3 and len(tok["logprobs"][0]["top"]) == 2
    plp = tok["prompt_logprobs"]  # null for the first prompt token, then each with its top 1
    assert plp[0] is None and [e["token_id"] for e in plp[1:]] == [40, 41, 42]
    assert all(len(e["top"]) == 1 and e["logprob"] <= e["top"][0][1] + 1e-6 for e in plp[1:])


# ------------------------------------------------------------------------------- ordering

def test_ordered_output_follows_input_order_unordered_has_same_records(llm, tmp_path):
    # Early lines are long, late lines short: finish order is far from input order.
    rows = [{"id": i, "prompt": _prompt(i), "max_tokens": 40 - i} for i in range(30)]
    _write(tmp_path / "in.jsonl", rows)
    sampling = {"ignore_eos": True}
    so = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "ordered.jsonl", ordered=True,
                            reorder_window=8, sampling=sampling, progress=False)
    su = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "unordered.jsonl",
                            sampling=sampling, progress=False)
    ordered, unordered = _read(tmp_path / "ordered.jsonl"), _read(tmp_path / "unordered.jsonl")
    assert [r["id"] for r in ordered] == list(range(30))
    assert [r["id"] for r in unordered] != list(range(30))  # so the check above means something
    assert sorted(r["id"] for r in unordered) == list(range(30))
    uo = _by_id(unordered)
    for r in ordered:
        assert (r["text"], r["token_ids"]) == (uo[r["id"]]["text"], uo[r["id"]]["token_ids"])
        assert len(r["token_ids"]) == 40 - r["id"]
    assert so["requests"] == su["requests"] == 30
    assert so["generated_tokens"] == su["generated_tokens"] == sum(40 - i for i in range(30))
    assert so["reorder_window"] == 8
    assert llm.engine.num_unfinished == 0  # nothing left behind in the shared engine


# -------------------------------------------------------------------------------- resume

@pytest.mark.parametrize("ordered", [False, True])
def test_resume_repairs_a_torn_line_and_completes_exactly_once(llm, tmp_path, ordered):
    rows = [{"id": f"r{i}", "prompt": _prompt(i), "max_tokens": 3 + i % 7} for i in range(24)]
    rows.insert(5, "{broken")
    _write(tmp_path / "in.jsonl", rows)
    kw = dict(ordered=ordered, sampling={"ignore_eos": True}, progress=False)
    llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "ref.jsonl", **kw)
    ref = (tmp_path / "ref.jsonl").read_bytes()
    lines = ref.splitlines(keepends=True)
    # a crash after 9 records, in the middle of writing the 10th
    (tmp_path / "out.jsonl").write_bytes(b"".join(lines[:9]) + lines[9][: len(lines[9]) // 2])
    s = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "out.jsonl", resume=True, **kw)
    assert s["resumed_records"] == 9 and s["skipped"] == 9
    out = _read(tmp_path / "out.jsonl")
    assert len(out) == len(rows)
    ids = [r["id"] for r in out if "error" not in r]
    assert sorted(ids) == sorted(f"r{i}" for i in range(24))  # each exactly once
    assert [r["line"] for r in out if "error" in r] == [6]
    want = _by_id(_read(tmp_path / "ref.jsonl"))
    for r in out:
        if "error" not in r:
            assert r["token_ids"] == want[r["id"]]["token_ids"]
    if ordered:  # a resumed ordered job is still in input order
        assert [r.get("id") for r in out] == [r.get("id") for r in _read(tmp_path / "ref.jsonl")]
    # resuming a finished job does nothing
    s2 = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "out.jsonl", resume=True, **kw)
    assert s2["requests"] == 0 and s2["errors"] == 0 and s2["skipped"] == len(rows)
    assert len(_read(tmp_path / "out.jsonl")) == len(rows)


def test_resume_refuses_damage_in_the_middle_and_foreign_files(tmp_path):
    ok = b'{"id": "a", "text": "x", "token_ids": [1]}\n'
    (tmp_path / "mid.jsonl").write_bytes(ok + b'{"id": garbage\n' + ok.replace(b'"a"', b'"b"'))
    with pytest.raises(BatchError, match="line 2"):
        scan_output(str(tmp_path / "mid.jsonl"))
    (tmp_path / "foreign.txt").write_bytes(b"hello world")  # no newline, not ours
    with pytest.raises(BatchError, match="line 1"):
        scan_output(str(tmp_path / "foreign.txt"))
    assert (tmp_path / "foreign.txt").read_bytes() == b"hello world"  # never truncated
    (tmp_path / "torn.jsonl").write_bytes(ok + b'{"id": "b", "te')
    assert scan_output(str(tmp_path / "torn.jsonl")) == ({'"a"'}, set(), 1)
    assert (tmp_path / "torn.jsonl").read_bytes() == ok


def test_existing_output_is_not_clobbered(tiny_dir, tmp_path, capsys):
    from jaxinfer.serve.cli import main

    _write(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    (tmp_path / "out.jsonl").write_text('{"id": 0, "text": "keep me"}\n')
    t0 = time.perf_counter()
    rc = main(["batch", "--model", str(tiny_dir), "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "out.jsonl")])
    assert rc == 2 and time.perf_counter() - t0 < 5  # fails before loading the model
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == '{"id": 0, "text": "keep me"}\n'
    with pytest.raises(BatchError, match="not empty"):
        run_batch(None, None, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    rc = main(["batch", "--model", str(tiny_dir), "--input", str(tmp_path / "missing.jsonl"),
               "--output", str(tmp_path / "new.jsonl")])
    assert rc == 2 and not (tmp_path / "new.jsonl").exists()


# ------------------------------------------------------------------- SIGKILL and resume

def _env():
    from tests.conftest import _CACHE

    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=_CACHE,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONPATH=str(REPO))
    return env


def _lines(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _run_until(cmd, out, kill_at, log, timeout=240):
    """Start the job; SIGKILL it once `out` has >= kill_at lines (None: let it finish)."""
    with open(log, "ab") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=_env())
        deadline = time.monotonic() + timeout
        try:
            while p.poll() is None and time.monotonic() < deadline:
                if kill_at is not None and _lines(out) >= kill_at:
                    p.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.005)
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return rc


def test_sigkill_twice_then_resume_gives_every_id_exactly_once(llm, tiny_dir, tmp_path):
    n = 160
    rows = [{"id": f"k{i}", "prompt": _prompt(i), "max_tokens": 8 + (i * 11) % 33}
            for i in range(n)]
    for at in (7, 50, 120):  # error lines must also come out exactly once
        rows.insert(at, {"id": f"bad{at}", "prompt": "x", "temperature": -2})
    _write(tmp_path / "in.jsonl", rows)
    llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "ref.jsonl",
                       sampling={"ignore_eos": True}, progress=False)
    ref = _read(tmp_path / "ref.jsonl")

    out, log = tmp_path / "out.jsonl", tmp_path / "stderr.log"
    cmd = [sys.executable, "-m", "jaxinfer.serve.cli", "batch", "--model", str(tiny_dir),
           "--input", str(tmp_path / "in.jsonl"), "--output", str(out), *ENGINE_FLAGS,
           "--ignore-eos", "--max-tokens", "16", "--fsync", "line"]
    total = len(rows)
    rc1 = _run_until(cmd, out, 20, log)
    after1 = _lines(out)
    rc2 = _run_until(cmd + ["--resume"], out, after1 + 40, log)
    after2 = _lines(out)
    rc3 = _run_until(cmd + ["--resume", "--summary-json", str(tmp_path / "s.json")], out, None, log)
    stderr = log.read_text(errors="replace")
    assert rc1 == rc2 == -signal.SIGKILL, stderr  # both kills landed mid-job
    assert 20 <= after1 < total and after1 + 40 <= after2 < total, (after1, after2)
    assert rc3 == 0, stderr

    got = _read(out)  # also proves there is no torn line left
    assert len(got) == total
    res = [r["id"] for r in got if "error" not in r]
    assert len(res) == len(set(res)) == n
    assert sorted(r["line"] for r in got if "error" in r) == sorted(
        r["line"] for r in ref if "error" in r)
    want = _by_id(ref)
    for r in got:
        if "error" not in r:
            assert (r["text"], r["token_ids"]) == (want[r["id"]]["text"], want[r["id"]]["token_ids"]), r["id"]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["skipped"] == s["resumed_records"] == after2  # what was there was skipped
    assert s["requests"] + s["errors"] == total - s["skipped"]
    assert "\r" not in stderr  # no progress bar when stderr is not a terminal
    assert "batch:" in stderr and "TTFT p50" in stderr


def test_engine_fault_gives_retry_records_that_resume_completes(tiny_dir, tmp_path):
    """A step that raises fails the lines it held (error records marked "retry"), the job goes
    on, and --resume computes exactly those lines again."""
    llm = LLM(str(tiny_dir), **ENGINE)
    rows = [{"id": i, "prompt": _prompt(i), "max_tokens": 5} for i in range(8)]
    _write(tmp_path / "in.jsonl", rows)
    from tests.faults import fail_once

    real = llm.engine._step
    fail_once(llm.engine, 2)
    s = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False,
                           sampling={"ignore_eos": True})
    llm.engine._step = real
    out = _read(tmp_path / "out.jsonl")
    retry = [r for r in out if "error" in r]
    assert retry and all(r["retry"] and "injected device failure" in r["error"] for r in retry)
    assert s["errors"] == len(retry) and s["requests"] == 8 - len(retry)
    s2 = llm.generate_jsonl(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False,
                            sampling={"ignore_eos": True}, resume=True)
    assert s2["requests"] == len(retry) and s2["errors"] == 0
    results = _by_id(_read(tmp_path / "out.jsonl"))
    assert set(results) == set(range(8))
    ref = llm.generate([r["prompt"] for r in rows],
                       SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [results[i]["token_ids"] for i in range(8)] == [o.token_ids for o in ref]


def test_refuse_late_holds_lines_and_the_job_completes(tiny_dir, tmp_path, capsys):
    """`jaxinfer batch --ttft-slo-ms 1 --refuse-late`: every request is predicted to miss a
    1 ms TTFT once step times are measured, so the engine refuses each line (Overloaded) while
    others of the job are in flight; the runner holds such a line and retries it after a step.
    The job ends with every id exactly once and no error record."""
    from jaxinfer.serve.cli import main

    rows = [{"id": f"r{i}", "prompt": f"line {i} of the job", "max_tokens": 3} for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["batch", "--model", str(tiny_dir), "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "out.jsonl"), "--ttft-slo-ms", "1", "--refuse-late",
               "--max-slots", "4", "--page-size", "8", "--max-model-len", "128",
               "--summary-json", str(tmp_path / "s.json"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert not [r for r in out if "error" in r] and all(len(r["token_ids"]) == 3 for r in out)
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests"] == 40 and s["errors"] == 0 and s["held"] > 0
