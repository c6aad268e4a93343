"""The cost model (tools/cost_model.py): XLA's counts of the decode step against hand-worked
figures, the layer extrapolation, the roofline and the table."""

import pytest

from jaxinfer.tools import cost_model as cm

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=32)


def test_per_layer_cost_is_exactly_linear():
    c1, c2, c3 = (cm.step_cost(SMALL, n, batch=4, context=64, tp=1) for n in (1, 2, 3))
    for k in ("flops", "bytes"):
        assert c3[k] == pytest.approx(2 * c2[k] - c1[k], rel=1e-9)


def test_counts_match_hand_worked_flops_and_bytes():
    batch, context = 4, 64
    cost = cm.step_cost(SMALL, 2, batch=batch, context=context, tp=1)
    # 2 FLOPs per weight per token, plus q.k and p.v over the context for every head
    attention = 2 * 2 * batch * context * SMALL["num_heads"] * SMALL["head_dim"] * 2
    flops = 2 * batch * cm.matmul_params(SMALL) + attention
    assert flops <= cost["flops"] <= 1.5 * flops
    # f32 compile: at least every weight and the KV once, and not several times over
    floor = cm.floor_bytes(SMALL, batch=1, context=context, tp=1, itemsize=4)
    one = cm.step_cost(SMALL, 2, batch=1, context=context, tp=1)
    assert floor <= one["bytes"] <= 2 * floor


def test_roofline_and_fit():
    # H100: 1 TFLOP in 1.011 ms beats 1 GB in 0.299 ms -> compute-bound
    p = cm.predict(1e12, 1e9, "H100 SXM", batch=8)
    assert p["bound"] == "compute" and p["step_ms"] == pytest.approx(1e12 / 989e12 * 1e3)
    assert p["tok_s"] == pytest.approx(8 / (1e12 / 989e12))
    assert cm.predict(1e9, 1e9, "TPU v5e", batch=1)["bound"] == "bandwidth"
    big = cm.MODELS["Llama-3-70B"]
    assert not cm.fits(big, "H200 SXM", 1, 2048, 1)  # 141 GB of bf16 weights
    assert cm.fits(big, "H200 SXM", 1, 2048, 4)


def test_table_from_a_small_build():
    rows = cm.build({"small": SMALL}, tps=(1,), batches=(1, 4), context=64, log=lambda s: None)
    assert [r["batch"] for r in rows] == [1, 4]
    assert rows[1]["gflops"] > rows[0]["gflops"] and all(r["H200 SXM"] for r in rows)
    md = cm.markdown(rows, "cmd")
    assert "| small | 1 | 4 |" in md and "`cmd`" in md and "bandwidth-bound" in md
