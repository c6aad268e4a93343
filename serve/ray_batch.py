"""Offline batch on Ray Data: N engine replicas over one dataset, every id exactly once.

Two ways in (`pip install 'jaxinfer[ray]'`; the core never imports ray):

* Your own pipeline: `LLMPredictor` is a callable class for `map_batches`. Each actor builds one
  `LLM` from the constructor kwargs and feeds a batch's rows to the engine continuously (the
  runner behind `jaxinfer batch`, runtime/host/batch.py), not one `generate` per row:

      ds.map_batches(LLMPredictor, batch_format="pyarrow", batch_size=64,
                     fn_constructor_kwargs={"model": "gemma3-270m", "max_slots": 16},
                     compute=ray.data.ActorPoolStrategy(size=4), num_tpus=4)

  Rows carry the JSONL line fields (`id`, `prompt` or `prompt_token_ids`, per-row sampling
  fields, `lora`); a null or NaN field is an absent one. Out come `jaxinfer batch`'s record
  fields: `id`, `text`, `token_ids`, `finish_reason`, `usage`, `metrics`, `error` (null unless
  the row was refused or failed; a bad row never fails the batch), `logprobs` /
  `prompt_logprobs` (JSON text: Arrow cannot hold [token id, logprob] pairs exactly), plus any
  `keep_columns` copied through.

* A JSONL job: `jaxinfer batch --ray --input in.jsonl --output out.jsonl [--replicas N]
  [--ray-address ADDR] [--ordered] [--resume]` (see `run`).

Exactly once (`run`)
--------------------
The driver reads the input once to cut it into blocks of `--block-lines` lines (byte offsets
only, nothing parsed) and writes them to `OUTPUT.shards/manifest.json` with the input's size.
Block k's records go to `OUTPUT.shards/part-<k>.jsonl`. A replica writes the part under a
temporary name, fsyncs it and renames it into place, so a part exists whole or not at all:
* a replica killed mid-block (crash, `ray.kill`, a lost node) leaves at most a temporary file;
  Ray Data restarts the actor and runs the block again, and a second run of a block replaces
  the same name, never adds a copy;
* a killed driver: `--resume` checks the manifest against the input, skips blocks whose part
  exists, and runs the rest.

OUTPUT itself, always written:
* without `--ordered`, appended as blocks finish: when a block's row comes back the driver
  appends its part whole to OUTPUT (blocks in finishing order, a block's records in input
  order), fsyncs OUTPUT, then appends `<block> <OUTPUT's size>` to `OUTPUT.shards/appended`
  and fsyncs that. A block is in OUTPUT once its ledger line is on disk. `--resume` truncates
  OUTPUT to the last ledger line's size (dropping an append the driver died in, or one it
  finished but did not log), re-counts what is kept, appends the parts finished before but not
  logged, then the rest as they finish: every line's record in OUTPUT exactly once.
* with `--ordered`, written once at the end in input order: to a temporary file, fsynced, then
  renamed over OUTPUT, so OUTPUT is absent or whole.

Limits: the output directory must be one filesystem every replica sees (a local disk on one
node; NFS or similar across nodes), with atomic rename; a killed block is computed again whole
(at most `--block-lines` lines); duplicate ids in different blocks are both served (each block
reports duplicates within itself), the later ones in OUTPUT (input order with `--ordered`,
finishing order without) are written as error records, as `jaxinfer batch` does, and the
summary counts the repeats. `--resume` continues only an OUTPUT that a `--ray` job wrote (its
`OUTPUT.shards/manifest.json` exists). The input may be any path pyarrow's filesystems open
(local, gs://, s3://, hdfs://); every replica reads its blocks' bytes itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import numbers
import os
import sys
import tempfile
import time
import uuid

from jaxinfer.runtime.host.batch import (BatchError, encode_record, fsync_dir_of, id_key,
                                         prepare_output, run_batch, write_all)

RECORD_COLUMNS = ("id", "text", "token_ids", "finish_reason", "usage", "metrics", "error")
JSON_COLUMNS = ("logprobs", "prompt_logprobs")
PART = "part-{:06d}.jsonl"
MANIFEST = "manifest.json"
LEDGER = "appended"  # unordered OUTPUT: "<block> <OUTPUT size after it>" per appended block
_TMP = ".tmp-"


# ------------------------------------------------------------------------- one block of lines

def run_lines(llm, data: bytes, sampling: dict | None, line_offset: int = 0,
              out_path: str | None = None) -> tuple[list[bytes], dict]:
    """JSONL bytes -> (one record line per input line, in input order; the runner's summary).

    The lines go through `run_batch` unchanged, so fields, ranges and error records are those
    of `jaxinfer batch`; `line_offset` numbers them as lines of the whole input. With
    `out_path` the records are left there (not fsynced) and not returned."""
    with tempfile.TemporaryDirectory(prefix="jaxinfer-ray-") as d:
        src, dst = os.path.join(d, "in.jsonl"), out_path or os.path.join(d, "out.jsonl")
        with open(src, "wb") as f:
            f.write(data)
        summary = run_batch(llm.engine, llm.tokenizer, src, dst, sampling=sampling,
                            ordered=True, overwrite=True, fsync="none", progress=False,
                            line_offset=line_offset)
        if out_path:
            return [], summary
        with open(dst, "rb") as f:
            return f.read().splitlines(keepends=True), summary


# --------------------------------------------------------------------------- the predictor

def _absent(v) -> bool:
    return v is None or (isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral)
                         and math.isnan(v))


def _plain(o):
    """json.dumps' fallback for what Arrow / numpy / pandas hand out (numpy scalars, arrays)."""
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"a {type(o).__name__} is not a JSON value")


def batch_rows(batch) -> list[dict]:
    """A Ray Data batch (pyarrow Table, pandas DataFrame or dict of arrays) -> row dicts."""
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):
        return batch.to_dict("records")
    cols = {k: v.tolist() if hasattr(v, "tolist") else list(v) for k, v in batch.items()}
    n = len(next(iter(cols.values()))) if cols else 0
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def _actor_host_devices() -> None:
    """Inside a Ray actor: as many JAX CPU devices as the CPUs Ray gave it (at least 1), not one
    per host core (runtime/device/host_devices.py), so replicas sharing a host do not split their
    matmuls over each other's cores. JAXINFER_HOST_DEVICES, if set, wins."""
    import os

    if "JAXINFER_HOST_DEVICES" in os.environ:
        return
    try:
        import ray

        if not ray.is_initialized():  # not in a Ray worker: the host's default applies
            return
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # noqa: BLE001 - no Ray, or no resources to read: the default applies
        return
    if cpus is not None:
        os.environ["JAXINFER_HOST_DEVICES"] = str(max(1, int(cpus)))


class LLMPredictor:
    """`ds.map_batches(LLMPredictor, fn_constructor_kwargs={...})`: one engine per actor.

    model, **llm_kwargs: as `LLM(model, ...)` (engine options, `tensor_parallel` over the
    actor's chips). sampling: defaults a row's fields override (greedy unless given).
    keep_columns: input columns copied to the output untouched and not sent to the engine."""

    def __init__(self, model: str | None = None, *, sampling: dict | None = None,
                 keep_columns: tuple[str, ...] | list[str] = (), **llm_kwargs):
        from jaxinfer.runtime.llm import LLM
        from jaxinfer.runtime.host.requests import RequestError, SamplingParams

        try:  # bad defaults fail the actor at once, before a batch is taken
            SamplingParams(**{"temperature": 0.0, **(sampling or {})})
        except RequestError as e:
            raise ValueError(f"sampling default {e}") from None
        self.sampling = dict(sampling or {})
        self.keep = tuple(keep_columns)
        _actor_host_devices()
        self.llm = LLM(model, **llm_kwargs) if model is not None else LLM(**llm_kwargs)

    def __call__(self, batch):
        import numpy as np

        rows = batch_rows(batch)
        lines, refused = [], {}
        for i, row in enumerate(rows):
            obj = {k: v for k, v in row.items() if k not in self.keep and not _absent(v)}
            try:
                lines.append(json.dumps(obj, default=_plain, allow_nan=False).encode("utf-8"))
            except (TypeError, ValueError, RecursionError) as e:
                refused[i] = f"row is not a JSON request: {e}"
                lines.append(b"{}")  # a placeholder that keeps the positions aligned
        records = []
        if rows:
            out, _ = run_lines(self.llm, b"\n".join(lines) + b"\n", self.sampling)
            records = [json.loads(r) for r in out]
        cols = {c: np.empty(len(rows), dtype=object) for c in
                (*RECORD_COLUMNS, *JSON_COLUMNS, *self.keep)}
        for i, (row, rec) in enumerate(zip(rows, records)):
            if i in refused:
                rec = {"id": row.get("id"), "error": refused[i]}
            rec["id"] = row.get("id") if rec.get("id") is None else rec["id"]
            for c in RECORD_COLUMNS:
                cols[c][i] = rec.get(c)
            for c in JSON_COLUMNS:
                cols[c][i] = None if rec.get(c) is None else json.dumps(rec[c])
            for c in self.keep:
                cols[c][i] = row.get(c)
        return cols


# ----------------------------------------------------------------------- the JSONL job's blocks

def _filesystem(path: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI."""
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def index_blocks(path: str, block_lines: int) -> tuple[list[dict], int, int]:
    """One pass over the input's bytes -> (blocks, bytes, lines): blocks of `block_lines` lines
    as byte ranges with their first line numbers (1-based, blank lines counted as `jaxinfer
    batch` counts them)."""
    fs, p = _filesystem(path)
    blocks, start, line, in_block, pos = [], 0, 1, 0, 0
    with fs.open_input_stream(p) as f:
        tail = b""
        while chunk := f.read(1 << 22):
            buf = tail + chunk
            base = pos - len(tail)
            i = 0
            while (j := buf.find(b"\n", i)) >= 0:
                i = j + 1
                in_block += 1
                if in_block == block_lines:
                    blocks.append({"block": len(blocks), "start": start, "end": base + i,
                                   "first_line": line})
                    start, line, in_block = base + i, line + block_lines, 0
            tail = buf[i:]
            pos += len(chunk)
    if pos > start:  # the last, short block (its last line may lack a newline)
        blocks.append({"block": len(blocks), "start": start, "end": pos, "first_line": line})
        line += in_block + (1 if tail else 0)
    return blocks, pos, line - 1


class BlockWorker:
    """A Ray Data actor of `run`: builds the engine from `jaxinfer batch`'s engine flags and
    turns each block row into its part file (written whole, then renamed into place)."""

    def __init__(self, engine_args: dict, sampling: dict, input_path: str, shards: str):
        from jaxinfer.serve.engine_args import llm_from_args

        _actor_host_devices()
        self.llm = llm_from_args(argparse.Namespace(**engine_args))
        self.sampling, self.input, self.shards = sampling, input_path, shards

    def __call__(self, batch):
        fs, p = _filesystem(self.input)
        out = {k: [] for k in ("block", "requests", "errors", "prompt_tokens",
                               "generated_tokens", "wall_s")}
        for b in batch_rows(batch):
            with fs.open_input_file(p) as f:
                data = f.read_at(b["end"] - b["start"], b["start"])
            final = os.path.join(self.shards, PART.format(b["block"]))
            tmp = f"{final}{_TMP}{uuid.uuid4().hex}"
            _, s = run_lines(self.llm, data, self.sampling, b["first_line"] - 1, out_path=tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir_of(final)
            for k in out:
                out[k].append(b["block"] if k == "block" else s[k])
        return out


# ---------------------------------------------------------------------------------- the driver

def _manifest(path: str, size: int, blocks: list[dict], block_lines: int) -> dict:
    h = hashlib.sha256(json.dumps([(b["start"], b["end"]) for b in blocks]).encode())
    return {"input": path, "size": size, "block_lines": block_lines, "blocks": len(blocks),
            "index_sha256": h.hexdigest()}


_PARTS = ("part-", MANIFEST, LEDGER)


def _prepare(shards: str, output: str, resume: bool, overwrite: bool) -> None:
    prepare_output(output, resume, overwrite)
    if os.path.exists(shards) and not os.path.isdir(shards):
        raise BatchError(f"{shards} exists and is not a directory")
    used = os.path.isdir(shards) and any(n.startswith(_PARTS) for n in os.listdir(shards))
    if used and not (resume or overwrite):
        raise BatchError(f"{shards} holds an earlier job's parts; pass --resume to continue it "
                         "or --overwrite to replace it")
    if resume and os.path.exists(output) and os.path.getsize(output) > 0 and \
            not os.path.exists(os.path.join(shards, MANIFEST)):
        raise BatchError(f"{output} was not written by a --ray job ({shards}/{MANIFEST} is "
                         "missing); --resume continues only those")
    if overwrite and os.path.isdir(shards):
        for n in os.listdir(shards):
            if n.startswith(_PARTS):
                os.remove(os.path.join(shards, n))
    os.makedirs(shards, exist_ok=True)


class _Tally:
    """Records in OUTPUT's order -> the summary's counts; a repeated id's later result becomes an
    error record (as `jaxinfer batch` writes it)."""

    def __init__(self):
        self.counts = dict(requests=0, errors=0, prompt_tokens=0, generated_tokens=0,
                           duplicate_ids=0)
        self.seen: set[str] = set()

    def feed(self, raw: bytes) -> bytes:
        rec = json.loads(raw)
        if rec["id"] is not None:
            key = id_key(rec["id"])
            if key in self.seen:
                self.counts["duplicate_ids"] += 1
                if "error" not in rec:
                    rec = {"id": rec["id"], "line": None,
                           "error": f"duplicate id {rec['id']!r} (an earlier line has it)"}
                    raw = encode_record(rec)
            self.seen.add(key)
        if "error" in rec:
            self.counts["errors"] += 1
        else:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += rec["usage"]["prompt_tokens"]
            self.counts["generated_tokens"] += len(rec["token_ids"])
        return raw


def _merge(shards: str, n_blocks: int, output: str) -> dict:
    """--ordered: every part in block order into OUTPUT, written whole then renamed into place."""
    tally = _Tally()
    tmp = f"{output}{_TMP}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as out:
            for k in range(n_blocks):
                with open(os.path.join(shards, PART.format(k)), "rb") as f:
                    for raw in f:
                        out.write(tally.feed(raw))
            out.flush()
            os.fsync(out.fileno())
        ledger = os.path.join(shards, LEDGER)
        if os.path.exists(ledger):  # an unordered run's ledger no longer describes OUTPUT
            os.remove(ledger)
            fsync_dir_of(ledger)
        os.replace(tmp, output)
        fsync_dir_of(output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return tally.counts


def _read_ledger(path: str, n_blocks: int) -> list[tuple[int, int]]:
    """The ledger's good prefix: [(block, OUTPUT size after it)], stopping at a torn line."""
    entries, seen = [], set()
    if not os.path.exists(path):
        return entries
    with open(path, "rb") as f:
        for raw in f:
            fields = raw.split()
            if not raw.endswith(b"\n") or len(fields) != 2 or not all(x.isdigit() for x in fields):
                break
            k, end = int(fields[0]), int(fields[1])
            if k >= n_blocks or k in seen or end < (entries[-1][1] if entries else 0):
                break
            seen.add(k)
            entries.append((k, end))
    return entries


class _Appender:
    """Unordered OUTPUT: a finished block's part appended whole, OUTPUT fsynced, then its ledger
    line appended and fsynced (see the module docstring)."""

    def __init__(self, output: str, shards: str, n_blocks: int, resume: bool):
        self.output, self.shards = output, shards
        self.ledger = os.path.join(shards, LEDGER)
        self.tally = _Tally()
        entries = _read_ledger(self.ledger, n_blocks) if resume else []
        size = os.path.getsize(output) if os.path.exists(output) else 0
        if entries and entries[-1][1] > size:  # OUTPUT is shorter than its ledger: rebuild
            entries = []
        self.end = entries[-1][1] if entries else 0
        self.done = {k for k, _ in entries}
        if resume and size > self.end:
            print(f"jaxinfer batch --ray: {output}: kept {len(entries)} block(s) appended before, "
                  f"dropped {size - self.end} bytes past them (appended again)", file=sys.stderr)
        with open(output, "ab") as f:
            f.truncate(self.end)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir_of(output)
        with open(output, "rb") as f:  # the kept blocks: their ids and counts
            try:
                for raw in f:
                    self.tally.feed(raw)
            except (ValueError, KeyError, TypeError) as e:
                raise BatchError(f"{output} is damaged (not the records its ledger "
                                 f"{self.ledger} lists: {e}); use a new --output") from None
        tmp = self.ledger + _TMP
        with open(tmp, "w") as f:  # the good prefix only: a torn line must not lead new ones
            f.writelines(f"{k} {end}\n" for k, end in entries)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.ledger)
        fsync_dir_of(self.ledger)
        self.out = open(output, "ab", buffering=0)
        self.log = open(self.ledger, "ab", buffering=0)

    def add(self, k: int) -> None:
        if k in self.done:
            return
        with open(os.path.join(self.shards, PART.format(k)), "rb") as f:
            data = b"".join(self.tally.feed(raw) for raw in f)
        _write_all(self.out, data)
        self.end += len(data)
        _write_all(self.log, f"{k} {self.end}\n".encode())
        self.done.add(k)

    def close(self) -> None:
        self.out.close()
        self.log.close()


def _write_all(f, data: bytes) -> None:
    """Every byte to an unbuffered file, then fsync."""
    write_all(f, data)
    os.fsync(f.fileno())


def _clean_tmp(shards: str, output: str) -> None:
    """Temporary files of a killed replica (parts) or driver (OUTPUT, ledger)."""
    for n in os.listdir(shards):
        if _TMP in n and n.startswith(("part-", LEDGER)):
            os.remove(os.path.join(shards, n))
    d, base = os.path.split(os.path.abspath(output))
    for n in os.listdir(d):
        if n.startswith(base + _TMP):
            os.remove(os.path.join(d, n))


def _init_ray(address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False,
                 logging_level="WARNING", log_to_driver=True)


def run(args, engine_args: dict, sampling: dict) -> dict:
    """`jaxinfer batch --ray`: blocks of the input to `--replicas` actors; returns the summary."""
    if args.input == "-":
        raise BatchError("--ray reads a file (or a URI), not stdin")
    if args.replicas < 1 or args.block_lines < 1:
        raise BatchError("--replicas and --block-lines must be >= 1")
    if not args.ray_address:  # a local cluster: the replicas see this machine's paths
        from jaxinfer.checkpoints.errors import CheckpointError
        from jaxinfer.checkpoints.loader import resolve

        try:
            resolve(engine_args.get("model", "gemma3-270m"))
        except CheckpointError as e:
            raise BatchError(str(e)) from None
    shards = args.output + ".shards"
    _prepare(shards, args.output, args.resume, args.overwrite)
    t0 = time.perf_counter()
    try:
        blocks, size, lines = index_blocks(args.input, args.block_lines)
    except (OSError, ValueError) as e:
        raise BatchError(f"cannot read input {args.input}: {e}") from None
    man = _manifest(args.input, size, blocks, args.block_lines)
    mpath = os.path.join(shards, MANIFEST)
    if os.path.exists(mpath):
        with open(mpath) as f:
            old = json.load(f)
        if {k: v for k, v in old.items() if k != "input"} != \
                {k: v for k, v in man.items() if k != "input"}:
            raise BatchError(f"{args.input} is not the input {shards} was made from (size, "
                             "line breaks or --block-lines differ); use a new --output")
    else:
        with open(mpath + _TMP, "w") as f:
            json.dump(man, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(mpath + _TMP, mpath)
    _clean_tmp(shards, args.output)
    todo = [b for b in blocks if not os.path.exists(os.path.join(shards, PART.format(b["block"])))]
    app = None if args.ordered else _Appender(args.output, shards, len(blocks), args.resume)
    try:
        wall_run = _run_blocks(args, engine_args, sampling, shards, blocks, todo, app)
        if app:
            for k in range(len(blocks)):  # a part a row never announced (none expected)
                if os.path.exists(os.path.join(shards, PART.format(k))):
                    app.add(k)
            if len(app.done) < len(blocks):
                raise BatchError(f"{len(blocks) - len(app.done)} blocks have no part after the "
                                 "Ray job; rerun with --resume")
            counts = app.tally.counts
        else:
            counts = _merge(shards, len(blocks), args.output)
    finally:
        if app:
            app.close()
    wall = time.perf_counter() - t0
    return {**counts, "lines": lines, "blocks": len(blocks),
            "blocks_resumed": len(blocks) - len(todo),
            "replicas": args.replicas, "wall_s": wall, "run_s": wall_run,
            "generated_tokens_per_s": counts["generated_tokens"] / wall if wall > 0 else None,
            "shards": shards, "output": args.output, "ordered": bool(args.ordered)}


def _run_blocks(args, engine_args: dict, sampling: dict, shards: str, blocks: list[dict],
                todo: list[dict], app: _Appender | None) -> float:
    """Run `todo` on the replicas; with `app`, append each block to OUTPUT as it comes back
    (the ones finished before, first). Returns the Ray job's wall time."""
    print(f"jaxinfer batch --ray: {len(blocks)} blocks of {args.block_lines} lines, "
          f"{len(blocks) - len(todo)} done before, {len(todo)} to run on {args.replicas} "
          f"replica(s)", file=sys.stderr)
    if app:
        running = {b["block"] for b in todo}
        for b in blocks:
            if b["block"] not in running:
                app.add(b["block"])
    if not todo:
        return 0.0
    import ray.data

    _init_ray(args.ray_address)
    t1 = time.perf_counter()
    remote = {"num_cpus": args.replica_cpus}
    if args.replica_gpus:
        remote["num_gpus"] = args.replica_gpus
    res = dict(args.replica_resources or {})
    if args.replica_tpus:
        res["TPU"] = args.replica_tpus
    if res:
        remote["resources"] = res
    ds = ray.data.from_items(todo, override_num_blocks=len(todo)).map_batches(
        BlockWorker, batch_size=1, compute=ray.data.ActorPoolStrategy(size=args.replicas),
        fn_constructor_kwargs=dict(engine_args=engine_args, sampling=sampling,
                                   input_path=args.input, shards=os.path.abspath(shards)),
        **remote)
    rows = iter(ds.iter_rows())
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return time.perf_counter() - t1
        except Exception as e:  # a replica could not start or a block failed past its retries
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:] or [type(e).__name__]
            raise BatchError(f"the Ray job failed: {last[0].strip()}; parts written so far are "
                             "kept - rerun with --resume") from e
        if app:  # outside the try: OUTPUT's own errors are not the Ray job's
            app.add(int(row["block"]))


def format_summary(s: dict) -> str:
    dup = f"; {s['duplicate_ids']} repeated ids" if s["duplicate_ids"] else ""
    return (f"batch --ray: {s['requests']} requests, {s['errors']} errors{dup} over "
            f"{s['blocks']} blocks ({s['blocks_resumed']} from an earlier run) on "
            f"{s['replicas']} replica(s) in {s['wall_s']:.1f}s\n"
            f"  tokens: {s['prompt_tokens']} prompt, {s['generated_tokens']} generated; "
            f"{s['generated_tokens_per_s'] or 0:.1f} gen tok/s; records in {s['output']}")
