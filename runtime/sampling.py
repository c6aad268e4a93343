"""Vectorized per-row sampling fused into the jitted step.

Each row's random key derives from (seed, position) only, so a seeded request draws the same
tokens alone or inside any batch. Greedy rows (temperature 0) take the argmax. Sampling is
Gumbel-max over the filtered, temperature-scaled logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20


def mask_vocab(logits: jax.Array, vocab_limit: int | None) -> jax.Array:
    """[..., V] logits with the ids >= vocab_limit (rows the tokenizer has no token for: a
    vocabulary padded for the matmul) at -inf, so they are never sampled nor in top logprobs."""
    v = logits.shape[-1]
    if vocab_limit is None or vocab_limit >= v:
        return logits
    return jnp.where(jnp.arange(v) < vocab_limit, logits, -jnp.inf)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """[S] keys from (seed, position)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def filter_logits(
    logits: jax.Array,  # [S, V] f32, already temperature-scaled
    top_k: jax.Array,  # [S] int32, 0 = off
    top_p: jax.Array,  # [S] f32, 1 = off
    min_p: jax.Array,  # [S] f32, 0 = off
) -> jax.Array:
    """-inf outside each row's top-k / nucleus / min-p set (one descending sort per row)."""
    v = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)  # [S, V]
    srt = jnp.take_along_axis(logits, order, axis=-1)  # [S, V] descending
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each rank
    rank = jnp.arange(v)[None, :]
    keep = before < top_p[:, None]
    keep &= (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    kept = jnp.where(keep, srt, -jnp.inf)
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(kept, inv, axis=-1)


def sample(
    logits: jax.Array,  # [S, V] f32
    temperature: jax.Array,  # [S]
    top_k: jax.Array,  # [S]
    top_p: jax.Array,  # [S]
    min_p: jax.Array,  # [S]
    seeds: jax.Array,  # [S] uint32
    positions: jax.Array,  # [S] int32
    *,
    filtered: bool,  # static: any row has top_k / top_p / min_p set
) -> jax.Array:  # [S] int32
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn() -> jax.Array:
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = logits / t
        if filtered:
            scaled = filter_logits(scaled, top_k, top_p, min_p)
        keys = row_keys(seeds, positions)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        return jnp.where(temperature > 0, jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32),
                         greedy)

    # all-greedy steps skip the noise (S x V draws) at run time; one compiled program
    return jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)


def top_logprobs(logits: jax.Array, tokens: jax.Array, n: int):
    """Log-probabilities of the model's distribution: chosen [S], top-n values/ids [S, n]."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    vals, ids = jax.lax.top_k(lp, n)
    return chosen, vals, ids
