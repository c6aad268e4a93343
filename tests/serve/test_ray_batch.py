"""Offline batch on a local Ray (2 CPUs, one cluster for the module) with the tiny Llama:
`jaxinfer batch --ray` against `jaxinfer batch` on one host, with a replica and then the driver
SIGKILLed mid-job; without --ordered, OUTPUT appended per block and resumed after a torn append
(the driver in this process); `LLMPredictor` in a user's `map_batches`; the block index by
hand."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import ray.data

from jaxinfer import SamplingParams
from jaxinfer.runtime.host.batch import BatchError
from jaxinfer.serve import ray_batch

REPO = Path(__file__).resolve().parents[2]
# conftest's shared tiny_llm engine: the one-host reference runs on it.
FLAGS = ["--max-slots", "4", "--page-size", "8", "--max-model-len", "256"]
WORDS = ("To be or not to be that is the question whether tis nobler in the mind to suffer "
         "the slings and arrows of outrageous fortune").split()
WORKER_TITLE = b"MapBatches(BlockWorker)"


def _prompt(i):
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (i * 5) % 17))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _parts(shards: Path) -> list[str]:
    return sorted(n for n in os.listdir(shards) if n.startswith("part-") and n.endswith(".jsonl"))


def _worker_pids() -> list[int]:
    """The Ray actor processes of `run` (Ray titles each worker process with its actor)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if WORKER_TITLE in cmd and b"ray::" in cmd:
                pids.append(int(d))
    return pids


def _wait(cond, timeout_s, what):
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_replicas_match_one_host_with_a_replica_and_the_driver_killed(
        cluster, tiny_llm, tiny_dir, tmp_path):
    rows = [json.dumps({"id": f"r{i}", "prompt": _prompt(i), "max_tokens": 4 + (i * 7) % 29})
            for i in range(200)]
    bad = {13: '{"id": "nop", "max_tokens": 3}',  # no prompt
           40: '{"id": "hot", "prompt": "x", "temperature": -2}',
           77: '{"id": "deep", "prompt": "x", "stop": ' + "[" * 5000 + "]" * 5000 + "}",
           90: "not json at all",
           120: "",  # blank: no record
           150: json.dumps({"id": "r3", "prompt": "again"})}  # an id of an earlier block
    for at in sorted(bad):
        rows.insert(at, bad[at])
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    sampling = {"ignore_eos": True, "max_tokens": 16}
    tiny_llm.generate_jsonl(src, tmp_path / "ref.jsonl", sampling=sampling, ordered=True,
                            progress=False)
    ref = _read(tmp_path / "ref.jsonl")

    out, shards = tmp_path / "out.jsonl", tmp_path / "out.jsonl.shards"
    cmd = [sys.executable, "-m", "jaxinfer.serve.cli", "batch", "--ray", "--ray-address",
           cluster, "--replicas", "2", "--block-lines", "8", "--model", str(tiny_dir), *FLAGS,
           "--input", str(src), "--output", str(out), "--ordered", "--ignore-eos",
           "--max-tokens", "16", "--summary-json", str(tmp_path / "s.json")]
    log = open(tmp_path / "driver.log", "w+")
    blocks = (len(rows) + 7) // 8
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log)
    try:
        _wait(lambda: shards.is_dir() and len(_parts(shards)) >= 1, 180, "the first part")
        victims = _worker_pids()
        assert len(victims) == 2, victims
        os.kill(victims[0], signal.SIGKILL)  # one replica dies mid-job
        at_kill = len(_parts(shards))
        _wait(lambda: len(_parts(shards)) >= at_kill + 4, 180, "parts after the replica died")
        assert driver.poll() is None, "the job ended before the driver was killed"
        driver.kill()  # then the driver
        driver.wait()
        done_before = len(_parts(shards))
        assert done_before < blocks
        # One replica finishes the job: the replica count may change across a resume.
        resumed = subprocess.run(cmd[:cmd.index("--replicas")] + cmd[cmd.index("--replicas") + 2:]
                                 + ["--resume"], cwd=REPO, stdout=log, stderr=log, timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    log.seek(0)
    text = log.read()
    assert resumed.returncode == 0, text[-6000:]
    assert "UDF failed" not in text
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["blocks"] == blocks and s["blocks_resumed"] >= done_before
    assert not [n for n in os.listdir(shards) if ray_batch._TMP in n]

    got = _read(out)
    assert len(got) == len(ref) == len(rows) - 1  # every line once (the blank one gives none)
    ids = [r["id"] for r in got if "error" not in r]
    assert len(ids) == len(set(ids)) == 200
    for g, r in zip(got, ref):
        if r["id"] == "r3" and "error" in r:  # the repeat: one host knows its line, we not
            assert "duplicate id" in g["error"] and "duplicate id" in r["error"]
            continue
        keep = ("id", "text", "token_ids", "finish_reason", "error", "line")
        assert {k: g.get(k) for k in keep} == {k: r.get(k) for k in keep}
    assert s["requests"] == 200 and s["errors"] == 5 and s["duplicate_ids"] == 1
    parts = [json.loads(x) for p in _parts(shards) for x in (shards / p).read_text().splitlines()]
    assert [p["id"] for p in parts] == [g["id"] for g in got]


def test_unordered_output_appended_per_block_then_resumed_after_a_torn_append(
        cluster, tiny_llm, tiny_dir, tmp_path, capsys):
    """Without --ordered, OUTPUT gets every block as it finishes; a driver killed after
    appending blocks it had not yet logged (and inside a ledger line) is resumed without Ray:
    OUTPUT is cut back to the last logged block and the rest appended, each id once."""
    from jaxinfer.serve.cli import build_parser

    rows = [json.dumps({"id": f"u{i}", "prompt": _prompt(i), "max_tokens": 2 + i % 5})
            for i in range(21)]
    rows.insert(9, '{"id": "nop", "max_tokens": 3}')  # no prompt: an error record
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n")
    tiny_llm.generate_jsonl(src, tmp_path / "ref.jsonl", sampling={"ignore_eos": True},
                            ordered=True, progress=False)
    ref = {r["id"]: r for r in _read(tmp_path / "ref.jsonl")}
    ledger_path = tmp_path / "out.jsonl.shards" / ray_batch.LEDGER
    cmd = ["batch", "--ray", "--block-lines", "4", "--model", str(tiny_dir), *FLAGS,
           "--input", str(src), "--output", str(out), "--ignore-eos",
           "--summary-json", str(tmp_path / "s.json")]

    def run(*extra):
        args = build_parser().parse_args(cmd + list(extra))
        assert args.fn(args) == 0, capsys.readouterr().err[-3000:]
        return json.loads((tmp_path / "s.json").read_text())

    def check():
        got = _read(out)
        assert sorted(r["id"] for r in got) == sorted(ref)  # each id exactly once
        for g in got:
            r = ref[g["id"]]
            assert {k: g.get(k) for k in ("text", "token_ids", "error", "line")} == \
                {k: r.get(k) for k in ("text", "token_ids", "error", "line")}
        ledger = [tuple(map(int, x.split())) for x in ledger_path.read_text().splitlines()]
        assert sorted(k for k, _ in ledger) == list(range(6))
        assert ledger[-1][1] == out.stat().st_size

    s = run()  # 22 lines: blocks of 4, 4, 4, 4, 4, 2
    assert (s["blocks"], s["blocks_resumed"], s["requests"], s["errors"]) == (6, 0, 21, 1)
    check()
    kept = ledger_path.read_text().splitlines()[:2]
    cut = int(kept[-1].split()[1])
    head = out.read_bytes()[:cut]
    ledger_path.write_text("\n".join(kept) + "\n" + "3 9")  # killed inside the third line
    with open(out, "ab") as f:  # and inside an append past the blocks it had logged
        f.write(b'{"id": "u0", "text": "to')
    s = run("--resume")
    assert (s["blocks"], s["blocks_resumed"], s["requests"], s["errors"]) == (6, 6, 21, 1)
    assert out.read_bytes()[:cut] == head
    check()


def test_predictor_in_map_batches_gives_records_and_error_rows(cluster, tiny_llm, tiny_dir):
    rows = [{"id": f"p{i}", "prompt": _prompt(i), "max_tokens": 3 + i % 5, "temperature": 0.0,
             "tag": f"t{i}"} for i in range(24)]
    rows[5]["prompt"] = None  # null: the field is absent
    rows[9]["temperature"] = 5.0
    rows[17]["max_tokens"] = 0
    ds = ray.data.from_items(rows, override_num_blocks=4).map_batches(
        ray_batch.LLMPredictor, batch_format="pyarrow", batch_size=8, num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=1), fn_constructor_kwargs=dict(
            model=str(tiny_dir), max_slots=4, page_size=8, max_model_len=256,
            sampling={"ignore_eos": True}, keep_columns=["tag"]))
    out = {r["id"]: r for r in ds.take_all()}
    assert sorted(out) == sorted(r["id"] for r in rows)
    errors = {k: v["error"] for k, v in out.items() if v["error"] is not None}
    assert set(errors) == {"p5", "p9", "p17"}
    assert "prompt" in errors["p5"] and "temperature" in errors["p9"]
    assert "max_tokens" in errors["p17"]
    for r in rows:
        got = out[r["id"]]
        assert got["tag"] == r["tag"]
        if r["id"] in errors:
            continue
        want = tiny_llm.generate(r["prompt"], SamplingParams(
            max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True))[0]
        assert list(got["token_ids"]) == want.token_ids and got["text"] == want.text
        assert got["finish_reason"] == "length"
        assert got["usage"]["completion_tokens"] == r["max_tokens"]


def test_block_index_by_hand(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"a\n\nbb\nccc\nd")  # 5 lines, the last without its newline
    blocks, size, lines = ray_batch.index_blocks(str(p), 2)
    assert (size, lines) == (11, 5)
    assert [(b["start"], b["end"], b["first_line"]) for b in blocks] == [
        (0, 3, 1), (3, 10, 3), (10, 11, 5)]
    blocks, _, lines = ray_batch.index_blocks(str(p), 5)
    assert lines == 5 and [(b["start"], b["end"]) for b in blocks] == [(0, 11)]


def test_changed_input_and_missing_model_fail_before_ray_starts(tmp_path):
    import argparse

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n')
    shards = tmp_path / "out.jsonl.shards"
    shards.mkdir()
    (shards / ray_batch.MANIFEST).write_text(json.dumps(
        {"input": str(src), "size": 999, "block_lines": 256, "blocks": 1, "index_sha256": "x"}))
    args = argparse.Namespace(input=str(src), output=str(tmp_path / "out.jsonl"), replicas=1,
                              block_lines=256, ordered=False, resume=True, overwrite=False,
                              ray_address=None)
    model = {"model": str(tmp_path)}  # a path that exists: the local-cluster check passes
    with pytest.raises(BatchError, match="not the input"):
        ray_batch.run(args, model, {})
    args.resume = False
    with pytest.raises(BatchError, match="--resume"):
        ray_batch.run(args, model, {})
    with pytest.raises(BatchError, match="no such file"):  # before any replica starts
        ray_batch.run(args, {"model": str(tmp_path / "nope")}, {})
