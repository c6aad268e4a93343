"""Child processes that run beside the suite.

The suite's own process keeps one core busy (XLA compiles on one thread); the machine has two.
A test whose work is a whole child process (the notebook's kernel, the 8-device pytest) marks
itself `@pytest.mark.background(NAME)`; the module registers how to start NAME with
`register(NAME, start)`. When collection finishes, conftest starts every job a selected test
names, and moves those tests to the end of the run, so the child works on the idle core while
the other tests run, and the tests then read its result.
"""

from __future__ import annotations

import subprocess
import tempfile
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


# name -> start(selected items that name it, a fresh work dir) -> Job
_STARTERS: dict[str, Callable[[list[pytest.Item], Path], Job]] = {}
_JOBS: dict[str, Job] = {}


def register(name: str, start: Callable[[list[pytest.Item], Path], Job]) -> None:
    _STARTERS[name] = start


def names_of(item: pytest.Item) -> list[str]:
    return [m.args[0] for m in item.iter_markers("background")]


def start_all(items: list[pytest.Item]) -> None:
    """Start one job per name the selected items carry (conftest, after collection)."""
    wanted: dict[str, list[pytest.Item]] = {}
    for it in items:
        for name in names_of(it):
            wanted.setdefault(name, []).append(it)
    for name, its in wanted.items():
        if name not in _STARTERS:
            raise pytest.UsageError(f"@pytest.mark.background({name!r}): no job registered")
        _JOBS[name] = _STARTERS[name](its, Path(tempfile.mkdtemp(prefix=f"bg_{name}_")))


def result(name: str) -> Done:
    """The finished job NAME (waits for it); a test that names it was started at collection."""
    job = _JOBS.get(name)
    assert job is not None, f"background job {name!r} was not started"
    return job.wait()


def workdir(name: str) -> Path:
    return _JOBS[name].workdir


def walls() -> dict[str, float | None]:
    """Seconds from each job's start to its exit (seen between tests; None: still running)."""
    for job in _JOBS.values():
        job.poll()
    return {name: job.wall_s for name, job in _JOBS.items()}


def stop_all() -> None:
    for job in _JOBS.values():
        job.kill()
