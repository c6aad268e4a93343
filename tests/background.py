"""Child processes that run beside the suite, one at a time.

The suite's own process keeps one core busy (XLA compiles on one thread); the machine has two.
A test whose work is a whole child process (the notebook's kernel, the 8-device pytest, the
shard of heavy test files) marks itself `@pytest.mark.background(NAME)`; the module registers
how to start NAME with `register(NAME, start)`. When collection finishes, conftest queues every
job a selected test names and moves those tests to the end of the run. The jobs run one after
another on a thread (a lane): the second core stays busy while the suite's process keeps the
first, and no third process competes with them (three processes on two cores slowed each child
~3x). The tests at the end then read each job's result.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


class Job:
    """One child process; stdout and stderr go to files (a full pipe would block the child)."""

    def __init__(self, args: Sequence[str], env: dict[str, str], workdir: Path, timeout_s: float):
        self.workdir, self.timeout_s = workdir, timeout_s
        self._out = open(workdir / "stdout", "w+")
        self._err = open(workdir / "stderr", "w+")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(list(args), cwd=ROOT, env=env, stdout=self._out,
                                     stderr=self._err, text=True)
        self._done: Done | None = None
        self.wall_s: float | None = None  # start to exit, as first seen by poll()

    def wait(self) -> Done:
        if self._done is None:
            left = self.timeout_s - (time.perf_counter() - self.t0)
            try:
                rc = self.proc.wait(timeout=max(left, 1.0))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            self._out.seek(0), self._err.seek(0)
            self._done = Done(rc, self._out.read(), self._err.read())
            self.poll()
            self._out.close(), self._err.close()
        return self._done

    def poll(self) -> None:
        if self.wall_s is None and self.proc.poll() is not None:
            self.wall_s = time.perf_counter() - self.t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# name -> start(selected items that name it, a fresh work dir) -> Job; run in registration order
_STARTERS: dict[str, Callable[[list[pytest.Item], Path], Job]] = {}
_JOBS: dict[str, Job] = {}
_QUEUED: dict[str, threading.Event] = {}  # set once the job has started (or will never start)
_STOP = threading.Event()
_FAILED: dict[str, str] = {}  # jobs whose start raised: the error


def register(name: str, start: Callable[[list[pytest.Item], Path], Job]) -> None:
    _STARTERS[name] = start


def names_of(item: pytest.Item) -> list[str]:
    return [m.args[0] for m in item.iter_markers("background")]


def start_all(items: list[pytest.Item]) -> None:
    """Queue one job per name the selected items carry (conftest, after collection) and start
    the lane that runs them one after another."""
    wanted: dict[str, list[pytest.Item]] = {}
    for it in items:
        for name in names_of(it):
            wanted.setdefault(name, []).append(it)
    for name in wanted:
        if name not in _STARTERS:
            raise pytest.UsageError(f"@pytest.mark.background({name!r}): no job registered")
    order = [n for n in _STARTERS if n in wanted]
    _QUEUED.update({n: threading.Event() for n in order})

    def lane():
        for name in order:
            try:
                if not _STOP.is_set():
                    _JOBS[name] = _STARTERS[name](
                        wanted[name], Path(tempfile.mkdtemp(prefix=f"bg_{name}_")))
            except Exception as e:  # noqa: BLE001 - its tests report it; the next job starts
                _FAILED[name] = f"{type(e).__name__}: {e}"
            finally:
                _QUEUED[name].set()
            if name in _JOBS:
                job = _JOBS[name]
                try:
                    job.proc.wait(timeout=job.timeout_s)
                except subprocess.TimeoutExpired:
                    job.kill()  # its tests report the timeout; the next job starts

    threading.Thread(target=lane, name="background-lane", daemon=True).start()


def _job(name: str) -> Job:
    assert name in _QUEUED, f"background job {name!r} was not queued"
    _QUEUED[name].wait()
    assert name in _JOBS, f"background job {name!r} did not start: {_FAILED.get(name, 'stopped')}"
    return _JOBS[name]


def result(name: str) -> Done:
    """The finished job NAME (waits for it); a test that names it was queued at collection."""
    return _job(name).wait()


def workdir(name: str) -> Path:
    return _job(name).workdir


def walls() -> dict[str, float | None]:
    """Seconds from each job's start to its exit (seen between tests; None: not done yet)."""
    for job in list(_JOBS.values()):
        job.poll()
    return {name: (_JOBS[name].wall_s if name in _JOBS else None) for name in _QUEUED}


def stop_all() -> None:
    _STOP.set()
    for job in list(_JOBS.values()):
        job.kill()
