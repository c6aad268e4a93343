"""The prefix cache's host tier (runtime/host/kv_host_tier.py, runtime/device/kv_offload.py):
its index by hand; then multi-turn conversations on the tiny Llama with a device pool a fraction
of their working set, greedy: the same tokens with the tier as without it (f32 and int8 KV), pages
restored from the host and counted as cached tokens, and host slots that no hash names poisoned
with NaN before every step without changing a token."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.host.kv_host_tier import HostTier

TURNS, CONVERSATIONS = 3, 6
ENGINE = dict(max_slots=2, page_size=8, num_pages=24, max_model_len=256, prefill_chunk=32)
OPENERS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind",
           "Now is the winter of our discontent made glorious summer by this sun of York",
           "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar",
           "All the world's a stage, and all the men and women merely players",
           "Is this a dagger which I see before me, the handle toward my hand?",
           "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name"]


def test_host_tier_index_by_hand():
    t = HostTier(2)
    assert t.put(b"a") == 0 and t.put(b"b") == 1
    assert t.put(b"a") is None  # already here: most recent now, no copy
    assert t.lookup([b"a", b"b", b"c"]) == [0, 1]  # the longest held prefix; b most recent
    assert t.put(b"c") == 0  # evicts the least recently used (a), reusing its slot
    assert t.lookup([b"a"]) == [] and t.lookup([b"b", b"c"]) == [1, 0]
    assert t.stats == {"offloaded": 3, "restored": 0, "evicted": 1}
    t.check_invariants()
    assert t.free_slots() == [] and t.reset() == 2 and t.free_slots() == [0, 1]
    with pytest.raises(ValueError, match="at least one slot"):
        HostTier(0)


def _conversations(llm) -> tuple[list[list[int]], dict]:
    """TURNS rounds over CONVERSATIONS chats: each turn's prompt is the chat so far (prompt and
    the model's answers) plus a new line; -> every turn's generated tokens, engine stats."""
    tok = llm.tokenizer
    chats = [tok.encode(o) for o in OPENERS[:CONVERSATIONS]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for t in range(TURNS):
        got = llm.generate(chats, sp)
        outs += [o.token_ids for o in got]
        chats = [c + o.token_ids + tok.encode(f" Turn {t}: and then?", add_special_tokens=False)
                 for c, o in zip(chats, got)]
    return outs, llm.engine.stats()


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_outputs_identical_with_and_without_the_host_tier(tiny_dir, kv):
    without = LLM(str(tiny_dir), kv_cache_dtype=kv, **ENGINE)
    want, st0 = _conversations(without)
    with_tier = LLM(str(tiny_dir), kv_cache_dtype=kv, kv_host_cache_gb=0.01, **ENGINE)
    got, st = _conversations(with_tier)
    assert got == want
    assert without.engine.scheduler.allocator.num_evictions > 0  # the pool was too small
    assert st["kv_host_pages_offloaded"] > 0 and st["kv_host_pages_restored"] > 0
    cached = lambda llm: llm.engine.scheduler.prefix_cache_stats()  # noqa: E731
    assert cached(with_tier)["host_cached_tokens"] == 8 * st["kv_host_pages_restored"]
    assert cached(with_tier)["cached_tokens"] > cached(without)["cached_tokens"]
    assert st["kv_host_bytes_used"] > 0 and st["kv_host_restore_s_per_page_p50"] > 0
    with_tier.engine.scheduler.host_tier.check_invariants()


def test_recycled_host_slots_are_never_read(tiny_dir):
    """A host tier of 12 slots (evicting constantly): before every step, every slot no hash
    names is filled with NaN; any such slot restored into a sequence would turn its logits NaN
    and change its tokens."""
    plain = LLM(str(tiny_dir), **ENGINE)
    want, _ = _conversations(plain)
    page_bytes = plain.engine.cache.page_bytes
    llm = LLM(str(tiny_dir), kv_host_cache_gb=12.5 * page_bytes / 2 ** 30, **ENGINE)
    eng = llm.engine
    assert eng.host_kv.slots == 12
    real_schedule = eng._schedule

    def poisoning():
        plan = real_schedule()
        eng.host_kv.land(needed=range(eng.host_kv.slots))  # every queued copy
        free = eng.scheduler.host_tier.free_slots()
        for host in eng.host_kv.arrays:
            host[:, free] = np.nan
        return plan

    eng._schedule = poisoning
    got, st = _conversations(llm)
    assert got == want
    assert st["kv_host_pages_evicted"] > 0 and st["kv_host_pages_restored"] > 0


def test_host_tier_metrics_are_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxinfer.serve.metrics import _StatsCollector

    stats = {"queue_depth": 0, "running": 0, "max_slots": 2, "pages_used": 1, "pages_free": 22,
             "pages_total": 23, "in_flight": 0, "compile_count": 3, "healthy": True,
             "spec_proposed": 0, "spec_accepted": 0, "tokens_generated": 5, "steps": 2,
             "requests": {}, "kv_host_slots": 12, "kv_host_bytes_used": 4096,
             "kv_host_pages_offloaded": 7, "kv_host_pages_restored": 3,
             "kv_host_pages_evicted": 1, "kv_host_restore_s_per_page_p50": 0.002}
    reg = CollectorRegistry()
    reg.register(_StatsCollector(type("Loop", (), {"stats": lambda self: stats})()))
    text = generate_latest(reg).decode()
    for line in ("jaxinfer_kv_host_bytes_used 4096.0", "jaxinfer_kv_host_pages_offloaded_total 7.0",
                 "jaxinfer_kv_host_pages_restored_total 3.0",
                 "jaxinfer_kv_host_restore_seconds_per_page_p50 0.002"):
        assert line in text, line


@pytest.mark.parametrize("gib, why", [(1e-9, "holds no KV page"),
                                      (1e7, "more than half of this host's")])
def test_host_tier_sizes_that_cannot_work_name_the_option(tiny_dir, gib, why):
    from jaxinfer.runtime.config import OptionError

    with pytest.raises(OptionError, match=f"^kv_host_cache_gb .*{why}"):
        LLM(str(tiny_dir), kv_host_cache_gb=gib, **ENGINE)
