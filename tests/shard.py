"""The second core: whole test files run in one child pytest beside the suite.

The suite's process keeps one core busy (XLA compiles on one thread). The files in FILES run in a
child pytest, the last job of the background lane (tests/background.py, job "shard", after the
8-device child and the notebook); in the suite's process each of their selected tests is
replaced by a ChildOutcome item that reports the child's outcome, message and duration for the
same node id. A run that selects only tests of FILES (or sets JAXINFER_NO_SHARD=1) runs them
in-process as usual.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

from tests import background

# Heavy self-contained files (no background tests of their own, no Gemma), chosen so that the
# lane (8-device child + notebook + these) ends about when the suite's process does; see the
# per-file table the suite prints.
FILES = (
    "tests/runtime/test_speculative.py",
    "tests/runtime/test_speculative_distribution.py",
    "tests/runtime/test_attention_backends.py",
    "tests/pallas_kernels/test_ragged_paged_attention.py",
    "tests/runtime/test_prefix_cache.py",
    "tests/runtime/test_int4.py",
    "tests/tools/test_bench_device.py",
    "tests/serve/test_ray_batch.py",
)
CHILD_ENV = "JAXINFER_SHARD_CHILD"
REPORT_ENV = "JAXINFER_TEST_REPORT"  # a child writes its outcomes and per-file table there


def active(config) -> bool:
    return not (os.environ.get(CHILD_ENV) or os.environ.get("JAXINFER_NO_SHARD")
                or config.option.collectonly)


class ChildOutcome(pytest.Item):
    """Stands for a test the child ran: passes, fails or skips as it did there."""

    def runtest(self) -> None:
        outcome, message, _ = _outcomes().get(self.nodeid, ("missing", "not in the child's report",
                                                            0.0))
        if outcome == "skipped":
            pytest.skip(message)
        if outcome != "passed":
            raise pytest.fail.Exception(f"[in the shard child] {outcome}\n{message}", pytrace=False)

    def reportinfo(self):
        return self.path, None, self.nodeid

    @property
    def child_seconds(self) -> float:
        return _outcomes().get(self.nodeid, ("", "", 0.0))[2]


def split(items: list[pytest.Item]) -> list[pytest.Item]:
    """Replace the selected tests of FILES with ChildOutcome items (marked for the "shard" job),
    when other tests are selected too (else the child would be the whole run)."""
    if all(it.nodeid.split("::")[0] in FILES for it in items):
        return items
    out = []
    for it in items:
        if it.nodeid.split("::")[0] in FILES:
            proxy = ChildOutcome.from_parent(it.parent, name=it.name)
            proxy.add_marker(pytest.mark.background("shard"))
            it = proxy
        out.append(it)
    return out


def _start(items, workdir: Path) -> background.Job:
    env = dict(os.environ, **{CHILD_ENV: "1", REPORT_ENV: str(workdir / "report.json")})
    return background.Job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(i.nodeid for i in items)], env, workdir, timeout_s=3600)


background.register("shard", _start)


@functools.cache
def _report() -> dict:
    r = background.result("shard")
    path = background.workdir("shard") / "report.json"
    if not path.exists():
        raise AssertionError(f"the shard child (exit {r.returncode}) wrote no report:\n"
                             f"{r.stdout[-4000:]}\n{r.stderr[-3000:]}")
    return json.loads(path.read_text())


def _outcomes() -> dict[str, tuple[str, str, float]]:
    """{nodeid: (passed | failed | error | skipped, message, seconds)} from the child."""
    return {k: tuple(v) for k, v in _report()["tests"].items()}


def child_files() -> dict[str, list[float]]:
    """The child's per-file table {file: [wall s, XLA compiles, compile s]} ({} if none ran)."""
    if "shard" not in background.walls():
        return {}
    try:
        return _report()["files"]
    except AssertionError:  # its tests already failed with the reason
        return {}


# ------------------------------------------------------------------ the child's side: the report
_REPORT: dict[str, list] = {}


def record(report) -> None:
    """pytest_runtest_logreport in a child: the first failure or skip of a test's phases wins,
    else "passed" after its call; seconds sum over the phases."""
    if not os.environ.get(REPORT_ENV):
        return
    row = _REPORT.setdefault(report.nodeid, ["passed", "", 0.0])
    row[2] += report.duration
    if row[0] == "passed" and not report.passed:
        row[0] = "skipped" if report.skipped else ("failed" if report.when == "call" else "error")
        row[1] = (report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple)
                  else report.longreprtext)[-6000:]


def write_report(per_file: dict[str, list[float]]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps({"tests": _REPORT, "files": per_file}))
