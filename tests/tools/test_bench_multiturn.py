"""tools/bench_multiturn.py on the tiny Llama with a pool a fraction of the conversations: the
tier restores pages and the report's phases and counters are consistent."""

from jaxinfer.runtime.llm import LLM
from jaxinfer.tools.bench_multiturn import run


def test_multiturn_report_with_the_tier(tiny_dir):
    llm = LLM(str(tiny_dir), max_slots=2, page_size=8, num_pages=24, max_model_len=512,
              kv_host_cache_gb=0.01)
    rep = run(llm, conversations=4, turns=3, output_len=4, opening_repeats=1)
    assert set(rep) == {"turn1", "later", "prefix_cache", "engine"}
    for phase in ("turn1", "later"):
        assert 0 < rep[phase]["ttft_p50_s"] <= rep[phase]["ttft_p99_s"]
    assert rep["engine"]["kv_host_pages_restored"] > 0
    assert rep["prefix_cache"]["host_cached_tokens"] == 8 * rep["engine"]["kv_host_pages_restored"]
