"""Embeddings (runtime/embedding.py, LLM.embed) against HF transformers on random-init models:
a bare Qwen3Model (no LM head: an embedding checkpoint, task "embed" found by itself) and a
Llama causal LM, pooled the same way by numpy from HF's final-normed hidden states."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch

from jaxinfer import LLM, RequestError
from jaxinfer.runtime.embedding import checkpoint_defaults, embedder, pool

# several lengths in one pass (23 + 5 + 1 + 12 + 3 = 44 tokens: the 64-row bucket)
PROMPTS = [[1, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
            18], [1, 8, 9, 1000, 1500], [1], [1] + list(range(300, 311)), [1, 77, 78]]
ENGINE = dict(max_slots=2, page_size=8, max_model_len=64)


def numpy_pool(h: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """h [L, D] one prompt's hidden states -> [D]."""
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling].astype(np.float64)
    return v / np.linalg.norm(v) if normalize else v


def hf_hidden(model, ids: list[int]) -> np.ndarray:
    """The final-normed hidden states [L, D] of one unpadded prompt."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


def _tokenizer_into(tiny_dir, d):
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, d / name)


@pytest.fixture(scope="module")
def qwen3_bare(tiny_dir, tmp_path_factory):
    """(dir, HF model): a random Qwen3Model saved bare (architectures ["Qwen3Model"], tensors
    without the "model." prefix, tied embeddings), perturbed norms."""
    import transformers

    d = tmp_path_factory.mktemp("qwen3_bare")
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=2000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    hf = transformers.Qwen3Model(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(d, safe_serialization=True)
    assert json.loads((d / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    _tokenizer_into(tiny_dir, d)
    return d, hf


@pytest.fixture(scope="module")
def llama(tiny_dir, tmp_path_factory):
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("llama_embed")
    hf = make_hf_model("llama", d, seed=2, hidden=64, layers=2, vocab=2000)
    _tokenizer_into(tiny_dir, d)
    return d, hf


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_bare):
    """Warmed up at start: task "auto" is "embed" here, so the embedding programs."""
    return LLM(str(qwen3_bare[0]), warmup=True, **ENGINE)


def test_pool_matches_numpy():
    rng = np.random.default_rng(0)
    lens = [3, 1, 6]
    h = rng.standard_normal((16, 8)).astype(np.float32)  # 10 rows used, 6 padding
    cu = np.asarray([0, 3, 4, 10, 10, 10], np.int32)  # 3 sequences, 2 empty padding ones
    for mode, name in enumerate(("last", "mean", "cls")):
        for normalize in (False, True):
            got = np.asarray(jax.jit(pool)(h, cu, np.int32(mode), np.bool_(normalize)))
            assert got.shape == (5, 8)
            for s, n in enumerate(lens):
                want = numpy_pool(h[cu[s]:cu[s] + n], name, normalize)
                np.testing.assert_allclose(got[s], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["qwen3_bare", "llama"])
def test_embed_matches_hf(which, request, llm_for, qwen3_llm):
    d, hf = request.getfixturevalue(which)
    llm = qwen3_llm if which == "qwen3_bare" else llm_for(d, **ENGINE)
    hidden = [hf_hidden(hf, p) for p in PROMPTS]
    pages = llm.engine.stats()["pages_free"]
    for pooling in ("last", "mean", "cls"):
        for normalize in (True, False):
            got = llm.embed(PROMPTS, pooling=pooling, normalize=normalize)
            assert got.shape == (len(PROMPTS), 64) and got.dtype == np.float32
            for g, h in zip(got, hidden):
                want = numpy_pool(h, pooling, normalize)
                cos = g @ want / (np.linalg.norm(g) * np.linalg.norm(want))
                assert cos > 1 - 1e-5, (pooling, cos)
                assert np.abs(g - want).max() < 1e-4 * max(1.0, np.abs(want).max())
            if normalize:
                np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert llm.engine.stats()["pages_free"] == pages  # the engine's own pages untouched
    # a text prompt goes through the tokenizer (the default pooling here: last)
    one = llm.embed("Hello there")
    ids = llm.tokenizer.encode("Hello there")
    np.testing.assert_allclose(one[0], numpy_pool(hf_hidden(hf, ids), "last", True), atol=1e-5)


def test_embedding_checkpoints_are_found(qwen3_llm, llama, llm_for, tmp_path):
    """Bare architectures and sentence-transformers dirs are task "embed" (with their Pooling
    module's mode); a causal LM is "generate". The embedding task's warm-up compiled every
    token bucket (16, 32, 64 rows under max_model_len 64) and no generation step."""
    assert qwen3_llm.task == "embed"
    assert qwen3_llm.warmup_stats["programs"] == 3 and qwen3_llm.engine.compile_count == 0
    assert llm_for(llama[0], **ENGINE).task == "generate"
    assert checkpoint_defaults(tmp_path, "LlamaForCausalLM") == ("generate", "last")
    assert checkpoint_defaults(tmp_path, "gguf:llama") == ("generate", "last")
    assert checkpoint_defaults(tmp_path, "LlamaModel") == ("embed", "last")
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    for mode, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                      ("last", "pooling_mode_lasttoken")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({key: True}))
        assert checkpoint_defaults(tmp_path, "Qwen3ForCausalLM") == ("embed", mode)


def test_repeated_embeds_of_similar_sizes_do_not_recompile(llama, llm_for):
    llm = llm_for(llama[0], **ENGINE)
    emb = embedder(llm.engine)
    llm.embed([[1, 5, 6], list(range(1, 20))])  # 22 tokens: the 32-row bucket
    before = emb.compile_count
    traces = []

    def on_duration(name, secs, **kw):
        if name.endswith("jaxpr_trace_duration"):  # a jit cache miss: a new program
            traces.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        for batch in ([[1, 2]] * 9, [list(range(3, 30))], [[1] * 10, [2] * 7, [3] * 8]):
            llm.embed(batch, pooling="mean")  # 18, 27, 25 tokens: the same bucket
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert emb.compile_count == before and traces == []
    # more prompts than one pass takes (64) and more tokens than the budget (64): several
    # passes, rows in order
    many = [[1, 2 + i % 50] for i in range(70)] + [list(range(1, 60)), list(range(2, 50))]
    got = llm.embed(many)
    for i in (0, 63, 64, 69, 70, 71):
        np.testing.assert_allclose(got[i], llm.embed([many[i]])[0], atol=1e-6)


def test_bad_inputs_name_the_field(tiny_llm):
    cases = [
        ([], "prompts"), ([""], "prompt"), ("", "prompt"), ([[]], "prompt"),
        ([[1, 5000]], "prompt"), ([[1] * 257], "prompt[0]"), ([[1, 2], [1] * 300], "prompt[1]"),
        ([[1, 2.5]], "prompt"), (5, "prompts"),
    ]
    for prompts, field in cases:
        with pytest.raises(RequestError) as e:
            tiny_llm.embed(prompts)
        assert e.value.field == field, (prompts, e.value)
    with pytest.raises(RequestError, match="pooling") as e:
        tiny_llm.embed([[1, 2]], pooling="max")
    assert e.value.field == "pooling"
    with pytest.raises(RequestError) as e:
        tiny_llm.embed([[1, 2]], normalize="yes")
    assert e.value.field == "normalize"
    with pytest.raises(RequestError) as e:
        tiny_llm.engine.embed([[1, 2], "ab"])
    assert e.value.field == "prompt[1]"
    assert tiny_llm.embed([[1] * 256]).shape == (1, 64)  # max_model_len tokens fit
