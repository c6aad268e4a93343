"""Multi-LoRA serving against HF transformers + PEFT (the oracle): random-init Llama and Qwen2 with
three random PEFT adapters of different ranks, scales and target modules."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import LLM, LoRARequest, RequestError, SamplingParams
from jaxinfer.checkpoints.errors import CheckpointError
from jaxinfer.checkpoints.hf import load_hf
from jaxinfer.checkpoints.peft import load_peft_adapter
from jaxinfer.runtime.device import lora as lora_ops
from jaxinfer.runtime.device.attention import AttentionMetadata
from jaxinfer.runtime.device.fused_projections import fuse_projections
from jaxinfer.runtime.device.kv_cache import init_cache
from jaxinfer.runtime.host.errors import AdapterInUse
from jaxinfer.runtime.host.lora_slots import LoraSlots
from jaxinfer.runtime.device.model import forward

peft = pytest.importorskip("peft")

# (name, r, alpha, target modules, rsLoRA)
ADAPTERS = [
    ("every-proj", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"], False),
    ("qv-rs", 4, 8, ["q_proj", "v_proj"], True),
    ("mlp-o", 16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
]
PROMPTS = [[1, 17, 250, 3, 99, 400, 7, 7, 7, 311, 42, 5], [1, 8, 9, 1000, 1500, 3],
           [1] + list(range(300, 327)), [1, 77, 78]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tiny_dir, tmp_path_factory):
    """(base dir, {adapter name: (dir, PEFT model)}, HF base model) for one family."""
    from tests.hf_models import make_hf_model

    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = root / "base"
    hf = make_hf_model(request.param, base, hidden=64, layers=2, vocab=2000)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, base / name)
    adapters = {}
    for i, (name, r, alpha, targets, rs) in enumerate(ADAPTERS):
        torch.manual_seed(10 + i)
        pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs,
            init_lora_weights=False)).eval()
        pm.save_pretrained(root / name)
        adapters[name] = (root / name, pm)
    return base, adapters, hf


def _ragged_metadata(lens: list[int], page_size: int = 8) -> tuple[AttentionMetadata, int]:
    """Sequences of `lens` tokens, each from position 0 in pages of its own; logits of every
    row. -> (metadata, pages used)."""
    pos, slots, pages, page = [], [], [], 1
    for n in lens:
        k = -(-n // page_size)
        own = list(range(page, page + k))
        page += k
        pages.append(own + [0] * (8 - k))
        pos += list(range(n))
        slots += [own[p // page_size] * page_size + p % page_size for p in range(n)]
    cu = np.concatenate([[0], np.cumsum(lens)])
    t = int(cu[-1])
    return AttentionMetadata(
        positions=jnp.asarray(pos, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32), kv_lens=jnp.asarray(lens, jnp.int32),
        page_indices=jnp.asarray(pages, jnp.int32), num_seqs=jnp.asarray([len(lens)], jnp.int32),
        logits_indices=jnp.arange(t, dtype=jnp.int32), max_q_len=max(lens)), page


@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
def test_one_ragged_batch_of_base_and_three_adapters_matches_hf_peft(family, fused):
    """One forward over four sequences (base model, then each adapter), adapters in device slots
    in another order: each sequence's logits within 1e-4 of HF + PEFT on that adapter alone,
    with the base's Q/K/V and gate/up apart or fused (the adapters add per projection)."""
    base, adapters, hf = family
    cfg, params = load_hf(base)
    if fused:
        params = fuse_projections(params)
        assert params.layers[0].wqkv is not None and params.layers[0].w_gate_up is not None
    names = list(adapters)
    stack = lora_ops.init_lora(cfg, 4, 16)
    slot_of = {"qv-rs": 1, "mlp-o": 2, "every-proj": 4}  # slot 3 stays empty
    for name, slot in slot_of.items():
        ad = load_peft_adapter(adapters[name][0], cfg, 16)
        stack = lora_ops.write_slot(stack, np.int32(slot),
                                    lora_ops.padded_weights(cfg, 16, ad.tensors))
    params = params.replace(lora=stack)
    md, pages = _ragged_metadata([len(p) for p in PROMPTS])
    ids = np.concatenate([np.full(len(p), s, np.int32)
                          for p, s in zip(PROMPTS, [0] + [slot_of[n] for n in names])])
    logits, _ = forward(params, jnp.asarray(np.concatenate(PROMPTS), jnp.int32),
                        init_cache(cfg, pages, 8, jnp.float32), md, cfg, "xla", jnp.asarray(ids))
    logits = np.asarray(logits)
    oracles = [hf] + [adapters[n][1] for n in names]
    t = 0
    for prompt, oracle in zip(PROMPTS, oracles):
        with torch.no_grad():
            want = oracle(torch.tensor([prompt])).logits[0].numpy()
        got = logits[t:t + len(prompt)]
        assert np.abs(got - want).max() <= 1e-4
        t += len(prompt)
    with torch.no_grad():  # the adapters matter: each moves the logits far from the base's
        moved = [np.abs(o(torch.tensor([PROMPTS[0]])).logits[0].numpy()
                        - hf(torch.tensor([PROMPTS[0]])).logits[0].numpy()).max()
                 for o in oracles[1:]]
    assert min(moved) > 0.05


def test_mixed_batch_gives_each_request_its_tokens_alone_and_hfs(family):
    """12 requests over the base model and 3 adapters with 2 device slots (adapters wait for a
    slot, slots are reused), chunked prefill and preemption: every request's greedy tokens
    equal its tokens alone and HF + PEFT's generate."""
    base, adapters, hf = family
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_slots=4,
              page_size=8, num_pages=24, max_model_len=128, prefill_chunk=16)
    reqs = {n: LoRARequest(n, i + 1, str(adapters[n][0])) for i, n in enumerate(adapters)}
    order = [None, "every-proj", "qv-rs", "mlp-o", "qv-rs", None, "mlp-o", "every-proj",
             "every-proj", "mlp-o", None, "qv-rs"]
    prompts = [PROMPTS[i % 4] + [5 + i] * (i * 3) for i in range(len(order))]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[reqs.get(n) for n in order])
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.lora_name for o in outs] == order
    for p, n, o in zip(prompts, order, outs):
        alone = llm.generate([p], sp, lora_request=reqs.get(n))[0]
        assert o.token_ids == alone.token_ids, n
        oracle = hf if n is None else adapters[n][1]
        with torch.no_grad():
            want = oracle.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        assert o.token_ids == want[0, len(p):].tolist(), n
    sch = llm.engine.scheduler
    sch.check_invariants()
    assert sch.lora_slots.refs() == {} and len(sch.lora_slots.loaded()) == 2
    # the same prompt on two adapters shares no prefix-cache page; on one adapter it does
    p = PROMPTS[2]
    first = llm.generate([p], sp, lora_request=reqs["qv-rs"])[0]
    other = llm.generate([p], sp, lora_request=reqs["mlp-o"])[0]
    again = llm.generate([p], sp, lora_request=reqs["qv-rs"])[0]
    assert other.metrics["cached_tokens"] == 0 and again.metrics["cached_tokens"] > 0
    assert again.token_ids == first.token_ids != other.token_ids
    # speculative decoding (n-gram proposals): the verify step applies each row's adapter
    spec = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_slots=4,
               page_size=8, max_model_len=128, speculative={"method": "ngram", "k": 3, "n": 2})
    rep = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, PROMPTS[0], [40, 41] * 9]
    names = [None, "every-proj", "qv-rs", "mlp-o"]
    a = spec.generate(rep, sp, lora_request=[reqs.get(n) for n in names])
    b = llm.generate(rep, sp, lora_request=[reqs.get(n) for n in names])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.metrics["spec_proposed"] for o in a) > 0


def test_int8_base_weights_with_float_adapters(family):
    """quantization="int8" (W8A8 on CPU) under adapters: the weights quantized, the adapters
    f32, no SmoothQuant scales in the norms (the adapters read them as trained); greedy tokens
    score the prompt like the f32 engine's on the same adapters (teacher-forced logprobs), far
    closer than the adapters are to each other."""
    base, adapters, _ = family
    kw = dict(enable_lora=True, max_loras=3, max_lora_rank=16, max_slots=4, page_size=8,
              max_model_len=128)
    f32 = LLM(str(base), **kw)
    q8 = LLM(str(base), quantization="int8", quant_mode="w8a8", **kw)
    lp8, lp32 = q8.engine.params.layers[0], f32.engine.params.layers[0]
    assert type(lp8.wq).__name__ == "QuantizedArray" and lp8.wq.mode == "w8a8"
    assert np.array_equal(np.asarray(lp8.attn_norm), np.asarray(lp32.attn_norm))
    reqs = [None] + [LoRARequest(n, i + 1, str(adapters[n][0])) for i, n in enumerate(adapters)]
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = PROMPTS[2]  # teacher-forced: each prompt token's logprob, no divergence

    def scores(llm):
        outs = llm.generate([prompt] * 4, sp, lora_request=reqs)
        return np.array([[x["logprob"] for x in o.prompt_logprobs[1:]] for o in outs])

    a, b = scores(f32), scores(q8)
    assert q8.engine.params.lora[0].a["q"].dtype == jnp.float32
    int8_error = np.abs(a - b).mean(axis=1)  # per adapter (row 0: the base model)
    adapter_effect = np.abs(a[1:] - a[0]).mean(axis=1)
    assert (int8_error[1:] < 0.2 * adapter_effect).all(), (int8_error, adapter_effect)


def _write_adapter(src, dst, config_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    if config_edit:
        conf.update(config_edit)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    if tensors_edit:
        t = load_file(str(dst / "adapter_model.safetensors"))
        save_file(tensors_edit(t), str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_adapters_and_requests_are_refused_naming_the_problem(family, tmp_path):
    base, adapters, _ = family
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_slots=2,
              page_size=8, max_model_len=64)
    good = adapters["every-proj"][0]
    sp = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(RequestError, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate(["hi"], sp, lora_request=LoRARequest("big", 1, str(adapters["mlp-o"][0])))
    with pytest.raises(RequestError, match=r"lora: unknown LoRA adapter 'nope'"):
        llm.engine.add_request([1, 2, 3], sp, lora="nope")
    other = tmp_path / "other_base"
    from tests.hf_models import make_hf_model

    hf2 = make_hf_model("llama", other, hidden=32, layers=2, vocab=2000)
    pm = peft.get_peft_model(hf2, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                  init_lora_weights=False))
    pm.save_pretrained(tmp_path / "for_other")
    cases = [
        (tmp_path / "for_other", "do not fit the base model"),
        (_write_adapter(good, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        (_write_adapter(good, tmp_path / "bias", {"bias": "all"}), "trained biases"),
        (_write_adapter(good, tmp_path / "alpha", {"lora_alpha": -1}), "lora_alpha must be"),
        (_write_adapter(good, tmp_path / "emb", tensors_edit=lambda t: t | {
            "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 2000),
                                                                             np.float32)}),
         "not a LoRA A/B weight"),
        (_write_adapter(good, tmp_path / "half", tensors_edit=lambda t: {
            k: v for k, v in t.items() if "layers.1.mlp.up_proj.lora_B" not in k}),
         "layer 1 up_proj: lora_B is missing"),
        (tmp_path / "missing", "not a directory"),
    ]
    for path, msg in cases:
        with pytest.raises(CheckpointError, match=msg):
            llm.engine.add_lora(f"x{len(msg)}", str(path))
    assert llm.engine.adapters.names() == []  # nothing half-registered
    # loaded once by name; another path under the same name must be unloaded first
    llm.engine.add_lora("a", str(good))
    assert llm.engine.add_lora("a", str(good)).key == llm.engine.adapters.get("a").key
    with pytest.raises(ValueError, match="already loaded"):
        llm.engine.add_lora("a", str(adapters["qv-rs"][0]))
    # unloading an adapter in use is refused; once its request is done it goes
    rid = llm.engine.add_request([1, 5, 6], SamplingParams(max_tokens=3, temperature=0), lora="a")
    with pytest.raises(ValueError, match="in use by 1"):
        llm.engine.remove_lora("a")
    while llm.engine.has_work:
        llm.engine.step()
    assert not llm.engine.num_unfinished
    llm.engine.remove_lora("a")
    assert llm.engine.adapters.names() == [] and llm.engine.scheduler.lora_slots.loaded() == {}
    base_only = LLM(str(base), max_slots=2, page_size=8, max_model_len=64)
    with pytest.raises(RequestError, match="enable_lora"):
        base_only.engine.add_request([1, 2], sp, lora="a")
    for bad, msg in [(dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
                     (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras")]:
        with pytest.raises(ValueError, match=msg):
            LLM(str(base), enable_lora=True, **bad)


def test_slot_table_reuses_idle_slots_least_recently_released_first():
    s = LoraSlots(2)
    assert s.acquire("a") == 1 and s.acquire("b") == 2 and s.acquire("a") == 1
    assert s.take_loads() == [(1, "a"), (2, "b")]
    assert s.acquire("c") is None  # both referenced
    s.release("b")
    s.release("a")
    assert s.acquire("c") == 2 and s.take_loads() == [(2, "c")]  # b went idle first
    s.release("a")  # a idle now: loaded, unreferenced
    assert s.acquire("a") == 1 and s.take_loads() == []  # still in its slot: no copy
    with pytest.raises(ValueError, match="in use"):
        s.evict("a")
    s.release("a")
    s.evict("a")
    assert s.loaded() == {"c": 2} and s.acquire("d") == 1
    assert s.refs() == {"c": 1, "d": 1}


def test_update_lora_serves_the_new_weights_in_place(family, tmp_path):
    """update_lora swaps an adapter's weights between requests: the tokens of the new weights
    registered fresh, no compilation, the old ones back after a bad path is refused."""
    base, adapters, _ = family
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_slots=4,
              page_size=8, max_model_len=128)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = (str(adapters[n][0]) for n in ("every-proj", "mlp-o"))
    want_b = llm.generate(PROMPTS, sp, lora_request=LoRARequest("ref-b", 9, b))
    first = llm.generate(PROMPTS, sp, lora_request=LoRARequest("rl", 1, a))
    programs = llm.engine.compile_count
    new = llm.update_lora("rl", b)
    assert new.path == b
    got = llm.generate(PROMPTS, sp, lora_request=LoRARequest("rl", 1, b))
    assert [o.token_ids for o in got] == [o.token_ids for o in want_b]
    assert [o.token_ids for o in got] != [o.token_ids for o in first]
    assert llm.engine.compile_count == programs
    with pytest.raises(CheckpointError, match="not a directory"):
        llm.update_lora("rl", str(tmp_path / "missing"))
    again = llm.generate(PROMPTS, sp, lora_request=LoRARequest("rl", 1, b))
    assert [o.token_ids for o in again] == [o.token_ids for o in want_b]
    # a trainer's tensors in memory (PEFT names), rank and alpha kept from the registered
    # adapter: B doubled equals the same adapter with lora_alpha doubled (read from a dir)
    from safetensors.numpy import load_file

    mem = load_file(str(Path(b) / "adapter_model.safetensors"))
    llm.update_lora("rl", {k: v * 2 if ".lora_B." in k else v for k, v in mem.items()})
    alpha2 = json.loads((Path(b) / "adapter_config.json").read_text())["lora_alpha"] * 2
    ref = _write_adapter(Path(b), tmp_path / "alpha2", config_edit={"lora_alpha": alpha2})
    want = llm.generate(PROMPTS, sp, lora_request=LoRARequest("ref-alpha2", 8, str(ref)))
    assert [o.token_ids for o in want] != [o.token_ids for o in want_b]
    via_mem = [llm.engine.add_request(p, sp, lora="rl") for p in PROMPTS]
    done = {}
    while len(done) < len(via_mem):
        done |= {d.request_id: d.output for d in llm.engine.step() if d.finished}
    assert [done[r].token_ids for r in via_mem] == [o.token_ids for o in want]
    with pytest.raises(CheckpointError, match="NaN"):
        llm.update_lora("rl", {k: v * np.nan for k, v in mem.items()})
    assert llm.engine.adapters.get("rl").path != b  # the doubled tensors still serve
    written = llm.engine.adapters.get("rl").path
    llm.update_lora("rl", b)  # the dir written for the tensors goes with them
    assert not Path(written).exists()
    rid = llm.engine.add_request(PROMPTS[0], sp, lora="rl")
    with pytest.raises(AdapterInUse):
        llm.update_lora("rl", a)
    llm.engine.abort(rid)
