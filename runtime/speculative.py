"""Speculative decoding: proposers (draft model, n-gram prompt lookup) and the acceptance rule.

One step of speculation for every decoding sequence at once:
  1. a proposer guesses up to k next tokens per sequence (`Proposer.propose`);
  2. the scheduler plans q_len = 1 + d rows for it (its last token + d proposals), the target runs
     one ragged forward with logits at all 1 + d positions (`steps.verify`);
  3. `accept` decides on the device, for all rows at once, how many proposals stand and which
     token follows them; the scheduler advances each sequence by its own count and rolls back
     the KV of rejected tokens by lengths (`Scheduler.update(..., num_accepted=...)`).

Acceptance (Leviathan et al. / Chen et al.): greedy rows keep the longest prefix agreeing with
the target's argmax, then emit the target's argmax. Sampled rows accept proposal x with
probability min(1, p(x)/q(x)) (p, q = the target's / proposer's distributions after the row's
temperature, top-k, top-p, min-p), on the first rejection sample from normalized max(0, p - q),
and if all d are accepted sample a bonus token from p. The emitted tokens are then distributed
exactly as the target's. A deterministic proposer (n-gram) has q = one-hot(x): accept with
probability p(x), on rejection sample from p without x.

Randomness keeps the engine's rule: the key of a token derives from (seed, position) only. The
token at position t uses key(seed, t) when drawn from p (so a bonus token equals what plain
decoding draws), fold_in(key, 1) for the accept test, fold_in(key, 2) for the residual draw and
fold_in(key, 3) for a draft model's own proposal draw.

The n-gram proposer is host numpy. The draft model keeps its own paged KV cache, page allocator
and a per-request *shadow* (the token ids whose K/V its cache holds). Before proposing it cuts the
shadow to the longest common prefix with the sequence's real tokens, so whatever the target
accepted, rejected, or recomputed after preemption, the draft recomputes exactly what changed
("catch-up", one ragged call for all sequences), then runs k - 1 single-token calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.attention import AttentionMetadata
from jaxinfer.runtime.config import SpecConfig, parse_speculative  # noqa: F401 (re-exported)
from jaxinfer.runtime.kv_cache import init_cache
from jaxinfer.runtime.model import forward
from jaxinfer.runtime.page_allocator import PageAllocator
from jaxinfer.runtime.plan import empty_step_arrays
from jaxinfer.runtime.sampling import filter_logits, row_keys

# config: runtime.config.SpecConfig / parse_speculative (pure Python, validated there)


# ---------------------------------------------------------------------------------- proposals


@dataclass
class DraftRequest:
    """A decoding sequence that may receive proposals this step (from Scheduler.decode_candidates)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs
    max_draft: int  # proposals it can use (k, less near max_tokens)
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float


@dataclass
class Proposals:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> proposals
    # draft model, sampled rows: the proposer's distributions on the device [S, K, V] and the
    # row of each request in it (None: deterministic proposals, q = one-hot)
    q_probs: jax.Array | None = None
    q_rows: dict[str, int] = field(default_factory=dict)


class Proposer:
    k: int

    def propose(self, reqs: list[DraftRequest]) -> Proposals:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop any state kept for it."""

    compile_count = 0  # programs compiled by the proposer (none without a model)

    def warmup(self) -> None:
        """Compile every program shape `propose` can run."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = n_max down to
    1) in prompt + outputs and propose the tokens that followed it (up to k)."""

    def __init__(self, k: int, n: int):
        self.k, self.n = k, n

    def lookup(self, tokens, k: int) -> list[int]:
        toks = np.asarray(tokens, np.int64)
        L = len(toks)
        for n in range(min(self.n, L - 1), 0, -1):
            suffix = toks[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(toks[: L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the latest earlier match
                return toks[start:start + k].tolist()
        return []

    def propose(self, reqs: list[DraftRequest]) -> Proposals:
        out = Proposals()
        for r in reqs:
            got = self.lookup(r.token_ids, min(self.k, r.max_draft))
            if got:
                out.tokens[r.request_id] = got
        return out


# ---------------------------------------------------------------------------------- acceptance


def probs_of(logits, temperature, top_k, top_p, min_p, *, filtered: bool):
    """Row distributions after temperature and filtering. logits [..., V] with row params [...]."""
    shape = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0)[..., None]
    scaled = logits / t
    if filtered:
        flat = scaled.reshape(-1, shape[-1])
        bc = lambda a: jnp.broadcast_to(a, shape[:-1]).reshape(-1)  # noqa: E731
        scaled = filter_logits(flat, bc(top_k), bc(top_p), bc(min_p)).reshape(shape)
    return jax.nn.softmax(scaled, axis=-1)


def _gumbel_pick(keys, log_dist):
    """argmax(log_dist + Gumbel(key)) per row: one draw from the (unnormalized) distribution."""
    g = jax.vmap(lambda k: jax.random.gumbel(k, (log_dist.shape[-1],), jnp.float32))(keys)
    return jnp.argmax(log_dist + g, axis=-1).astype(jnp.int32)


def accept(
    logits: jax.Array,  # [S, K+1, V] f32 target logits at the last token and each proposal
    draft: jax.Array,  # [S, K] int32 proposals (entries >= num_draft ignored)
    num_draft: jax.Array,  # [S] int32 in 0..K
    q: jax.Array | None,  # [S, K, V] proposer distributions; None = one-hot(draft)
    temperature: jax.Array,  # [S]
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    seeds: jax.Array,  # [S] uint32
    positions: jax.Array,  # [S] position of the token predicted by logits[:, 0]
    *,
    filtered: bool,
) -> tuple[jax.Array, jax.Array]:
    """-> (num_accepted [S] int32, tokens [S, K+1] int32). Row s emits tokens[s, :num_accepted+1]
    (accepted proposals, then the correction or bonus token); later entries are -1."""
    S, K1, V = logits.shape
    K = K1 - 1
    rows = jnp.arange(S)
    greedy_row = temperature <= 0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    p = probs_of(logits, temperature[:, None], top_k[:, None], top_p[:, None], min_p[:, None],
                 filtered=filtered)  # [S, K+1, V]
    if q is None:
        q = jax.nn.one_hot(draft, V, dtype=jnp.float32)  # [S, K, V]
    pos = positions[:, None] + jnp.arange(K1)[None, :]  # [S, K+1]
    keys = row_keys(jnp.repeat(seeds, K1), pos.reshape(-1)).reshape(S, K1)  # [S, K+1]

    live = jnp.arange(K)[None, :] < num_draft[:, None]  # [S, K]
    safe_draft = jnp.where(live, draft, 0)
    px = jnp.take_along_axis(p[:, :K], safe_draft[..., None], axis=-1)[..., 0]  # [S, K]
    qx = jnp.take_along_axis(q, safe_draft[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys[:, :K])
    ok = jnp.where(greedy_row[:, None], safe_draft == argmax[:, :K], u * qx < px) & live
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [S]

    # the token after the accepted run: residual draw after a rejection, else a bonus from p
    rejected = n_acc < num_draft
    p_j = p[rows, n_acc]  # [S, V]
    q_j = jnp.concatenate([q, jnp.zeros((S, 1, V), q.dtype)], axis=1)[rows, n_acc]
    resid = jnp.maximum(p_j - q_j, 0.0)
    use_resid = rejected & (resid.sum(-1) > 0)  # (a rejection with zero residual has prob. 0)
    dist = jnp.where(use_resid[:, None], resid, p_j)
    key_j = keys[rows, n_acc]
    key_j = jnp.where(use_resid, jax.vmap(lambda k: jax.random.fold_in(k, 2))(key_j), key_j)
    drawn = _gumbel_pick(key_j, jnp.log(dist))
    final = jnp.where(greedy_row, argmax[rows, n_acc], drawn)

    j = jnp.arange(K1)[None, :]
    padded = jnp.concatenate([draft, jnp.zeros((S, 1), draft.dtype)], axis=1)
    tokens = jnp.where(j < n_acc[:, None], padded, jnp.where(j == n_acc[:, None], final[:, None], -1))
    return n_acc, tokens.astype(jnp.int32)


# ---------------------------------------------------------------------------------- draft model


def draft_step(params, cache, arrays, *, cfg, backend, max_q_len, filtered, want_q):
    """One draft forward over a ragged plan: -> (tokens [S], q [S, V] or None, cache). Greedy rows
    take the argmax; sampled rows draw from q with key fold_in(key(seed, pos), 3)."""
    md = AttentionMetadata(
        positions=arrays["positions"], slot_mapping=arrays["slot_mapping"],
        cu_q_lens=arrays["cu_q_lens"], kv_lens=arrays["kv_lens"],
        page_indices=arrays["page_indices"], num_seqs=arrays["num_seqs"],
        logits_indices=arrays["logits_indices"], max_q_len=max_q_len,
    )
    logits, cache = forward(params, arrays["token_ids"], cache, md, cfg, backend)  # [S, V]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not want_q:
        return greedy, None, cache
    q = probs_of(logits, arrays["temperature"], arrays["top_k"], arrays["top_p"], arrays["min_p"],
                 filtered=filtered)
    keys = row_keys(arrays["seeds"], arrays["sample_positions"])
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys)
    drawn = _gumbel_pick(keys, jnp.log(q))
    return jnp.where(arrays["temperature"] > 0, drawn, greedy), q, cache


def _pow2(lo: int, n: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


@dataclass
class _Shadow:
    tokens: list[int] = field(default_factory=list)  # ids whose K/V the draft cache holds
    pages: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """A smaller (or the same) model sharing the target's vocabulary, with its own paged cache.
    All proposing sequences run together: one ragged catch-up call, then k - 1 decode calls."""

    def __init__(self, cfg, params, *, k: int, max_slots: int, page_size: int, num_pages: int,
                 max_model_len: int, token_budget: int, backend: str, dtype=jnp.float32):
        self.cfg, self.params, self.k = cfg, params, k
        self.S, self.ps, self.budget = max_slots, page_size, max(token_budget, max_slots)
        self.max_pages = -(-(max_model_len + k) // page_size)
        self.allocator = PageAllocator(num_pages)
        self.cache = init_cache(cfg, num_pages, page_size, dtype)
        self.shadows: dict[str, _Shadow] = {}
        self._step = jax.jit(
            functools.partial(draft_step, cfg=cfg, backend=backend),
            static_argnames=("max_q_len", "filtered", "want_q"), donate_argnames=("cache",),
        )

    @property
    def compile_count(self) -> int:
        return self._step._cache_size()

    def warmup(self) -> None:
        """Every (T, P, max_q_len) shape `_run` can make, greedy (want_q False): T powers of two
        from 16 to the budget's, P powers of two capped at max_pages, max_q_len T, or 1 when T
        is small enough for one token per row."""
        S, t_hi = self.S, _pow2(16, self.budget)
        T = 16
        while T <= t_hi:
            P = 1
            while True:
                p = min(P, self.max_pages)
                a = empty_step_arrays(T, S, p, num_seqs=S)
                for q in sorted({T} | ({1} if T <= _pow2(16, S) else set())):
                    self.cache = self._step(self.params, self.cache, a, max_q_len=q,
                                            filtered=False, want_q=False)[2]
                if p == self.max_pages:
                    break
                P *= 2
            T *= 2

    def release(self, request_id: str) -> None:
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.allocator.free(reversed(sh.pages))

    def _ensure_pages(self, sh: _Shadow, n_tokens: int, keep: set[str]) -> bool:
        need = -(-n_tokens // self.ps) - len(sh.pages)
        if need <= 0:
            return True
        got = self.allocator.allocate(need)
        if got is None:  # make room: drop shadows of sequences not proposing this step
            for rid in [r for r in self.shadows if r not in keep]:
                self.release(rid)
            got = self.allocator.allocate(need)
            if got is None:
                return False
        sh.pages.extend(got)
        return True

    def _run(self, rows, reqs, want_q, filtered):
        """rows: [(row index, shadow, new tokens)] -> (tokens [S] host, q [S, V] device|None).
        Each row computes its new tokens after its shadow and samples at the last one."""
        ps = self.ps
        T = _pow2(16, sum(len(t) for _, _, t in rows))
        P = min(_pow2(1, max(len(sh.pages) for _, sh, _ in rows)), self.max_pages)
        S = self.S
        a = empty_step_arrays(T, S, P, num_seqs=S)
        by_row = {i: (sh, t) for i, sh, t in rows}
        t0 = 0
        for i in range(S):  # rows in fixed order; absent rows get q_len 0
            if i in by_row:
                sh, new = by_row[i]
                start, n = len(sh.tokens), len(new)
                pos = np.arange(start, start + n)
                a["token_ids"][t0:t0 + n] = new
                a["positions"][t0:t0 + n] = pos
                a["slot_mapping"][t0:t0 + n] = np.asarray(sh.pages)[pos // ps] * ps + pos % ps
                a["page_indices"][i, :len(sh.pages)] = sh.pages
                a["kv_lens"][i] = start + n
                a["logits_indices"][i] = t0 + n - 1
                r = reqs[i]
                a["temperature"][i], a["top_k"][i] = r.temperature, r.top_k
                a["top_p"][i], a["min_p"][i], a["seeds"][i] = r.top_p, r.min_p, r.seed
                a["sample_positions"][i] = start + n
                sh.tokens.extend(int(x) for x in new)
                t0 += n
            a["cu_q_lens"][i + 1] = t0
        max_q = 1 if all(len(t) == 1 for _, _, t in rows) else T
        toks, q, self.cache = self._step(self.params, self.cache, a, max_q_len=max_q,
                                         filtered=filtered, want_q=want_q)
        return np.asarray(jax.device_get(toks)), q

    def propose(self, reqs: list[DraftRequest]) -> Proposals:
        reqs = [r for r in reqs if r.max_draft > 0][: self.S]
        out = Proposals()
        if not reqs:
            return out
        keep = {r.request_id for r in reqs}
        want_q = any(r.temperature > 0 for r in reqs)
        filtered = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1 or r.min_p > 0)
                       for r in reqs)
        # cut each shadow to what still matches the real tokens (never past the last token)
        todo = {}
        for i, r in enumerate(reqs):
            sh = self.shadows.setdefault(r.request_id, _Shadow())
            toks = r.token_ids
            m = min(len(sh.tokens), len(toks) - 1)
            lcp = 0
            while lcp < m and sh.tokens[lcp] == toks[lcp]:
                lcp += 1
            del sh.tokens[lcp:]
            todo[i] = toks[lcp:]
        # catch-up: computes up to each last token; its logits give proposal 1
        props: dict[int, list[int]] = {i: [] for i in todo}
        q1 = None
        while todo:
            rows, budget = [], self.budget
            for i in list(todo):
                sh, rest = self.shadows[reqs[i].request_id], todo[i]
                n = min(len(rest), budget)
                if n <= 0:
                    break
                if not self._ensure_pages(sh, len(sh.tokens) + n + self.k, keep):
                    del todo[i], props[i]
                    continue
                rows.append((i, sh, rest[:n]))
                budget -= n
                todo[i] = rest[n:]
            if not rows:
                break
            toks, q = self._run(rows, reqs, want_q, filtered)
            done = [i for i, _, _ in rows if not todo[i]]
            for i in done:
                props[i].append(int(toks[i]))
                del todo[i]
            if want_q:
                mask = np.zeros(self.S, bool)
                mask[done] = True
                q1 = q if q1 is None else jnp.where(jnp.asarray(mask)[:, None], q, q1)
        qs = [q1]
        for j in range(1, self.k):  # feed proposal j, get proposal j + 1
            rows = [(i, self.shadows[reqs[i].request_id], [p[-1]]) for i, p in props.items()
                    if len(p) == j and reqs[i].max_draft > j]
            if not rows:
                break
            toks, q = self._run(rows, reqs, want_q, filtered)
            for i, _, _ in rows:
                props[i].append(int(toks[i]))
            qs.append(q)
        for i, p in props.items():
            if p:
                out.tokens[reqs[i].request_id] = p[: reqs[i].max_draft]
                out.q_rows[reqs[i].request_id] = i
        if want_q and out.tokens:
            while len(qs) < self.k:
                qs.append(jnp.zeros_like(qs[0]))
            out.q_probs = jnp.stack(qs, axis=1)  # [S, K, V]
        return out


def check_vocab(target_cfg, draft_cfg, what: str) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"speculative draft model {what} has vocab size {draft_cfg.vocab_size}, the target has "
            f"{target_cfg.vocab_size}: a draft must share the target's tokenizer and vocabulary"
        )
