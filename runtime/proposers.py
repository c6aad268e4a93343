"""Speculative decoding: the proposers (draft model, n-gram prompt lookup).

One step of speculation for every decoding sequence at once:
  1. a proposer guesses up to k next tokens per sequence (`Proposer.propose`);
  2. the scheduler plans q_len = 1 + d rows for it (its last token + d proposals), the target runs
     one ragged forward with logits at all 1 + d positions (`steps.verify`);
  3. `sampling.accept` decides on the device, for all rows at once, how many proposals stand and
     which token follows them; the scheduler advances each sequence by its own count and rolls
     back the KV of rejected tokens by lengths (`Scheduler.update(..., num_accepted=...)`).

A draft model draws its own proposal for the token at position t with fold_in(key(seed, t), 3)
(the other fold-ins of that key: runtime/device/sampling.py).

The n-gram proposer is host numpy. The draft model keeps its own paged KV cache, page allocator
and a per-request *shadow* (the token ids whose K/V its cache holds). Before proposing it cuts the
shadow to the longest common prefix with the sequence's real tokens, so whatever the target
accepted, rejected, or recomputed after preemption, the draft recomputes exactly what changed
("catch-up", one ragged call for all sequences), then runs k - 1 single-token calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.host.page_allocator import PageAllocator
from jaxinfer.runtime.plan import STEP_GROUPS, bucket, padding_arrays, pow_buckets
from jaxinfer.runtime.device.speculative import draft_step
from jaxinfer.runtime.device.steps import Launches, shared_jit

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


# ---------------------------------------------------------------------------------- draft model

@dataclass
class _Shadow:
    tokens: list[int] = field(default_factory=list)  # ids whose K/V the draft cache holds
    pages: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """A smaller (or the same) model sharing the target's vocabulary, with its own paged cache.
    All proposing sequences run together: one ragged catch-up call, then k - 1 decode calls."""

    def __init__(self, cfg, params, *, k: int, max_slots: int, page_size: int, num_pages: int,
                 token_budget: int, backend: str, page_buckets: tuple[int, ...],
                 dtype=jnp.float32):
        self.cfg, self.params, self.k = cfg, params, k
        self.S, self.ps, self.budget = max_slots, page_size, max(token_budget, max_slots)
        self.page_buckets = page_buckets  # page-table widths, the last one a shadow's most pages
        self.allocator = PageAllocator(num_pages)
        self.cache = init_cache(cfg, num_pages, page_size, dtype)
        self.shadows: dict[str, _Shadow] = {}
        self._step = Launches(shared_jit(draft_step, ("max_q_len", "filtered", "want_q"),
                                         cfg=cfg, backend=backend))

    @property
    def compile_count(self) -> int:
        return self._step.count

    def warmup(self) -> None:
        """Every (T, P, max_q_len) shape `_run` can make, greedy (want_q False): T powers of two
        from 16 to the budget's, P from page_buckets, max_q_len T, or 1 when T is small enough
        for one token per row."""
        S = self.S
        for T in pow_buckets(16, self.budget):
            for P in self.page_buckets:
                a = padding_arrays(STEP_GROUPS, T=T, S=S, P=P, num_seqs=S)
                for q in sorted({T} | ({1} if T <= pow_buckets(16, S)[-1] else set())):
                    self.cache = self._step(self.params, self.cache, a, max_q_len=q,
                                            filtered=False, want_q=False)[2]

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
        T = pow_buckets(16, sum(len(t) for _, _, t in rows))[-1]
        P = bucket(self.page_buckets, max(len(sh.pages) for _, sh, _ in rows))
        S = self.S
        a = padding_arrays(STEP_GROUPS, T=T, S=S, P=P, num_seqs=S)
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
