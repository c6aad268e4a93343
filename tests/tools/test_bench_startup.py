"""tools/bench_startup.py: the compile log it reads names each program with its trace, lower and
compile times and the persistent cache's hits; a start in a fresh process on the tiny Llama,
cold then warm, reports its phases and programs."""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp

from jaxinfer.tools import bench_startup


def test_the_compile_log_is_read_per_program(tmp_path):
    handler = bench_startup._Programs()
    loggers = [logging.getLogger(n) for n in ("jax", "jax._src.compiler")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
        lg.propagate = False
    jax.config.update("jax_log_compiles", True)
    try:
        salt = float(time.time_ns() % 1_000_003)  # a program no cache has seen

        def startup_probe(x):
            return jnp.tanh(x) * salt

        jax.jit(startup_probe)(jnp.ones(7)).block_until_ready()
    finally:
        jax.config.update("jax_log_compiles", False)
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
    row = handler.table["startup_probe"]
    assert row["count"] == 1 and row["compile_s"] > 0 and row["trace_s"] > 0
    assert row["lower_s"] > 0 and row["hits"] == 0


def test_cold_then_warm_start_of_the_tiny_model(tiny_dir, capsys):
    a = argparse.Namespace(model=str(tiny_dir), modes="background", tokens=4, repeats=1,
                           serve=False, out=None, compiled_dir=None)
    report = bench_startup.measure(a)
    cold, warm = report["runs"]["background cold"][0], report["runs"]["background warm"][0]
    for r in (cold, warm):
        assert r["tokens"] == 4 and 0 < r["first_token_s"] <= r["tokens_s"] < r["process_s"]
        assert r["load_s"] > 0 and r["import_s"] > 0
    assert cold["layerwise_steps"] > 0  # an empty cache: the first steps ran layer by layer
    assert sum(p["hits"] for p in warm["programs"].values()) > 0  # warm: the cache served some
    assert sum(p["hits"] for p in cold["programs"].values()) == 0
    table = bench_startup.format_table(report)
    assert "| background cold |" in table and "layer_rows" in table
