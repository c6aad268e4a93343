"""Host-side KV page allocator with prefix caching. Numpy + hashlib only, no JAX.

Pages are integers 0..num_pages-1 indexing the device page pools (runtime/device/kv_cache.py). Page 0 is
the null page: page-table padding points at it and padding tokens write into it, so it is never
handed out.

Every usable page is in exactly one of three states:
  * held:   ref count >= 1 (one per sequence whose page table lists it);
  * cached: ref count 0 but registered under a prefix hash: its K/V are still valid, a later
            request with the same prefix may take it back (`incref`), and it is evictable;
  * free:   ref count 0, no hash.
`num_free` counts free + cached: both can be handed out by `allocate`.

Order (deterministic, relied on by tests):
  * initially the free queue is 1, 2, ..., num_pages-1, and allocation pops from the front, so a
    fresh allocator hands out the lowest pages first;
  * a page whose ref count drops to 0 goes to the BACK of the free queue (no hash) or to the
    most-recently-used end of the cached LRU (hash), in the order the caller passed it to `free`;
  * `allocate` takes truly free pages first (FIFO: freed longest ago first), then evicts cached
    pages least recently used first, dropping their hash entries;
  * `incref` of a cached page takes it out of the LRU (it is held again); when its last holder
    frees it, it re-enters the LRU at the most-recently-used end.

Prefix hashes: `page_hashes(tokens, page_size, salt)` chains a blake2b digest per FULL page over
the parent page's digest and the page's token ids, so equal hashes mean equal token prefixes (up
to a 128-bit collision). `salt` namespaces everything that changes K/V for the same tokens
(adapter, KV dtype/quantization, model revision): today the engine passes b"".
A hash maps to at most one page: registering a hash that is already mapped (two sequences
computed the same page concurrently) is a no-op, and that duplicate page is freed, not cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import numpy as np

NULL_PAGE = 0
HASH_BYTES = 16


class PageAllocatorError(AssertionError):
    """A bookkeeping bug: double free, freeing the null page or a page never allocated."""


def hash_page(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Digest of one full page given its parent's digest (the root digest for page 0);
    `extra`: what else its tokens stand for (the digests of the images whose tokens it holds)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    if extra:
        h.update(b"\x00extra" + extra)
    return h.digest()


def root_hash(salt: bytes = b"") -> bytes:
    """The parent digest of a sequence's first page: mixes in the namespace `salt`."""
    return hashlib.blake2b(b"jaxinfer-prefix\x00" + bytes(salt), digest_size=HASH_BYTES).digest()


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes = b"",
                parent: bytes | None = None, extras: Sequence[bytes] | None = None
                ) -> list[bytes]:
    """Chained hashes of the full pages of `tokens` (a partial last page gets none). `tokens`
    starts on a page boundary; `parent` is the digest of the page just before it, None for a
    sequence's first page (then the root digest of `salt` is the parent). `extras[j]`: page
    j's `hash_page` extra (None: none)."""
    parent = root_hash(salt) if parent is None else parent
    out = []
    for j in range(len(tokens) // page_size):
        parent = hash_page(parent, tokens[j * page_size:(j + 1) * page_size],
                           extras[j] if extras else b"")
        out.append(parent)
    return out


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = int(num_pages)  # including the null page
        self._free: deque[int] = deque(range(1, self.num_pages))
        self._ref = np.zeros(self.num_pages, np.int32)  # [num_pages] holders of each page
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, LRU first
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash (held or cached)
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self.num_evictions = 0
        # with a host tier: the (page, hash) of each cached page `allocate` evicted, for the
        # scheduler to offload before the page's new owner writes it (None: not recorded)
        self.evicted: list[tuple[int, bytes]] | None = None

    # ------------------------------------------------------------------ counts and views

    @property
    def num_total(self) -> int:
        """Usable pages (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: truly free + cached (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Cached pages held by nobody (evictable)."""
        return len(self._lru)

    @property
    def free_list(self) -> list[int]:
        """The truly free queue front to back: the order the next allocations return them."""
        return list(self._free)

    @property
    def cached_list(self) -> list[int]:
        """Cached evictable pages, least recently used (next evicted) first."""
        return list(self._lru)

    def ref_count(self, page: int) -> int:
        return int(self._ref[page])

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    # ------------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages, truly free ones first (FIFO), then evicting cached ones (LRU first); None
        (and nothing taken) if fewer than `n` are available: the caller then preempts or waits."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.popleft())
            else:
                p, _ = self._lru.popitem(last=False)
                h = self._hash_of.pop(p)
                del self._page_of[h]
                self.num_evictions += 1
                if self.evicted is not None:
                    self.evicted.append((p, h))
                pages.append(p)
        self._ref[pages] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add a holder to held or cached pages (sharing). A cached page leaves the LRU."""
        pages = list(pages)
        for p in pages:
            self._check_range(p)
            if self._ref[p] <= 0 and p not in self._lru:
                raise PageAllocatorError(f"page {p} is neither held nor cached")
        for p in pages:
            if self._ref[p] == 0:
                del self._lru[p]
            self._ref[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder of each page; a page left with no holder becomes cached (MRU end of
        the LRU) if it has a hash, else goes to the back of the free queue, in the given order.
        Validates everything before changing anything."""
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            self._check_range(p)
            drops[p] = drops.get(p, 0) + 1
        for p, k in drops.items():
            if k > self._ref[p]:
                raise PageAllocatorError(
                    f"page {p} freed {k} time(s) but has {self._ref[p]} holder(s) (double free?)")
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache

    def register(self, page: int, page_hash: bytes) -> bool:
        """Record that held `page` now holds the full page whose prefix hash is `page_hash`.
        Returns False (and changes nothing) if that hash already names a page or `page` already
        has a hash."""
        self._check_range(page)
        if self._ref[page] <= 0:
            raise PageAllocatorError(f"page {page} is not held: cannot register it")
        if page_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest prefix of `hashes` present in the cache (held or cached). Changes
        nothing: the caller `incref`s what it takes."""
        out = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unheld) page: they become truly free, in LRU order. Held pages
        keep their hashes. Returns how many pages were dropped."""
        n = len(self._lru)
        while self._lru:
            p, _ = self._lru.popitem(last=False)
            del self._page_of[self._hash_of.pop(p)]
            self._free.append(p)
        return n

    def check_invariants(self) -> None:
        """Raise AssertionError if the three page states are inconsistent."""
        free, cached = list(self._free), list(self._lru)
        held = [p for p in range(1, self.num_pages) if self._ref[p] > 0]
        assert self._ref[NULL_PAGE] == 0 and (self._ref >= 0).all()
        assert sorted(free + cached + held) == list(range(1, self.num_pages)), "page leaked or duplicated"
        assert all(self._ref[p] == 0 and p not in self._hash_of for p in free)
        assert all(self._ref[p] == 0 and p in self._hash_of for p in cached)
        assert len(self._page_of) == len(self._hash_of)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())

    def _check_range(self, p: int) -> None:
        if not (0 < p < self.num_pages):
            raise PageAllocatorError(f"page {p} is the null page or out of range")
