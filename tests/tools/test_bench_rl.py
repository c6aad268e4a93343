"""tools/bench_rl.py on the tiny model: the report's rows (throughput per workload, the
update_weights times) and its CLI's refusals."""

from __future__ import annotations

import pytest


def test_report_rows(tiny_dir):
    from jaxinfer.tools.bench_rl import WORKLOADS, run

    lines = []
    r = run(str(tiny_dir), repeats=1, max_slots=4, engines=("one device",), log=lines.append)
    row = r["engines"]["one device"]
    assert set(WORKLOADS) <= set(row) and row["tensor_parallel"] == 1
    assert all(row[w]["steady_tok_s"] > 0 and row[w]["first_tok_s"] > 0 for w in WORKLOADS)
    up = row["update_weights"]
    assert 0 < up["pytree_s"] and 0 < up["dir_s"] and 0 < up["pytree_first_s"]
    sl = row["sleep"]
    assert sl["level_2"] < sl["level_1"] < sl["awake"] and sl["woken"] > sl["level_2"]
    assert "invariant_vs_one_device" not in r  # needs both engines
    assert any("update_weights" in line for line in lines)


def test_cli_refuses_unknown_engines(capsys):
    from jaxinfer.tools.bench_rl import main

    with pytest.raises(SystemExit):
        main(["--engines", "fastest"])
    assert "--engines" in capsys.readouterr().err
