"""Embeddings: prompts through the model's prefill, pooled per prompt, no KV pages kept.

`embedder(engine)(prompts, pooling, normalize) -> f32 [n, D]` (what `Engine.embed` runs). Prompts
(token ids) are packed sequence after sequence into passes of at most `budget` token rows
(max_model_len rounded up to a power of two) and MAX_SEQS prompts. A pass is one jitted program
per token bucket (powers of two from MIN_ROWS up to the budget; the sequence rows and page
tables are sized from the bucket, so nothing else makes a program): the model's forward over a
scratch KV cache made inside the program (each prompt its own pages, in order after the null
page; gone when the program ends), the final-normed hidden state of every row, `pool`ed per
prompt and L2-normalized on request. The engine's own cache and scheduler are never touched; a
server runs embeddings on the engine thread between two steps, so generation waits meanwhile.

Pooling: "last" (the prompt's last token: decoder embedding models such as Qwen3-Embedding),
"mean" (over its tokens), "cls" (its first token). The model's default: a sentence-transformers
checkpoint's (modules.json names the Pooling module, whose config.json says the mode), else
"last".

The task (EngineConfig.task): "embed" warms up the embedding programs instead of the step
programs. "auto" is "embed" for an embedding checkpoint: config.json's `architectures` names a
bare model without an LM head ("Qwen3Model", "LlamaModel", ...; such a checkpoint loads when
its embeddings are tied) or the dir is a sentence-transformers one (modules.json); else
"generate". Under either task the engine generates and embeds.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.runtime.device.attention import AttentionMetadata
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.device.model import forward_hidden
from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.requests import Limits, check_ids

POOLINGS = ("last", "mean", "cls")
MIN_ROWS = 16  # the smallest token bucket
MAX_SEQS = 64  # prompts in one pass at most (the sequence rows of a bucket: min(bucket, this))


def pool(h: jax.Array, cu: jax.Array, mode: jax.Array, normalize: jax.Array) -> jax.Array:
    """h [T, D] hidden states of packed rows; cu [S+1] int32 row offsets of S sequences (padding
    sequences are empty at the end, padding rows follow cu[-1]); mode [] int32, an index into
    POOLINGS; normalize [] bool -> f32 [S, D] (rows of empty sequences: any value)."""
    h = h.astype(jnp.float32)
    t, s = h.shape[0], cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]  # [S]
    seg = jnp.searchsorted(cu[1:], jnp.arange(t), side="right")  # [T] row's sequence (S: none)
    mean = jax.ops.segment_sum(h, seg, num_segments=s + 1)[:s] / jnp.maximum(lens, 1)[:, None]
    last = h[jnp.clip(cu[1:] - 1, 0, t - 1)]  # [S, D]
    first = h[jnp.clip(cu[:-1], 0, t - 1)]  # [S, D]
    out = jnp.where(mode == 0, last, jnp.where(mode == 1, mean, first))  # [S, D]
    norm = jnp.sqrt(jnp.sum(out * out, axis=-1, keepdims=True))  # [S, 1]
    return jnp.where(normalize, out / jnp.maximum(norm, 1e-12), out)


def _pass(params, tokens, positions, slots, cu, pages, num_seqs, mode, normalize, *, cfg,
          backend, page_size, num_pages, kv_dtype, mesh):
    """One pass: tokens, positions, slots [T] int32; cu [S+1]; pages [S, P] each sequence's
    pages of the scratch cache; num_seqs [1] -> f32 [S, D] pooled rows."""
    def run():
        t = tokens.shape[0]
        md = AttentionMetadata(positions=positions, slot_mapping=slots, cu_q_lens=cu,
                               kv_lens=cu[1:] - cu[:-1], page_indices=pages, num_seqs=num_seqs,
                               logits_indices=jnp.arange(t, dtype=jnp.int32), max_q_len=t)
        cache = init_cache(cfg, num_pages, page_size, kv_dtype)
        h, _ = forward_hidden(params, tokens, cache, md, cfg, backend)  # [T, D]
        return pool(h, cu, mode, normalize)

    if mesh is None:
        return run()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the Pallas kernels' shard_map
        return run()


@functools.lru_cache(maxsize=8)
def _jitted(cfg, backend: str, page_size: int, kv_dtype, mesh):
    """The pass for one model, shared by its engines (one program per token bucket)."""
    def fn(params, tokens, *args):
        t = tokens.shape[0]
        s = min(t, MAX_SEQS)
        num_pages = 1 + -(-t // page_size) + s  # every sequence may leave one page part-filled
        return _pass(params, tokens, *args, cfg=cfg, backend=backend, page_size=page_size,
                     num_pages=num_pages, kv_dtype=kv_dtype, mesh=mesh)

    return jax.jit(fn)


def check_prompts(prompts, limits: Limits, name: str = "prompt") -> list[list[int]]:
    """Token-id prompts to embed -> lists of ints; RequestError naming `name` (the whole
    list) or `name[i]` (one prompt): none, empty, ids out of the vocabulary, longer than
    max_model_len."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise RequestError(name, "must be a non-empty list of token id lists")
    out = []
    for i, p in enumerate(prompts):
        where = f"{name}[{i}]"
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise RequestError(where, "must be a list of token ids")
        if not p:
            raise RequestError(where, "must not be empty")
        ids = [int(t) for t in p]
        check_ids(ids, limits, where)
        if len(ids) > limits.max_model_len:
            raise RequestError(where, f"{len(ids)} tokens exceed max_model_len "
                                      f"{limits.max_model_len}")
        out.append(ids)
    return out


def checkpoint_defaults(source, architecture: str) -> tuple[str, str]:
    """(the task "auto" means, the default pooling) of a checkpoint: see the module doc."""
    task = "embed" if architecture.endswith("Model") and "For" not in architecture else "generate"
    d = Path(source) if source is not None else None
    if d is None or not (d / "modules.json").is_file():
        return task, "last"
    try:
        modules = json.loads((d / "modules.json").read_text())
        cfg = next(json.loads((d / m["path"] / "config.json").read_text()) for m in modules
                   if str(m.get("type", "")).endswith("Pooling"))
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return "embed", "last"  # no readable Pooling module: the decoder default
    for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_cls_token", "cls")):
        if cfg.get(key):
            return "embed", mode
    return "embed", "last"


class Embedder:
    """One engine's embedding passes; `compile_count`: token buckets launched (programs)."""

    def __init__(self, engine, pooling: str = "last"):
        self.engine, self.pooling = engine, pooling
        ecfg = engine.ecfg
        self.page_size = ecfg.page_size
        self.budget = max(MIN_ROWS, 1 << (ecfg.max_model_len - 1).bit_length())
        self.pages_per_seq = -(-ecfg.max_model_len // self.page_size)
        kv_dtype = jnp.bfloat16 if ecfg.dtype == "bfloat16" else jnp.float32
        self._fn = _jitted(engine.cfg, engine.backend, self.page_size, kv_dtype, engine.mesh)
        self._seen: set[int] = set()

    @property
    def compile_count(self) -> int:
        return len(self._seen)

    def buckets(self) -> list[int]:
        return [b for b in (MIN_ROWS << i for i in range(32)) if b <= self.budget]

    def __call__(self, prompts, pooling: str | None = None, normalize: bool = True) -> np.ndarray:
        if getattr(self.engine, "plan_channel", None) is not None:
            raise RequestError(None, "embeddings are not served on several hosts")
        pooling = self.pooling if pooling is None else pooling
        if pooling not in POOLINGS:
            raise RequestError("pooling", f"must be one of {list(POOLINGS)}, got {pooling!r}")
        if not isinstance(normalize, bool):
            raise RequestError("normalize", f"must be True or False, got {normalize!r}")
        prompts = check_prompts(prompts, self.engine.limits)
        groups, cur, total = [], [], 0
        for i, p in enumerate(prompts):  # in order, as many as fit a pass
            if cur and (total + len(p) > self.budget or len(cur) == MAX_SEQS):
                groups.append(cur)
                cur, total = [], 0
            cur.append(i)
            total += len(p)
        groups.append(cur)
        mode = np.int32(POOLINGS.index(pooling))
        outs = [self._launch([prompts[i] for i in g], mode, normalize) for g in groups]
        return np.concatenate([np.asarray(o)[:len(g)] for o, g in zip(outs, groups)])

    def _launch(self, seqs: list[list[int]], mode, normalize: bool):
        t = max(MIN_ROWS, 1 << (sum(map(len, seqs)) - 1).bit_length())
        self._seen.add(t)
        return self._fn(self.engine.params, *self._pack(seqs, t), mode, np.bool_(normalize))

    def _pack(self, seqs: list[list[int]], t: int) -> tuple[np.ndarray, ...]:
        """Host arrays of one pass: tokens, positions, slots [T]; cu [S+1]; pages [S, P];
        num_seqs [1]. Padding rows write to the null page."""
        ps, s = self.page_size, min(t, MAX_SEQS)
        p = -(-min(t, self.pages_per_seq * ps) // ps)
        tokens, positions, slots = (np.zeros(t, np.int32) for _ in range(3))
        cu, pages = np.zeros(s + 1, np.int32), np.zeros((s, p), np.int32)
        row, page = 0, 1
        for i, ids in enumerate(seqs):
            k, pos = len(ids), np.arange(len(ids))
            own = np.arange(page, page + -(-k // ps))
            tokens[row:row + k], positions[row:row + k] = ids, pos
            slots[row:row + k] = own[pos // ps] * ps + pos % ps
            pages[i, :len(own)] = own
            row, page = row + k, page + len(own)
            cu[i + 1:] = row
        return tokens, positions, slots, cu, pages, np.asarray([len(seqs)], np.int32)

    def warmup(self) -> int:
        """Launch every token bucket once (all padding); the number of new programs."""
        before = self.compile_count
        for t in self.buckets():
            self._seen.add(t)
            jax.block_until_ready(self._fn(self.engine.params, *self._pack([], t), np.int32(0),
                                           np.bool_(True)))
        return self.compile_count - before


_EMBEDDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def embedder(engine, pooling: str | None = None) -> Embedder:
    """The engine's Embedder (made on first use); `pooling`: its default pooling from now on."""
    e = _EMBEDDERS.get(engine)
    if e is None:
        e = _EMBEDDERS[engine] = Embedder(engine)
    if pooling is not None:
        e.pooling = pooling
    return e
