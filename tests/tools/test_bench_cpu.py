"""tools/bench_cpu.py: the weights a token row multiplies, counted by hand for the tiny Llama;
the matmul table and the step kinds come back for every row count and step, all positive."""

from jaxinfer.tools import bench_cpu


def test_layer_weights_and_step_kinds(tiny_llm):
    # per layer: wq 64x(4x16) + wk, wv 64x(2x16) + wo (4x16)x64 + gate, up 64x128 + down 128x64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert bench_cpu._layer_weights(tiny_llm.model.params) == 2 * per_layer
    table = bench_cpu.matmul_table(64, repeats=2)
    assert "XLA, one device" in table and "torch, 1 thread" in table
    assert any(name.startswith("XLA, output-major in") for name in table)
    assert "XLA, int4, groups of 64 (widened)" in table
    from jaxinfer.runtime.device import cpu_kernels

    if cpu_kernels.load() is not None:  # the kernels' rows beside XLA's
        assert sum(name.startswith("kernel (") for name in table) == len(bench_cpu.QUANTIZED)
    assert all(set(row) == set(bench_cpu.ROWS) and min(row.values()) > 0
               for row in table.values())
    steps = bench_cpu.step_kinds(tiny_llm, repeats=1)
    assert sorted(steps) == ["decode 1", "prefill 255"]  # 4 slots; 256-token model length
    assert all(r["step_s"] > 0 and r["gflop_s"] > 0 for r in steps.values())
