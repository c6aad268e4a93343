"""What logits processors cost: decode with every row under processors against none, side by side
in one engine (medians of alternating repeats; the first, compiling, run reported apart).

    python -m jaxinfer.tools.bench_processors                    # Gemma 3 270M, 16 rows
    python -m jaxinfer.tools.bench_processors --model DIR --rows 4 --tokens 16 --repeats 2

"All processors" is repetition 1.1, presence 0.3, frequency 0.2, logit_bias on 3 ids, 2 bad
words and min_tokens 8 (at most the tokens generated) on every row, so each step gathers, applies and records all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PROMPT = "The history of the city begins with"


def variants(tokens: int = 64) -> dict[str, dict]:
    return {"none": {},
            "all processors": dict(repetition_penalty=1.1, presence_penalty=0.3,
                                   frequency_penalty=0.2, logit_bias={100: 1.0, 200: -1.0,
                                                                     300: 0.5},
                                   bad_words=["zebra", "quantum leap"], min_tokens=min(8, tokens))}


def run(llm, *, rows: int, tokens: int, repeats: int) -> dict:
    from jaxinfer.runtime.host.requests import SamplingParams

    params = {name: SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **kw)
              for name, kw in variants(tokens).items()}
    prompts = [f"{PROMPT} {i}" for i in range(rows)]
    times: dict[str, list[float]] = {name: [] for name in params}
    first = {}
    for r in range(repeats + 1):  # run 0 compiles: reported apart
        for name, sp in params.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            dt = time.perf_counter() - t0
            assert all(len(o.token_ids) == tokens for o in outs)
            if r == 0:
                first[name] = rows * tokens / dt
            else:
                times[name].append(rows * tokens / dt)
    steady = {name: statistics.median(v) for name, v in times.items()}
    return {"rows": rows, "tokens": tokens, "repeats": repeats,
            "tok_s": steady, "first_run_tok_s": first,
            "ratio": steady["all processors"] / steady["none"],
            "processor_state_bytes": llm.engine.stats()["processor_state_bytes"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rows", type=int, default=16, help="concurrent requests (and slots)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    from jaxinfer.runtime.llm import LLM

    llm = LLM(a.model, max_slots=a.rows, max_model_len=256)
    rep = run(llm, rows=a.rows, tokens=a.tokens, repeats=a.repeats)
    for name, v in rep["tok_s"].items():
        print(f"{name:16s} {v:8.1f} tok/s steady (first run {rep['first_run_tok_s'][name]:.1f})")
    print(f"all processors / none: {rep['ratio']:.3f}x; processor state "
          f"{rep['processor_state_bytes'] / 2**20:.1f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
