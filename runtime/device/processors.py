"""Per-request logits processors on the device: logit_bias, repetition / presence / frequency
penalties, allowed_token_ids, min_tokens, bad words -- over one state row per scheduler slot
(the rows' layout and how the host fills one: runtime/host/processors.py).

The step gathers the rows of its processed sequences (`slots` >= 0), applies them to those rows'
logits before structured-output masks and sampling, then adds the sampled tokens to the rows'
counts and recent tokens. Steps with no processed row skip all of it at run time (lax.cond: one
program). A verify step applies them at each verify position j with the counts and recent tokens
as of the row's first j proposals, so greedy speculation equals plain decoding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.runtime.plan import PROMPT_BIT


class ProcState(NamedTuple):
    """One row per slot R (or, gathered, per logits row N): see runtime/host/processors.py."""

    counts: jax.Array  # [R, V] int32
    recent: jax.Array  # [R, H] int32
    penalties: jax.Array  # [R, 3] f32
    min_pos: jax.Array  # [R] int32
    stop_ids: jax.Array  # [R, NS] int32
    bias_ids: jax.Array  # [R, NB] int32
    bias_vals: jax.Array  # [R, NB] f32
    allowed: jax.Array  # [R, W] int32
    bad: jax.Array  # [R, NW, H + 1] int32


def init_state(slots: int, shapes: dict) -> ProcState:
    """Zeros: `shapes` name -> (row shape, dtype), runtime/host/processors.py Dims.shapes()."""
    return ProcState(**{n: jnp.zeros((slots, *s), d) for n, (s, d) in shapes.items()})


@functools.partial(jax.jit, donate_argnums=0)
def write_slot(state: ProcState, slot: jax.Array, row: dict) -> ProcState:
    """The state with slot `slot`'s row replaced by `row` (SLOT_ROW arrays); `state` is donated
    (written in place, not copied per admission)."""
    return ProcState(*(a.at[slot].set(row[n]) for n, a in zip(ProcState._fields, state)))


def _banned(x: jax.Array, ids: jax.Array) -> jax.Array:
    """x [N, V] with -inf at ids [N, k] (ids >= V: none)."""
    return x.at[jnp.arange(x.shape[0])[:, None], ids].set(-jnp.inf, mode="drop")


def apply(logits: jax.Array, st: ProcState, positions: jax.Array, active: jax.Array) -> jax.Array:
    """logits [N, V] f32 through the rows' processors: st holds the N rows (gathered per logits
    row, recent = the H tokens before the sampled position), positions [N] the sampled tokens'
    positions, active [N] bool (inactive rows come back unchanged)."""
    n, v = logits.shape
    rows = jnp.arange(n)[:, None]
    x = logits.at[rows, st.bias_ids].add(st.bias_vals, mode="drop")  # logit_bias
    seen = st.counts != 0  # in the prompt or the output
    rep = st.penalties[:, 0:1]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    out = (st.counts & (PROMPT_BIT - 1)).astype(jnp.float32)  # output occurrences
    x = x - st.penalties[:, 2:3] * out - st.penalties[:, 1:2] * (out > 0)
    bits = (st.allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [N, W, 32]
    x = jnp.where(bits.reshape(n, -1)[:, :v] > 0, x, -jnp.inf)  # allowed_token_ids
    x = _banned(x, jnp.where((positions < st.min_pos)[:, None], st.stop_ids, v))  # min_tokens
    h = st.recent.shape[1]
    prefix, last = st.bad[..., :h], st.bad[..., h]  # [N, NW, H], [N, NW]
    match = jnp.all((prefix < 0) | (prefix == st.recent[:, None, :]), axis=-1) & (last >= 0)
    x = _banned(x, jnp.where(match, last, v))  # bad words
    return jnp.where(active[:, None], x, logits)


def process_rows(logits: jax.Array, state: ProcState, slots: jax.Array,
                 positions: jax.Array) -> jax.Array:
    """A step's logits [S, V]: row s through slot slots[s]'s processors (-1: none)."""
    def run() -> jax.Array:
        st = ProcState(*(a[jnp.maximum(slots, 0)] for a in state))
        return apply(logits, st, positions, slots >= 0)

    return jax.lax.cond(jnp.any(slots >= 0), run, lambda: logits)


def process_verify(logits: jax.Array, state: ProcState, slots: jax.Array, positions: jax.Array,
                   draft: jax.Array, num_draft: jax.Array) -> jax.Array:
    """A verify step's logits [S, K+1, V]: position j of row s as if its first j proposals
    (draft [S, K], num_draft [S]) had been sampled -- counted, and among the recent tokens."""
    s, k1, v = logits.shape
    k = k1 - 1

    def run() -> jax.Array:
        st = ProcState(*(a[jnp.maximum(slots, 0)] for a in state))  # [S, ...]
        j = jnp.arange(k1)
        before = (jnp.arange(k)[None, None, :] < j[None, :, None]) & \
            (jnp.arange(k)[None, None, :] < num_draft[:, None, None])  # [S, K+1, K]
        counts = jnp.broadcast_to(st.counts[:, None], (s, k1, v))
        counts = counts.at[jnp.arange(s)[:, None, None], j[None, :, None], draft[:, None, :]].add(
            before.astype(jnp.int32), mode="drop")  # [S, K+1, V]
        h = st.recent.shape[1]
        seq = jnp.concatenate([st.recent, draft], axis=1)  # [S, H + K]
        window = jnp.broadcast_to((j[:, None] + jnp.arange(h))[None], (s, k1, h))
        recent = jnp.take_along_axis(jnp.broadcast_to(seq[:, None], (s, k1, h + k)), window,
                                     axis=2)  # [S, K+1, H]: the H tokens before position j
        rep = lambda a: jnp.repeat(a, k1, axis=0)  # noqa: E731 - [S, ...] -> [S*(K+1), ...]
        flat = ProcState(counts.reshape(s * k1, v), recent.reshape(s * k1, h), rep(st.penalties),
                         rep(st.min_pos), rep(st.stop_ids), rep(st.bias_ids), rep(st.bias_vals),
                         rep(st.allowed), rep(st.bad))
        pos = (positions[:, None] + j[None, :]).reshape(-1)
        out = apply(logits.reshape(s * k1, v), flat, pos, jnp.repeat(slots >= 0, k1))
        return out.reshape(s, k1, v)

    return jax.lax.cond(jnp.any(slots >= 0), run, lambda: logits)


def record(state: ProcState, slots: jax.Array, tokens: jax.Array, emitted: jax.Array) -> ProcState:
    """The state after rows s emitted tokens[s, :emitted[s]] (tokens [S, E], emitted [S]); rows
    with slots[s] < 0 change nothing."""
    r = state.counts.shape[0]
    e = tokens.shape[1]
    live = (slots >= 0)[:, None] & (jnp.arange(e)[None, :] < emitted[:, None])  # [S, E]
    at = jnp.where(slots >= 0, slots, r)  # r: dropped
    counts = state.counts.at[at[:, None], jnp.maximum(tokens, 0)].add(
        live.astype(jnp.int32), mode="drop")
    h = state.recent.shape[1]
    seq = jnp.concatenate([state.recent[jnp.minimum(at, r - 1)], jnp.where(live, tokens, -1)],
                          axis=1)  # [S, H + E]
    shifted = jnp.take_along_axis(seq, emitted[:, None] + jnp.arange(h)[None, :], axis=1)
    recent = state.recent.at[at].set(shifted, mode="drop")
    return state._replace(counts=counts, recent=recent)
