"""gpt-oss with MXFP4 experts, as OpenAI ships it: a random-init HF gpt-oss whose expert tensors
are rewritten as `_blocks` + `_scales` (checkpoints/mxfp4.py `encode`). Loaded, the experts stay
MXFP4 (QuantizedArray fmt "mxfp4": int8 2*e2m1 values, f32 scales per 32 along the contracted
axis) and dequantize to the numpy decoder's weights bit for bit; logits and greedy tokens equal
HF transformers' on the same MXFP4 checkpoint (dequantized by transformers on load)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoints import mxfp4
from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.runtime.device.quantization import QuantizedArray
from tests.hf_models import make_hf_model
from tests.model_utils import run_sequence

PROMPT = [1, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5, 128, 64, 200, 9, 10, 11, 300, 301]
EXPERTS = ("gate_up_proj", "down_proj")
LAYERS = 2


def _expert_key(i: int, proj: str) -> str:
    return f"model.layers.{i}.mlp.experts.{proj}"


def write_mxfp4(dense, out, edit=lambda tensors: None):
    """The HF dir `dense` rewritten into `out` with its experts MXFP4 as gpt-oss stores them:
    gate_up_proj [E, D, 2F] -> [E, 2F, D] encoded along D, down_proj [E, F, D] -> [E, D, F]
    along F; `edit(tensors)` may spoil them first. Returns the tensors written."""
    out.mkdir()
    tensors = {}
    for name, arr in load_file(dense / "model.safetensors").items():
        if name.endswith(tuple(f"experts.{p}" for p in EXPERTS)):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.encode(
                arr.transpose(0, 2, 1))
        else:
            tensors[name] = arr
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dense / "config.json").read_text())
    # as in openai/gpt-oss-20b's config.json (modules_to_not_convert is not read)
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(hf))
    for f in dense.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return tensors


@pytest.fixture(scope="module")
def oss(tiny_dir, tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    dense = root / "dense"
    dense_hf = make_hf_model("gpt_oss", dense, hidden=64, layers=LAYERS, vocab=2000)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, dense / name)
    tensors = write_mxfp4(dense, root / "mxfp4")
    # transformers' own MXFP4 read (dequantized on the CPU): the reference
    hf = transformers.GptOssForCausalLM.from_pretrained(
        root / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager").eval()
    decoded = {(i, p): mxfp4.decode(tensors[_expert_key(i, p) + "_blocks"],
                                    tensors[_expert_key(i, p) + "_scales"]).transpose(0, 2, 1)
               for i in range(LAYERS) for p in EXPERTS}  # HF's dense [E, D, 2F] / [E, F, D]
    cfg, params = load_hf(root / "mxfp4")
    return SimpleNamespace(dir=root / "mxfp4", dense=dense, dense_hf=dense_hf, hf=hf,
                           decoded=decoded, cfg=cfg, params=params)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_experts_stay_mxfp4_and_dequantize_to_the_decoder_bit_for_bit(oss):
    e, d, f = oss.cfg.num_experts, oss.cfg.hidden_size, oss.cfg.moe_intermediate_size
    for i, lp in enumerate(oss.params.layers):
        gate_up, down = oss.decoded[i, "gate_up_proj"], oss.decoded[i, "down_proj"]
        # HF's reference model holds the numpy decoder's weights
        experts = oss.hf.model.layers[i].mlp.experts
        np.testing.assert_array_equal(bits(experts.gate_up_proj.detach().numpy()), bits(gate_up))
        np.testing.assert_array_equal(bits(experts.down_proj.detach().numpy()), bits(down))
        want = {"we_gate": gate_up[..., 0::2], "we_up": gate_up[..., 1::2], "we_down": down}
        for field, w in want.items():
            q = getattr(lp, field)
            assert isinstance(q, QuantizedArray) and q.fmt == "mxfp4" and q.mode == "weight_only"
            assert q.values.dtype == jnp.int8 and q.scales.dtype == jnp.float32
            assert (q.group_size, q.group_axis, q.reduce_axes, q.offsets) == (32, 1, (1,), None)
            assert q.shape == w.shape == ((e, d, f) if field != "we_down" else (e, f, d))
            assert q.scales.shape == (e, q.shape[1] // 32, q.shape[2])
            assert int(jnp.abs(q.values).max()) <= 12
            # exact; the int8 form reads -0.0 as +0.0
            np.testing.assert_array_equal(bits(q.dequantize()), bits(w + np.float32(0.0)))
            # 1 byte a weight + 4 bytes per 32: 0.5625x the bf16 weight
            assert q.nbytes == w.size * 9 // 8 == w.size * 2 * 0.5625
        # the experts the MoE forms read: take() of axis 0 keeps the groups
        idx = jnp.array([[3, 0], [7, 7]])
        np.testing.assert_array_equal(lp.we_down.take(idx).dequantize(),
                                      (down + np.float32(0.0))[np.asarray(idx)])
    # everything else as in the dense checkpoint
    _, dense = load_hf(oss.dense)
    np.testing.assert_array_equal(oss.params.layers[1].wq, dense.layers[1].wq)
    np.testing.assert_array_equal(oss.params.layers[0].we_gate_b, dense.layers[0].we_gate_b)


def test_prefill_and_decode_logits_equal_hf(oss):
    prefill, decoded, dec = run_sequence(oss.params, oss.cfg, PROMPT, page_size=8,
                                         decode_steps=8)
    ref = hf_logits(oss.hf, PROMPT + decoded)
    assert np.abs(prefill - ref[:len(PROMPT)]).max() <= 1e-4
    assert np.abs(dec - ref[len(PROMPT):len(PROMPT) + 8]).max() <= 1e-4
    # the comparison sees the MXFP4 rounding: the dense model before it is far off
    assert np.abs(prefill - hf_logits(oss.dense_hf, PROMPT)).max() > 1e-2


def test_dequantize_gives_float_experts_with_the_same_logits(oss):
    from jaxinfer.checkpoints.loader import load_model

    cfg, params = load_hf(oss.dir, keep_mxfp4=False)
    for kept, lp in zip(oss.params.layers, params.layers):
        for field in ("we_gate", "we_up", "we_down"):
            w = getattr(lp, field)
            assert isinstance(w, jax.Array) and w.dtype == jnp.float32
            np.testing.assert_array_equal(w, getattr(kept, field).dequantize())
    want, _, want_dec = run_sequence(oss.params, oss.cfg, PROMPT, page_size=8, decode_steps=4)
    got, _, got_dec = run_sequence(params, cfg, PROMPT, page_size=8, decode_steps=4)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got_dec, want_dec, atol=1e-5)
    # load_model (the engine's loader): kept only when asked (runtime/build.py's choice)
    assert isinstance(load_model(oss.dir, keep_mxfp4=True).params.layers[0].we_up,
                      QuantizedArray)
    assert isinstance(load_model(oss.dir).params.layers[0].we_up, jax.Array)
    bf16 = load_model(oss.dir, dtype="bfloat16").params.layers[0].we_up
    assert bf16.dtype == jnp.bfloat16  # exact: every MXFP4 value has <= 2 significant bits
    np.testing.assert_array_equal(bf16.astype(jnp.float32), params.layers[0].we_up)


def test_served_greedy_equals_hf_generate(oss):
    """The engine on the kept experts, and LLM(quantization="dequantize"), give HF's tokens."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.runtime.build import prepare
    from jaxinfer.runtime.config import EngineConfig
    from jaxinfer.runtime.engine import Engine
    from jaxinfer.runtime.host.tokenizer import load_tokenizer

    prompts = [PROMPT, PROMPT[:7] + [900, 901, 1500]]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [hf_greedy(oss.hf, p, 10) for p in prompts]
    options = dict(max_slots=2, page_size=8, max_model_len=64)
    eng = Engine(prepare(oss.cfg, oss.params, load_tokenizer(str(oss.dir)),
                         EngineConfig(**options)))
    assert isinstance(eng.params.layers[0].we_gate, QuantizedArray)
    rids = [eng.add_request(p, greedy) for p in prompts]
    got = {rid: [] for rid in rids}
    while eng.has_work:
        for delta in eng.step():
            got[delta.request_id] += delta.token_ids
    assert [got[rid] for rid in rids] == want
    llm = LLM(str(oss.dir), quantization="dequantize", **options)
    assert isinstance(llm.engine.params.layers[0].we_gate, jax.Array)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == want
    kept = LLM(str(oss.dir), **options)  # the default keeps them, recorded as "mxfp4"
    assert kept.engine.params.layers[0].we_gate.fmt == "mxfp4"
    assert kept.engine.ecfg.quantization == "mxfp4"
    assert [o.token_ids for o in kept.generate(prompts, greedy)] == want


def _drop(key):
    return lambda tensors: tensors.pop(key)


def _short_scales(tensors):
    key = _expert_key(0, "down_proj") + "_scales"
    tensors[key] = np.ascontiguousarray(tensors[key][..., :-1])


@pytest.mark.parametrize("edit,match", [
    (_drop(_expert_key(1, "gate_up_proj") + "_scales"),
     r"'model.layers.1.mlp.experts.gate_up_proj'.*gate_up_proj_blocks without "
     r".*gate_up_proj_scales"),
    (_drop(_expert_key(0, "down_proj") + "_blocks"),
     r"'model.layers.0.mlp.experts.down_proj'.*down_proj_scales without .*down_proj_blocks"),
    (_short_scales, r"'model.layers.0.mlp.experts.down_proj'.*scales must be"),
], ids=["blocks without scales", "scales without blocks", "scales of the wrong shape"])
def test_malformed_mxfp4_is_a_checkpoint_error_naming_the_tensor(oss, tmp_path, edit, match):
    write_mxfp4(oss.dense, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        load_hf(tmp_path / "bad")
