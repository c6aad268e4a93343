"""Offline inference over JSONL files: the runner behind `jaxinfer batch` (serve/batch.py) and
`LLM.generate_jsonl`.

    jaxinfer batch --model M --input in.jsonl --output out.jsonl [--resume] [--ordered]

Input: one request per line, `{"id": ..., "prompt": "..."}` or `{"id": ..., "prompt_token_ids":
[...]}`, with optional per-line sampling fields (`max_tokens`, `temperature`, `top_k`, `top_p`,
`min_p`, `seed`, `stop`, `stop_token_ids`, `logprobs`, `prompt_logprobs`, `ignore_eos`, and
`structured_outputs`
{"json": schema} / {"regex": ...} / {"choice": [...]} / {"grammar": ...} / {"json_object": true})
that override the command's defaults, `lora` (a loaded LoRA adapter's name) and, for a vision
model, `multi_modal_data` {"image": a data URL or base64 string, or a list of them} (the prompt
marks each image, e.g. Gemma 3's "<start_of_image>"; runtime/host/image_prompt.py); lines are
checked by the same request door (runtime/host/requests.py) as every other front end.
Output: one line per input line, either a result

    {"id", "text", "token_ids", "finish_reason",
     "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"},
     "metrics": {"queue_s", "ttft_s", "itl_s_mean", "e2e_s"}}
    (+ "logprobs" / "prompt_logprobs" when asked for: [null, {"token_id", "logprob", "top"}...])

or, for a line that cannot be served, `{"id": <id or null>, "line": <1-based line number>,
"error": "..."}`; the job goes on. Blank lines are ignored. A line the engine failed (a step
raised; not the line's fault) gets an error record with `"retry": true`: `--resume` computes it
again and appends its result after it.

How it runs
-----------
* The input is read one line at a time; nothing per line is kept after its record is written
  except its id (a short string in a set, to detect duplicate ids and to skip finished ids on
  resume). Memory is therefore O(window) for prompts and results plus ~100 bytes per id.
* Requests are admitted continuously: whenever fewer than `max_inflight` (default 2 x max_slots
  + 4) admitted requests are unfinished, the next line is parsed and added to the engine, so the
  engine's batch stays full while the file lasts. No static chunks.
* Results are written as they finish. With `ordered=True` they are written in input order
  through a reorder buffer of at most `reorder_window` records (default 4 x max_slots + 8):
  when every position in the window is taken (finished-but-waiting plus in flight), admission
  stops until the head of the window finishes.

Durability (what "acknowledged" means)
--------------------------------------
* Every record is written with one `write()` of the complete line and flushed to the OS at
  once. A killed process (SIGKILL, OOM killer, Ctrl-C) therefore loses no record it wrote; at
  worst the line being written at that instant is torn, and `--resume` repairs it.
* A record is *acknowledged* - counted by the progress bar, the summary and the returned
  counts - only after `fsync()` of the output file has returned for it. `fsync="step"` (the
  default) is a group commit: one fsync per engine step covers every record that step
  finished (and at most 256 error/skip records while reading), so fsync cost is per step,
  not per line. `fsync="line"` fsyncs after every line. `fsync="none"` never fsyncs (records
  survive a process crash but not an OS crash; nothing is ever "acknowledged" durably).
* After an OS crash or power loss, every acknowledged record is on disk. Records written but
  not yet fsynced may be missing or torn; `--resume` truncates a torn tail and recomputes
  whatever is missing, so the finished job still holds every input line exactly once.

Resume
------
`resume=True` scans the existing output: a last line without its newline (or an unparsable
last line) is truncated away; an unparsable line in the middle is a fatal error (the file is not
ours or is damaged). Results are keyed by id, error records by line number; those input lines
are skipped. Without `resume`, an existing non-empty output is a fatal error (never clobbered)
unless `overwrite=True`.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

from jaxinfer.runtime.host.errors import QueueFull, RequestError
from jaxinfer.runtime.host.interface import EngineInterface
from jaxinfer.runtime.host.requests import (SAMPLING_FIELDS, Limits, SamplingParams, check_request,
                                            parse_prompt, sampling_from_json)
from jaxinfer.runtime.host.image_prompt import parse_multimodal

REQUEST_FIELDS = {"id", "prompt", "prompt_token_ids", "lora", "multi_modal_data"}
LINE_SAMPLING = set(SAMPLING_FIELDS)  # per-line fields of SamplingParams
METRIC_KEYS = ("queue_s", "ttft_s", "itl_s_mean", "e2e_s")
FSYNC_MODES = ("step", "line", "none")
_GROUP_MAX = 256  # records per fsync group while reading (errors / skips)
_RESERVOIR = 100_000  # latency samples kept for the p50/p99 summary (exact below this)


class BatchError(Exception):
    """A fatal error: the job cannot go on (bad paths, damaged output, ...)."""


class LineError(Exception):
    """One input line cannot be served; becomes an error record."""


@dataclass
class _Job:
    line: int
    uid: object  # the user's id, as given
    key: str  # canonical id key (JSON text of the id)
    prompt_ids: list[int]
    params: SamplingParams
    seq: int = -1
    lora: str | None = None  # a LoRA adapter's name
    images: list | None = None  # [(digest, pixels)] (runtime/host/image_prompt.py)


def id_key(uid) -> str:
    """Canonical key of an id: its JSON text, so 1 and "1" stay distinct."""
    return json.dumps(uid, ensure_ascii=True, separators=(",", ":"))


# ------------------------------------------------------------------------------------- parsing

class _Parser:
    """One line -> a job, through the request door (runtime.host.requests): the same fields, ranges
    and prompt checks as every other front end."""

    def __init__(self, tokenizer, defaults: dict, limits: Limits, images=None):
        self.tokenizer, self.limits = tokenizer, limits
        self.images = images  # the ImageDoor of a vision model; None: text only
        try:
            self.defaults = dict(defaults)
            self.default_params = SamplingParams(**self.defaults)
        except RequestError as e:  # a bad default is fatal, early
            raise BatchError(f"sampling default {e}") from None

    def decode(self, raw: bytes):
        """bytes -> (obj, uid, key). Raises LineError (uid None if the id is unknown)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineError(f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise LineError(f"invalid JSON: {e}") from None
        except RecursionError:
            raise LineError("invalid JSON: nested too deeply") from None
        if not isinstance(obj, dict):
            raise LineError(f"a line must be a JSON object, got {type(obj).__name__}")
        if "id" not in obj:
            raise LineError("missing field 'id'")
        uid = obj["id"]
        if isinstance(uid, bool) or not isinstance(uid, (str, int)):
            raise LineError(f"field 'id' must be a string or an integer, got {json.dumps(uid)[:80]}")
        if isinstance(uid, str) and not uid:
            raise LineError("field 'id' must be a non-empty string")
        if isinstance(uid, int) and not -(2**63) <= uid < 2**63:
            raise LineError("field 'id' must fit in 64 bits")
        return obj, uid, id_key(uid)

    def job(self, obj: dict, line: int, uid, key: str) -> _Job:
        unknown = sorted(set(obj) - REQUEST_FIELDS - LINE_SAMPLING)
        if unknown:
            raise LineError(f"unknown field(s) {unknown[:10]}")
        has_p, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_p and has_ids:
            raise LineError("give either 'prompt' or 'prompt_token_ids', not both")
        if not (has_p or has_ids):
            raise LineError("missing field 'prompt' (or 'prompt_token_ids')")
        images = None
        try:
            if "multi_modal_data" in obj:
                _, prompt_ids, images = parse_multimodal(
                    {k: obj[k] for k in ("prompt", "prompt_token_ids", "multi_modal_data")
                     if k in obj}, self.tokenizer, self.images,
                    lambda p, name: parse_prompt(p, self.tokenizer, self.limits, name))
            elif has_p:
                if not isinstance(obj["prompt"], str):
                    raise RequestError("prompt", f"must be a string, got {type(obj['prompt']).__name__}")
                _, prompt_ids = parse_prompt(obj["prompt"], self.tokenizer, self.limits)
            else:
                ids = obj["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise RequestError("prompt_token_ids", "must be a list of token ids")
                _, prompt_ids = parse_prompt(ids, self.tokenizer, self.limits, "prompt_token_ids")
            params = (sampling_from_json(obj, self.defaults)
                      if any(k in LINE_SAMPLING for k in obj) else self.default_params)
            check_request(prompt_ids, params, self.limits)
            for k in ("n", "best_of"):  # a line is one completion (one output record)
                if getattr(params, k) not in (None, 1):
                    raise RequestError(k, "must be 1 in a JSONL batch: one line is one "
                                          "completion (repeat the line with other seeds)")
            lora = obj.get("lora")
            if lora is not None and (not isinstance(lora, str) or not lora):
                raise RequestError("lora", "must be a LoRA adapter's name (a non-empty string)")
        except RequestError as e:
            raise LineError(_line_message(e)) from None
        return _Job(line=line, uid=uid, key=key, prompt_ids=prompt_ids, params=params, lora=lora,
                    images=images or None)


# ------------------------------------------------------------------------------------ output

def encode_record(rec: dict) -> bytes:
    try:
        return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate somewhere: fall back to \u escapes
        return (json.dumps(rec, ensure_ascii=True) + "\n").encode("ascii")


def scan_output(path: str) -> tuple[set[str], set[int], int]:
    """Read an existing output for --resume: (result id keys, error line numbers, records).

    Our writer can leave at most one damaged line, at the end: a line without its newline (the
    process died inside the write) or, after an OS crash, a line of garbage. That tail is
    truncated if it begins like one of our records (`{"id"`). Anything else unparsable is
    fatal: the file is damaged or not ours, and it is never truncated."""
    done_ids: set[str] = set()
    done_lines: set[int] = set()
    n = 0
    offset = good_end = 0
    bad_at = None  # line number of an unparsable complete line
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            rec = None
            if raw.endswith(b"\n"):
                try:
                    rec = json.loads(raw)
                except ValueError:
                    pass
            ok = isinstance(rec, dict) and "id" in rec and ("error" in rec or "text" in rec)
            if bad_at is not None or (not ok and not raw.startswith(b'{"id"')):
                raise BatchError(f"{path}: line {bad_at or lineno} is not a jaxinfer batch "
                                 "record; the output is damaged or not ours")
            if not ok:
                bad_at = lineno  # a torn/garbled record: must be the last line
                continue
            if "error" in rec:
                line = rec.get("line")
                if isinstance(line, int) and not isinstance(line, bool) and not rec.get("retry"):
                    done_lines.add(line)
            else:
                done_ids.add(id_key(rec["id"]))
            n += 1
            offset += len(raw)
            good_end = offset
    size = os.path.getsize(path)
    if good_end < size:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
        print(f"jaxinfer batch: repaired {path}: dropped a torn last record "
              f"({size - good_end} bytes); it will be recomputed", file=sys.stderr)
    return done_ids, done_lines, n


class _Writer:
    """Appends records; see the module docstring for the durability contract."""

    def __init__(self, path: str, fsync: str):
        if fsync not in FSYNC_MODES:
            raise BatchError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        self.fsync = fsync
        existed = os.path.exists(path)
        self.f = open(path, "ab", buffering=0)  # unbuffered: each write() goes to the OS
        if not existed and fsync != "none":
            fsync_dir_of(path)
        self.unsynced = 0

    def write(self, data: bytes) -> None:
        write_all(self.f, data)
        if self.fsync == "line":
            os.fsync(self.f.fileno())
        else:
            self.unsynced += 1

    def commit(self) -> None:
        if self.unsynced and self.fsync == "step":
            os.fsync(self.f.fileno())
        self.unsynced = 0

    def close(self) -> None:
        self.commit()
        self.f.close()


def write_all(f, data: bytes) -> None:
    """Every byte of `data` to the unbuffered file `f` (one raw write may take fewer)."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def fsync_dir_of(path: str) -> None:
    """fsync the directory holding `path` (its new or renamed entry), where the OS allows."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def prepare_output(path: str, resume: bool, overwrite: bool) -> None:
    """The checks done before the model loads, so a wrong invocation fails fast."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise BatchError(f"output directory {d} does not exist")
    if resume and overwrite:
        raise BatchError("--resume and --overwrite exclude each other")
    if os.path.isdir(path):
        raise BatchError(f"output {path} is a directory")
    if os.path.exists(path) and os.path.getsize(path) > 0 and not (resume or overwrite):
        raise BatchError(f"output {path} exists and is not empty; pass --resume to continue it "
                         "or --overwrite to replace it")


# ------------------------------------------------------------------------------------ stats

class _Reservoir:
    """Uniform sample of at most `cap` values (exact percentiles below `cap`)."""

    def __init__(self, cap: int = _RESERVOIR, seed: int = 0):
        self.cap, self.n, self.vals = cap, 0, []
        self.total = 0.0
        self.rng = random.Random(seed)

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        if len(self.vals) < self.cap:
            self.vals.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < self.cap:
                self.vals[j] = v

    def summary(self) -> dict:
        if not self.vals:
            return {"p50": None, "p99": None, "mean": None, "n": 0}
        s = sorted(self.vals)

        def pct(q):
            return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

        return {"p50": pct(0.50), "p99": pct(0.99), "mean": self.total / self.n, "n": self.n}


def _count_lines(f) -> int | None:
    """Lines in a seekable regular file of at most 2 GiB (one pass of bytes.count, ~1 GB/s,
    so the progress bar can show an ETA). None otherwise: the bar then shows no ETA."""
    try:
        if not os.path.isfile(f.name) or not f.seekable() or os.path.getsize(f.name) > 2 << 30:
            return None
        pos = f.tell()
    except (OSError, AttributeError, TypeError):
        return None
    n, last = 0, b"\n"
    while chunk := f.read(1 << 20):
        n += chunk.count(b"\n")
        last = chunk[-1:]
    f.seek(pos)
    return n + (last != b"\n")


def _progress(enabled: bool, total: int | None):
    if not enabled:
        return None
    from tqdm import tqdm

    try:  # a pty with no size set (CI, pty.spawn) reports 0 columns: tqdm would draw nothing
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        width = 0
    return tqdm(total=total, unit="line", desc="batch", file=sys.stderr, smoothing=0.1,
                dynamic_ncols=width > 0, ncols=None if width > 0 else 100,
                nrows=None if width > 0 else 20)


# ------------------------------------------------------------------------------------ the job

def run_batch(engine: EngineInterface, tokenizer, input_path, output_path, *,
              sampling: dict | None = None,
              resume: bool = False, overwrite: bool = False, ordered: bool = False,
              max_inflight: int | None = None, reorder_window: int | None = None,
              fsync: str = "step", progress: bool | None = None,
              summary_json: str | None = None, on_step=None, line_offset: int = 0) -> dict:
    """Run one JSONL job through `engine` (runtime/host/interface.py); return the summary
    dict. `sampling` holds SamplingParams defaults that lines may override. `progress`
    None shows a tqdm bar only when stderr is a terminal. `on_step(engine, inflight)` is a
    test hook called before each engine step. `line_offset`: the input is a slice of a larger
    file starting after that many lines (error records and resume use the file's numbers)."""
    prepare_output(output_path, resume, overwrite)
    parser = _Parser(tokenizer, {"temperature": 0.0, **(sampling or {})}, engine.limits,
                     engine.image_door())
    max_slots = engine.stats()["max_slots"]
    max_inflight = max_inflight or 2 * max_slots + 4
    reorder_window = reorder_window or max(4 * max_slots + 8, max_inflight)
    if max_inflight < 1 or reorder_window < 1:
        raise BatchError("max_inflight and reorder_window must be >= 1")

    done_ids: set[str] = set()
    done_lines: set[int] = set()
    resumed_records = 0
    if resume and os.path.exists(output_path):
        done_ids, done_lines, resumed_records = scan_output(output_path)
    elif overwrite and os.path.exists(output_path):
        with open(output_path, "wb"):
            pass

    if input_path == "-":
        fin = sys.stdin.buffer
    else:
        try:
            fin = open(input_path, "rb")
        except OSError as e:
            raise BatchError(f"cannot open input {input_path}: {e.strerror}") from None
    writer = _Writer(output_path, fsync)
    show = sys.stderr.isatty() if progress is None else progress
    bar = _progress(show, _count_lines(fin) if show else None)
    prefix = f"jsonl-{os.getpid():x}-{id(writer):x}-"

    # held: admissions the engine put off (queue full, or predicted late with refuse_late)
    stats = dict(requests=0, errors=0, skipped=0, held=0, prompt_tokens=0, generated_tokens=0)
    ttft, itl = _Reservoir(), _Reservoir(seed=1)
    seen: set[str] = set()
    inflight: dict[str, _Job] = {}
    reorder: dict[int, bytes] = {}
    next_seq = head_seq = 0
    acked_lines = 0  # progress-bar lines resolved since the last commit
    # a job the engine refused (QueueFull, or Overloaded with latency targets and refuse_late),
    # retried after a step; once nothing of this job is in flight it is taken whatever the
    # prediction (offline work has no client to refuse: a line is held back, never dropped)
    held: _Job | None = None
    eof = False
    lineno = line_offset
    t0 = time.perf_counter()
    last_post = 0.0

    def emit(seq: int, data: bytes) -> None:
        nonlocal head_seq
        if not ordered:
            writer.write(data)
            return
        reorder[seq] = data
        while head_seq in reorder:
            writer.write(reorder.pop(head_seq))
            head_seq += 1

    def commit(final: bool = False) -> None:
        nonlocal acked_lines, last_post
        writer.commit()
        if bar is not None:
            now = time.perf_counter()
            if final or now - last_post > 0.5:
                last_post = now
                el = max(now - t0, 1e-9)
                bar.set_postfix_str(f"{stats['generated_tokens'] / el:.0f} tok/s, "
                                    f"{stats['requests']} ok, {stats['errors']} err",
                                    refresh=False)
            bar.update(acked_lines)
        acked_lines = 0

    def error(line: int, uid, msg: str) -> None:
        nonlocal next_seq, acked_lines
        stats["errors"] += 1
        acked_lines += 1
        emit(next_seq, encode_record({"id": uid, "line": line, "error": msg}))
        next_seq += 1

    def admit(job: _Job) -> bool:
        """False if the engine's queue is full (the job is held for later)."""
        nonlocal next_seq, held
        rid = prefix + str(job.line)
        try:
            engine.add_request(job.prompt_ids, job.params, rid, lora=job.lora,
                               refuse_late=bool(inflight),
                               **({"images": job.images} if job.images else {}))
        except QueueFull:  # Overloaded too: hold the line until a step has made room
            held = job
            stats["held"] += 1
            return False
        except RequestError as e:  # prompt too long for the model, an unknown adapter, ...
            error(job.line, job.uid, _line_message(e))
            return True
        except ValueError as e:  # anything else the engine refuses a request for: this line's
            error(job.line, job.uid, str(e))
            return True
        if job.seq < 0:
            job.seq = next_seq
            next_seq += 1
        inflight[rid] = job
        return True

    def can_admit() -> bool:
        if len(inflight) >= max_inflight:
            return False
        return not ordered or next_seq - head_seq < reorder_window

    def read_one() -> None:
        """Read lines until one is admitted, errors, or the file ends."""
        nonlocal eof, lineno, acked_lines
        while True:
            raw = fin.readline()
            if not raw:
                eof = True
                return
            lineno += 1
            if not raw.strip():
                acked_lines += 1  # blank line: nothing to serve
                return
            uid = None
            try:
                obj, uid, key = parser.decode(raw)
                if key in seen:
                    raise LineError(f"duplicate id {uid!r} (an earlier line has it)")
                seen.add(key)
                if key in done_ids or lineno in done_lines:
                    stats["skipped"] += 1
                    acked_lines += 1
                    if acked_lines >= _GROUP_MAX:
                        commit()
                    continue
                job = parser.job(obj, lineno, uid, key)
            except LineError as e:
                if lineno in done_lines:  # this error was already reported
                    stats["skipped"] += 1
                    acked_lines += 1
                    continue
                error(lineno, uid, str(e))
                return
            admit(job)
            return

    try:
        while True:
            if held is not None:
                job, held = held, None
                admit(job)
            while held is None and not eof and can_admit():
                read_one()
                if acked_lines >= _GROUP_MAX:
                    commit()
            commit()
            if not inflight and held is None:
                if eof:
                    commit(final=True)
                    break
                continue
            if on_step is not None:
                on_step(engine, inflight)
            deltas = engine.step()
            for d in deltas:
                if not d.finished or d.request_id not in inflight:
                    continue
                job = inflight.pop(d.request_id)
                out = d.output
                if out.finish_reason == "error":  # the engine failed it: --resume retries it
                    stats["errors"] += 1
                    acked_lines += 1
                    emit(job.seq, encode_record({"id": job.uid, "line": job.line,
                                                  "error": out.error or "engine step failed",
                                                  "retry": True}))
                    continue
                m = out.metrics
                rec = {
                    "id": job.uid, "text": out.text, "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason, "usage": out.usage,
                    "metrics": {k: m.get(k) for k in METRIC_KEYS},
                }
                if out.logprobs is not None:
                    rec["logprobs"] = out.logprobs
                if out.prompt_logprobs is not None:
                    rec["prompt_logprobs"] = out.prompt_logprobs
                stats["requests"] += 1
                stats["prompt_tokens"] += len(out.prompt_token_ids)
                stats["generated_tokens"] += len(out.token_ids)
                if m.get("ttft_s") is not None:
                    ttft.add(m["ttft_s"])
                for x in m.get("itl_s") or ():
                    itl.add(x)
                acked_lines += 1
                emit(job.seq, encode_record(rec))
            if not deltas and inflight and not engine.num_unfinished:
                raise BatchError(f"engine has no work but {len(inflight)} requests are in flight")
    finally:
        for rid in list(inflight):  # leave a shared engine clean (notebooks)
            engine.abort(rid)
        writer.close()
        if bar is not None:
            bar.close()
        if fin is not sys.stdin.buffer:
            fin.close()

    wall = time.perf_counter() - t0
    summary = {
        **stats,
        "lines": lineno - line_offset, "resumed_records": resumed_records, "wall_s": wall,
        "requests_per_s": stats["requests"] / wall if wall > 0 else None,
        "generated_tokens_per_s": stats["generated_tokens"] / wall if wall > 0 else None,
        "total_tokens_per_s": (stats["prompt_tokens"] + stats["generated_tokens"]) / wall
        if wall > 0 else None,
        "ttft_s": ttft.summary(), "itl_s": itl.summary(),
        "input": str(input_path), "output": str(output_path), "ordered": ordered,
        "resume": resume, "max_inflight": max_inflight,
        "reorder_window": reorder_window if ordered else None,
    }
    if summary_json:
        with open(summary_json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return summary


def _line_message(e: RequestError) -> str:
    return f"field {e.field!r}: {e.reason}" if e.field else e.reason


def format_summary(s: dict) -> str:
    def ms(d, k):
        v = d.get(k)
        return "-" if v is None else f"{v * 1e3:.1f}ms"

    return (
        f"batch: {s['requests']} requests, {s['errors']} errors, {s['skipped']} skipped "
        f"(resume) in {s['wall_s']:.1f}s"
        + (f"; admissions held back {s['held']}x (queue full or predicted late)"
           if s.get("held") else "") + "\n"
        f"  tokens: {s['prompt_tokens']} prompt, {s['generated_tokens']} generated; "
        f"{s['generated_tokens_per_s'] or 0:.1f} gen tok/s, "
        f"{s['total_tokens_per_s'] or 0:.1f} total tok/s, {s['requests_per_s'] or 0:.2f} req/s\n"
        f"  TTFT p50 {ms(s['ttft_s'], 'p50')} p99 {ms(s['ttft_s'], 'p99')}; "
        f"ITL p50 {ms(s['itl_s'], 'p50')} p99 {ms(s['itl_s'], 'p99')}"
    )
