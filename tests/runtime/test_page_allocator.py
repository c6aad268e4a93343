"""Host page allocator: exact page ids, FIFO free-list order, ref counts, bug detection. No JAX."""

import pytest

from jaxinfer.runtime.host.page_allocator import PageAllocator, PageAllocatorError


def test_lowest_first_then_fifo_free_queue():
    a = PageAllocator(6)  # usable pages 1..5
    assert a.num_total == 5 and a.num_free == 5
    assert a.free_list == [1, 2, 3, 4, 5]
    assert a.allocate(2) == [1, 2]
    assert a.allocate(3) == [3, 4, 5]
    assert a.num_free == 0
    assert a.allocate(1) is None
    a.free([4, 2])  # freed pages go to the back, in the given order
    assert a.free_list == [4, 2]
    assert a.allocate(1) == [4]
    a.free([1])
    assert a.free_list == [2, 1]
    assert a.allocate(3) is None  # all or nothing: nothing taken
    assert a.free_list == [2, 1] and a.num_free == 2
    assert a.allocate(2) == [2, 1]
    assert a.allocate(0) == []
    a.free([5, 3, 4, 2, 1])
    assert a.free_list == [5, 3, 4, 2, 1]
    assert a.num_free == a.num_total


def test_page_zero_is_never_handed_out():
    a = PageAllocator(4)
    assert a.allocate(3) == [1, 2, 3]
    assert a.allocate(1) is None
    a.free([3, 2, 1])
    assert 0 not in a.allocate(3)


@pytest.mark.parametrize("bad", [[0], [7], [-1], [3]])
def test_freeing_null_out_of_range_or_unallocated_page_is_a_bug(bad):
    a = PageAllocator(7)
    a.allocate(2)  # pages 1, 2 allocated; 3 is free
    with pytest.raises(PageAllocatorError):
        a.free(bad)
    assert a.free_list == [3, 4, 5, 6]


def test_double_free_raises_and_changes_nothing():
    a = PageAllocator(5)
    assert a.allocate(3) == [1, 2, 3]
    a.free([2])
    with pytest.raises(AssertionError):  # PageAllocatorError is an AssertionError
        a.free([2])
    with pytest.raises(PageAllocatorError):
        a.free([1, 3, 1])  # duplicate inside one call: validated before anything is freed
    assert a.free_list == [4, 2]
    assert a.ref_count(1) == 1 and a.ref_count(3) == 1


def test_ref_counts_keep_shared_pages_until_last_owner_frees():
    a = PageAllocator(5)
    assert a.allocate(2) == [1, 2]
    assert a.ref_count(1) == 1 and a.ref_count(3) == 0
    a.incref([1])
    assert a.ref_count(1) == 2
    a.free([2, 1])
    assert a.free_list == [3, 4, 2]  # page 1 still has an owner
    assert a.ref_count(1) == 1
    a.free([1])
    assert a.free_list == [3, 4, 2, 1]
    with pytest.raises(PageAllocatorError):
        a.incref([1])  # not allocated any more


def test_bad_sizes():
    with pytest.raises(ValueError):
        PageAllocator(1)
    with pytest.raises(ValueError):
        PageAllocator(3).allocate(-1)


# --------------------------------------------------------------------------- prefix caching

from jaxinfer.runtime.host.page_allocator import hash_page, page_hashes, root_hash  # noqa: E402


def test_page_hashes_chain_over_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)  # 3 full pages; token 7 is a partial page
    assert len(a) == 3 and len(set(a)) == 3 and all(len(h) == 16 for h in a)
    assert page_hashes([1, 2, 3, 4, 5, 6], 2) == a  # partial page ignored
    assert a[0] == hash_page(root_hash(), [1, 2]) and a[1] == hash_page(a[0], [3, 4])
    b = page_hashes([9, 2, 3, 4, 5, 6], 2)  # same tokens in page 1 and 2, different page 0
    assert b[0] != a[0] and b[1] != a[1] and b[2] != a[2]  # chained: the parent changes all
    assert page_hashes([5, 6, 8, 8], 2, parent=a[1]) == [a[2], hash_page(a[2], [8, 8])]
    assert page_hashes([1, 2, 3, 4], 2, salt=b"int8-kv") != a[:2]  # namespace changes everything
    assert page_hashes([1, 2], 4) == [] and page_hashes([], 2) == []
    assert page_hashes([1, 2], 1) != page_hashes([1, 2], 2)  # different page split
    assert hash_page(root_hash(), [256]) != hash_page(root_hash(), [1, 0])  # not byte-ambiguous


def test_cached_pages_are_evictable_lru_after_truly_free_ones():
    a = PageAllocator(7)  # usable 1..6
    h = page_hashes(list(range(12)), 2)  # six distinct page hashes
    assert a.allocate(4) == [1, 2, 3, 4]
    for p, hh in zip([1, 2, 3], h):
        assert a.register(p, hh)
    assert a.hash_of(1) == h[0] and a.hash_of(4) is None
    a.free([4, 3, 2, 1])  # tail first, as the scheduler does
    assert a.free_list == [5, 6, 4] and a.cached_list == [3, 2, 1]
    assert a.num_free == 6 and a.num_cached == 3
    assert a.lookup(h) == [1, 2, 3] and a.lookup([h[0], h[4], h[2]]) == [1]  # stops at a miss
    a.check_invariants()
    # take back the first two pages of the prefix (ref 0 -> 1): they leave the LRU
    a.incref([1, 2])
    assert a.ref_count(1) == a.ref_count(2) == 1 and a.cached_list == [3]
    assert a.num_free == 4
    # allocation: truly free first (FIFO), then LRU eviction, dropping the hash entry
    assert a.allocate(3) == [5, 6, 4]
    assert a.num_evictions == 0
    assert a.allocate(1) == [3] and a.num_evictions == 1
    assert a.hash_of(3) is None and a.lookup(h) == [1, 2]
    assert a.allocate(1) is None  # everything held
    # a shared page: two holders; it becomes cached only when the last one frees it
    a.incref([2])
    a.free([2])
    assert a.ref_count(2) == 1 and a.cached_list == []
    a.free([2, 1])
    assert a.cached_list == [2, 1]  # back at the MRU end, in the given order
    a.incref([1])
    a.free([1])
    assert a.cached_list == [2, 1]
    a.incref([2])
    a.free([2])
    assert a.cached_list == [1, 2]  # 2 used most recently
    assert a.allocate(1) == [1]  # LRU: 1 evicted before 2
    assert a.lookup(h) == []  # page 1 (the prefix head) is gone, so nothing matches
    a.free([1, 3, 4, 5, 6])
    assert a.free_list == [1, 3, 4, 5, 6] and a.cached_list == [2]
    assert a.num_free == a.num_total == 6
    a.check_invariants()


def test_register_rules_and_reset():
    a = PageAllocator(5)
    h = page_hashes([1, 2, 3, 4], 2)
    assert a.allocate(3) == [1, 2, 3]
    assert a.register(1, h[0])
    assert not a.register(2, h[0])  # hash already names page 1: the duplicate stays private
    assert not a.register(1, h[1])  # page already has a hash
    assert a.hash_of(2) is None and a.lookup(h) == [1]
    with pytest.raises(PageAllocatorError):
        a.register(4, h[1])  # not held
    with pytest.raises(PageAllocatorError):
        a.register(0, h[1])
    a.free([3, 2, 1])
    assert a.free_list == [4, 3, 2] and a.cached_list == [1]
    with pytest.raises(PageAllocatorError):
        a.incref([2])  # freed without a hash: neither held nor cached
    with pytest.raises(PageAllocatorError):
        a.free([1])  # cached pages have no holder: freeing again is a double free
    assert a.reset_prefix_cache() == 1
    assert a.free_list == [4, 3, 2, 1] and a.cached_list == [] and a.lookup(h) == []
    a.check_invariants()


def test_check_invariants_catches_corruption():
    a = PageAllocator(4)
    a.allocate(1)
    a._free.append(1)  # a held page also on the free queue
    with pytest.raises(AssertionError):
        a.check_invariants()
