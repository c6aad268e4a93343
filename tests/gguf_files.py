"""GGUF files written the way llama.cpp's converter lays them out, for the loaders' tests
(tests/checkpoints/test_gguf_{gpt_oss,deepseek,gemma4}.py), and the HF-side checks they share."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch


def write_gguf(path: Path, arch: str, meta: dict, tensors: list, *, drop=(), set_kv=None,
               replace=None, types: dict | None = None) -> Path:
    """meta: key -> (GGUFWriter method, value), set_kv over it, `drop` keys and tensors left
    out; tensors: (name, array) or (name, array, raw ggml type of the array's bytes);
    `replace`: name -> the array written instead; `types`: name -> a ggml type the array is
    quantized to (else written as it is)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (method, value) in (meta | (set_kv or {})).items():
        if key not in drop:
            getattr(w, method)(key, value)
    for name, a, *raw in tensors:
        if name in drop:
            continue
        a = (replace or {}).get(name, a)
        qtype = (types or {}).get(name)
        if qtype is not None:
            a, raw = gguf.quants.quantize(a, qtype), [qtype]
        w.add_tensor(name, a, raw_dtype=raw[0] if raw and raw[0] is not None else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_gguf_served_equals_hf(path: Path, hf, new: int = 8) -> None:
    """LLM(path to the .gguf), its tokenizer from the file: greedy tokens = HF's generate."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(path), max_slots=2, page_size=8, max_model_len=64)
    greedy = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    outs = llm.generate(["The king is dead; long live the king.", "O Romeo, Romeo"], greedy)
    for o in outs:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.prompt_token_ids[0] == 1 and len(o.prompt_token_ids) > 4
        assert o.token_ids == ref[0, len(o.prompt_token_ids):].tolist(), o.prompt
