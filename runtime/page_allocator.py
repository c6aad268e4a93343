"""Host-side KV page allocator. Numpy only, no JAX.

Pages are integers 0..num_pages-1 indexing the device page pools (runtime/kv_cache.py). Page 0 is
the null page: page-table padding points at it and padding tokens write into it, so it is never
handed out.

Free-list order (deterministic, relied on by tests):
  * initially the free queue is 1, 2, ..., num_pages-1, and allocation pops from the front, so a
    fresh allocator hands out the lowest pages first;
  * a page whose ref count drops to 0 is appended at the BACK of the queue, in the order the
    caller passed it to `free`. So the queue is FIFO: the page freed longest ago is reused first.

Every page carries a ref count (1 once allocated). Today each page has exactly one owner; the count
is there so prefix caching can share pages (`incref`) and keep freed-but-cached pages in this same
FIFO queue as its LRU eviction order, without changing the interface.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

NULL_PAGE = 0


class PageAllocatorError(AssertionError):
    """A bookkeeping bug: double free, freeing the null page or a page never allocated."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = int(num_pages)  # including the null page
        self._free: deque[int] = deque(range(1, self.num_pages))
        self._ref = np.zeros(self.num_pages, np.int32)  # [num_pages] owners of each page

    @property
    def num_total(self) -> int:
        """Usable pages (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_list(self) -> list[int]:
        """The free queue front to back: the order the next allocations will return."""
        return list(self._free)

    def ref_count(self, page: int) -> int:
        return int(self._ref[page])

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages from the front of the free queue, or None (and nothing taken) if fewer than
        `n` are free: the caller then preempts or waits."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._ref[pages] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add an owner to already-allocated pages (sharing; used by prefix caching)."""
        pages = list(pages)
        self._check_owned(pages)
        for p in pages:
            self._ref[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one owner of each page; pages left with no owner go to the back of the free queue
        in the given order. Validates everything before changing anything."""
        pages = list(pages)
        self._check_owned(pages)
        drops: dict[int, int] = {}
        for p in pages:
            drops[p] = drops.get(p, 0) + 1
        for p, k in drops.items():
            if k > self._ref[p]:
                raise PageAllocatorError(f"page {p} freed {k} times but has {self._ref[p]} owner(s)")
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def _check_owned(self, pages: list[int]) -> None:
        for p in pages:
            if not (0 < p < self.num_pages):
                raise PageAllocatorError(f"page {p} is the null page or out of range")
            if self._ref[p] <= 0:
                raise PageAllocatorError(f"page {p} is not allocated (double free?)")
