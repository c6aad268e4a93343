"""Who writes which arrays of a step plan (runtime/plan.py's PLAN_FIELDS). No JAX.

The scheduler lays out a plan's rows [(sequence, tokens this step)] in plan order. The core
(`write_core`) fills what every step has: the rows' tokens (known ids, pending ids fed on the
device from the previous step, proposals), positions, cache slots, lengths, page tables, the
rows that sample. Each feature is a writer that owns its own arrays and the StepPlan statics
it sets:

    SamplingRows     temperature, top_k, top_p, min_p, seeds, sample_positions
    LogprobRows      prompt_targets; num_logprobs, prompt_logprobs
    StructuredRows   constrained (FILLED_BY_ENGINE: the masks, from the request's grammar)
    ProcessorRows    proc_slots; proc_loads
    SpeculativeRows  num_draft, draft_ids, verify_indices; spec_k      (num_spec_tokens > 0)
    LoraRows         lora_ids; lora_loads                             (with adapter slots)
    ImageRows        see_until; mm_items, see_until_on
    RopeRows         rope_positions; mrope

`PlanRows` holds the writers of one scheduler configuration; an OPTIONAL writer left out leaves
its arrays padding and its statics at its `off()`. Every PLAN_FIELDS field is written by exactly
one of the core, a writer or the engine (tests/runtime/test_scheduler.py). Writers see the rows as
`spans`: (sequence, first token row, first position, tokens) per sequence row, in row order.
"""

from __future__ import annotations

import numpy as np

LOGPROBS_BUCKET = 20  # static top-n logprobs width when any row asks for logprobs

CORE_FIELDS = ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_indices",
               "num_seqs", "logits_indices", "feed_rows", "samples")


def write_core(a: dict[str, np.ndarray], rows: list, page_size: int) -> list[tuple]:
    """Fill CORE_FIELDS (num_seqs: padding_arrays) for `rows`; return the spans."""
    ps = page_size
    token_ids, positions, slot_mapping = a["token_ids"], a["positions"], a["slot_mapping"]
    cu_q_lens, kv_lens, page_indices = a["cu_q_lens"], a["kv_lens"], a["page_indices"]
    logits_indices, feed_rows, samples = a["logits_indices"], a["feed_rows"], a["samples"]
    spans, t = [], 0
    for s, (seq, n) in enumerate(rows):
        start, known, total = seq.num_computed, seq.num_known, seq.num_tokens
        for i in range(n):
            pos = start + i
            if pos < known:
                token_ids[t + i] = seq.token(pos)
            elif pos < total:  # pending: sampled by the previous plan, read on the device
                feed_rows[t + i] = seq.sample_row
            else:  # proposals past the sequence's own tokens
                token_ids[t + i] = seq.draft[pos - total]
            positions[t + i] = pos
            slot_mapping[t + i] = seq.pages[pos // ps] * ps + pos % ps
        spans.append((seq, t, start, n))
        t += n
        cu_q_lens[s + 1] = t
        kv_lens[s] = start + n
        page_indices[s, : len(seq.pages)] = seq.pages
        logits_indices[s] = t - 1
        samples[s] = start + n >= total
    cu_q_lens[len(rows) + 1 :] = t
    return spans


class SamplingRows:
    fields = ("temperature", "top_k", "top_p", "min_p", "seeds", "sample_positions")

    def write(self, a, spans) -> dict:
        temperature, top_k, top_p, min_p, seeds, sample_positions = (a[f] for f in self.fields)
        for s, (seq, _, start, n) in enumerate(spans):
            p = seq.req.params
            temperature[s], top_k[s], top_p[s], min_p[s] = p.temperature, p.top_k, p.top_p, p.min_p
            seeds[s] = seq.seed
            sample_positions[s] = start + n - len(seq.draft)  # the first verify row's position
        return {}


class LogprobRows:
    """Prompt tokens scored by the rows of requests that want prompt logprobs; the top-n width
    when any row wants logprobs."""

    fields = ("prompt_targets",)

    def write(self, a, spans) -> dict:
        targets, want = a["prompt_targets"], False
        for seq, t, start, n in spans:
            p = seq.req.params
            want = want or p.logprobs is not None
            if p.prompt_logprobs is not None:  # rows scoring a next prompt token
                end = min(start + n, len(seq.req.prompt_ids) - 1)
                if end > start:
                    targets[t:t + end - start] = seq.req.prompt_ids[start + 1:end + 1]
        prompt = bool((targets >= 0).any())
        return {"num_logprobs": LOGPROBS_BUCKET if prompt or want else 0,
                "prompt_logprobs": prompt}


class StructuredRows:
    """Flags the rows that sample under a structured-output constraint."""

    fields = ("constrained",)

    def write(self, a, spans) -> dict:
        constrained, samples = a["constrained"], a["samples"]
        for s, (seq, _, _, _) in enumerate(spans):
            constrained[s] = samples[s] and seq.req.params.structured_outputs is not None
        return {}


FILLED_BY_ENGINE = ("token_bitmask", "draft_bitmask")  # the constrained rows' masks


class ProcessorRows:
    """Rows that sample under logits processors (penalties, logit_bias, bans: a request with a
    `procs` spec) name their slot's processor state row; a sequence that took its slot since
    that row was last written for it gets a load before the step (runtime/host/processors.py)."""

    fields = ("proc_slots",)

    def __init__(self):
        self._loaded: dict[int, tuple] = {}  # slot -> (sequence, admissions) its row holds

    def write(self, a, spans) -> dict:
        proc_slots, samples, loads = a["proc_slots"], a["samples"], []
        for s, (seq, _, _, _) in enumerate(spans):
            if seq.req.procs is None:
                continue
            if self._loaded.get(seq.slot) != (seq, seq.admissions):
                self._loaded[seq.slot] = (seq, seq.admissions)
                loads.append((seq.slot, seq))
            if samples[s]:
                proc_slots[s] = seq.slot
        return {"proc_loads": loads}


class SpeculativeRows:
    """A row with d <= K proposals: the proposals, and the token rows whose logits verify
    them (runtime/plan.py)."""

    fields = ("num_draft", "draft_ids", "verify_indices")

    def __init__(self, k: int):
        self.k = k
        self._steps = np.arange(k + 1)

    def write(self, a, spans) -> dict:
        num_draft, draft_ids, verify_indices = (a[f] for f in self.fields)
        for s, (seq, t, _, n) in enumerate(spans):
            d = len(seq.draft)
            num_draft[s] = d
            draft_ids[s, :d] = seq.draft
            verify_indices[s] = t + n - 1 - d + np.minimum(self._steps, d)
        return {"spec_k": self.k}

    @staticmethod
    def off() -> dict:
        return {"spec_k": 0}


class LoraRows:
    """Each token row's adapter slot; the adapter loads due before the step (from `gate`,
    runtime/host/lora_slots.py)."""

    fields = ("lora_ids",)

    def __init__(self, gate):
        self.gate = gate

    def write(self, a, spans) -> dict:
        lora_ids = a["lora_ids"]
        for seq, t, _, n in spans:
            lora_ids[t:t + n] = seq.lora_slot
        return {"lora_loads": self.gate.take_loads()}

    @staticmethod
    def off() -> dict:
        return {"lora_loads": []}


class ImageRows:
    """The rows of image tokens (a prompt's ImageSpans): which image token each run of rows is,
    and, where an image's tokens attend to each other both ways, how far every row sees (image
    tokens: their image's last position; the rest: their own). Steps without such rows leave
    see_until padding and are not sent it."""

    fields = ("see_until",)

    def write(self, a, spans) -> dict:
        items = []
        for seq, t, start, n in spans:
            for im in seq.req.images:
                lo, hi = max(im.start, start), min(im.end, start + n)
                if lo < hi:
                    items.append((t + lo - start, im, lo - im.start, hi - lo))
        both_ways = any(im.bidirectional for _, im, _, _ in items)
        if both_ways:
            see = a["see_until"]
            see[:] = a["positions"]
            for t, im, _, k in items:
                if im.bidirectional:
                    see[t:t + k] = im.end - 1
        return {"mm_items": items, "see_until_on": both_ways}


class RopeRows:
    """Multimodal RoPE (Qwen3-VL): each row's (t, h, w) positions, from its request's prompt
    positions (runtime/host/image_prompt.py mrope_positions) or, past the prompt, its position +
    the request's delta; a row of a request without them: its position thrice. Steps with no
    such request leave them padding and are not sent them."""

    fields = ("rope_positions",)

    def write(self, a, spans) -> dict:
        on = any(seq.req.rope_positions is not None for seq, _, _, _ in spans)
        if on:
            out, positions = a["rope_positions"], a["positions"]
            for seq, t, start, n in spans:
                pos = positions[t:t + n]
                rp = seq.req.rope_positions
                if rp is None:
                    out[t:t + n] = pos[:, None]
                    continue
                inside = pos < len(rp)
                out[t:t + n] = np.where(inside[:, None], rp[np.minimum(pos, len(rp) - 1)],
                                        (pos + seq.req.rope_delta)[:, None])
        return {"mrope": on}


WRITERS = (SamplingRows, LogprobRows, StructuredRows, ProcessorRows, SpeculativeRows, LoraRows,
           ImageRows, RopeRows)
OPTIONAL = (SpeculativeRows, LoraRows)  # left out by some configurations: their `off()` statics


class PlanRows:
    """The writers of one scheduler configuration: proposals with `num_spec_tokens` > 0,
    adapter rows with a LoRA gate."""

    def __init__(self, *, page_size: int, num_spec_tokens: int = 0, lora_gate=None):
        self.page_size = page_size
        writers = [SamplingRows(), LogprobRows(), StructuredRows(), ProcessorRows(), ImageRows(),
                   RopeRows()]
        if num_spec_tokens:
            writers.append(SpeculativeRows(num_spec_tokens))
        if lora_gate is not None:
            writers.append(LoraRows(lora_gate))
        self.writers = tuple(writers)
        self._left_out = [w for w in OPTIONAL if not any(type(x) is w for x in writers)]

    def write(self, a: dict[str, np.ndarray], rows: list) -> dict:
        """Fill the plan arrays `a` (padding) for `rows`; return the StepPlan statics."""
        spans = write_core(a, rows, self.page_size)
        statics: dict = {}
        for w in self._left_out:
            statics.update(w.off())
        for w in self.writers:
            statics.update(w.write(a, spans))
        return statics
