"""Speculative sampling preserves the target's distribution.

1. The acceptance rule on explicit distributions: 20k independent rows (distinct seeds) through
   `runtime.device.sampling.accept` in one vmapped call; the empirical distribution of the first
   emitted token must match p exactly (TV distance under a stated bound), and so must the second
   token given the first proposal was accepted — for a good draft, a deliberately bad draft (q far
   from p), and a deterministic (n-gram, one-hot q) draft; with temperature and top-k filtering.
   A negative control shows the statistic detects a wrong rule.
2. End to end through the Engine on a tiny-vocabulary (V = 16) random model with a bad draft
   model: the marginal distributions of generated tokens 2 and 3 (both produced by verify steps)
   match the exact target marginals computed by enumeration.

Bound: for N draws over V outcomes, E[TV] <= 0.5 * sum_i sqrt(p_i / N) <= 0.5 * sqrt(V / N).
With V = 12, N = 20000 that is 0.012; we assert TV < 0.03 (a > 4-sigma margin, ~never flakes;
the seeds are fixed anyway, so the test is deterministic).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime.config import EngineConfig, ModelConfig
from jaxinfer.runtime.host.requests import SamplingParams
from jaxinfer.runtime.build import prepare
from jaxinfer.runtime.engine import Engine
from jaxinfer.runtime.device.model import init_params
from jaxinfer.runtime.device.sampling import accept, probs_of
from jaxinfer.runtime.host.tokenizer import Tokenizer

V, K, N = 12, 3, 20_000
BOUND = 0.03


def tv(counts, p):
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def _dist(rng, sharp):
    x = rng.normal(size=V) * sharp
    return np.exp(x) / np.exp(x).sum()


def _run_accept(p_logits, q, draft, temperature=1.0, top_k=0):
    """p_logits [K+1, V] shared by all rows; q [K, V] or None; draft [N, K]."""
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (N, K + 1, V))
    qq = None if q is None else jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, K, V))
    full = lambda v, dt: jnp.full((N,), v, dt)  # noqa: E731
    fn = jax.jit(accept, static_argnames=("filtered",))
    n_acc, toks = fn(logits, jnp.asarray(draft, jnp.int32), full(K, jnp.int32), qq,
                     full(temperature, jnp.float32), full(top_k, jnp.int32), full(1.0, jnp.float32),
                     full(0.0, jnp.float32), jnp.arange(N, dtype=jnp.uint32) * 7919 + 1,
                     full(5, jnp.int32), filtered=top_k > 0)
    return np.asarray(n_acc), np.asarray(toks)


def _target(p_logits, temperature=1.0, top_k=0):
    lg = jnp.asarray(p_logits, jnp.float32)
    return np.asarray(probs_of(lg, jnp.full((K + 1,), temperature), jnp.full((K + 1,), top_k),
                               jnp.ones(K + 1), jnp.zeros(K + 1), filtered=top_k > 0))


def _check(p, n_acc, toks, second_too=True):
    first = np.bincount(toks[:, 0], minlength=V)
    assert tv(first, p[0]) < BOUND
    second = np.bincount(toks[n_acc >= 1, 1], minlength=V)  # given proposal 1 stood
    m = second.sum()
    if second_too:
        assert m > 500
        assert tv(second, p[1]) < 2 * 0.5 * np.sqrt(V / m)  # 2x the mean-TV bound for m draws
    # emitted tokens: a + 1 valid, then -1
    j = np.arange(K + 1)[None]
    assert ((toks >= 0) == (j <= n_acc[:, None])).all()


@pytest.mark.parametrize("case", ["good", "bad", "bad_t07_topk5"])
def test_rejection_sampling_matches_target_with_draft_distribution(case):
    rng = np.random.default_rng(0)
    p_logits = rng.normal(size=(K + 1, V)) * 1.5
    temperature, top_k = (0.7, 5) if case == "bad_t07_topk5" else (1.0, 0)
    p = _target(p_logits, temperature, top_k)
    if case == "good":
        q = 0.7 * p[:K] + 0.3 / V
    else:  # far from p: mass where p has little
        q = np.stack([np.exp(-3 * p[i] * V) for i in range(K)])
        q /= q.sum(-1, keepdims=True)
        assert 0.5 * np.abs(q - p[:K]).sum(-1).min() > 0.4
    draft = np.stack([rng.choice(V, size=N, p=q[i]) for i in range(K)], axis=1)
    n_acc, toks = _run_accept(p_logits, q, draft, temperature, top_k)
    _check(p, n_acc, toks)
    if case == "good":
        assert n_acc.mean() > 1.0  # a close draft is mostly accepted
    else:
        assert n_acc.mean() < 0.6
    # negative control: emitting the proposals as they are would fail the same bound
    assert tv(np.bincount(draft[:, 0], minlength=V), p[0]) > 5 * BOUND or case == "good"


def test_rejection_sampling_matches_target_with_point_mass_proposals():
    """Deterministic (n-gram) proposals: accept x with prob p(x), else sample p without x."""
    rng = np.random.default_rng(1)
    p_logits = rng.normal(size=(K + 1, V)) * 1.5
    p = _target(p_logits)
    for draft_tok in (int(np.argmax(p[0])), int(np.argmin(p[0]))):  # a likely and an unlikely guess
        draft = np.tile(np.array([draft_tok, int(np.argmax(p[1])), 0]), (N, 1))
        n_acc, toks = _run_accept(p_logits, None, draft)
        _check(p, n_acc, toks, second_too=draft_tok == int(np.argmax(p[0])))
        assert abs((n_acc >= 1).mean() - p[0, draft_tok]) < 0.02  # accepted with prob p(x)


def test_greedy_rows_take_longest_agreeing_prefix_then_target_token():
    lg = np.full((3, K + 1, V), -5.0, np.float32)
    best = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]]
    for s in range(3):
        for j in range(K + 1):
            lg[s, j, best[s][j]] = 5.0
    draft = np.array([[1, 2, 3], [5, 0, 7], [1, 10, 11]], np.int32)
    nd = np.array([3, 3, 2], np.int32)
    z = jnp.zeros(3)
    n_acc, toks = accept(jnp.asarray(lg), jnp.asarray(draft), jnp.asarray(nd), None, z,
                         jnp.zeros(3, jnp.int32), jnp.ones(3), z, jnp.arange(3, dtype=jnp.uint32),
                         jnp.zeros(3, jnp.int32), filtered=False)
    assert np.asarray(n_acc).tolist() == [3, 1, 0]
    assert np.asarray(toks).tolist() == [[1, 2, 3, 4], [5, 6, -1, -1], [9, -1, -1, -1]]


def test_statistic_detects_a_wrong_rule():
    """Control: accepting every proposal of a bad draft is caught by the same bound."""
    rng = np.random.default_rng(2)
    p = _target(rng.normal(size=(K + 1, V)) * 1.5)
    q = np.roll(p[0], 3)
    wrong = np.bincount(rng.choice(V, size=N, p=q), minlength=V)
    assert tv(wrong, p[0]) > 5 * BOUND


# ------------------------------------------------------------------------ end to end (engine)


class _IdTokenizer(Tokenizer):
    vocab_size, bos_id, eos_ids, add_bos = 16, None, (), False

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + int(i)) for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 65 for c in text]


TINY = ModelConfig(family="llama", vocab_size=16, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)


def _exact_marginals(params, prompt):
    """p(x1), p(x2), p(x3) of the target at temperature 1 by enumeration (V^2 = 256 sequences)."""
    from tests.model_utils import run_sequence

    def nxt(seq):
        lg, _, _ = run_sequence(params, TINY, seq, page_size=8)
        e = np.exp(lg[-1] - lg[-1].max())
        return e / e.sum()

    p1 = nxt(prompt)
    p2_given = np.stack([nxt(prompt + [a]) for a in range(16)])  # [x1, x2]
    p2 = p1 @ p2_given
    p3 = np.zeros(16)
    for a in range(16):
        for b in range(16):
            p3 += p1[a] * p2_given[a, b] * nxt(prompt + [a, b])
    return p1, p2, p3


def test_engine_speculative_sampling_matches_exact_target_marginals():
    target = init_params(TINY, jax.random.key(0), scale=0.5)
    draft = init_params(TINY, jax.random.key(1), scale=0.5)  # a bad draft: unrelated weights
    prompt = [3, 1, 4, 1, 5]
    p1, p2, p3 = _exact_marginals(target, prompt)
    ecfg = EngineConfig(max_slots=32, page_size=8, max_model_len=32, prefill_chunk=256,
                        enable_prefix_caching=True,
                        speculative={"method": "draft", "model": "bad-draft", "k": 3})
    eng = Engine(prepare(TINY, target, _IdTokenizer(), ecfg, draft=(TINY, draft)))
    n = 4000
    for i in range(n):
        eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=i,
                                               ignore_eos=True), request_id=f"r{i}")
    done = {}
    while eng.num_unfinished:
        done |= {d.request_id: d.output for d in eng.step() if d.finished}
    toks = np.array([done[f"r{i}"].token_ids for i in range(n)])
    assert toks.shape == (n, 5)
    bound = 0.5 * np.sqrt(16 / n) * 1.6  # 0.05 (mean TV is < 0.5 sqrt(V/N) = 0.032)
    for j, p in enumerate((p1, p2, p3)):
        assert tv(np.bincount(toks[:, j], minlength=16), p) < bound, j
    q1 = _exact_marginals(draft, prompt)[1]
    assert 0.5 * np.abs(q1 - p2).sum() > 3 * bound  # the draft really is far from the target
    sch = eng.scheduler
    assert sch.free_pages == sch.allocator.num_total and sch.num_running == 0
    assert eng.proposer.allocator.num_free == eng.proposer.allocator.num_total
