"""`jaxinfer bench device --smoke`: the accelerator proof kit runs end to end on CPU (tiny
shapes, interpret-mode kernels), so it cannot rot between device loans."""

import json

from jaxinfer.tools.bench_device import main, make_case, markdown


def test_smoke_runs_every_section_and_writes_both_reports(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "device.json").read_text())
    secs = data["sections"]
    assert list(secs) == ["env", "kernels", "bandwidth", "engine", "moe"]
    assert not any("error" in s for s in secs.values())
    kern = secs["kernels"]["rows"]
    assert len(kern) == 8 and all(r["ok"] and r["max_err"] < 0.03 for r in kern)
    assert {r["layout"] for r in kern} == {"decode", "prefill", "verify", "mixed"}
    assert any(r["int8"] and r["nan_fill"] for r in kern) and any(r["window"] for r in kern)
    bw = secs["bandwidth"]
    assert bw["copy_bandwidth_gbs"] > 0 and all(r["kernel_gbs"] > 0 for r in bw["rows"])
    eng = secs["engine"]["rows"]
    steady = [r for r in eng if r["run"] == "steady"]
    assert {r["batch"] for r in steady} == {1, 4} and any("int8" in r["weights"] for r in steady)
    assert any("int4" in r["weights"] for r in steady)
    assert all(r["compiles"] == 0 and r["decode_tok_s"] > 0 for r in steady)
    moe = [r for r in secs["moe"]["rows"] if r["run"] == "steady"]
    assert {(r["batch"], r["weights"][:4]) for r in moe} == {(1, "floa"), (4, "floa"), (1, "int8")}
    assert all(r["compiles"] == 0 and r["decode_tok_s"] > 0 for r in moe)
    md = (tmp_path / "device.md").read_text()
    assert md == markdown(data) and "| layout | page_size | head_dim |" in md
    assert "## kernels" in md and "passed: 8/8" in md


def test_nan_fill_poisons_exactly_the_slots_no_valid_position_reads():
    import numpy as np

    args, _ = make_case([1, 3], [5, 18], num_kv_heads=1, gqa=1, head_dim=8, page_size=8,
                        dtype=np.float32, nan_fill=True)
    k, table = np.asarray(args[1])[0], np.asarray(args[4])  # [N, ps, D], [S, P]
    live = np.zeros(k.shape[:2], bool)
    for s, kv in enumerate([5, 18]):
        for j in range(kv):
            live[table[s, j // 8], j % 8] = True
    assert live.sum() == 23 and k.shape[0] == 1 + 1 + 3 + 2  # null page + pages + 2 spare
    assert np.isfinite(k[live]).all() and np.isnan(k[~live]).all()
