"""`jaxinfer bench startup`: what a user waits for before the first token, cold and warm.

    jaxinfer bench startup                         # default model; both compile modes, 3 repeats
    jaxinfer bench startup --modes background --repeats 1 --serve --out r.json

Each run is a fresh process. Cold: the model cache (JAXINFER_CACHE) and the compilation cache
(JAXINFER_COMPILATION_CACHE) are empty directories; warm: the same directories again, filled by
the cold run before it. A run reports import, load (checkpoint to engine), first token after load,
the time to `--tokens` tokens, the process's wall time (exit waits for a background compile
under way: its program lands in the cache), and every program it compiled: name, count,
trace / lower / compile seconds, and how many the persistent cache served. `--serve`: `jaxinfer
serve --http-port P` started the same way, timed to its first 200 on /health and to the answer
of one completion. `--compiled-dir DIR`: also cold runs (empty model and compilation caches)
that start with the programs `jaxinfer compile` wrote in DIR. Medians over `--repeats`; the table lists the last
run's programs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = "The capital of France is"
# jax's compile log lines (jax_log_compiles) and the persistent cache's hit line
_EVENTS = (
    (re.compile(r"Finished tracing (?:\+ transforming )?(\w+) for \w+ in ([\d.e-]+) sec"), "trace"),
    (re.compile(r"Finished jaxpr to MLIR module conversion \w+\((\w+)\) in ([\d.e-]+) sec"),
     "lower"),
    (re.compile(r"Finished XLA compilation of \w+\((\w+)\) in ([\d.e-]+) sec"), "compile"),
    (re.compile(r"[Pp]ersistent compilation cache hit for '\w+?_(\w+)'"), "hit"),
)


class _Programs(logging.Handler):
    """Collects jax's compile log into {name: {count, trace_s, lower_s, compile_s, hits}}."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.table: dict[str, dict] = {}

    def emit(self, record):
        msg = record.getMessage()
        for rx, kind in _EVENTS:
            m = rx.search(msg)
            if m is None:
                continue
            row = self.table.setdefault(m.group(1), dict(count=0, trace_s=0.0, lower_s=0.0,
                                                         compile_s=0.0, hits=0))
            if kind == "hit":
                row["hits"] += 1
            else:
                row[f"{kind}_s"] += float(m.group(2))
                row["count"] += kind == "compile"
            return


def child(a) -> dict:
    """One start, in this process: import, load, first token, `tokens` tokens."""
    t0 = time.perf_counter()
    import jax

    from jaxinfer.runtime.host.requests import SamplingParams
    from jaxinfer.runtime.llm import LLM

    t_import = time.perf_counter() - t0
    jax.config.update("jax_log_compiles", True)
    programs = _Programs()
    for name in ("jax", "jax._src.compiler"):
        lg = logging.getLogger(name)
        lg.addHandler(programs)
        lg.setLevel(logging.DEBUG if name.endswith("compiler") else logging.WARNING)
        lg.propagate = False
    t1 = time.perf_counter()
    shipped = {"compiled_dir": a.compiled_dir} if a.compiled_dir else {}
    llm = LLM(a.model, compile_mode=a.compile_mode, **shipped)
    t_load = time.perf_counter() - t1
    t2, first, n = time.perf_counter(), None, 0
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for d in llm.stream(PROMPT, sp):
        n += len(d.token_ids)
        if first is None and n:
            first = time.perf_counter() - t2
    step = llm.engine._step
    return dict(import_s=t_import, load_s=t_load, first_token_s=first,
                tokens_s=time.perf_counter() - t2, tokens=n,
                layerwise_steps=getattr(step, "layerwise_steps", 0), programs=programs.table)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_run(a, env: dict) -> dict:
    """`jaxinfer serve` from its start: seconds to /health 200 and to one completion's answer."""
    port, http = _free_port(), _free_port()
    t0 = time.perf_counter()
    exe = os.path.join(os.path.dirname(sys.executable), "jaxinfer")  # the console script
    proc = subprocess.Popen([exe, "serve", "--model",
                             a.model, "--port", str(port), "--http-port", str(http),
                             "--compile-mode", a.compile_mode,
                             *(["--compiled-dir", a.shipped] if a.shipped else [])],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base, ready = f"http://127.0.0.1:{http}", None
    try:
        while ready is None:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
            except OSError:
                time.sleep(0.05)
        body = json.dumps({"model": a.model, "prompt": PROMPT, "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        answered = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(120)
    return dict(ready_s=ready, answered_s=answered, text=text)


def run_once(a, mode: str, env: dict, shipped: str | None = None) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "jaxinfer.tools.bench_startup", "--child",
                        "--model", a.model, "--compile-mode", mode, "--tokens", str(a.tokens),
                        *(["--compiled-dir", shipped] if shipped else [])],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"startup run failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def measure(a) -> dict:
    report = {"model": a.model, "tokens": a.tokens, "repeats": a.repeats, "runs": {}}
    for mode in a.modes.split(","):
        for rep in range(a.repeats):
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, JAXINFER_CACHE=os.path.join(d, "models"),
                           JAXINFER_COMPILATION_CACHE=os.path.join(d, "xla"))
                for temp in ("cold", "warm"):
                    runs = report["runs"].setdefault(f"{mode} {temp}", [])
                    runs.append(run_once(a, mode, env))
                    print(f"{mode} {temp} #{rep + 1}: first token "
                          f"{runs[-1]['first_token_s']:.2f} s after load "
                          f"{runs[-1]['load_s']:.2f} s", file=sys.stderr, flush=True)
                if a.compiled_dir:  # a fresh host again (empty caches), the programs shipped
                    shipped = dict(env, JAXINFER_CACHE=os.path.join(d, "models3"),
                                   JAXINFER_COMPILATION_CACHE=os.path.join(d, "xla3"))
                    runs = report["runs"].setdefault(f"{mode} cold, shipped", [])
                    runs.append(run_once(a, mode, shipped, a.compiled_dir))
                    print(f"{mode} cold, shipped #{rep + 1}: first token "
                          f"{runs[-1]['first_token_s']:.2f} s after load "
                          f"{runs[-1]['load_s']:.2f} s", file=sys.stderr, flush=True)
                if a.serve:
                    temps = ["serve cold", "serve warm"] + (
                        ["serve cold, shipped"] if a.compiled_dir else [])
                    for temp in temps:
                        if temp != "serve warm":  # its own empty caches
                            env = dict(env, JAXINFER_COMPILATION_CACHE=os.path.join(
                                d, temp.replace(" ", "_").replace(",", "")))
                        if "shipped" in temp:  # a fresh host: the model cache empty too
                            env = dict(env, JAXINFER_CACHE=os.path.join(d, "models4"))
                        shipped = a.compiled_dir if "shipped" in temp else None
                        report["runs"].setdefault(f"{mode} {temp}", []).append(serve_run(
                            argparse.Namespace(**{**vars(a), "compile_mode": mode,
                                                  "shipped": shipped}), env))
    return report


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def format_table(report: dict) -> str:
    lines = ["| run | import s | load s | first token s | "
             f"{report['tokens']} tokens s | process s | programs compiled (cache hits) |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in report["runs"].items():
        if "ready_s" in runs[0]:
            continue
        progs = runs[-1]["programs"]
        n = sum(p["count"] for p in progs.values())
        hits = sum(p["hits"] for p in progs.values())
        lines.append(f"| {name} | {_median(runs, 'import_s'):.2f} | {_median(runs, 'load_s'):.2f}"
                     f" | **{_median(runs, 'first_token_s'):.2f}** | "
                     f"{_median(runs, 'tokens_s'):.2f} | {_median(runs, 'process_s'):.2f} | "
                     f"{n} ({hits}) |")
    serve = {k: v for k, v in report["runs"].items() if "ready_s" in v[0]}
    if serve:
        lines += ["", "| serve | accepting (/health 200) s | first completion answered s |",
                  "|---|---|---|"]
        for name, runs in serve.items():
            lines.append(f"| {name} | **{_median(runs, 'ready_s'):.2f}** | "
                         f"{_median(runs, 'answered_s'):.2f} |")
    for name, runs in report["runs"].items():
        if "programs" not in runs[0]:
            continue
        lines += ["", f"{name} (last run): program | compiles | trace s | lower s | compile s "
                      "| cache hits"]
        for prog, p in sorted(runs[-1]["programs"].items(), key=lambda kv: -kv[1]["compile_s"]):
            if p["count"] or p["hits"]:
                lines.append(f"  {prog} | {p['count']} | {p['trace_s']:.2f} | {p['lower_s']:.2f}"
                             f" | {p['compile_s']:.2f} | {p['hits']}")
    return "\n".join(lines)


def add_args(p) -> None:
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--modes", default="blocking,background",
                   help="compile modes to start in, comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="tokens the first request generates")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", action="store_true", help="also time `jaxinfer serve`")
    p.add_argument("--out", default=None, help="write the report as JSON")
    p.add_argument("--compiled-dir", default=None,
                   help="programs `jaxinfer compile` wrote for --model: also start with empty "
                        "caches and these (runs '... cold, shipped')")


def cmd(a) -> int:
    report = measure(a)
    print(format_table(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def register(bench) -> None:
    p = bench.add_parser("startup", help="import / load / compile / first token, cold and warm")
    add_args(p)
    p.set_defaults(fn=cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-mode", default="background", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    return cmd(a)


if __name__ == "__main__":
    sys.exit(main())
