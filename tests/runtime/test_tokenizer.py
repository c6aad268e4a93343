"""Tokenizers against independent oracles: sentencepiece itself, `tokenizers`, HF transformers.

Fixtures train tiny models on inline multilingual text (a sentencepiece BPE with byte fallback,
a byte-level BPE), convert them with transformers, and write GGUF files from them with the `gguf`
writer; the real Gemma 3 270M GGUF is checked against transformers' own GGUF tokenizer loader.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from jaxinfer.runtime.host.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    check_compatible,
    load_tokenizer,
    tokenizer_from_gguf,
)

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

_BASE_TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
It was the best of times, it was the worst of times; it was the age of wisdom.
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Übung, Straße, Äpfel und Öl.
Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë.
東京は日本の首都です。私は毎朝コーヒーを飲みます。今日はいい天気ですね。
我们今天去公园散步。中文的汉字非常有意思。北京是中国的首都。
I love pizza 🍕 and coffee ☕! Party time 🎉🎉 😀 👍🏽 — “quoted” text…
def add(a, b):
    return a + b  # two  spaces and\ttabs
Numbers: 3.14159, 2024-11-29, 1,000,000 and 42."""

# Text the models were not trained on: rare CJK, emoji outside the corpus (byte fallback),
# whitespace runs, tabs, newlines, digits, a combining accent.
MIXED = (
    "Hello  wörld!\tTabs\tand\n\nnewlines   three spaces. 12345 + 0.5 = 12345.5\n"
    "Emoji: 😀🍕🦄✨👩‍👩‍👧 CJK: 中文 日本語の文章 龘 한국어 e\u0301 Straße — end "
)
SAMPLES = [
    MIXED,
    "The capital of France is",
    "  leading spaces",
    "trailing spaces  ",
    "\n",
    "🦄",
    "a",
    "Ünïcödé façade naïve “quotes” ‘x’ …",
    "\t\tcode():\n\t\treturn 1",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 龘龘龘",
]


def _corpus_lines() -> list[str]:
    lines = []
    base = _BASE_TEXT.splitlines()
    for i in range(120):
        for j, ln in enumerate(base):
            lines.append(f"{ln} {i * 7 + j}" if i % 2 else ln)
            if i % 5 == 0:
                lines.append(ln[::-1])
    return lines


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory) -> Path:
    """A checkpoint-like directory holding a freshly trained sentencepiece BPE tokenizer.model."""
    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()),
        model_prefix=str(d / "tokenizer"),
        model_type="bpe",
        vocab_size=800,
        byte_fallback=True,
        character_coverage=0.995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        control_symbols=["<end_of_turn>"],
        user_defined_symbols=["<tool>"],
        hard_vocab_limit=False,
        num_threads=2,
        minloglevel=2,
    )
    (d / "tokenizer.vocab").unlink()
    return d


@pytest.fixture(scope="session")
def sp_ref(sp_dir):
    return spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))


@pytest.fixture(scope="session")
def sp_tok(sp_dir) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(sp_dir / "tokenizer.model")


@pytest.fixture(scope="session")
def hf_llama(sp_dir):
    """transformers' conversion of the sentencepiece model (its own independent implementation)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaTokenizer.from_pretrained(str(sp_dir))


@pytest.fixture(scope="session")
def hf_llama_dir(hf_llama, tmp_path_factory) -> Path:
    """tokenizer.json + tokenizer_config.json as transformers saves them, plus a config.json."""
    d = tmp_path_factory.mktemp("hf_llama")
    hf_llama.save_pretrained(str(d))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg))
    end_of_turn = hf_llama.convert_tokens_to_ids("<end_of_turn>")
    (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, end_of_turn]}))
    return d


@pytest.fixture(scope="session")
def bytelevel_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (GPT-2 style) trained with `tokenizers`, saved as tokenizer.json."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = TkTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_corpus_lines(), trainer=trainer)
    d = tmp_path_factory.mktemp("bytelevel")
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return d


# -------------------------------------------------------------------------------------------
# sentencepiece
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_ids_match_sentencepiece_and_hf(sp_tok, sp_ref, hf_llama, text):
    ours = sp_tok.encode(text, add_special_tokens=False)
    assert ours == sp_ref.encode(text)
    if not text.startswith(" "):
        # transformers' Metaspace skips the dummy prefix when the text already starts with a
        # space ("  x" -> "▁▁x" instead of sentencepiece's "▁▁▁x"); sentencepiece is the reference.
        assert ours == hf_llama(text, add_special_tokens=False)["input_ids"]
    assert sp_tok.decode(ours) == text == sp_ref.decode(ours)
    assert sp_tok.encode(text) == [sp_ref.bos_id()] + ours  # add_bos defaults on


def test_sentencepiece_byte_fallback_and_attributes(sp_tok, sp_ref):
    ids = sp_tok.encode("🦄", add_special_tokens=False)
    # 🦄 is not in the training text: four byte pieces after the dummy-prefix space.
    assert [sp_tok.id_to_piece(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x84>"]
    assert sp_tok.vocab_size == sp_ref.get_piece_size()
    assert sp_tok.bos_id == sp_ref.bos_id() == sp_tok.token_to_id("<s>")
    end_of_turn = sp_tok.token_to_id("<end_of_turn>")
    assert sp_tok.eos_ids == (sp_ref.eos_id(), end_of_turn)
    assert sp_tok.add_bos is True
    assert {sp_ref.bos_id(), sp_ref.eos_id(), end_of_turn} <= sp_tok.special_ids
    assert sp_tok.convert_ids_to_tokens(sp_ref.encode("Hund")) == sp_ref.encode("Hund", out_type=str)


def test_sentencepiece_control_tokens_in_text_match_hf(sp_tok, hf_llama):
    text = "a<end_of_turn>b <tool>c<s>Hund"
    ours = sp_tok.encode(text, add_special_tokens=False)
    assert ours == hf_llama(text, add_special_tokens=False)["input_ids"]
    assert sp_tok.token_to_id("<end_of_turn>") in ours
    assert sp_tok.decode(ours) == "ab <tool>cHund"
    assert sp_tok.decode(ours, skip_special_tokens=False) == text
    assert sp_tok.decode(ours, skip_special_tokens=False) == hf_llama.decode(ours, skip_special_tokens=False)


def test_sentencepiece_from_bytes(sp_dir, sp_ref):
    tok = SentencePieceTokenizer((sp_dir / "tokenizer.model").read_bytes())
    assert tok.encode(MIXED, add_special_tokens=False) == sp_ref.encode(MIXED)


def test_load_tokenizer_finds_tokenizer_model(sp_dir, sp_ref):
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.encode(MIXED) == [sp_ref.bos_id()] + sp_ref.encode(MIXED)
    tok2 = load_tokenizer(sp_dir, bos_id=5, eos_ids=[7, 8])
    assert (tok2.bos_id, tok2.eos_ids) == (5, (7, 8))
    assert tok2.encode("x")[0] == 5


# -------------------------------------------------------------------------------------------
# HF tokenizer.json
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES + ["a<end_of_turn>b <tool>c"])
def test_hf_tokenizer_matches_transformers(hf_llama_dir, text):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_llama_dir))
    tok = load_tokenizer(hf_llama_dir)
    assert isinstance(tok, HFTokenizer)
    plain = tok.encode(text, add_special_tokens=False)
    assert plain == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == [ref.bos_token_id] + plain
    assert tok.decode(plain) == ref.decode(plain, skip_special_tokens=True)


def test_hf_tokenizer_specials_from_configs(hf_llama_dir, sp_ref):
    tok = load_tokenizer(hf_llama_dir)
    end_of_turn = sp_ref.piece_to_id("<end_of_turn>")
    assert tok.bos_id == sp_ref.bos_id()
    assert tok.eos_ids == (sp_ref.eos_id(), end_of_turn)
    assert tok.add_bos is True
    assert tok.vocab_size == sp_ref.get_piece_size()
    assert end_of_turn in tok.special_ids
    # add_bos_token: false in tokenizer_config.json turns BOS off.
    cfg = json.loads((hf_llama_dir / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    d = hf_llama_dir.parent / "hf_llama_nobos"
    shutil.copytree(hf_llama_dir, d, dirs_exist_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok2 = load_tokenizer(d)
    assert tok2.add_bos is False
    assert tok2.encode("Hund") == tok.encode("Hund", add_special_tokens=False)


def test_tokenizer_json_preferred_over_model(hf_llama_dir, sp_dir, tmp_path):
    shutil.copytree(hf_llama_dir, tmp_path, dirs_exist_ok=True)
    shutil.copy(sp_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)


@pytest.mark.parametrize("text", SAMPLES + ["<|im_start|>user\nhi<|im_end|>"])
def test_bytelevel_bpe_matches_tokenizers_and_transformers(bytelevel_dir, text):
    from tokenizers import Tokenizer as TkTokenizer

    transformers = pytest.importorskip("transformers")
    ref = TkTokenizer.from_file(str(bytelevel_dir / "tokenizer.json"))
    tf = transformers.AutoTokenizer.from_pretrained(str(bytelevel_dir))
    tok = load_tokenizer(bytelevel_dir)
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids == tf(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == tf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_bytelevel_specials(bytelevel_dir):
    tok = load_tokenizer(bytelevel_dir)
    assert tok.bos_id == 0 and tok.add_bos is False
    # eos from tokenizer_config (0) and generation_config ([0, 2]); <|im_end|> (2) is an end of turn.
    assert tok.eos_ids == (0, 2)
    assert tok.special_ids == {0, 1, 2}


# -------------------------------------------------------------------------------------------
# Streaming detokenization
# -------------------------------------------------------------------------------------------


def _check_streaming(tok: Tokenizer, prompt: list[int], generated: list[int], skip: bool = True) -> None:
    """The IncrementalDetokenizer contract, checked after every token.

    With T(k) = decode(prompt + gen[:k])[len(decode(prompt)):]: at every k where the one-shot
    decode does not end in U+FFFD (no incomplete character), the concatenated deltas equal T(k)
    exactly; at the other k, what was emitted is a prefix of T at the next such k (text is only
    held back, never retracted); after flush() it equals the one-shot text of the whole sequence.
    """
    base = tok.decode(prompt, skip_special_tokens=skip)
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    emitted = ""
    pending: list[str] = []  # emitted texts at incomplete points, checked at the next clean one
    for k, t in enumerate(generated, 1):
        emitted += det.add(t)
        assert emitted == det.text
        full = tok.decode(prompt + generated[:k], skip_special_tokens=skip)
        if full.endswith("\ufffd"):
            pending.append(emitted)
            continue
        assert full.startswith(base)
        assert emitted == full[len(base) :], (k, emitted, full[len(base) :])
        assert all(emitted.startswith(p) for p in pending)
        pending.clear()
    emitted += det.flush()
    full = tok.decode(prompt + generated, skip_special_tokens=skip)
    assert full.startswith(base)
    assert emitted == det.text == full[len(base) :]
    assert all(emitted.startswith(p) for p in pending)


def _stream_cases(tok: Tokenizer) -> list[tuple[list[int], list[int]]]:
    cases = []
    for text in SAMPLES:
        ids = tok.encode(text)
        for cut in (0, 1, len(ids) // 2):
            # the prompt ends on a character boundary (it is encoded text)
            while cut > 0 and tok.decode(ids[:cut]).endswith("\ufffd"):
                cut -= 1
            cases.append((ids[:cut], ids[cut:]))
    return cases


def test_streaming_sentencepiece(sp_tok):
    for prompt, gen in _stream_cases(sp_tok):
        _check_streaming(sp_tok, prompt, gen)
    # leading-space semantics: after a prompt the first "▁the" keeps its space, without one it doesn't
    prompt = sp_tok.encode("Pack my box")
    gen = sp_tok.encode("with five", add_special_tokens=False)
    assert sp_tok.id_to_piece(gen[0]).startswith("\u2581")
    det = IncrementalDetokenizer(sp_tok, prompt)
    assert "".join(det.add(t) for t in gen) + det.flush() == " with five"
    det = IncrementalDetokenizer(sp_tok)
    assert "".join(det.add(t) for t in gen) + det.flush() == "with five" == sp_tok.decode(gen)


def test_streaming_never_emits_half_a_character(sp_tok):
    ids = sp_tok.encode("🦄", add_special_tokens=False)
    assert len(ids) == 5  # "▁" + four byte pieces
    det = IncrementalDetokenizer(sp_tok, sp_tok.encode("Hund"))
    deltas = [det.add(t) for t in ids]
    assert deltas == [" ", "", "", "", "🦄"] or deltas == ["", "", "", "", " 🦄"]
    assert "\ufffd" not in det.text
    # an incomplete sequence that never completes is emitted by flush, as decode renders it
    det = IncrementalDetokenizer(sp_tok)
    assert det.add(ids[1]) == "" and det.add(ids[2]) == ""
    assert det.flush() == sp_tok.decode(ids[1:3]) and "\ufffd" in det.text
    # ... and an invalid byte followed by text is released as soon as the text arrives
    det = IncrementalDetokenizer(sp_tok)
    tail = sp_tok.encode("Hund", add_special_tokens=False)
    out = det.add(ids[1]) + "".join(det.add(t) for t in tail)
    assert out == sp_tok.decode([ids[1]] + tail)


def test_streaming_random_ids_sentencepiece(sp_tok):
    rng = random.Random(0)
    n = sp_tok.vocab_size
    for _ in range(40):
        gen = [rng.randrange(n) for _ in range(rng.randint(1, 25))]
        _check_streaming(sp_tok, sp_tok.encode("Hund"), gen)
        _check_streaming(sp_tok, [], gen, skip=False)


def test_streaming_bytelevel(bytelevel_dir):
    tok = load_tokenizer(bytelevel_dir)
    for prompt, gen in _stream_cases(tok):
        _check_streaming(tok, prompt, gen)
        _check_streaming(tok, prompt, gen, skip=False)
    rng = random.Random(1)
    for _ in range(40):
        gen = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        _check_streaming(tok, tok.encode("Hund"), gen)


def test_streaming_hf_metaspace(hf_llama_dir):
    # tokenizer.json with a Metaspace pre-tokenizer and a Strip decoder (first space dropped)
    tok = load_tokenizer(hf_llama_dir)
    for prompt, gen in _stream_cases(tok):
        _check_streaming(tok, prompt, gen)
        _check_streaming(tok, prompt, gen, skip=False)
    end_of_turn = tok.token_to_id("<end_of_turn>")
    gen = tok.encode("Hund", add_special_tokens=False) + [end_of_turn] + tok.encode("Öl 🦄", add_special_tokens=False)
    _check_streaming(tok, [tok.bos_id], gen)
    _check_streaming(tok, [], [end_of_turn] + gen)
    # The prompt ends in byte-fallback runs longer than the detokenizer's left context, and the
    # generated text continues the run: HF's ByteFallback decodes a whole run at once, so the
    # context must not start inside a character.
    ids = tok.encode("Hund 🦄🦄✨ok")
    cut = next(c for c in range(len(ids)) if tok.decode(ids[:c]) == "Hund 🦄🦄")
    assert tok.id_to_piece(ids[cut]) == "<0xE2>" and tok.id_to_piece(ids[cut - 6]) == "<0xA6>"
    _check_streaming(tok, ids[:cut], ids[cut:])


def test_streaming_is_windowed(sp_tok):
    """Each add decodes a bounded window, not the whole sequence (O(1) per token)."""

    class Counting(SentencePieceTokenizer):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting(sp_tok.processor.serialized_model_proto())
    gen = tok.encode(MIXED * 20, add_special_tokens=False)
    assert len(gen) > 1000
    prompt = tok.encode("Hund")
    det = IncrementalDetokenizer(tok, prompt)
    Counting.longest = 0
    text = "".join(det.add(t) for t in gen) + det.flush()
    assert Counting.longest <= 16
    assert text == " " + tok.decode(gen) == tok.decode(prompt + gen)[len("Hund") :]


# -------------------------------------------------------------------------------------------
# GGUF vocabularies written from the fixtures (llama and gpt2 kinds)
# -------------------------------------------------------------------------------------------


def _gguf_reader(path: Path, fill) -> "gguf.GGUFReader":
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="session")
def sp_gguf(sp_ref, tmp_path_factory):
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    proto.ParseFromString(sp_ref.serialized_model_proto())

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list([p.piece for p in proto.pieces])
        w.add_token_scores([p.score for p in proto.pieces])
        w.add_token_types([int(p.type) for p in proto.pieces])
        w.add_bos_token_id(sp_ref.bos_id())
        w.add_eos_token_id(sp_ref.eos_id())
        w.add_unk_token_id(sp_ref.unk_id())
        w.add_add_bos_token(True)

    return _gguf_reader(tmp_path_factory.mktemp("gguf") / "sp.gguf", fill)


def test_gguf_llama_kind_matches_sentencepiece(sp_gguf, sp_ref):
    tok = tokenizer_from_gguf(sp_gguf, "sp.gguf")
    assert isinstance(tok, SentencePieceTokenizer)
    for text in SAMPLES:
        assert tok.encode(text) == [sp_ref.bos_id()] + sp_ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_ids == (sp_ref.eos_id(), sp_ref.piece_to_id("<end_of_turn>"))
    assert tok.vocab_size == sp_ref.get_piece_size()


def test_gguf_gpt2_kind_matches_tokenizers(bytelevel_dir, tmp_path):
    from tokenizers import Tokenizer as TkTokenizer

    ref = TkTokenizer.from_file(str(bytelevel_dir / "tokenizer.json"))
    model = json.loads((bytelevel_dir / "tokenizer.json").read_text())["model"]
    vocab = ref.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = {t.content for t in ref.get_added_tokens_decoder().values() if t.special}

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_bos_token_id(vocab["<|endoftext|>"])
        w.add_eos_token_id(vocab["<|endoftext|>"])

        w.add_eot_token_id(vocab["<|im_start|>"])  # not really, but it must be carried along

    tok = tokenizer_from_gguf(_gguf_reader(tmp_path / "bpe.gguf", fill), "bpe.gguf")
    assert isinstance(tok, HFTokenizer)
    assert tok.add_bos is False
    assert tok.eos_ids == (vocab["<|endoftext|>"], vocab["<|im_start|>"], vocab["<|im_end|>"])
    for text in SAMPLES + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    _check_export_roundtrip(tok, tmp_path / "export")


def _check_export_roundtrip(tok: Tokenizer, d: Path) -> None:
    d.mkdir()
    for name, data in tok.export_files().items():
        (d / name).write_bytes(data)
    back = load_tokenizer(d)
    assert type(back) is type(tok)
    assert (back.vocab_size, back.bos_id, back.eos_ids, back.add_bos, back.add_eos) == (
        tok.vocab_size, tok.bos_id, tok.eos_ids, tok.add_bos, tok.add_eos
    )
    assert back.special_ids == tok.special_ids
    for text in GEMMA_TEXTS:
        assert back.encode(text) == tok.encode(text)


def test_gguf_unsupported_kind(tmp_path):
    def fill(w):
        w.add_tokenizer_model("rwkv")
        w.add_token_list(["a", "b"])

    with pytest.raises(TokenizerError, match=r"odd\.gguf.*unsupported.*rwkv"):
        tokenizer_from_gguf(_gguf_reader(tmp_path / "odd.gguf", fill), "odd.gguf")


# -------------------------------------------------------------------------------------------
# The real Gemma 3 270M GGUF vs transformers' GGUF tokenizer
# -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma_tok(gemma_tokenizer) -> Tokenizer:
    """Ours, via the shared session fixture: `tokenizer_from_gguf` on the real GGUF's reader."""
    return gemma_tokenizer


@pytest.fixture(scope="session")
def gemma_hf_tok(gemma_gguf_path, hf_parses_gemma_once, request):
    """transformers' tokenizer converted from the same GGUF (cached: the conversion takes ~17 s)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as TkTokenizer

    gemma_path = Path(gemma_gguf_path)
    key = f"gemma_hf_tok_{transformers.__version__}_{gemma_path.stat().st_size}"
    cache_dir = Path(request.config.cache.mkdir(key))
    cached = cache_dir / "tokenizer.json"
    if not cached.is_file():
        ref = transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
        ref.backend_tokenizer.save(str(cached))
    return TkTokenizer.from_file(str(cached))


GEMMA_TEXTS = SAMPLES + [
    "double  spaces,\ttabs\t\tand\n\nnewlines\n\n\n   and    four",
    "digits 0123456789 3.14159 2024-11-29 1,000,000",
    "emoji 😀🎉👩‍👩‍👧🦄 and CJK 中文字符 日本語のテキスト 한국어 ไทย العربية हिन्दी",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "\U0010ffff\x00\x7f private use and controls",
]


def test_gemma_known_ids(gemma_tok):
    assert gemma_tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert (gemma_tok.vocab_size, gemma_tok.bos_id, gemma_tok.add_bos) == (262144, 2, True)
    assert gemma_tok.eos_ids == (1, 106)
    assert gemma_tok.id_to_piece(106) == "<end_of_turn>"


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_matches_transformers_gguf_tokenizer(gemma_tok, gemma_hf_tok, text):
    ids = gemma_tok.encode(text, add_special_tokens=False)
    assert ids == gemma_hf_tok.encode(text, add_special_tokens=False).ids
    assert gemma_tok.encode(text) == [2] + ids
    assert gemma_tok.decode(ids, skip_special_tokens=False) == text
    assert gemma_tok.decode(ids) == gemma_hf_tok.decode(ids, skip_special_tokens=True)


def test_gemma_export_roundtrip(gemma_tok, tmp_path):
    _check_export_roundtrip(gemma_tok, tmp_path / "export")


def test_gemma_whitespace_runs_are_single_tokens(gemma_tok):
    # Gemma stores whitespace runs as user-defined tokens with real spaces in the GGUF; they must
    # still match (as U+2581 runs in the rebuilt sentencepiece model).
    ids = gemma_tok.encode("a    b", add_special_tokens=False)
    assert [gemma_tok.id_to_piece(i) for i in ids] == ["a", "▁▁▁▁", "b"]
    assert ids[1] == 140  # the GGUF's "    " token
    assert gemma_tok.encode("\t\t", add_special_tokens=False) == [255969]


def test_gemma_random_text_matches_transformers(gemma_tok, gemma_hf_tok):
    rng = random.Random(2)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789      \t\t\n\n.,;:!?'\"()<>-_*/\\|@#$%") + list(
        "äöüßéçñ中文日本語한국어😀🎉👍🏽∑√ÆØ"
    ) + ["\u200d", "\u00a0", "\r\n", "\u3000", "<b>", "<end_of_turn>", "\u2581"]
    for _ in range(500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert gemma_tok.encode(s, add_special_tokens=False) == gemma_hf_tok.encode(s, add_special_tokens=False).ids, s


def test_streaming_gemma(gemma_tok):
    for prompt, gen in _stream_cases(gemma_tok):
        _check_streaming(gemma_tok, prompt, gen)
    text = "<start_of_turn>model\nSure — 中文 😀🦄 ok<end_of_turn>"
    ids = gemma_tok.encode(text)
    _check_streaming(gemma_tok, ids[:4], ids[4:])
    _check_streaming(gemma_tok, ids[:4], ids[4:], skip=False)


# -------------------------------------------------------------------------------------------
# Bad input
# -------------------------------------------------------------------------------------------


def test_missing_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=rf"{tmp_path}.*tokenizer\.json.*tokenizer\.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_corrupt_tokenizer_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01 definitely not a protobuf \xff" * 10)
    with pytest.raises(TokenizerError, match=r"tokenizer\.model.*not a valid sentencepiece model"):
        load_tokenizer(tmp_path)


def test_truncated_tokenizer_model(sp_dir, tmp_path):
    data = (sp_dir / "tokenizer.model").read_bytes()
    (tmp_path / "tokenizer.model").write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizerError, match=r"tokenizer\.model"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_json(tmp_path, bytelevel_dir):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match=rf"{tmp_path / 'tokenizer.json'}.*not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    shutil.copy(bytelevel_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)


def test_check_compatible(sp_tok):
    check_compatible(sp_tok, sp_tok.vocab_size, "m")
    check_compatible(sp_tok, sp_tok.vocab_size + 64, "m")  # padded embedding is fine
    with pytest.raises(TokenizerError, match=rf"mismatch for my-model.*{sp_tok.vocab_size} tokens.*only 500 rows"):
        check_compatible(sp_tok, 500, "my-model")


def test_out_of_range_ids(sp_tok, bytelevel_dir):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        sp_tok.decode([1, sp_tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        load_tokenizer(bytelevel_dir).decode([-1])
