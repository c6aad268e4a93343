"""Jitted step functions: one model pass over a StepPlan plus fused logits processors and sampling.

One step serves prefill chunks and decode tokens alike (the ragged layout covers both). The cache
is donated. Only one packed f32 array travels back to the host per step:
  [:, 0] sampled token id, [:, 1] its logprob, then n top logprobs and n top ids (n static);
with prompt logprobs (static), a second [T, 1 + 2n] one: the logprob of each token row's next
prompt token, then the row's top-n (computed from every row's logits, in chunks of rows).
Token ids are exact in f32 (vocabularies < 2**24). Under asynchronous scheduling a step reads
its decode rows' input tokens from the previous step's output on the device (`prev`), so the host
can plan and launch step n+1 before step n's tokens have come back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.runtime.device.attention import AttentionMetadata
from jaxinfer.runtime.config import ModelConfig
from jaxinfer.runtime.device.kv_cache import KVCache
from jaxinfer.runtime.device.model import (INVARIANT_ROWS, LayerParams, Params, by_rows,
                                           compute_logits, embed_tokens, final_rows, forward,
                                           forward_hidden, layer)
from jaxinfer.runtime.plan import SAMPLING_FIELDS
from jaxinfer.runtime.device.processors import ProcState, process_rows, process_verify, record
from jaxinfer.runtime.device.sampling import accept, allow_tokens, mask_vocab, sample, top_logprobs


def _metadata(a: dict, max_q_len: int) -> AttentionMetadata:
    return AttentionMetadata(
        positions=a["positions"], slot_mapping=a["slot_mapping"], cu_q_lens=a["cu_q_lens"],
        kv_lens=a["kv_lens"], page_indices=a["page_indices"], num_seqs=a["num_seqs"],
        logits_indices=a["logits_indices"], max_q_len=max_q_len, see_until=a.get("see_until"),
        rope_positions=a.get("rope_positions"),
    )


def given_rows(a: dict):
    """(embeds [T, D], mask [T], deepstack [K, T, D] or None) of the rows whose input the engine
    gives (image tokens: mm_embeds, mm_mask, mm_deep), or None."""
    return (a["mm_embeds"], a["mm_mask"], a.get("mm_deep")) if "mm_embeds" in a else None


# Vocabulary x hidden at and above which a step projects its live sequences' rows only (a
# `lax.switch` over 1, S/2 and S rows): below it (test-sized models) the head is cheap and the
# extra branches, which XLA compiles in full, cost more than they save.
ONE_ROW_HEAD_MIN = 1 << 23


def step(
    params: Params,
    cache: KVCache,
    arrays: dict[str, jax.Array],
    *,
    cfg: ModelConfig,
    backend: str,
    max_q_len: int,
    num_logprobs: int,
    filtered: bool,
    procs: ProcState | None = None,
    prompt_logprobs: bool = False,
    prev: jax.Array | None = None,
    vocab_limit: int | None = None,
    processed_logprobs: bool = False,
):
    """-> (packed [S, 1 (+ 1 + 2n)], cache, procs), or ((packed, prompt [T, 1 + 2n]), cache,
    procs) with `prompt_logprobs` (n = num_logprobs): row t of `prompt` scores
    arrays["prompt_targets"][t]. `procs`: the logits processors' state (processors.py), updated
    with the sampled tokens (None: no processors, and None comes back). `vocab_limit`: ids at and above it are never sampled (see
    sampling.mask_vocab). Logprobs are the model's own distribution, or with
    `processed_logprobs` the one sampled from (after processors and structured-output masks,
    before temperature and top-k/p/min-p).
    `prev` int32 [S]: the previous step's sampled tokens, read by the rows that
    arrays["feed_rows"] [T] points at (asynchronous scheduling; None: every id is in token_ids)."""
    if prompt_logprobs:  # every row's hidden state: [T, D]
        h_all, cache = body(params, cache, arrays, cfg=cfg, backend=backend,
                            max_q_len=max_q_len, prev=prev, all_rows=True)
        h = h_all[arrays["logits_indices"]]  # [S, D]
        prompt = prompt_logprob_rows(params, h_all, arrays["prompt_targets"], cfg,
                                     num_logprobs, vocab_limit)
    else:
        h, cache = body(params, cache, arrays, cfg=cfg, backend=backend, max_q_len=max_q_len,
                        prev=prev)  # [S, D]
        prompt = None
    packed, procs = head(params, h, arrays, procs, cfg=cfg, num_logprobs=num_logprobs,
                         filtered=filtered, vocab_limit=vocab_limit,
                         processed_logprobs=processed_logprobs)
    return (packed if prompt is None else (packed, prompt)), cache, procs


def fed_tokens(arrays: dict[str, jax.Array], prev: jax.Array | None) -> jax.Array:
    """[T] the step's input ids: token_ids, with the rows arrays["feed_rows"] points at read
    from the previous step's sampled tokens `prev` [S] (asynchronous scheduling)."""
    token_ids = arrays["token_ids"]
    if prev is None:
        return token_ids
    feed = arrays["feed_rows"]
    return jnp.where(feed >= 0, prev[jnp.maximum(feed, 0)], token_ids)


def body(params: Params, cache: KVCache, arrays: dict[str, jax.Array], *, cfg: ModelConfig,
         backend: str, max_q_len: int, prev: jax.Array | None = None, all_rows: bool = False
         ) -> tuple[jax.Array, KVCache]:
    """The model over a step's token rows -> (final-normed hidden states [S, D] of its
    logits_indices rows, or of all T rows with `all_rows`; the cache with their K/V)."""
    md = _metadata(arrays, max_q_len)
    if all_rows:
        md = md.replace(logits_indices=jnp.arange(arrays["token_ids"].shape[0]))
    return forward_hidden(params, fed_tokens(arrays, prev), cache, md, cfg, backend,
                          arrays["lora_ids"], given_rows(arrays))


def head(params: Params, h: jax.Array, arrays: dict[str, jax.Array], procs: ProcState | None,
         *, cfg: ModelConfig, num_logprobs: int, filtered: bool, vocab_limit: int | None = None,
         processed_logprobs: bool = False, rows: int | None = None
         ) -> tuple[jax.Array, ProcState | None]:
    """h [S, D] -> (packed [S, 1 (+ 1 + 2n)], procs): the vocabulary projection, logits
    processors, structured-output masks, sampling and logprobs of a step's rows; the processor
    state takes the sampled tokens. Its program depends on S and the statics only, never on
    the token or page bucket. `rows` (static): project and sample the first `rows` rows only
    (the live sequences come first), one smaller program per value; None: see below."""
    s = h.shape[0]

    def sample_rows(h, a) -> jax.Array:  # rows h [N, D] and their sampling fields -> [N, C]
        logits = mask_vocab(compute_logits(params, h, cfg), vocab_limit)  # [N, V]
        processed = logits if procs is None else process_rows(logits, procs, a["proc_slots"],
                                                               a["sample_positions"])
        allowed = allow_tokens(processed, a["token_bitmask"], a["constrained"])
        tokens = sample(allowed, a["temperature"], a["top_k"], a["top_p"], a["min_p"],
                        a["seeds"], a["sample_positions"], filtered=filtered)
        cols = [tokens.astype(jnp.float32)[:, None]]
        if num_logprobs:
            chosen, vals, ids = top_logprobs(allowed if processed_logprobs else logits, tokens,
                                             num_logprobs)
            cols += [chosen[:, None], vals, ids.astype(jnp.float32)]
        return jnp.concatenate(cols, axis=1)

    def head_and_sample(rows: int) -> jax.Array:  # the first `rows` rows, padded back to S
        a = {k: arrays[k][:rows] for k in SAMPLING_FIELDS}
        return jnp.pad(sample_rows(h[:rows], a), ((0, s - rows), (0, 0)))

    if cfg.batch_invariant:  # every row alike, in fixed blocks (model.by_rows)
        packed = by_rows(sample_rows, cfg, h, {k: arrays[k] for k in SAMPLING_FIELDS},
                         live=arrays["num_seqs"][0])  # the live sequences' rows come first
    elif rows is not None or s == 1 or cfg.vocab_size * cfg.hidden_size < ONE_ROW_HEAD_MIN:
        packed = head_and_sample(s if rows is None else rows)
    else:
        # The vocabulary projection, the largest matmul of a small model, runs on the live
        # sequences' rows only (they come first), padded to 1, S/2 or S rows: a batch-1 decode
        # projects one row, 16 sequences on 32 slots 16. All branches are one program.
        rows = sorted({1, max(1, s // 2), s})
        which = jnp.searchsorted(jnp.asarray(rows), arrays["num_seqs"][0])
        packed = jax.lax.switch(jnp.minimum(which, len(rows) - 1),
                                [functools.partial(head_and_sample, r) for r in rows])
    if procs is not None:
        slots = arrays["proc_slots"]
        procs = record(procs, slots, packed[:, :1].astype(jnp.int32),
                       (slots >= 0).astype(jnp.int32))
    return packed, procs


# ---- the body layer by layer (runtime/device/programs.py): small programs that compile fast ----
# The plan arrays a layer reads (AttentionMetadata's), put on the device once per step.
# ... and the ones the head reads (none of them [T]-shaped: one head program serves every bucket)
HEAD_FIELDS = SAMPLING_FIELDS + ("num_seqs",)
METADATA_FIELDS = ("positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_indices",
                   "num_seqs", "logits_indices", "see_until", "rope_positions")  # (the last two:
# image steps only)


def embed_rows(params: Params, arrays: dict[str, jax.Array], prev: jax.Array | None, *,
               cfg: ModelConfig):
    """body's first part: (x [T, D], the adapter mask [T, L] or None, the per-layer inputs
    [T, L, P] or None)."""
    return embed_tokens(params, fed_tokens(arrays, prev), cfg, arrays["lora_ids"],
                        given_rows(arrays))


def layer_rows(lp: LayerParams, x: jax.Array, k_pages, v_pages, md: dict[str, jax.Array],
               adapter, mask: jax.Array | None, ple: jax.Array | None, *, cfg: ModelConfig,
               i: int, backend: str, max_q_len: int):
    """body's layer i (static; model.layer_kind(cfg, i) shares one program among the layers
    that behave alike): -> (x, k_pages, v_pages)."""
    return layer(lp, x, k_pages, v_pages, _metadata(md, max_q_len), cfg, i, backend, adapter,
                 mask, ple)


def last_rows(params: Params, x: jax.Array, md: dict[str, jax.Array], *, cfg: ModelConfig
              ) -> jax.Array:
    """body's last part: the final-normed logits rows [S, D]."""
    return final_rows(params, x, md["logits_indices"], cfg)


# Token rows whose [rows, V] f32 logits exist at once when scoring a prompt: Gemma's 262k
# vocabulary makes that 32 MiB a chunk.
PROMPT_ROWS_CHUNK = 32


def prompt_logprob_rows(params: Params, h: jax.Array, targets: jax.Array, cfg: ModelConfig,
                        n: int, vocab_limit: int | None) -> jax.Array:
    """h [T, D] every token row's final hidden state, targets [T] (the next prompt token; -1:
    none) -> f32 [T, 1 + 2n]: the target's logprob, the top-n logprobs, their ids. The [T, V]
    logits never exist whole: rows go through the head PROMPT_ROWS_CHUNK at a time."""
    t = h.shape[0]
    c = INVARIANT_ROWS if cfg.batch_invariant else min(t, PROMPT_ROWS_CHUNK)
    pad = -t % c
    hc = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, h.shape[1])  # [T/c, c, D]
    tc = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(-1, c)  # [T/c, c]

    def chunk(args):
        hh, tt = args
        logits = mask_vocab(compute_logits(params, hh, cfg), vocab_limit)  # [c, V]
        chosen, vals, ids = top_logprobs(logits, tt, n)
        return jnp.concatenate([chosen[:, None], vals, ids.astype(jnp.float32)], axis=1)

    return jax.lax.map(chunk, (hc, tc)).reshape(t + pad, 1 + 2 * n)[:t]


@jax.jit
def sampled_tokens(packed) -> jax.Array:
    """int32 [S]: the token column of a step's packed output (the next step's `prev`)."""
    packed = packed[0] if isinstance(packed, tuple) else packed
    return packed[:, 0].astype(jnp.int32)


def verify(
    params: Params,
    cache: KVCache,
    arrays: dict[str, jax.Array],
    q_probs: jax.Array | None,  # [S', K, V] proposer distributions (draft model), else None
    q_rows: jax.Array,  # [S] int32 row of each plan row in q_probs
    *,
    cfg: ModelConfig,
    backend: str,
    max_q_len: int,
    num_logprobs: int,
    filtered: bool,
    procs: ProcState | None = None,
    vocab_limit: int | None = None,
    processed_logprobs: bool = False,
) -> tuple[jax.Array, KVCache, ProcState | None]:
    """Speculative verify: one forward with logits at every row's last token and proposals
    (arrays["logits_indices"] is [S*(K+1)]), then acceptance for all rows on the device.
    Packed [S, 2 + K (+ 1 + 2n)]: [:, 0] proposals accepted a, [:, 1:K+2] the emitted tokens
    (a + 1 valid, then -1), then logprobs of the token drawn at the first verify row (rows that
    want logprobs get no proposals, so that is their one token)."""
    S, K = arrays["draft_ids"].shape
    md = _metadata(arrays, max_q_len)
    logits, cache = forward(params, arrays["token_ids"], cache, md, cfg, backend,
                            arrays["lora_ids"], given_rows(arrays))  # [S*(K+1), V]
    logits = mask_vocab(logits, vocab_limit).reshape(S, K + 1, -1)  # [S, K+1, V]
    slots = arrays["proc_slots"]

    def accept_rows(logits, a):  # rows' logits [s, K+1, V] and their fields -> packed [s, C]
        s = logits.shape[0]
        raw = logits[:, 0]  # logprobs are the model's own (before any processor or constraint)
        if procs is not None:
            logits = process_verify(logits, procs, a["proc_slots"], a["sample_positions"],
                                    a["draft_ids"], a["num_draft"])
        # a constrained row's verify row j takes the grammar's mask after its first j proposals
        masks = jnp.concatenate([a["token_bitmask"][:, None], a["draft_bitmask"]], 1)
        logits = allow_tokens(logits.reshape(s * (K + 1), -1), masks.reshape(s * (K + 1), -1),
                              jnp.repeat(a["constrained"], K + 1)).reshape(s, K + 1, -1)
        n_acc, tokens = accept(
            logits, a["draft_ids"], a["num_draft"], a.get("q"), a["temperature"], a["top_k"],
            a["top_p"], a["min_p"], a["seeds"], a["sample_positions"], filtered=filtered)
        cols = [n_acc.astype(jnp.float32)[:, None], tokens.astype(jnp.float32)]
        if num_logprobs:
            chosen, vals, ids = top_logprobs(logits[:, 0] if processed_logprobs else raw,
                                             tokens[:, 0], num_logprobs)
            cols += [chosen[:, None], vals, ids.astype(jnp.float32)]
        return jnp.concatenate(cols, axis=1)

    fields = {k: arrays[k] for k in _VERIFY_ROW_FIELDS}
    if q_probs is not None:
        fields["q"] = q_probs[q_rows]  # [S, K, V]
    # batch-invariant: each row's acceptance in fixed blocks of rows, as a plain step's head
    packed = by_rows(accept_rows, cfg, logits, fields)
    if procs is not None:
        n_acc, tokens = packed[:, 0].astype(jnp.int32), packed[:, 1:K + 2].astype(jnp.int32)
        procs = record(procs, slots, tokens, jnp.where(slots >= 0, n_acc + 1, 0))
    return packed, cache, procs


# the per-row fields of a verify step's acceptance (besides the logits)
_VERIFY_ROW_FIELDS = SAMPLING_FIELDS + ("draft_ids", "num_draft", "draft_bitmask")


class Launches:
    """A jitted step and the distinct programs one engine has launched through it: `count` is
    what `Engine.compile_count` reports, so "no new programs after warm-up" holds per engine
    even when the jitted function is shared (`shared_jit`) and another engine compiled first.
    A program is its abstract signature: the tree, shapes and dtypes of every argument after
    params and cache (those two are fixed for an engine) and the static values."""

    def __init__(self, jitted):
        self.jitted, self._seen = jitted, set()

    def __call__(self, params, cache, *args, **kwargs):
        self._seen.add(self._key(args, kwargs))
        return self.jitted(params, cache, *args, **kwargs)

    def launched(self, params, cache, *args, **kwargs) -> bool:
        """Whether a call with these arguments was launched before (its program exists)."""
        return self._key(args, kwargs) in self._seen

    @staticmethod
    def _key(args, kwargs) -> tuple:
        leaves, tree = jax.tree.flatten((args, kwargs))
        return tree, tuple((x.shape, x.dtype) if hasattr(x, "shape") else x for x in leaves)

    @property
    def count(self) -> int:
        return len(self._seen)


_VERIFY_STATICS = ("max_q_len", "num_logprobs", "filtered")
_STEP_STATICS = _VERIFY_STATICS + ("prompt_logprobs",)


def make_verify(cfg: ModelConfig, backend: str, shardings=None,
                vocab_limit: int | None = None, processed_logprobs: bool = False) -> Launches:
    """The verify step (static: q bucket, logprob count, filter flag; q_probs None or not
    retraces once); `shardings` as for make_step."""
    return _jit(verify, _VERIFY_STATICS, shardings, cfg=cfg, backend=backend,
                vocab_limit=vocab_limit, processed_logprobs=processed_logprobs)


def make_step(cfg: ModelConfig, backend: str, shardings=None,
              vocab_limit: int | None = None, processed_logprobs: bool = False,
              mesh=None) -> Launches:
    """The step for one model; static: q bucket, logprob count, filter flag, prompt logprobs.
    `shardings` (tensor parallel): (params, cache, replicated) NamedSharding trees from
    runtime.device.sharding. Without them, `mesh` (an AbstractMesh; None: none) is the mesh
    the step is traced on when its arrays come laid out on one (shared_jit)."""
    return _jit(step, _STEP_STATICS, shardings, cfg=cfg, backend=backend,
                vocab_limit=vocab_limit, processed_logprobs=processed_logprobs, mesh=mesh)


def _jit(fn, statics: tuple[str, ...], shardings, mesh=None, **bound) -> Launches:
    """One device: the process's shared jit of `fn`. On a mesh (`shardings`): `fn` traced on
    the mesh (the Pallas attention kernels and expert-parallel layers run per device in a
    shard_map over its "model" axis). Inputs arrive laid out (params and cache committed to
    their shardings; host plan arrays are replicated); the packed output is replicated and the
    new cache keeps the donated cache's layout, so steady-state steps never reshard or
    recompile. The processor state is replicated. (jit takes no in_shardings together with
    keyword static args.)"""
    if shardings is None:
        return Launches(shared_jit(fn, statics, ("cache", "procs"), mesh=mesh, **bound))
    _, cache_sh, rep = shardings
    return Launches(jax.jit(functools.partial(on_mesh(fn, rep.mesh.abstract_mesh), **bound),
                            static_argnames=statics, donate_argnames=("cache", "procs"),
                            out_shardings=(rep, cache_sh, rep)))


def on_mesh(fn, mesh):
    """`fn` traced with `mesh` (an AbstractMesh; None: as it is) as the context mesh, where the
    model's expert-parallel layers (runtime/device/moe.py) and the Pallas attention kernels
    (runtime/device/attention.py) find the "model" axis."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh):
            return fn(*args, **kwargs)

    return traced


@functools.lru_cache(maxsize=16)
def shared_jit(fn, statics: tuple[str, ...], donate: tuple[str, ...] = ("cache",), mesh=None,
               **bound):
    """One jitted `fn` per set of bound keyword values (model config, backend, ...) and `mesh`
    in the process, so engines of one model trace and compile each shape once; `statics` are
    its static argument names and `donate` the donated ones; `mesh` (an AbstractMesh) the
    mesh it is traced on, for engines whose arrays lie on one (`on_mesh`). Its programs
    outlive the engines that launched them (until evicted, or `jax.clear_caches()`); on
    XLA:CPU each holds a few hundred memory mappings, of the process's vm.max_map_count."""
    return jax.jit(functools.partial(on_mesh(fn, mesh), **bound), static_argnames=statics,
                   donate_argnames=donate)
