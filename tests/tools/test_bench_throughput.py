"""`jaxinfer bench throughput` on the random-init tiny Llama, in its own process as users run it:
every run (continuous, static batches, synchronous scheduling) serves every requested token, HF
transformers runs at each static batch size asked for and its best is the peer,
serving compiles nothing after warm-up, and every run starts with an empty prefix cache."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest


ROOT = Path(__file__).resolve().parents[2]


def test_report_counts_and_no_compiles_after_warmup(tiny_dir, tmp_path):
    model = tiny_dir
    out = tmp_path / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAXINFER_COMPILATION_CACHE=jax.config.jax_compilation_cache_dir or "0")
    r = subprocess.run(
        [sys.executable, "-m", "jaxinfer.serve.cli", "bench", "throughput", "--model", str(model),
         "--num-requests", "6", "--input-len", "4:30", "--output-len", "2:12", "--max-slots", "4",
         "--max-model-len", "64", "--prefill-chunk", "16", "--static-batching", "--compare-sync",
         "--compare-hf", "--hf-batches", "2,4", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "async_vs_sync" in r.stdout and "continuous_vs_static" in r.stdout
    rep = json.loads(out.read_text())
    want = rep["workload"]["output_tokens"]
    assert rep["requests"] == 6 and 6 * 2 <= want <= 6 * 12
    for run in (rep, rep["static"], rep["sync"]):
        assert run["output_tokens"] == want and run["steps"] > 0
        assert run["cached_prompt_tokens"] == 0  # random prompts share nothing but with a rerun
    assert rep["new_compiles_after_warmup"] == 0
    first = rep["first_run"]  # before warm-up: it compiles what it meets, serves every token
    assert first["output_tokens"] == want and first["programs"] > 0
    assert f"engine, first run ({first['programs']} programs)" in r.stdout
    # both runs of a pair serve the same `want` tokens, so a tokens/s ratio is the other run's
    # wall clock over the engine's: recomputed from the raw walls, and as the table prints it
    for key, other in (("continuous_vs_static", "static"), ("async_vs_sync", "sync")):
        ratio = rep[other]["wall_s"] / rep["wall_s"]
        assert rep[key] == pytest.approx(ratio, rel=1e-9)
        printed = re.search(rf"^{key}: ([0-9.]+)x$", r.stdout, re.M)
        assert printed and abs(float(printed.group(1)) - ratio) <= 0.005 + 1e-9
    assert rep["batch1_decode_step_s"] > 0 and rep["param_bytes"] > 0
    assert rep["load_s"] > 0 and rep["quantization"] is None and "load " in r.stdout
    hf = rep["hf_output_tokens_per_s_by_batch"]  # HF at each static batch size; its best counts
    assert sorted(hf) == ["2", "4"] and rep["hf_output_tokens"] == want
    assert rep["hf_output_tokens_per_s"] == hf[str(rep["hf_best_batch"])] == max(hf.values())
    assert f"HF generate, batch {rep['hf_best_batch']} (best)" in r.stdout
