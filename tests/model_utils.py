"""Helpers for model tests: run whole sequences through the paged forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.attention import AttentionMetadata
from jaxinfer.runtime.kv_cache import init_cache
from jaxinfer.runtime.model import forward


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
