"""Teacher-forced logprobs as a pure function a trainer can call and differentiate.

    lp = sequence_logprobs(params, cfg, tokens)     # tokens [B, L] -> lp [B, L - 1] f32
    lp[b, t] = log p(tokens[b, t + 1] | tokens[b, :t + 1])

`params` in the model's own layout (LLM.get_weights(), runtime/weights.py) or the engine's form;
the same `model.forward` the engine's steps run, over a scratch paged cache of its own (B
sequences of L tokens, each in its own pages after the null page 0), on the XLA attention path
with a loop of static length (backend "xla_every_chunk": differentiable, jax.grad of a loss over
`lp` gives the params' gradients). Padding tokens past a
sequence's end are the caller's to mask: position t only sees tokens 0..t.

`LLM.logprob_fn()` binds it to an engine (its page size, page-table width, vocabulary). The
engine's rollouts and `LLM.score` agree with it within float tolerance (1e-5,
tests/runtime/test_weights.py); with batch_invariant=True (the model's own layout, fixed row
blocks, one query row per attention tile, the same KV chunks) bit for bit
(tests/runtime/test_batch_invariant.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.attention import batch_metadata
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import forward


def sequence_logprobs(params, cfg: ModelConfig, tokens: jax.Array, *, page_size: int = 16,
                      table_pages: int | None = None, vocab_limit: int | None = None
                      ) -> jax.Array:
    """tokens [B, L] int32 -> [B, L - 1] f32: each next token's logprob (see the module doc).
    `vocab_limit`: ids at or past it are never sampled (the engine's text vocabulary, when the
    model's is padded past the tokenizer's): left out of the softmax, as the engine does."""
    b, length = tokens.shape
    md, num_pages = batch_metadata(b, length, page_size, table_pages)
    dtype = params.final_norm.dtype
    cache = init_cache(cfg, num_pages, page_size, dtype)
    logits, _ = forward(params, tokens.reshape(-1).astype(jnp.int32), cache, md, cfg,
                        "xla_every_chunk")
    logits = logits.reshape(b, length, -1)[:, :-1]  # [B, L - 1, V]
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
