"""`jaxinfer bench throughput` on the random-init tiny Llama: every run (continuous, static
batches, synchronous scheduling) serves every requested token, serving compiles nothing after
warm-up, and every run starts with an empty prefix cache."""

import argparse

from tools import bench_throughput as bt
from tools.make_test_model import make


def test_report_counts_and_no_compiles_after_warmup(tmp_path):
    model = make(tmp_path / "tiny", "tiny", seed=0)
    p = argparse.ArgumentParser()
    bt.add_args(p)
    args = p.parse_args(["--model", str(model), "--num-requests", "6", "--input-len", "4:30",
                         "--output-len", "2:12", "--max-slots", "4", "--max-model-len", "64",
                         "--prefill-chunk", "16", "--static-batching", "--compare-sync"])
    r = bt.run(args)
    want = r["workload"]["output_tokens"]
    assert r["requests"] == 6 and 6 * 2 <= want <= 6 * 12
    for run in (r, r["static"], r["sync"]):
        assert run["output_tokens"] == want and run["steps"] > 0
        assert run["cached_prompt_tokens"] == 0  # random prompts share nothing but with a rerun
    assert r["new_compiles_after_warmup"] == 0
    assert r["continuous_vs_static"] == r["output_tokens_per_s"] / r["static"]["output_tokens_per_s"]
    assert r["batch1_decode_step_s"] > 0 and r["param_bytes"] > 0
    assert "async_vs_sync" in bt.format_table(r)
