"""Per-request logits processors, the host half: what a request asks for, and the rows of the
device state its slot is loaded with. No JAX (the device half: runtime/device/processors.py).

A request uses processors when it sets any of repetition_penalty, presence_penalty,
frequency_penalty, logit_bias, min_tokens, bad_words or allowed_token_ids. The device keeps one
state row per scheduler slot; the row of a request's slot is written once when it takes the slot
(admission, or re-admission after preemption: then from every token it has so far) and the step
updates it with each token it samples, on the device, so penalties cost no host round trip and
asynchronous scheduling and speculation see the counts of their own prefix.

A slot's row (`SLOT_ROW`; dims: V vocabulary, W = ceil(V / 32) words):

    counts     [V] int32       output occurrences of each id, + PROMPT_BIT if it is in the prompt
    recent     [H] int32       the last H tokens (prompt and output), -1 before the first
    penalties  [3] f32         repetition, presence, frequency
    min_pos    []  int32       positions below it sample no stop id (prompt length + min_tokens)
    stop_ids   [NS] int32      EOS (unless ignore_eos) and stop_token_ids; V: none
    bias_ids   [NB] int32      logit_bias ids (V: none), bias_vals [NB] f32 their values
    allowed    [W] int32       allowed_token_ids as bits (all set: any)
    bad        [NW, H + 1]     bad-word token sequences, right-aligned, -1 before the first

The order the device applies them in: logit_bias, repetition penalty, frequency and presence
penalties, then the bans (allowed_token_ids, min_tokens, bad words) -- bias before penalties, as
vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxinfer.runtime.host.errors import RequestError
from jaxinfer.runtime.host.requests import (MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS,
                                            SamplingParams)
from jaxinfer.runtime.plan import PROMPT_BIT

MAX_BAD_WORD_TOKENS = 16  # a bad word's token sequence, at most
HISTORY = MAX_BAD_WORD_TOKENS - 1  # H: tokens before a bad word's last one
MAX_EOS_IDS = 8


@dataclass(frozen=True)
class Dims:
    vocab: int  # V
    stops: int = MAX_STOP_TOKEN_IDS + MAX_EOS_IDS  # NS
    bias: int = MAX_LOGIT_BIAS  # NB
    bad: int = 2 * MAX_BAD_WORDS  # NW: each word with and without a leading space
    history: int = HISTORY  # H

    @property
    def words(self) -> int:
        return -(-self.vocab // 32)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], type]]:
        """SLOT_ROW's arrays: name -> (shape, dtype)."""
        return {"counts": ((self.vocab,), np.int32), "recent": ((self.history,), np.int32),
                "penalties": ((3,), np.float32), "min_pos": ((), np.int32),
                "stop_ids": ((self.stops,), np.int32), "bias_ids": ((self.bias,), np.int32),
                "bias_vals": ((self.bias,), np.float32), "allowed": ((self.words,), np.int32),
                "bad": ((self.bad, self.history + 1), np.int32)}


def bad_word_ids(words: Sequence[str], tokenizer) -> list[tuple[int, ...]]:
    """Each bad word's token sequences: the word as it is and after a space (how it reads
    mid-sentence), without BOS; deduplicated. RequestError naming the word if one tokenizes to
    nothing or to more than MAX_BAD_WORD_TOKENS tokens."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        for text in (word, " " + word.lstrip(" ")):
            try:
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
                raise RequestError(f"bad_words[{i}]", f"cannot be tokenized: "
                                                      f"{type(e).__name__}") from None
            if not ids:
                raise RequestError(f"bad_words[{i}]", "encodes to no tokens")
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise RequestError(f"bad_words[{i}]", f"encodes to {len(ids)} tokens; at most "
                                                      f"{MAX_BAD_WORD_TOKENS}")
            if ids not in out:
                out.append(ids)
    return out


@dataclass(frozen=True)
class ProcessorSpec:
    """What one request's processors need beside its tokens (built once, at add_request)."""

    penalties: tuple[float, float, float]  # repetition, presence, frequency
    min_tokens: int
    stop_ids: tuple[int, ...]  # banned before min_tokens
    bias: tuple[tuple[int, float], ...]
    allowed: tuple[int, ...] | None
    bad: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, p: SamplingParams, eos_ids: Sequence[int], tokenizer) -> ProcessorSpec | None:
        if not processor_fields(p):
            return None
        stops = tuple(dict.fromkeys((() if p.ignore_eos else tuple(eos_ids)[:MAX_EOS_IDS])
                                    + p.stop_token_ids))
        return cls((p.repetition_penalty, p.presence_penalty, p.frequency_penalty), p.min_tokens,
                   stops, p.logit_bias, p.allowed_token_ids,
                   tuple(bad_word_ids(p.bad_words, tokenizer)) if p.bad_words else ())

    def slot_row(self, dims: Dims, prompt: Sequence[int], output: Sequence[int]) -> dict:
        """The slot's state row for a sequence with these prompt and output tokens."""
        V, H = dims.vocab, dims.history
        row = {name: np.zeros(shape, dtype) for name, (shape, dtype) in dims.shapes().items()}
        counts = row["counts"]
        counts[np.asarray(prompt, np.int64)] = PROMPT_BIT
        if len(output):
            counts += np.bincount(np.asarray(output, np.int64), minlength=V).astype(np.int32)
        tail = (list(prompt) + list(output))[-H:]
        row["recent"][:] = -1
        if tail:
            row["recent"][H - len(tail):] = tail
        row["penalties"][:] = self.penalties
        row["min_pos"][...] = len(prompt) + self.min_tokens
        row["stop_ids"][:] = V
        row["stop_ids"][:len(self.stop_ids)] = self.stop_ids
        row["bias_ids"][:] = V
        for i, (t, b) in enumerate(self.bias):
            row["bias_ids"][i], row["bias_vals"][i] = t, b
        if self.allowed is None:
            row["allowed"][:] = -1
        else:
            bits = np.zeros(dims.words * 32, np.uint8)
            bits[np.asarray(self.allowed, np.int64)] = 1
            row["allowed"][:] = np.packbits(bits, bitorder="little").view(np.int32)
        row["bad"][:] = -1
        for i, ids in enumerate(self.bad):
            row["bad"][i, H + 1 - len(ids):] = ids
        return row


def processor_fields(p: SamplingParams) -> list[str]:
    """The processor fields `p` sets, in table order."""
    off = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "logit_bias": (), "min_tokens": 0, "bad_words": (), "allowed_token_ids": None}
    return [n for n, v in off.items() if getattr(p, n) != v]
