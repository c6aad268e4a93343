"""HF checkpoint dirs (single and sharded), `jaxinfer convert` to orbax, and bad input."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.checkpoints.loader import load_model
from jaxinfer.checkpoints.orbax_io import load_converted
from tests.model_utils import run_sequence
from jaxinfer.tools.make_test_model import make

PROMPT = [1, 40, 41, 42, 500, 7, 8, 900, 1500, 3]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make(tmp_path_factory.mktemp("hf_tiny"), "tiny", seed=1)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def test_convert_cli_then_llm_gives_bit_identical_logits(hf_dir, tmp_path):
    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, "-m", "jaxinfer.serve.cli", "convert", str(hf_dir), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    a, b = load_model(hf_dir), load_model(out)
    assert a.cfg == b.cfg
    assert _leaves_equal(a.params, b.params)
    la, _, _ = run_sequence(a.params, a.cfg, PROMPT)
    lb, _, _ = run_sequence(b.params, b.cfg, PROMPT)
    assert np.array_equal(la, lb)
    assert a.tokenizer.encode("Good night, sweet prince") == b.tokenizer.encode(
        "Good night, sweet prince")
    # converting onto an existing non-empty dir is refused
    r = subprocess.run([sys.executable, "-m", "jaxinfer.serve.cli", "convert", str(hf_dir), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr


def test_convert_bf16(hf_dir, tmp_path):
    from jaxinfer.checkpoints.convert import convert

    out = convert(str(hf_dir), tmp_path / "bf16", dtype="bfloat16")
    cfg, params = load_converted(out)
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"bfloat16"}
    _, ref = load_hf(hf_dir)
    assert np.allclose(np.asarray(params.embed, np.float32), np.asarray(ref.embed), atol=1e-2)


def test_sharded_safetensors_index(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, d / f)
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    assert _leaves_equal(load_hf(d)[1], load_hf(hf_dir)[1])
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_hf(d)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="not a model: expected config.json"):
        load_model(d)
    with pytest.raises(CheckpointError, match=r"config.json: not found"):
        load_hf(d)


def test_missing_weights(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights found"):
        load_model(d)


def test_corrupt_weights(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: unreadable safetensors"):
        load_model(d)


def test_corrupt_config(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        load_model(d)


def test_unknown_architecture(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: unsupported architecture 'MambaForCausalLM'"):
        load_model(d)


def test_shape_mismatch_names_tensor(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"w_gate.*shape"):
        load_model(d)


def test_tokenizer_model_mismatch(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 1000  # the tokenizer has 2000 pieces
    (d / "config.json").write_text(json.dumps(cfg))
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:1000]
    t["lm_head.weight"] = t["lm_head.weight"][:1000]
    save_file(t, str(d / "model.safetensors"))
    from jaxinfer.runtime.host.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match=str(d)):
        load_model(d)


def test_missing_tokenizer(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    (d / "tokenizer.model").unlink()
    from jaxinfer.runtime.host.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_model(d)


def test_unknown_path_and_not_gguf(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "nope")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(f)


def test_generate_cli_on_hf_dir(hf_dir):
    r = subprocess.run([sys.executable, "-m", "jaxinfer.serve.cli", "generate", "--model", str(hf_dir),
                        "--max-tokens", "5", "--no-stream", "To be"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be") and "5 tokens" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxinfer.serve.cli", "generate", "--model", "/nonexistent",
                        "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file or directory" in r.stderr
