"""`jaxinfer bench sweep`: the Pareto front and goodput by hand, and a tiny end-to-end sweep."""

from __future__ import annotations

import json

from jaxinfer.tools.bench_sweep import goodput, pareto


def _pt(tok_s, itl_p99):
    return {"output_token_throughput": tok_s, "itl_ms": {"p99": itl_p99}}


def test_pareto_front_keeps_points_no_other_beats_on_both_axes():
    pts = [_pt(100, 50), _pt(200, 80), _pt(150, 90), _pt(200, 60), _pt(50, 40), _pt(50, 45)]
    # (150, 90) loses to (200, 60); (200, 80) too; (50, 45) to (50, 40)
    assert pareto(pts) == [0, 3, 4]


def test_goodput_counts_requests_within_every_target():
    reqs = [dict(ok=True, ttft=0.1, itl=[0.01, 0.02]), dict(ok=True, ttft=0.5, itl=[0.01]),
            dict(ok=True, ttft=0.1, itl=[0.2]), dict(ok=False, ttft=None, itl=[])]
    assert goodput(reqs, 2.0, 200, 50) == (0.5, 1 / 3)
    assert goodput(reqs, 2.0, None, 50) == (1.0, 2 / 3)
    assert goodput(reqs, 1.0, None, None) == (3.0, 1.0)


def test_sweep_on_the_tiny_model_writes_table_json_and_plot(tiny_dir, tmp_path, capsys):
    from jaxinfer.serve.cli import main

    out = tmp_path / "sweep"
    rc = main(["bench", "sweep", "--model", str(tiny_dir), "--max-slots", "1,4", "--rates",
               "inf", "--num-requests", "6", "--input-len", "4:12", "--output-len", "4:8",
               "--max-model-len", "64", "--ttft-slo-ms", "60000", "--itl-slo-ms", "60000",
               "--schedule-slo", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    pts = report["points"]
    assert [p["max_slots"] for p in pts] == [1, 4]
    assert all(p["completed"] == 6 and p["slo_attainment"] == 1.0 for p in pts)
    assert report["pareto"] and report["recommended_max_slots"] in (1, 4)
    assert out.with_suffix(".png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "| max_slots | rate |" in text and "recommended max_slots" in text
