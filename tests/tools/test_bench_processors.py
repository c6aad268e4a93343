"""tools/bench_processors.py on the tiny model: both variants run, the report's numbers are
consistent, and the processor state is the slots' [V] count rows and the rest."""

from jaxinfer.tools.bench_processors import run, variants


def test_bench_processors_reports_both_variants(tiny_llm):
    rep = run(tiny_llm, rows=2, tokens=4, repeats=1)
    assert set(rep["tok_s"]) == set(variants()) == {"none", "all processors"}
    assert all(v > 0 for v in rep["tok_s"].values())
    slots, vocab = tiny_llm.engine.ecfg.max_slots, tiny_llm.model.cfg.vocab_size
    assert rep["processor_state_bytes"] >= slots * vocab * 4  # the counts alone
    assert tiny_llm.engine.scheduler.num_running == 0
