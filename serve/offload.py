"""Tokenizer work off the asyncio event loop.

Encoding a long prompt (or rendering a chat template) takes milliseconds to seconds; done on the
event loop it would stall every other request, gRPC and HTTP alike, and the health checks. The
tokenizers (sentencepiece, HF tokenizers) release the GIL while they encode, so a small thread
pool keeps the loop free. At most `max_pending` jobs run or wait in the pool; further callers
wait their turn on the event loop (holding no pool resources).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


class Offload:
    def __init__(self, workers: int = 2, max_pending: int = 16):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._max_pending = max_pending
        self._sem: asyncio.Semaphore | None = None  # made on the loop that first uses it

    async def run(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on a pool thread; its result, or its exception re-raised."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._max_pending)
        async with self._sem:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
