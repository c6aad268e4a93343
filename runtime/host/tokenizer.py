"""Tokenizers: sentencepiece `.model`, HF `tokenizer.json`, GGUF vocabularies; streaming detokenizer.

Every tokenizer the runtime uses has the same small surface (`Tokenizer`):

* `encode(text, add_special_tokens=True)` -> ids. Control/special tokens written literally in the
  text (``"<start_of_turn>"``, ``"<|eot_id|>"``) become their single ids, as HF tokenizers do, so a
  rendered chat template encodes correctly. With `add_special_tokens`, BOS is prepended when
  `add_bos` (and EOS appended when `add_eos`).
* `decode(ids, skip_special_tokens=True)` -> text.
* `vocab_size` (1 + the largest id), `bos_id`, `eos_ids` (every id that ends generation),
  `add_bos`, `special_ids` (ids that `skip_special_tokens` drops).

Three back ends:

* `SentencePieceTokenizer` -- a sentencepiece model (`tokenizer.model` or serialized proto bytes)
  run by the `sentencepiece` library itself.
* `HFTokenizer` -- a `tokenizer.json` run by the `tokenizers` library; BOS/EOS and `add_bos` come
  from `tokenizer_config.json`, `special_tokens_map.json`, `config.json` and
  `generation_config.json` next to it.
* `tokenizer_from_gguf` -- the vocabulary inside a GGUF file. ``tokenizer.ggml.model == "llama"``
  (sentencepiece style, also Gemma's) is rebuilt as a sentencepiece BPE `ModelProto` (pieces,
  scores and piece types copied; identity normalizer, no whitespace collapsing; the dummy prefix
  from ``tokenizer.ggml.add_space_prefix``) and run by `sentencepiece`, which is exactly the
  algorithm llama.cpp's SPM tokenizer implements. ``"gpt2"`` (byte-level BPE with merges) is built
  as a `tokenizers` BPE with the pre-tokenizer regex named by ``tokenizer.ggml.pre``.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas without ever emitting
half a UTF-8 character, at O(1) amortized decode work per token.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Tokenizer",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "decode_text",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "check_compatible",
    "END_OF_TURN_TOKENS",
]

# Control tokens that end an assistant turn in common chat formats. When one of these exists in a
# vocabulary as a control/special token, it is counted among `eos_ids` (Gemma's `<end_of_turn>`,
# Llama 3's `<|eot_id|>`/`<|eom_id|>`, ChatML's `<|im_end|>`, Phi-3's `<|end|>`).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")

_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer cannot be found, loaded, or used with the model it was paired with."""


# ---------------------------------------------------------------------------------------------
# Base class
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """The interface the runtime uses. Subclasses fill the attributes in `__init__`."""

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool = False
    special_ids: frozenset[int] = frozenset()
    source: str = "<tokenizer>"
    # Jinja chat template from the checkpoint (tokenizer_config.json `chat_template`, a
    # `chat_template.jinja` file, or GGUF `tokenizer.chat_template`); None when it has none.
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def id_to_piece(self, token_id: int) -> str:
        raise NotImplementedError

    def token_to_id(self, piece: str) -> int | None:
        raise NotImplementedError

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_piece(int(i)) for i in ids]

    def export_files(self) -> dict[str, bytes]:
        """Files (name -> bytes) from which `load_tokenizer` rebuilds this tokenizer exactly.

        Used to ship a GGUF's vocabulary next to converted weights: the vocabulary file plus a
        `tokenizer_config.json` with BOS/EOS, `add_bos_token`/`add_eos_token` and the full EOS list
        (`eos_token_ids`, a jaxinfer key read back by `load_tokenizer`).
        """
        raise NotImplementedError

    def _export_config(self) -> bytes:
        cfg: dict[str, Any] = {
            "add_bos_token": bool(self.add_bos),
            "add_eos_token": bool(self.add_eos),
            "eos_token_ids": list(self.eos_ids),
        }
        if self.bos_id is not None:
            cfg["bos_token"] = self.id_to_piece(self.bos_id)
        if self.eos_ids:
            cfg["eos_token"] = self.id_to_piece(self.eos_ids[0])
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return json.dumps(cfg, indent=2, ensure_ascii=False).encode("utf-8")

    # -- helpers shared by the back ends ------------------------------------------------------

    def _with_specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids = [self.bos_id] + ids
            if self.add_eos and self.eos_ids:
                ids = ids + [self.eos_ids[0]]
        return ids

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        for i in out:
            if i < 0 or i >= self.vocab_size:
                raise TokenizerError(
                    f"token id {i} is outside the vocabulary of {self.source} (size {self.vocab_size})"
                )
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={self.eos_ids}, add_bos={self.add_bos})"
        )


def _dedupe(ids: Iterable[int | None]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) >= 0 and int(i) not in out:
            out.append(int(i))
    return tuple(out)


class _Literals:
    """Finds any of some pieces in a text, leftmost first and then longest (as an alternation
    regex of them, longest first, would). Built from a dict by first character and length: a
    regex over Gemma's ~6k control pieces took 0.6 s to compile on every load."""

    def __init__(self, pieces: Iterable[str]) -> None:
        by_first: dict[str, dict[int, set[str]]] = {}
        for p in {p for p in pieces if p}:
            by_first.setdefault(p[0], {}).setdefault(len(p), set()).add(p)
        self._by_first = {c: sorted(lens.items(), reverse=True) for c, lens in by_first.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in by_first) + "]")

    def finditer(self, text: str) -> Iterator[tuple[int, int, str]]:
        """(start, end, piece) of each match, left to right, never overlapping."""
        pos = 0
        while (m := self._starts.search(text, pos)) is not None:
            i = m.start()
            pos = i + 1
            for n, pieces in self._by_first[text[i]]:
                if text[i:i + n] in pieces:
                    yield i, i + n, text[i:i + n]
                    pos = i + n
                    break


def _special_splitter(pieces: Iterable[str]) -> _Literals | None:
    """A finder of `pieces` written literally, longest first (so `<a>` never shadows `<ab>`)."""
    found = _Literals(pieces)
    return found if found._by_first else None


# ---------------------------------------------------------------------------------------------
# sentencepiece
# ---------------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model, run by the `sentencepiece` library.

    `model` is a path to a `.model` file or the serialized `ModelProto` bytes. Defaults: BOS/EOS
    are the model's own `<s>`/`</s>` (whatever its trainer spec names them), `add_bos` is True when
    the model has a BOS piece (the Llama/Gemma convention). Control pieces written literally in
    the text are encoded as their ids; text after such a piece gets no dummy-prefix space (as HF
    fast tokenizers with ``prepend_scheme="first"`` behave).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        bos_id: int | None = None,
        eos_ids: Sequence[int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        source: str | None = None,
    ) -> None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2

        if isinstance(model, (bytes, bytearray)):
            data = bytes(model)
            self.source = source or "<sentencepiece model bytes>"
        else:
            path = Path(model)
            self.source = source or str(path)
            try:
                data = path.read_bytes()
            except OSError as e:
                raise TokenizerError(f"cannot read sentencepiece model {path}: {e}") from e
        from google.protobuf.message import DecodeError

        proto = sp_pb2.ModelProto()
        try:
            proto.ParseFromString(data)
        except DecodeError as e:
            raise TokenizerError(
                f"{self.source} is not a valid sentencepiece model (protobuf parse failed: {e})"
            ) from e
        if len(proto.pieces) == 0:
            raise TokenizerError(f"{self.source} is not a valid sentencepiece model (no pieces)")
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError, ValueError) as e:
            raise TokenizerError(f"{self.source} is not a valid sentencepiece model: {e}") from e
        self._sp = sp
        self._proto_bytes = data
        self._add_dummy_prefix = bool(proto.normalizer_spec.add_dummy_prefix)
        self._sp_no_prefix: Any = None  # built lazily, see _encode_plain

        n = sp.GetPieceSize()
        self.vocab_size = n
        # from the parsed proto, not 2 x n library calls (Gemma's 262k pieces: ~0.9 s -> ~0.2 s)
        control_type = sp_pb2.ModelProto.SentencePiece.CONTROL
        self._pieces = [p.piece for p in proto.pieces]
        control = [i for i, p in enumerate(proto.pieces) if p.type == control_type]
        self.special_ids = frozenset(control)
        self._piece_ids = {p: i for i, p in enumerate(self._pieces)}
        self._control_re = _special_splitter(self._pieces[i] for i in control)
        self._control_ids = {self._pieces[i]: i for i in control}

        def own(i: int) -> int | None:
            return i if 0 <= i < n else None

        self.bos_id = bos_id if bos_id is not None else own(sp.bos_id())
        if eos_ids is not None:
            self.eos_ids = _dedupe(eos_ids)
        else:
            self.eos_ids = _dedupe(
                [own(sp.eos_id())] + [self._control_ids.get(t) for t in END_OF_TURN_TOKENS]
            )
        self.add_bos = (self.bos_id is not None) if add_bos is None else bool(add_bos)
        self.add_eos = bool(add_eos)

    # -- encode -------------------------------------------------------------------------------

    def _encode_plain(self, text: str, at_start: bool) -> list[int]:
        if not text:
            return []
        if at_start or not self._add_dummy_prefix:
            return list(self._sp.EncodeAsIds(text))
        if self._sp_no_prefix is None:
            import sentencepiece as spm
            from sentencepiece import sentencepiece_model_pb2 as sp_pb2

            proto = sp_pb2.ModelProto()
            proto.ParseFromString(self._proto_bytes)
            proto.normalizer_spec.add_dummy_prefix = False
            sp = spm.SentencePieceProcessor()
            sp.LoadFromSerializedProto(proto.SerializeToString())
            self._sp_no_prefix = sp
        return list(self._sp_no_prefix.EncodeAsIds(text))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        pos = 0
        if self._control_re is not None:
            for start, end, piece in self._control_re.finditer(text):
                ids += self._encode_plain(text[pos:start], at_start=pos == 0)
                ids.append(self._control_ids[piece])
                pos = end
        ids += self._encode_plain(text[pos:], at_start=pos == 0)
        return self._with_specials(ids, add_special_tokens)

    # -- decode -------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._check_ids(ids)
        if skip_special_tokens or not any(i in self.special_ids for i in ids):
            # sentencepiece renders control pieces as "" by itself.
            return self._sp.DecodeIds(ids)
        # Keep control pieces as their text: decode the runs between them. Only the very first
        # non-control piece of the whole sequence loses its dummy-prefix space, as in one-shot
        # decoding, so a run after the first one gets that space back.
        out: list[str] = []
        run: list[int] = []
        seen_text = False

        def flush_run() -> None:
            nonlocal seen_text
            if not run:
                return
            text = self._sp.DecodeIds(run)
            if seen_text and self._add_dummy_prefix and self._pieces[run[0]].startswith("\u2581"):
                text = " " + text
            out.append(text)
            seen_text = True
            run.clear()

        for i in ids:
            if i in self.special_ids:
                flush_run()
                out.append(self._pieces[i])
            else:
                run.append(i)
        flush_run()
        return "".join(out)

    def id_to_piece(self, token_id: int) -> str:
        return self._pieces[int(token_id)]

    def token_to_id(self, piece: str) -> int | None:
        return self._piece_ids.get(piece)

    def export_files(self) -> dict[str, bytes]:
        return {"tokenizer.model": self._proto_bytes, "tokenizer_config.json": self._export_config()}

    @property
    def processor(self) -> Any:
        """The underlying `sentencepiece.SentencePieceProcessor`."""
        return self._sp


# ---------------------------------------------------------------------------------------------
# HF tokenizer.json
# ---------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """`"<s>"` or `{"content": "<s>", ...}` (both spellings appear in tokenizer_config.json)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer(Tokenizer):
    """A `tokenizer.json`, run by the `tokenizers` library.

    BOS/EOS: explicit arguments first; else `tokenizer_config.json` (`bos_token`, `eos_token`,
    `add_bos_token`, `add_eos_token`), `special_tokens_map.json`, `config.json` and
    `generation_config.json` (`bos_token_id`, `eos_token_id`, int or list) from the same
    directory. A jaxinfer `eos_token_ids` list in tokenizer_config.json (written by
    `export_files`) is taken as the whole EOS set. Otherwise all EOS ids found are unioned, plus any end-of-turn control token
    (`END_OF_TURN_TOKENS`) present as a special token. When no config says whether BOS is added,
    the tokenizer.json post-processor decides (it is probed once). We add BOS/EOS ourselves and
    never run the post-processor, so `add_bos` is always what `encode` does.

    `clean_up_tokenization_spaces` is deliberately not applied: it is lossy and not local, so
    streamed text could not match one-shot decoding.
    """

    def __init__(
        self,
        tokenizer_json: str | os.PathLike[str] | None = None,
        *,
        backend: Any = None,
        config_dir: str | os.PathLike[str] | None = None,
        bos_id: int | None = None,
        eos_ids: Sequence[int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        source: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _TkTokenizer

        if backend is None:
            if tokenizer_json is None:
                raise TypeError("HFTokenizer needs a tokenizer.json path or a `backend`")
            path = Path(tokenizer_json)
            self.source = source or str(path)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read {path}: {e}") from e
            try:
                backend = _TkTokenizer.from_str(text)
            except Exception as e:  # tokenizers raises a bare `Exception` on malformed JSON
                raise TokenizerError(f"{path} is not a valid tokenizer.json: {e}") from e
            if config_dir is None:
                config_dir = path.parent
        else:
            self.source = source or "<tokenizers.Tokenizer>"
        self._tk = backend

        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size = max([backend.get_vocab_size(with_added_tokens=True) - 1, *added.keys()]) + 1

        cfg: dict[str, Any] = {}
        stm: dict[str, Any] = {}
        model_cfg: dict[str, Any] = {}
        gen_cfg: dict[str, Any] = {}
        if config_dir is not None:
            d = Path(config_dir)
            for name, target in (
                ("tokenizer_config.json", cfg),
                ("special_tokens_map.json", stm),
                ("config.json", model_cfg),
                ("generation_config.json", gen_cfg),
            ):
                if (d / name).is_file():
                    target.update(_read_json(d / name))
        if isinstance(model_cfg.get("text_config"), dict):  # multimodal wrappers (Gemma 3)
            model_cfg = {**model_cfg["text_config"], **model_cfg}

        def tok_id(value: Any) -> int | None:
            content = _token_content(value)
            return None if content is None else backend.token_to_id(content)

        if bos_id is None:
            bos_id = tok_id(cfg.get("bos_token"))
        if bos_id is None:
            bos_id = tok_id(stm.get("bos_token"))
        if bos_id is None:
            ids = _as_id_list(model_cfg.get("bos_token_id")) or _as_id_list(gen_cfg.get("bos_token_id"))
            bos_id = ids[0] if ids else None
        self.bos_id = bos_id

        if eos_ids is None and isinstance(cfg.get("eos_token_ids"), list):
            eos_ids = _as_id_list(cfg["eos_token_ids"])
        if eos_ids is not None:
            self.eos_ids = _dedupe(eos_ids)
        else:
            found: list[int | None] = [tok_id(cfg.get("eos_token")), tok_id(stm.get("eos_token"))]
            found += _as_id_list(model_cfg.get("eos_token_id"))
            found += _as_id_list(gen_cfg.get("eos_token_id"))
            for name in END_OF_TURN_TOKENS:
                i = backend.token_to_id(name)
                if i is not None and i in self.special_ids:
                    found.append(i)
            self.eos_ids = _dedupe(found)

        probe_bos, probe_eos = self._probe_post_processor()
        if add_bos is None:
            add_bos = cfg.get("add_bos_token") if isinstance(cfg.get("add_bos_token"), bool) else probe_bos
        if add_eos is None:
            add_eos = cfg.get("add_eos_token") if isinstance(cfg.get("add_eos_token"), bool) else probe_eos
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.add_eos = bool(add_eos) and bool(self.eos_ids)

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """Does the tokenizer.json post-processor add BOS / EOS around a single sequence?"""
        if self._tk.post_processor is None:
            return False, False
        plain = self._tk.encode("a", add_special_tokens=False).ids
        full = self._tk.encode("a", add_special_tokens=True).ids
        if not plain or len(full) <= len(plain):
            return False, False
        start = full.index(plain[0]) if plain[0] in full else 0
        pre, post = full[:start], full[start + len(plain) :]
        bos = self.bos_id is not None and self.bos_id in pre
        eos = any(e in post for e in self.eos_ids)
        return bos, eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._tk.encode(text, add_special_tokens=False).ids)
        return self._with_specials(ids, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tk.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary of {self.source}")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def export_files(self) -> dict[str, bytes]:
        return {
            "tokenizer.json": self._tk.to_str().encode("utf-8"),
            "tokenizer_config.json": self._export_config(),
        }

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk


# ---------------------------------------------------------------------------------------------
# Finding a tokenizer in a checkpoint directory
# ---------------------------------------------------------------------------------------------

_LOOKED_FOR = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(
    checkpoint_dir: str | os.PathLike[str],
    *,
    bos_id: int | None = None,
    eos_ids: Sequence[int] | None = None,
) -> Tokenizer:
    """The tokenizer of a checkpoint directory: `tokenizer.json` if present, else `tokenizer.model`.

    For a `tokenizer.model`, BOS/EOS/add_bos defaults come from the model itself, overridden by
    `tokenizer_config.json` / `config.json` / `generation_config.json` in the directory when they
    name them. Raises `TokenizerError` naming the directory and the files looked for when neither
    exists, or naming the file when it cannot be loaded.
    """
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise TokenizerError(f"tokenizer directory {d} does not exist or is not a directory")
    tj = d / "tokenizer.json"
    tm = d / "tokenizer.model"
    if tj.is_file() or tm.is_file():
        tok: Tokenizer = (HFTokenizer(tj, config_dir=d, bos_id=bos_id, eos_ids=eos_ids) if tj.is_file()
                          else _sentencepiece_with_configs(tm, d, bos_id=bos_id, eos_ids=eos_ids))
        tok.chat_template = chat_template_from_dir(d)
        return tok
    raise TokenizerError(
        f"no tokenizer found in {d}: looked for {' and '.join(_LOOKED_FOR)} (neither exists)"
    )


def chat_template_from_dir(d: Path) -> str | None:
    """The checkpoint's chat template: `chat_template.jinja` (newer HF layout) or
    tokenizer_config.json `chat_template` (a string, or a list of {name, template} where the
    one named "default" is taken)."""
    f = d / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    t = cfg.get("chat_template")
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default")
    return t if isinstance(t, str) and t else None


def _sentencepiece_with_configs(
    path: Path, d: Path, *, bos_id: int | None, eos_ids: Sequence[int] | None
) -> SentencePieceTokenizer:
    base = SentencePieceTokenizer(path, bos_id=bos_id, eos_ids=eos_ids)
    cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    model_cfg = _read_json(d / "config.json") if (d / "config.json").is_file() else {}
    gen_cfg = (
        _read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    )
    if not (cfg or model_cfg or gen_cfg):
        return base
    if bos_id is None:
        content = _token_content(cfg.get("bos_token"))
        if content is not None and base.token_to_id(content) is not None:
            base.bos_id = base.token_to_id(content)
        elif _as_id_list(model_cfg.get("bos_token_id")):
            base.bos_id = _as_id_list(model_cfg.get("bos_token_id"))[0]
    if eos_ids is None and isinstance(cfg.get("eos_token_ids"), list):
        base.eos_ids = _dedupe(_as_id_list(cfg["eos_token_ids"]))
    elif eos_ids is None:
        content = _token_content(cfg.get("eos_token"))
        extra: list[int | None] = [base.token_to_id(content)] if content is not None else []
        extra += _as_id_list(model_cfg.get("eos_token_id")) + _as_id_list(gen_cfg.get("eos_token_id"))
        base.eos_ids = _dedupe(list(base.eos_ids) + extra)
    if isinstance(cfg.get("add_bos_token"), bool):
        base.add_bos = cfg["add_bos_token"]
    if isinstance(cfg.get("add_eos_token"), bool):
        base.add_eos = cfg["add_eos_token"]
    base.add_bos = base.add_bos and base.bos_id is not None
    return base


def check_compatible(tokenizer: Tokenizer, vocab_size_of_model: int, source: str) -> None:
    """Raise `TokenizerError` when `tokenizer` can produce ids the model has no embedding row for.

    A model may have more rows than the tokenizer has tokens (padding to a multiple of 64/128 is
    common); fewer means the tokenizer belongs to another model.
    """
    if tokenizer.vocab_size > vocab_size_of_model:
        raise TokenizerError(
            f"tokenizer/model mismatch for {source}: the tokenizer ({tokenizer.source}) has "
            f"{tokenizer.vocab_size} tokens but the model's embedding has only "
            f"{vocab_size_of_model} rows"
        )
    for name, ids in (("bos", [tokenizer.bos_id]), ("eos", list(tokenizer.eos_ids))):
        for i in ids:
            if i is not None and not 0 <= i < vocab_size_of_model:
                raise TokenizerError(
                    f"tokenizer/model mismatch for {source}: {name} id {i} is outside the model's "
                    f"{vocab_size_of_model} embedding rows"
                )


# ---------------------------------------------------------------------------------------------
# GGUF vocabularies
# ---------------------------------------------------------------------------------------------

# GGUF token types (llama.cpp), numerically equal to sentencepiece's ModelProto piece types.
_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNUSED, _GGUF_BYTE = 1, 2, 3, 4, 5, 6

# Byte-level BPE pre-tokenizer regexes, by `tokenizer.ggml.pre`.
_PRE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_PRE = {
    "default": (_PRE_GPT2, False),
    "gpt2": (_PRE_GPT2, False),
    "gpt-2": (_PRE_GPT2, False),
    "llama3": (_PRE_LLAMA3, True),
    "llama-v3": (_PRE_LLAMA3, True),
    "llama-bpe": (_PRE_LLAMA3, True),
    "qwen2": (_PRE_QWEN2, False),
    "deepseek-r1-qwen": (_PRE_QWEN2, False),
}


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def tokenizer_from_gguf(reader: Any, source: str) -> Tokenizer:
    """The tokenizer stored in a GGUF file's metadata (`reader`: a checkpoints.gguf_header
    GGUFFile, or a `gguf.GGUFReader`).

    BOS is `tokenizer.ggml.bos_token_id`; `add_bos` is `tokenizer.ggml.add_bos_token` (default
    True for the sentencepiece kind, as llama.cpp does); `eos_ids` unions `eos_token_id`,
    `eot_token_id`, `eom_token_id` and any end-of-turn control token (Gemma's `<end_of_turn>`).
    """
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise TokenizerError(
            f"{source} has no tokenizer in its metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)"
        )
    tokens = list(tokens)
    n = len(tokens)
    types = _gguf_field(reader, "tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [_GGUF_NORMAL] * n
    if len(types) != n:
        raise TokenizerError(f"{source}: {len(types)} token types for {n} tokens")

    def opt_id(key: str) -> int | None:
        v = _gguf_field(reader, key)
        return int(v) if v is not None and 0 <= int(v) < n else None

    bos = opt_id("tokenizer.ggml.bos_token_id")
    eos = [opt_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    by_name = {t: i for i, t in enumerate(tokens) if types[i] == _GGUF_CONTROL and t in END_OF_TURN_TOKENS}
    eos += [by_name.get(t) for t in END_OF_TURN_TOKENS]
    eos_ids = _dedupe(eos)
    add_bos_field = _gguf_field(reader, "tokenizer.ggml.add_bos_token")
    add_eos = bool(_gguf_field(reader, "tokenizer.ggml.add_eos_token", False))

    if kind == "llama":
        scores = _gguf_field(reader, "tokenizer.ggml.scores")
        scores = [float(s) for s in scores] if scores is not None else [0.0] * n
        if len(scores) != n:
            raise TokenizerError(f"{source}: {len(scores)} token scores for {n} tokens")
        proto = _sentencepiece_proto_from_vocab(
            tokens,
            scores,
            types,
            unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
            bos_id=bos,
            eos_id=eos[0],
            pad_id=opt_id("tokenizer.ggml.padding_token_id"),
            add_space_prefix=bool(_gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)),
            source=source,
        )
        return SentencePieceTokenizer(
            proto,
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=True if add_bos_field is None else bool(add_bos_field),
            add_eos=add_eos,
            source=source,
        )
    if kind == "gpt2":
        merges = _gguf_field(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError(f"{source}: a gpt2 (byte-level BPE) vocabulary without tokenizer.ggml.merges")
        pre = str(_gguf_field(reader, "tokenizer.ggml.pre", "default"))
        backend = _byte_level_bpe(tokens, list(merges), types, pre, source)
        return HFTokenizer(
            backend=backend,
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=False if add_bos_field is None else bool(add_bos_field),
            add_eos=add_eos,
            source=source,
        )
    raise TokenizerError(
        f"{source}: unsupported GGUF tokenizer kind tokenizer.ggml.model={kind!r} (supported: llama, gpt2)"
    )


def _sentencepiece_proto_from_vocab(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    unk_id: int | None,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None,
    add_space_prefix: bool,
    source: str,
) -> bytes:
    """A sentencepiece BPE ModelProto equivalent to a llama.cpp SPM vocabulary.

    * Model type BPE: llama.cpp merges the adjacent pair whose result has the best score, which is
      sentencepiece's BPE encoder; byte fallback when the vocabulary has `<0xXX>` byte pieces.
    * Normalizer: identity (no NFKC), whitespace escaped to U+2581, runs of whitespace kept, dummy
      prefix only if `add_space_prefix` (Gemma: no).
    * GGUF files store whitespace-only user-defined tokens with real spaces (Gemma's `"  "` ...);
      sentencepiece matches user-defined pieces on the escaped text, so they become U+2581 runs.
    * The unknown piece must have type UNKNOWN (Gemma's GGUF marks `<unk>` as CONTROL).
    """
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    n = len(tokens)
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _GGUF_UNKNOWN), 0)
    proto = sp_pb2.ModelProto()
    seen: set[str] = set()
    valid_types = {_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNUSED, _GGUF_BYTE}
    for i in range(n):
        piece, typ = tokens[i], types[i]
        if typ not in valid_types:
            typ = _GGUF_NORMAL
        if i == unk_id:
            typ = _GGUF_UNKNOWN
        elif typ == _GGUF_UNKNOWN:
            typ = _GGUF_CONTROL  # sentencepiece allows exactly one unknown piece
        if typ != _GGUF_CONTROL and " " in piece:
            piece = piece.replace(" ", "\u2581")
        if not piece or piece in seen:
            # sentencepiece needs unique, non-empty pieces; keep the id, make the piece inert.
            piece, typ = f"<gguf_unused_{i}>", _GGUF_UNUSED
            if piece in seen:
                raise TokenizerError(f"{source}: cannot build a sentencepiece model (token {i} clashes)")
        seen.add(piece)
        p = proto.pieces.add()
        p.piece = piece
        p.score = scores[i]
        p.type = typ
    ts = proto.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = any(t == _GGUF_BYTE for t in types)
    ts.split_by_whitespace = False  # trainer-only setting; the BPE encoder never pre-splits
    ts.unk_id = unk_id
    ts.unk_piece = proto.pieces[unk_id].piece
    ts.bos_id = bos_id if bos_id is not None else -1
    ts.eos_id = eos_id if eos_id is not None else -1
    ts.pad_id = pad_id if pad_id is not None else -1
    if bos_id is not None:
        ts.bos_piece = proto.pieces[bos_id].piece
    if eos_id is not None:
        ts.eos_piece = proto.pieces[eos_id].piece
    if pad_id is not None:
        ts.pad_piece = proto.pieces[pad_id].piece
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = add_space_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return proto.SerializeToString()


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str, source: str) -> Any:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _TkTokenizer

    if pre not in _BPE_PRE:
        raise TokenizerError(
            f"{source}: unsupported byte-level pre-tokenizer tokenizer.ggml.pre={pre!r} "
            f"(supported: {', '.join(sorted(_BPE_PRE))})"
        )
    pattern, ignore_merges = _BPE_PRE[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for m in merges:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise TokenizerError(f"{source}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges)
    except Exception as e:  # tokenizers raises a bare Exception on inconsistent vocab/merges
        raise TokenizerError(f"{source}: cannot build a byte-level BPE from the vocabulary: {e}") from e
    tk = _TkTokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED and t]
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)
    return tk


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


def decode_text(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = False) -> str:
    """`tokenizer.decode(ids, skip_special_tokens)`; when special tokens are kept and
    `spaces_between_special_tokens`, each special token and each run of other tokens between
    them is decoded on its own and the parts are joined by single spaces (the rule of HF's
    Python tokenizers that vLLM follows: ``"<s> Hello</s>"`` -> ``"<s> Hello </s>"``)."""
    if skip_special_tokens or not spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    special, parts, run = tokenizer.special_ids, [], []
    for i in ids:
        if i in special:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            parts.append(tokenizer.decode([i], skip_special_tokens=False))
        else:
            run.append(i)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    return " ".join(parts)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one delta per `add`.

    Definition. With prompt ids P and generated ids G[:k], the *text of the first k generated
    tokens* is ``T(k) = decode(P + G[:k])[len(decode(P)):]`` (`decode_text` with this
    detokenizer's `skip_special_tokens` and `spaces_between_special_tokens`). For an empty prompt
    that is ``decode(G[:k])``; after a prompt it keeps
    the leading space of a first ``"▁the"`` piece that one-shot ``decode(G)`` of a sentencepiece
    model would drop.

    Guarantee: whenever ``decode(P + G[:k])`` does not end in U+FFFD (no incomplete UTF-8
    sequence from byte-fallback / byte-level tokens at the end), ``self.text == T(k)`` exactly.
    In between, the text after the last complete character is held back, never retracted: what
    was emitted is a prefix of T at the next complete point. `flush()` emits the held-back tail
    as `decode` renders it (U+FFFD for bytes that never completed), after which
    ``self.text == T(k)``. (A vocabulary token whose text really ends in U+FFFD is held until the
    next token or flush.) The prompt must end on a character boundary, which encoded text does.

    Cost: each `add` decodes a window starting at the last boundary where everything had been
    emitted (plus a few prompt tokens of left context at the start), so decode work is O(1)
    amortized per token, not O(n).
    """

    _PROMPT_CONTEXT = 6  # prompt tokens decoded as left context for the first generated token

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids]
        self._read = len(self._ids)  # all text up to here has been emitted (a clean boundary)
        self._prefix = self._prompt_context_start()
        self._prefix_len = len(self._decode(self._prefix, self._read))
        self._held_emitted = 0  # chars past `_read` already emitted while the tail is incomplete
        self.text = ""
        self.generated_ids: list[int] = []

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return decode_text(self.tokenizer, self._ids[start:stop], self.skip_special_tokens,
                           self.spaces_between_special_tokens)

    def _prompt_context_start(self) -> int:
        # A few prompt tokens of left context, starting on a character boundary: a window that
        # began inside a multi-byte character would decode its first bytes as U+FFFD, and some
        # decoders (HF ByteFallback) then replace the whole byte run, later text included.
        read = self._read
        start = self._context_start(read, max(0, read - self._PROMPT_CONTEXT))
        limit = max(0, read - 4 * self._PROMPT_CONTEXT)
        while start > limit and self._decode(start, read).startswith(_REPLACEMENT):
            start -= 1
        return start

    def _context_start(self, read: int, start: int) -> int:
        # Back up over special tokens so the window's left context holds a real piece: decoders
        # strip a dummy-prefix space from the first piece they render, which must be context.
        special = self.tokenizer.special_ids
        i = start
        while i > 0 and all(t in special for t in self._ids[i:read]):
            i -= 1
        return i

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        self.generated_ids.append(int(token_id))
        window = self._decode(self._prefix, len(self._ids))
        tail = window[self._prefix_len :]
        if tail.endswith(_REPLACEMENT):
            # Possibly an incomplete UTF-8 sequence: emit what precedes it, hold the rest.
            stable = tail.rstrip(_REPLACEMENT)
            delta = stable[self._held_emitted :] if len(stable) > self._held_emitted else ""
            self._held_emitted = max(self._held_emitted, len(stable))
            self.text += delta
            return delta
        delta = tail[self._held_emitted :]
        self._held_emitted = 0
        new_prefix = self._context_start(len(self._ids), self._read)
        self._read = len(self._ids)
        self._prefix = new_prefix
        self._prefix_len = len(self._decode(self._prefix, self._read))
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit the held-back tail as `decode` renders it (U+FFFD for bytes that never completed)."""
        window = self._decode(self._prefix, len(self._ids))
        tail = window[self._prefix_len :]
        delta = tail[self._held_emitted :]
        self._held_emitted = 0
        if len(self._ids) > self._read:
            self._prefix = self._context_start(len(self._ids), self._read)
            self._read = len(self._ids)
            self._prefix_len = len(self._decode(self._prefix, self._read))
        self.text += delta
        return delta
