"""The draft model's step for speculative decoding (runtime/proposers.py drives it): one ragged
forward of the draft model that picks each row's proposal, greedy or sampled.

A draft model draws its own proposal for the token at position t with fold_in(key(seed, t), 3)
(the other fold-ins of that key: runtime/device/sampling.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.runtime.device.attention import AttentionMetadata
from jaxinfer.runtime.device.model import forward
from jaxinfer.runtime.device.sampling import gumbel_pick, probs_of, row_argmax, row_keys


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
    greedy = row_argmax(logits)
    if not want_q:
        return greedy, None, cache
    q = probs_of(logits, arrays["temperature"], arrays["top_k"], arrays["top_p"], arrays["min_p"],
                 filtered=filtered)
    keys = row_keys(arrays["seeds"], arrays["sample_positions"])
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys)
    drawn = gumbel_pick(keys, jnp.log(q))
    return jnp.where(arrays["temperature"] > 0, drawn, greedy), q, cache
