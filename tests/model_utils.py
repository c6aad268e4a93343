"""Helpers for model tests: run whole sequences through the paged forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device.attention import AttentionMetadata
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import forward


def single_sequence_metadata(start: int, num_tokens: int, page_size: int, pages: list[int],
                             all_logits: bool = True, rows: int | None = None) -> AttentionMetadata:
    """Metadata for one sequence computing tokens [start, start + num_tokens) in `pages`.
    rows: token rows of the step (>= num_tokens); rows past the sequence are padding (position 0,
    written to the null page's slot 0) as the engine pads a step, so nearby lengths share one
    compiled program. With all_logits, logits of every row (padding rows' are meaningless)."""
    rows = num_tokens if rows is None else rows
    pos = np.zeros(rows, np.int64)
    pos[:num_tokens] = np.arange(start, start + num_tokens)
    slots = np.asarray(pages)[pos // page_size] * page_size + pos % page_size
    slots[num_tokens:] = 0
    return AttentionMetadata(
        positions=jnp.asarray(pos, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
        kv_lens=jnp.asarray([start + num_tokens], jnp.int32),
        page_indices=jnp.asarray([pages], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.arange(rows if all_logits else 1, dtype=jnp.int32)
        + (0 if all_logits else num_tokens - 1),
        max_q_len=rows,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _fwd(params, tokens, cache, md, cfg, backend):
    return forward(params, tokens, cache, md, cfg, backend)


def run_sequence(params, cfg, tokens, *, page_size=16, backend="xla", decode_steps=0,
                 cache_dtype=jnp.float32, bucket=16):
    """Prefill `tokens` (all logits) then greedy-decode `decode_steps` tokens one at a time.
    Returns (prefill_logits [T, V], decoded_ids, decode_logits [n, V]).

    The prefill's rows are padded to a multiple of `bucket` and the cache's pages to a power of
    two, so sequences of nearby lengths run the same compiled programs."""
    tokens = list(tokens)
    n = len(tokens)
    total = n + decode_steps
    n_pages = 1 << (-(-total // page_size) - 1).bit_length()
    pages = list(range(1, n_pages + 1))
    cache = init_cache(cfg, n_pages + 1, page_size, cache_dtype)
    rows = -(-n // bucket) * bucket
    md = single_sequence_metadata(0, n, page_size, pages, rows=rows)
    padded = jnp.asarray(tokens + [0] * (rows - n), jnp.int32)
    logits, cache = _fwd(params, padded, cache, md, cfg, backend)
    logits = logits[:n]
    out, dec_logits = [], []
    last = logits[-1]
    for i in range(decode_steps):
        nxt = int(jnp.argmax(last))
        out.append(nxt)
        md = single_sequence_metadata(n + i, 1, page_size, pages)
        lg, cache = _fwd(params, jnp.asarray([nxt], jnp.int32), cache, md, cfg, backend)
        last = lg[0]
        dec_logits.append(np.asarray(last))
    return np.asarray(logits), out, np.asarray(dec_logits)


def assert_same_logits(params, other, cfg, *, seed: int = 0, n: int = 20, rtol: float = 1e-5):
    """Prefill logits of `params` and `other` over n random tokens agree (rtol, and atol rtol
    times their max |value|): the same function computed two ways."""
    toks = list(np.random.default_rng(seed).integers(3, cfg.vocab_size, n))
    a, _, _ = run_sequence(params, cfg, toks, page_size=8)
    b, _, _ = run_sequence(other, cfg, toks, page_size=8)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def greedy_batch(params, cfg, prompts, *, decode_steps, page_size=16, backend="xla",
                 cache_dtype=jnp.float32, bucket=16):
    """Greedy-decode `decode_steps` tokens after each of `prompts`, all in one batch as the
    engine lays out a step: one prefill step packing every prompt (rows padded to a multiple of
    `bucket`), then one step per token for every sequence. Returns the decoded ids per prompt.

    A batched step reads the weights once for all the sequences, where run_sequence reads them
    once per sequence and token."""
    s = len(prompts)
    lens = np.asarray([len(p) for p in prompts])
    per_seq = -(-(int(lens.max()) + decode_steps) // page_size)
    pages = np.arange(1, s * per_seq + 1).reshape(s, per_seq)
    cache = init_cache(cfg, s * per_seq + 1, page_size, cache_dtype)

    def step(tokens, starts, counts, rows):
        pos = np.zeros(rows, np.int64)
        slots = np.zeros(rows, np.int64)  # padding rows write the null page's slot 0
        cu = np.concatenate([[0], np.cumsum(counts)])
        for i in range(s):
            p = np.arange(starts[i], starts[i] + counts[i])
            pos[cu[i]: cu[i + 1]] = p
            slots[cu[i]: cu[i + 1]] = pages[i][p // page_size] * page_size + p % page_size
        md = AttentionMetadata(
            positions=jnp.asarray(pos, jnp.int32),
            slot_mapping=jnp.asarray(slots, jnp.int32),
            cu_q_lens=jnp.asarray(cu, jnp.int32),
            kv_lens=jnp.asarray(starts + counts, jnp.int32),
            page_indices=jnp.asarray(pages, jnp.int32),
            num_seqs=jnp.asarray([s], jnp.int32),
            logits_indices=jnp.asarray(cu[1:] - 1, jnp.int32),  # each sequence's last row
            max_q_len=rows,
        )
        padded = jnp.asarray(list(tokens) + [0] * (rows - len(tokens)), jnp.int32)
        nonlocal cache
        logits, cache = _fwd(params, padded, cache, md, cfg, backend)
        return [int(t) for t in np.asarray(jnp.argmax(logits, -1))]

    rows = -(-int(lens.sum()) // bucket) * bucket
    nxt = step([t for p in prompts for t in p], np.zeros(s, np.int64), lens, rows)
    out = [[t] for t in nxt]
    for i in range(1, decode_steps):
        nxt = step(nxt, lens + i - 1, np.ones(s, np.int64), s)
        for o, t in zip(out, nxt):
            o.append(t)
    return out
