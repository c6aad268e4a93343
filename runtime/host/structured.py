"""Structured output: what a request's output must match, and the per-row token masks.

`StructuredOutputs` (vLLM's shape: exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object`) is a request field, checked at the request door. `Grammars` is the engine's
constraint engine over llguidance (JSON schema, regex and Lark grammars compiled against the
served vocabulary; masks as int32 bitmasks [S, ceil(V/32)], bit v of word v // 32 set = id v
allowed). Host code: numpy and llguidance, no JAX (the scheduler imports the request door).

    grammars = Grammars(tokenizer, vocab_size=V, eos_ids=eos)
    grammars.check(so)                  # at the door: RequestError naming the field
    fut = grammars.start(so)            # thread pool -> Future[matcher] (tokenizer built once)
    grammars.fill([(matcher, row), ...], bitmask)   # next-token masks of the constrained rows
    matcher.consume_tokens(new_ids)     # after each step

JSON is generated compactly: `", "` between items, `": "` after keys, no other whitespace. Free
whitespace lets a small model emit newlines until max_tokens, which no parser accepts.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from jaxinfer.runtime.host.errors import RequestError

MAX_GRAMMAR_CHARS = 1 << 16  # a schema / regex / grammar's text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputs:
    """The output must match: `json` a JSON schema (dict or JSON text), `regex` a regular
    expression, `choice` one of the strings, `grammar` a Lark grammar (llguidance's dialect),
    `json_object` any JSON object. Exactly one is set. Bad values raise RequestError naming
    `structured_outputs.<kind>` (or `field` given to `from_json`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise RequestError("structured_outputs", f"set exactly one of {', '.join(KINDS)}; got "
                                               f"{', '.join(set_) or 'none'}")
        kind = set_[0]
        name = f"structured_outputs.{kind}"
        v = getattr(self, kind)
        if kind == "json":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    raise RequestError(name, f"is not valid JSON: {e}") from None
            if not isinstance(v, (dict, bool)):
                raise RequestError(name, f"must be a JSON schema (an object), got {type(v).__name__}")
            try:
                text = json.dumps(v, sort_keys=True, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise RequestError(name, f"is not a JSON value: {type(e).__name__}: {e}") from None
            _check_len(name, text)
            object.__setattr__(self, "json", text)  # canonical: hashable, one cache key
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                raise RequestError(name, f"must be a non-empty string, got {type(v).__name__}")
            _check_len(name, v)
        elif kind == "choice":
            if isinstance(v, str) or not isinstance(v, Sequence) or not v:
                raise RequestError(name, "must be a non-empty list of strings")
            if len(v) > MAX_CHOICES:
                raise RequestError(name, f"takes at most {MAX_CHOICES} strings, got {len(v)}")
            if not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in v):
                raise RequestError(name, f"must hold strings of 1..{MAX_CHOICE_CHARS} characters")
            object.__setattr__(self, "choice", tuple(v))
        elif v is not True:
            raise RequestError(name, f"must be a boolean, got {type(v).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_json(cls, obj) -> StructuredOutputs:
        """From a JSON object {"json": ..., "regex": ..., ...} (vLLM's `structured_outputs`)."""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, Mapping):
            raise RequestError("structured_outputs", f"must be an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(KINDS))
        if unknown:
            raise RequestError(f"structured_outputs.{unknown[0]}",
                               f"unknown field (known: {', '.join(KINDS)})")
        return cls(**{k: v for k, v in obj.items() if v is not None})


def _check_len(name: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(name, f"is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    import llguidance as llg

    M = llg.LLMatcher
    kind = so.kind
    if kind == "json":
        return M.grammar_from_json_schema(so.json, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return M.grammar_from_regex(so.regex)
    if kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    return M.grammar_from_lark(so.grammar)


def checked_grammar(so: StructuredOutputs) -> str:
    """The grammar of a constraint llguidance can compile; RequestError naming it otherwise."""
    ok, got = _checked(so)
    if not ok:
        raise RequestError(f"structured_outputs.{so.kind}", got)
    return got


@functools.lru_cache(maxsize=256)
def _checked(so: StructuredOutputs) -> tuple[bool, str]:
    """(True, grammar) or (False, why), cached by constraint."""
    import llguidance as llg

    try:
        text = grammar_text(so)
    except ValueError as e:
        return False, f"invalid: {e}"
    msg = llg.LLMatcher.validate_grammar(text)
    if msg:
        return False, f"invalid: {msg.strip().splitlines()[0]}"
    return True, text


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes as llguidance reads a vocabulary: text pieces as UTF-8 (sentencepiece's
    U+2581 as a space, byte pieces <0xNN> as that byte), special tokens as b"\\xff" + their name
    (never matched by text), ids past the tokenizer's vocabulary (a padded matmul) empty."""
    sp = tokenizer.processor
    out = []
    for i in range(tokenizer.vocab_size):
        piece = sp.IdToPiece(i)
        if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i):
            out.append(b"\xff" + piece.encode())
        elif sp.IsByte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out + [b""] * (vocab_size - len(out))


class _SentencePieceVocab:
    """llguidance's TokenizerWrapper protocol over a SentencePieceTokenizer. Its tokenize
    callback must spell its input exactly (llguidance re-tokenizes forced bytes with it), which
    sentencepiece's normalization (whitespace folding, NFKC) does not promise: it splits greedily
    into the longest pieces instead."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        self.tokens = token_bytes(tokenizer, vocab_size)
        self.eos_token_id, self.bos_token_id = eos_id, tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        special = set(self.special_token_ids)
        self._ids = {}
        for i, b in enumerate(self.tokens):
            if b and i not in special:
                self._ids.setdefault(b, i)
        self._longest = max(map(len, self._ids))

    def __call__(self, text) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} has no token in the vocabulary")
        return out


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """The llguidance tokenizer of the served vocabulary (about 2 s for Gemma's 262k ids)."""
    import llguidance as llg

    from jaxinfer.runtime.host.tokenizer import HFTokenizer

    eos = list(eos_ids)
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llg.TokenizerWrapper(_SentencePieceVocab(tokenizer, vocab_size, eos[0]))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class Grammars:
    """One engine's constraint engine: the door's check, matchers built off the serving path
    (a thread pool; one compiled matcher per constraint, copied per request), and masks."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_ids: Sequence[int], threads: int = 2):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.words = -(-vocab_size // 32)  # W: int32 words per mask row
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._ll = None  # llguidance tokenizer, built on first use (in the pool)
        self._compiled: dict[StructuredOutputs, object] = {}  # constraint -> initial matcher
        self._executor = None

    @classmethod
    def of(cls, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> Grammars | None:
        """The engine's grammars, or None (structured output refused at the door) when the
        tokenizer is not one llguidance can read (sentencepiece or tokenizer.json) or has no EOS."""
        from jaxinfer.runtime.host.tokenizer import HFTokenizer, SentencePieceTokenizer

        if not isinstance(tokenizer, (HFTokenizer, SentencePieceTokenizer)) or not eos_ids:
            return None
        return cls(tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)

    def check(self, so: StructuredOutputs) -> None:
        """The door: a constraint llguidance cannot compile raises RequestError naming it."""
        checked_grammar(so)

    def min_tokens(self, so: StructuredOutputs) -> int:
        """Fewer tokens than this cannot spell any output `so` allows (a lower bound: the
        shortest match's bytes over the longest piece's; runtime/host/shortest_output.py)."""
        from jaxinfer.runtime.host.shortest_output import shortest_bytes

        return -(-shortest_bytes(so) // self.longest_piece)

    @functools.cached_property
    def longest_piece(self) -> int:
        """The most bytes one token of the vocabulary spells (computed once, on first use)."""
        from jaxinfer.runtime.host.tokenizer import HFTokenizer

        if isinstance(self.tokenizer, HFTokenizer):  # UTF-8 of byte-level pieces: an upper bound
            pieces = self.tokenizer.backend.get_vocab(with_added_tokens=False)
            return max(1, max(len(p.encode()) for p in pieces))
        return max(1, max(len(b) for b in token_bytes(self.tokenizer, self.vocab_size)
                          if not b.startswith(b"\xff")))

    def start(self, so: StructuredOutputs) -> Future:
        """A fresh matcher for one request, built in the pool."""
        return self._pool.submit(self._matcher, so)

    def _matcher(self, so: StructuredOutputs):
        import llguidance as llg

        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
                self._executor = llg.LLExecutor()
            base = self._compiled.get(so)
            if base is None:
                base = llg.LLMatcher(self._ll, checked_grammar(so), log_level=0)
                if base.is_error():
                    raise RequestError(f"structured_outputs.{so.kind}", f"invalid: {base.get_error()}")
                if len(self._compiled) >= 256:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[so] = base
        return base.deep_copy()

    def fill(self, rows: list[tuple[object, int]], bitmask: np.ndarray) -> None:
        """Write each (matcher, row)'s next-token mask into bitmask [N, W] (int32, C order)."""
        self._check(bitmask)
        if rows:
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, self.words * 4,
                                                   bitmask.shape[0])

    def fill_drafts(self, rows: list[tuple[object, int, list[int]]], bitmask: np.ndarray) -> None:
        """Speculative rows: for each (matcher, row r, proposals d), bitmask[r + j] = the mask
        after the first j proposals, j = 0..len(d), stopping after a proposal the grammar
        refuses (verify rejects it there; later rows keep what they held). Matchers are left as
        they were."""
        self._check(bitmask)
        if rows:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                rows, bitmask.ctypes.data, self.words * 4, bitmask.shape[0])

    def _check(self, bitmask: np.ndarray) -> None:
        if (bitmask.ndim != 2 or bitmask.shape[1] != self.words or bitmask.dtype != np.int32
                or not bitmask.flags["C_CONTIGUOUS"]):
            raise ValueError(f"bitmask {bitmask.dtype}{list(bitmask.shape)} is not int32 "
                             f"[N, {self.words}] in C order")


class Constraints:
    """An engine's constrained requests: those whose matcher is still compiling (`held`, kept
    out of the scheduler until it is ready) and the live matchers, advanced by every token the
    step emits. With asynchronous scheduling the engine applies a step with constrained rows
    before planning the next one: a row's next mask needs its last token."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self.held: dict[str, tuple[Future, object]] = {}  # request id -> (matcher, Request)
        self.live: dict[str, object] = {}  # request id -> matcher

    def hold(self, req, so: StructuredOutputs) -> None:
        self.held[req.request_id] = (self.grammars.start(so), req)

    def ready(self, wait_s: float = 0.0) -> list[tuple[object, str | None]]:
        """Held requests whose matcher is built (waiting up to `wait_s` for one):
        [(Request, None)] to schedule, or [(Request, why)] for a matcher that failed."""
        if wait_s and self.held and not any(f.done() for f, _ in self.held.values()):
            from concurrent.futures import FIRST_COMPLETED, wait

            wait([f for f, _ in self.held.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        out = []
        for rid, (fut, req) in list(self.held.items()):
            if not fut.done():
                continue
            del self.held[rid]
            try:
                self.live[rid] = fut.result()
                out.append((req, None))
            except Exception as e:  # noqa: BLE001 - that request fails, the engine goes on
                out.append((req, f"structured output: {e}"))
        return out

    def any_in(self, plan) -> bool:
        return any(rid in self.live for rid in plan.request_ids)

    def fill(self, plan) -> None:
        """The masks of the plan's constrained rows: the next token's (plan.token_bitmask) and,
        for rows with proposals, those after each proposal (plan.draft_bitmask)."""
        live = [(self.live[rid], s) for s, rid in enumerate(plan.request_ids)
                if plan.constrained[s] and rid in self.live]
        if not plan.has_drafts:
            self.grammars.fill(live, plan.token_bitmask)
            return
        k = plan.spec_k
        masks = np.full((len(live), k + 1, self.grammars.words), -1, np.int32)  # [L, K+1, W]
        flat = masks.reshape(-1, self.grammars.words)
        rows = [(m, i * (k + 1), [int(t) for t in plan.draft_ids[s, :plan.num_draft[s]]])
                for i, (m, s) in enumerate(live)]
        self.grammars.fill_drafts([r for r in rows if r[2]], flat)
        self.grammars.fill([(m, r) for m, r, d in rows if not d], flat)
        for i, (_, s) in enumerate(live):
            plan.token_bitmask[s] = masks[i, 0]
            plan.draft_bitmask[s] = masks[i, 1:]

    def advance(self, request_id: str, token_ids: Sequence[int]) -> tuple[str | None, str]:
        """Feed a step's tokens to the request's matcher -> (None, "") to go on, ("stop", "")
        when the grammar is complete, ("error", why) when a token broke it."""
        m = self.live.get(request_id)
        if m is None:
            return None, ""
        if not m.consume_tokens(list(token_ids)):
            return "error", f"structured output: {m.get_error() or 'token rejected by the grammar'}"
        return ("stop", "") if m.is_stopped() else (None, "")

    def drop(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        held = self.held.pop(request_id, None)
        if held is not None:
            held[0].cancel()
