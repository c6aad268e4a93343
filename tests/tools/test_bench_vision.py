"""tools/bench_vision.py in a child process (it sets the host device count before JAX starts):
a tiny tower split over 2 host devices answers as on one device, and the row says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_tower_split_over_two_devices_matches_one():
    out = subprocess.run([sys.executable, "-m", "jaxinfer.tools.bench_vision", "--tiny",
                          "--devices", "2", "--repeats", "1", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["devices"] == 2 and row["layers"] == 2 and row["platform"] == "cpu"
    assert row["max_abs_diff"] < 1e-4
    assert row["one_steady_s"] > 0 and row["split_steady_s"] > 0
