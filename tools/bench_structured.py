"""Structured output on a model that follows no schema unaided: validity and cost.

    jaxinfer bench-structured --n 100            # 5 JSON schemas + regex + choice, temps 0 and 1
    python -m jaxinfer.tools.bench_structured --n 100 --json out.json

Validity: each completion of each constraint (N prompts, temperature 0 and 1.0) must parse and
validate (`jsonschema` is the oracle for JSON, `re.fullmatch` for the regex, membership for the
choice). Speed, side by side in one engine: 8 concurrent JSON-schema requests against 8
unconstrained ones of the same length (tokens/s, medians of repeats), and the host's mask cost
per constrained step (llguidance, all rows of the step).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

SCHEMAS = {
    "person": {  # nested object, required fields, a bounded string
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object", "additionalProperties": False,
                        "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 24},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        },
    },
    "tags": {  # array with bounds
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                "items": {"type": "string", "maxLength": 12}}},
    },
    "sentiment": {  # enum + boolean
        "type": "object", "additionalProperties": False, "required": ["label", "sure"],
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "sure": {"type": "boolean"}},
    },
    "measure": {  # numbers with ranges
        "type": "object", "additionalProperties": False, "required": ["count", "score"],
        "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 1,
                                  "multipleOf": 0.01}},
    },
    "event": {  # array of objects, optional field
        "type": "object", "additionalProperties": False, "required": ["events"],
        "properties": {"events": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"type": "object", "additionalProperties": False, "required": ["year"],
                      "properties": {"year": {"type": "integer", "minimum": 1000,
                                              "maximum": 2100},
                                     "what": {"type": "string", "maxLength": 20}}}}},
    },
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
CHOICE = ("red", "green", "blue", "yellow")
TOPICS = ("a city", "a storm", "a market", "a library", "a river", "a song", "a school",
          "a train", "a garden", "a museum", "an island", "a bakery", "a bridge", "a forest",
          "a festival", "a hospital", "a harbour", "a castle", "a desert", "a laboratory")


def prompts(n: int, what: str) -> list[str]:
    return [f"Write {what} about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(n)]


def constraints() -> dict[str, tuple[dict, object]]:
    """name -> (structured_outputs, validator(text) -> None or raise)."""
    import jsonschema

    out = {}
    for name, schema in SCHEMAS.items():
        def check(text, schema=schema):
            jsonschema.validate(json.loads(text), schema)
        out[f"json:{name}"] = ({"json": schema}, check)

    def check_regex(text):
        if not re.fullmatch(REGEX, text):
            raise ValueError(f"{text!r} does not match {REGEX}")

    def check_choice(text):
        if text not in CHOICE:
            raise ValueError(f"{text!r} is not one of {CHOICE}")
    out["regex"] = ({"regex": REGEX}, check_regex)
    out["choice"] = ({"choice": list(CHOICE)}, check_choice)
    return out


def validity(llm, n: int, temperatures=(0.0, 1.0), max_tokens: int = 96, names=None) -> dict:
    """{constraint: {temperature: (valid, total, first failure or None)}}: every completion in
    one generate call (the engine batches them all). `names`: only these constraints."""
    from jaxinfer.runtime.host.requests import SamplingParams

    cases = [(name, so, check, t) for name, (so, check) in constraints().items()
             for t in temperatures if names is None or name in names]
    ps, sps = [], []
    for name, so, _, t in cases:
        ps += prompts(n, "a JSON record" if name.startswith("json") else "it")
        sps += [SamplingParams(max_tokens=max_tokens, temperature=t, seed=i, structured_outputs=so)
                for i in range(n)]
    outs = llm.generate(ps, sps)
    res: dict = {}
    for k, (name, _, check, t) in enumerate(cases):
        ok, first = 0, None
        for o in outs[k * n:(k + 1) * n]:
            try:
                check(o.text)
                ok += 1
            except Exception as e:  # noqa: BLE001 - counted, the first one shown
                first = first or f"{o.finish_reason}: {o.text!r}: {type(e).__name__}"
        res.setdefault(name, {})[t] = (ok, n, first)
    return res


def speed(llm, *, n: int = 8, max_tokens: int = 48, repeats: int = 3) -> dict:
    """8 concurrent JSON-schema requests vs 8 unconstrained, same prompts and length (the
    unconstrained ones ignore EOS so they run the same number of tokens)."""
    from jaxinfer.runtime.host.requests import SamplingParams

    ps = prompts(n, "a JSON record")
    so = {"json": {"type": "object", "additionalProperties": False, "required": ["items"],
                   "properties": {"items": {"type": "array", "items": {"type": "integer"}}}}}
    runs = {"constrained": [], "unconstrained": []}
    mask_s = []
    eng = llm.engine
    for _ in range(repeats + 1):  # the first round compiles and builds the vocabulary
        for kind in runs:
            extra = dict(structured_outputs=so) if kind == "constrained" else dict(ignore_eos=True)
            sps = [SamplingParams(max_tokens=max_tokens, temperature=0, **extra)] * n
            fill = eng.constraints.fill if eng.constraints else None
            spent = [0.0, 0]

            def timed(plan, fill=fill, spent=spent):
                t = time.perf_counter()
                fill(plan)
                spent[0] += time.perf_counter() - t
                spent[1] += 1
            if fill:
                eng.constraints.fill = timed
            t0 = time.perf_counter()
            outs = llm.generate(ps, sps)
            dt = time.perf_counter() - t0
            if fill:
                eng.constraints.fill = fill
            runs[kind].append(sum(len(o.token_ids) for o in outs) / dt)
            if kind == "constrained" and spent[1]:
                mask_s.append(spent[0] / spent[1])
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}
    return {"tok_s": med, "ratio": med["constrained"] / med["unconstrained"],
            "mask_ms_per_step": 1e3 * statistics.median(mask_s[1:]), "first_round_tok_s":
            {k: v[0] for k, v in runs.items()}}


def table(valid: dict, sp: dict | None) -> str:
    lines = ["| constraint | temperature | valid | first failure |", "|---|---|---|---|"]
    for name, by_t in valid.items():
        for t, (ok, n, first) in by_t.items():
            lines.append(f"| {name} | {t} | {ok}/{n} | {first or ''} |")
    if sp:
        lines += ["", f"8 concurrent requests, tok/s (median of repeats): constrained "
                      f"{sp['tok_s']['constrained']:.1f}, unconstrained "
                      f"{sp['tok_s']['unconstrained']:.1f} (ratio {sp['ratio']:.2f}); host mask "
                      f"cost {sp['mask_ms_per_step']:.2f} ms per constrained step"]
    return "\n".join(lines)


def cmd(args) -> int:
    from jaxinfer.runtime.llm import LLM

    llm = LLM(args.model, max_slots=args.max_slots)
    valid = validity(llm, args.n, max_tokens=args.max_tokens)
    sp = None if args.no_speed else speed(llm)
    print(table(valid, sp))
    if args.json:
        Path(args.json).write_text(json.dumps({"validity": {k: {str(t): v for t, v in d.items()}
                                                             for k, d in valid.items()},
                                               "speed": sp}, indent=2))
    bad = sum(n - ok for d in valid.values() for ok, n, _ in d.values())
    return 1 if bad else 0


def add_args(p) -> None:
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--n", type=int, default=100, help="completions per constraint and temperature")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-slots", type=int, default=16)
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")


def register(sub, engine_args) -> None:
    p = sub.add_parser("bench-structured", help="structured output: validity and mask cost")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
