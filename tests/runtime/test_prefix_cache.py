"""Prefix caching end to end on a random-init tiny Llama: outputs identical with and without it
(greedy and seeded sampling, under preemption and eviction), cached_tokens in usage, and
NaN-poisoned free pages that must never leak into any output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

PS = 8  # page size used throughout


def _workload(tok):
    """Prompts (token id lists) over two shared system prompts plus a few unrelated ones."""
    sys_a = tok.encode("You are a helpful assistant who answers in the style of Shakespeare. " * 2)
    sys_b = tok.encode("Summarise the following passage in one short line, plainly: ")
    suffixes = ["To be, or not to be", "Hello there", "What light through yonder window breaks?",
                "Cry havoc", "Out, damned spot!", "All the world's a stage", "O Romeo",
                "Et tu, Brute?"]
    prompts = []
    for i, s in enumerate(suffixes):
        prompts.append((sys_a if i % 2 == 0 else sys_b) + tok.encode(s))
    prompts += [tok.encode("Now is the winter of our discontent"), tok.encode("Good night")]
    prompts.append(list(sys_a))  # exactly the system prompt: its last token is still computed
    assert len(sys_a) >= 4 * PS and len(sys_b) >= 2 * PS
    return prompts


def _params(n, sampled):
    if sampled:
        return [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=100 + i,
                               ignore_eos=True, logprobs=2) for i in range(n)]
    return [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)] * n


def _engine_opts(**kw):
    opts = dict(max_slots=4, page_size=PS, max_model_len=128, prefill_chunk=32)
    opts.update(kw)
    return opts


def _check_pool(llm):
    sch = llm.engine.scheduler
    sch.check_invariants()
    al = sch.allocator
    assert len(al.free_list) + al.num_cached == al.num_total  # nothing leaked or double-freed
    assert all(al.ref_count(p) == 0 for p in range(al.num_pages))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_pages", [None, 18], ids=["roomy", "pressure"])
def test_outputs_identical_with_and_without_prefix_caching(tiny_dir, llm_for, sampled,
                                                            num_pages):
    # `on` starts cold (its hit rate, preemptions and evictions are this test's); `off` keeps
    # nothing between requests, so it is shared
    on = LLM(str(tiny_dir), **_engine_opts(num_pages=num_pages))
    off = llm_for(tiny_dir, **_engine_opts(num_pages=num_pages, enable_prefix_caching=False))
    assert on.config.enable_prefix_caching and not off.config.enable_prefix_caching
    prompts = _workload(on.tokenizer)
    params = _params(len(prompts), sampled)
    # two rounds: the second finds the first round's pages cached (and, under pressure, evicts)
    for rnd in range(2):
        got = on.generate(prompts, params)
        want = off.generate(prompts, params)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, (rnd, g.prompt_token_ids)
            for lg, lw in zip(g.logprobs, w.logprobs):
                assert lg["logprob"] == pytest.approx(lw["logprob"], abs=1e-4)
            assert w.usage["cached_tokens"] == 0
            assert g.usage["cached_tokens"] % PS == 0
            assert g.usage["cached_tokens"] < len(g.prompt_token_ids)  # last token computed
            assert g.usage["cached_tokens"] == g.metrics["cached_tokens"]
        if rnd == 1:  # every prompt of >= 1 full page + 1 token was seen before
            for g in got:
                n = len(g.prompt_token_ids)
                if num_pages is None:
                    assert g.usage["cached_tokens"] == (n - 1) // PS * PS, n
        _check_pool(on)
        _check_pool(off)
    st = on.engine.scheduler.prefix_cache_stats()
    assert st["hit_rate"] > 0.3 and st["cached_tokens"] > 0
    assert off.engine.scheduler.prefix_cache_stats()["cached_tokens"] == 0
    if num_pages is not None:
        assert on.engine.scheduler.num_preemptions > 0 and st["evictions"] > 0


def _poison_unused_pages(llm, pages):
    """Fill `pages` of every floating K/V pool ([Hkv, N, ps, Dh]) with NaN."""
    eng = llm.engine
    n = eng.scheduler.allocator.num_pages
    idx = jnp.asarray(sorted(pages), jnp.int32)

    def poison(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 and x.shape[1] == n:
            return x.at[:, idx].set(jnp.nan)
        return x

    before = jax.tree.leaves(eng.cache)
    eng.cache = jax.tree.map(poison, eng.cache)
    poisoned = [y for x, y in zip(before, jax.tree.leaves(eng.cache)) if x is not y]
    assert poisoned, "no K/V pool found to poison"
    assert all(bool(jnp.isnan(y[:, idx]).all()) for y in poisoned)


def _finite(out):
    return all(np.isfinite(lp["logprob"]) and all(np.isfinite(v) for _, v in lp["top"])
               for lp in out.logprobs)


def test_nan_poisoned_free_pages_never_leak(tiny_dir, llm_for):
    """After each round, every page neither held nor cached is NaN-filled; the next round's
    requests (sharing cached prefixes, evicting and reusing pages) must match a fresh engine's
    outputs exactly, with finite logprobs. A page handed to a new sequence is only partly written,
    so any read of its stale/NaN remainder (or of a free page) would poison the logits."""
    opts = _engine_opts(num_pages=18)
    llm = LLM(str(tiny_dir), **opts)
    prompts = _workload(llm.tokenizer)
    rounds = [prompts[:6], prompts[3:] + prompts[:2], prompts[::-1]]
    for rnd, batch in enumerate(rounds):
        al = llm.engine.scheduler.allocator
        free = al.free_list  # truly free: no holder, no hash
        assert free and not set(free) & set(al.cached_list)
        _poison_unused_pages(llm, free)
        params = _params(len(batch), sampled=rnd == 1)
        got = llm.generate(batch, params)
        fresh = llm_for(tiny_dir, **dict(opts, enable_prefix_caching=False)).generate(batch,
                                                                                     params)
        for g, w in zip(got, fresh):
            assert _finite(g), (rnd, g.prompt_token_ids)
            assert g.token_ids == w.token_ids, (rnd, g.prompt_token_ids)
        if rnd > 0:
            assert sum(g.usage["cached_tokens"] for g in got) > 0
        _check_pool(llm)
    st = llm.engine.scheduler.prefix_cache_stats()
    assert st["evictions"] > 0 and llm.engine.scheduler.num_preemptions > 0


def test_nan_detector_works_on_a_shared_cached_page(tiny_dir):
    """Control for the test above: poisoning a page that IS shared (cached) does show up."""
    llm = LLM(str(tiny_dir), **_engine_opts())
    prompt = _workload(llm.tokenizer)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    clean = llm.generate([prompt], params)[0]
    assert _finite(clean)
    cached = llm.engine.scheduler.allocator.cached_list
    assert cached
    _poison_unused_pages(llm, cached)
    again = llm.generate([prompt], params)[0]
    assert again.usage["cached_tokens"] > 0
    assert not _finite(again)


def test_prefix_caching_flag_and_usage_keys(tiny_dir, llm_for):
    llm = llm_for(tiny_dir, **_engine_opts(enable_prefix_caching=False))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert set(out.usage) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert llm.engine.scheduler.enable_prefix_caching is False
