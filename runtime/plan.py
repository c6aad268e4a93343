"""The step plan: what the host scheduler hands the device each step, and its static shapes.
Numpy only, no JAX.

Dimensions: T token rows (padded to a bucket) packed sequence after sequence; S sequence rows
(the scheduler's slots); P page-table columns (a bucket); K proposals per row at most
(speculative decoding; 0 without); W int32 words of a token bitmask, ceil(V / 32) (1 when the
engine serves no structured output). Row s of the per-sequence arrays describes the s-th scheduled
sequence; rows >= num_seqs are padding (q_len 0, kv_len 0, page row all 0 = the null page).

`PLAN_FIELDS` is the one schema of the plan's arrays. StepPlan's array attributes, the padding
arrays (`padding_arrays`, which the scheduler fills), the step's sampling inputs
(`SAMPLING_FIELDS`) and the multi-host plan codec (runtime/device/sharding.py) derive from it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, make_dataclass

import numpy as np


@dataclass(frozen=True)
class PlanField:
    name: str
    dtype: type
    shape: str  # extents over the dims T, S, P, K, W, comma-separated: "S,P", "S+1", "S,K+1", "1"
    group: str  # tokens | sequences | sampling (the step's inputs) | speculative | feed | host
    pad: int | float = 0  # value of padding rows

    @functools.cached_property
    def _terms(self) -> tuple[tuple[str, int], ...]:  # "S,K+1" -> (("S", 0), ("K", 1))
        out = []
        for term in self.shape.split(","):
            dim, _, add = term.partition("+")
            out.append((dim, int(add or 0)) if dim.isalpha() else ("", int(dim)))
        return tuple(out)

    def extent(self, dims: dict[str, int]) -> tuple[int, ...]:
        """The array's shape at the plan dims {"T": t, "S": s, ...}."""
        return tuple(dims[d] + c if d else c for d, c in self._terms)


PLAN_FIELDS = (
    #         name                dtype       shape    group          pad
    PlanField("token_ids",        np.int32,   "T",     "tokens"),
    PlanField("positions",        np.int32,   "T",     "tokens"),
    PlanField("slot_mapping",     np.int32,   "T",     "tokens"),  # page * page_size + offset
    PlanField("prompt_targets",   np.int32,   "T",     "tokens",      -1),  # next prompt token
    PlanField("lora_ids",         np.int32,   "T",     "tokens"),  # adapter slot, 0 = none
    PlanField("cu_q_lens",        np.int32,   "S+1",   "sequences"),
    PlanField("kv_lens",          np.int32,   "S",     "sequences"),  # after this step's tokens
    PlanField("page_indices",     np.int32,   "S,P",   "sequences"),
    PlanField("num_seqs",         np.int32,   "1",     "sequences"),
    PlanField("logits_indices",   np.int32,   "S",     "sequences"),  # token row of each last token
    PlanField("temperature",      np.float32, "S",     "sampling"),  # 0 = greedy
    PlanField("top_k",            np.int32,   "S",     "sampling"),  # 0 = off
    PlanField("top_p",            np.float32, "S",     "sampling",    1),  # 1 = off
    PlanField("min_p",            np.float32, "S",     "sampling"),  # 0 = off
    PlanField("seeds",            np.uint32,  "S",     "sampling"),
    PlanField("sample_positions", np.int32,   "S",     "sampling"),  # PRNG key input
    PlanField("constrained",      np.int32,   "S",     "sampling"),  # 1: token_bitmask applies
    PlanField("token_bitmask",    np.int32,   "S,W",   "sampling"),  # bit v: id v allowed
    PlanField("proc_slots",       np.int32,   "S",     "sampling",    -1),  # processors' state row
    PlanField("num_draft",        np.int32,   "S",     "speculative"),
    PlanField("draft_ids",        np.int32,   "S,K",   "speculative"),
    PlanField("verify_indices",   np.int32,   "S,K+1", "speculative"),
    PlanField("draft_bitmask",    np.int32,   "S,K,W", "speculative"),  # masks after proposals
    PlanField("feed_rows",        np.int32,   "T",     "feed",        -1),
    PlanField("see_until",        np.int32,   "T",     "vision"),  # last position row t sees
    PlanField("rope_positions",   np.int32,   "T,3",   "mrope"),  # (t, h, w) RoPE positions
    PlanField("samples",          np.bool_,   "S",     "host"),  # the row yields a token
)
# sample_positions: the position of the token sampled at the row (with proposals: the position
# predicted by its first verify row). Speculative: a row with d <= K proposals computes its last
# token + d proposals; verify_indices[s, j] is the token row whose logits predict position
# sample_positions[s] + j (j > d repeats the last row). feed (asynchronous scheduling): token row
# t takes the token sampled at row feed_rows[t] of the previous step, on the device; -1: token_ids[t].
# prompt_targets (prompt logprobs): the prompt token after row t's, scored by row t's logits;
# -1: none wanted (no such token, the request asks for none, or a decode row).
# lora_ids: the LoRA adapter slot of row t's sequence (runtime/device/lora.py; 0: the base model).
# vision (steps with Gemma 3 image tokens only): row t attends to positions <= see_until[t]:
# its own position, or for an image token its image's last (the image's tokens see each other).
# mrope (steps with Qwen3-VL image requests only): row t's multimodal RoPE positions.
# host: bookkeeping never sent to the device. constrained / token_bitmask (structured output):
# the scheduler flags the rows, the engine fills their masks (runtime/host/structured.py);
# draft_bitmask[s, j]: the mask of verify row j + 1, after the row's first j + 1 proposals.
# proc_slots (logits processors: penalties, logit_bias, bans): the slot whose processor state
# row applies to the row's sampled token, and takes it (-1: none; runtime/device/processors.py).
PROMPT_BIT = 1 << 24  # processor state counts: the id is in the prompt (runtime/host/processors.py)

GROUPS = tuple(dict.fromkeys(f.group for f in PLAN_FIELDS))  # every field
STEP_GROUPS = ("tokens", "sequences", "sampling")  # the jitted step's inputs (and the codec's)


@functools.cache
def fields_of(*groups: str) -> tuple[PlanField, ...]:
    """The fields of `groups`, in table order."""
    return tuple(f for f in PLAN_FIELDS if f.group in groups)


SAMPLING_FIELDS = tuple(f.name for f in fields_of("sampling"))


def padding_arrays(groups: Sequence[str], *, T: int, S: int, P: int, K: int = 0, W: int = 1,
                   num_seqs: int = 0) -> dict[str, np.ndarray]:
    """The arrays of `groups` at the dims (T, S, P, K, W), every row padding (num_seqs rows
    live); builders fill them."""
    out = {name: np.full(shape, pad, dtype) if pad else np.zeros(shape, dtype)
           for name, shape, dtype, pad in _layout(tuple(groups), T, S, P, K, W)}
    if "num_seqs" in out:
        out["num_seqs"][0] = num_seqs
    return out


@functools.lru_cache(maxsize=1024)  # one entry per bucket shape: the per-step cost is allocation
def _layout(groups: tuple[str, ...], T: int, S: int, P: int, K: int, W: int):
    dims = {"T": T, "S": S, "P": P, "K": K, "W": W}
    return tuple((f.name, f.extent(dims), f.dtype, f.pad) for f in fields_of(*groups))


def plan_dims(arrays: dict[str, np.ndarray], fields: Sequence[PlanField]) -> dict[str, int]:
    """The dims read off the arrays' shapes (each from the first field with it alone on an axis)."""
    dims: dict[str, int] = {}
    for f in fields:
        for (d, c), n in zip(f._terms, np.shape(arrays[f.name])):
            if d and not c:
                dims.setdefault(d, n)
    return dims


def verify_inputs(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The verify step's arrays from a plan's step and speculative arrays: logits at every
    verify row (logits_indices [S*(K+1)]), the proposals draft_ids [S, K] and num_draft [S],
    the constrained rows' masks after each proposal draft_bitmask [S, K, W]."""
    out = {f.name: arrays[f.name] for f in fields_of(*STEP_GROUPS)}
    out["logits_indices"] = arrays["verify_indices"].reshape(-1)
    for name in ("num_draft", "draft_ids", "draft_bitmask"):
        out[name] = arrays[name]
    return out


class _StepPlanViews:
    @property
    def num_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])

    @property
    def has_drafts(self) -> bool:
        return bool(self.num_draft.any())

    @property
    def image_groups(self) -> tuple[str, ...]:
        """The groups a step with image rows also sends (none without)."""
        return ("vision",) * self.see_until_on + ("mrope",) * self.mrope

    def device_arrays(self, feed: bool = False) -> dict[str, np.ndarray]:
        """The jitted step's arrays (shapes fixed by the buckets); `feed`: with feed_rows."""
        groups = STEP_GROUPS + ("feed",) if feed else STEP_GROUPS
        return {f.name: getattr(self, f.name) for f in fields_of(*groups, *self.image_groups)}

    def verify_arrays(self) -> dict[str, np.ndarray]:
        out = verify_inputs({f.name: getattr(self, f.name) for f in PLAN_FIELDS})
        return out | {f.name: getattr(self, f.name) for f in fields_of(*self.image_groups)}


StepPlan = make_dataclass(
    "StepPlan",
    [(f.name, np.ndarray) for f in PLAN_FIELDS] + [
        ("max_q_len", int),  # static bound on q_len (a bucket)
        ("request_ids", list[str]),  # per live sequence row
        ("num_logprobs", int),  # top-n logprobs wanted by any row (static: 0 or the bucket)
        ("prompt_logprobs", bool),  # some row scores prompt tokens (static): prompt_targets >= 0
        ("spec_k", int),  # K
        ("lora_loads", list),  # [(slot, adapter key)] to copy to the device before this step
        ("proc_loads", list),  # [(slot, sequence)] processor state rows to write before it
        # the host KV tier (runtime/host/kv_host_tier.py), before it, in this order:
        ("kv_offloads", list),  # [(device page, host slot)] evicted pages to copy to the host
        ("kv_restores", list),  # [(device page, host slot)] host pages to copy to the device
        # image tokens (runtime/host/image_prompt.py): [(first token row, ImageSpan, first of its
        # tokens, count)]; the engine puts the encoder's embeddings on those rows
        ("mm_items", list),
        ("see_until_on", bool),  # the vision group goes to the device
        ("mrope", bool),  # the mrope group goes to the device
    ],
    bases=(_StepPlanViews,),
)
StepPlan.__module__ = __name__
StepPlan.__doc__ = "One step: an array per PLAN_FIELDS row (plan.token_ids, ...) and static values."


# ------------------------------------------------------------------------------- buckets


def pow_buckets(lo: int, hi: int, factor: int = 2, *, cap: bool = False) -> tuple[int, ...]:
    """lo, lo * factor, lo * factor**2, ... up to the first >= hi (`cap`: that one is hi): few
    static shapes, each at most `factor`x the work it stands for."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * factor)
    if cap:
        out[-1] = hi
    return tuple(out)


def bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest of the ascending `buckets` >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
