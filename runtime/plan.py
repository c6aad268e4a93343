"""The step plan: what the host scheduler hands the device each step. Numpy only, no JAX.

T token rows (padded to a bucket) packed sequence after sequence; S sequence rows (padded to a
bucket). Row s of the per-sequence arrays describes the s-th scheduled sequence; rows >= num_seqs
are padding (q_len 0, kv_len 0, page row all 0 = the null page).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def empty_step_arrays(t: int, s: int, p: int, num_seqs: int = 0) -> dict[str, np.ndarray]:
    """The step's device arrays at bucket shape (T=t, S=s, P=p) with every row padding: zero
    tokens, q/kv lengths and page tables (the null page), greedy sampling. Builders fill them."""
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return dict(
        token_ids=i32(t), positions=i32(t), slot_mapping=i32(t), cu_q_lens=i32(s + 1),
        kv_lens=i32(s), page_indices=i32(s, p), num_seqs=np.array([num_seqs], np.int32),
        logits_indices=i32(s), temperature=np.zeros(s, np.float32), top_k=i32(s),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
        seeds=np.zeros(s, np.uint32), sample_positions=i32(s),
    )


@dataclass
class StepPlan:
    # token rows [T]
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int32 [T] page * page_size + offset; padding rows -> 0
    # sequence rows [S]
    cu_q_lens: np.ndarray  # int32 [S+1]
    kv_lens: np.ndarray  # int32 [S] KV length after this step's tokens are written
    page_indices: np.ndarray  # int32 [S, P]
    num_seqs: np.ndarray  # int32 [1]
    logits_indices: np.ndarray  # int32 [S] token row of each sequence's last token (padding -> 0)
    max_q_len: int  # static bound on q_len (a bucket)
    # sampling, per sequence row [S]
    temperature: np.ndarray  # float32 [S] (0 = greedy)
    top_k: np.ndarray  # int32 [S] (0 = off)
    top_p: np.ndarray  # float32 [S]
    min_p: np.ndarray  # float32 [S]
    seeds: np.ndarray  # uint32 [S]
    sample_positions: np.ndarray  # int32 [S] position of the token being sampled (PRNG key input)
    # host bookkeeping (not sent to the device)
    request_ids: list[str] = field(default_factory=list)  # per live sequence row
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [S] row yields a token
    num_logprobs: int = 0  # top-n logprobs wanted by any row this step (static bucket: 0 or 20)
    # speculative decoding (K = spec_k proposals at most per row; all zeros/empty when K = 0).
    # A row with d proposals computes its last token + d proposals; sample_positions is then the
    # position predicted by its first verify row, and verify_indices[s, j] (j = 0..K) the token row
    # whose logits predict position sample_positions[s] + j (j > d repeats the last row).
    spec_k: int = 0
    num_draft: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [S]
    draft_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [S, K]
    verify_indices: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [S, K+1]
    # asynchronous scheduling: token row t takes the token sampled at row feed_rows[t] of the
    # previous step (on the device; its id is not known to the host yet); -1: token_ids[t]
    feed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [T]

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the jitted step consumes (shapes fixed by the buckets)."""
        names = (
            "token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_indices",
            "num_seqs", "logits_indices", "temperature", "top_k", "top_p", "min_p", "seeds",
            "sample_positions",
        )
        return {n: getattr(self, n) for n in names}

    @property
    def has_drafts(self) -> bool:
        return bool(self.num_draft.size and self.num_draft.any())

    def verify_arrays(self) -> dict[str, np.ndarray]:
        """The verify step's arrays: logits at every verify row ([S*(K+1)] logits_indices)."""
        a = self.device_arrays()
        a["logits_indices"] = self.verify_indices.reshape(-1)
        a["num_draft"] = self.num_draft
        a["draft_ids"] = self.draft_ids
        return a
