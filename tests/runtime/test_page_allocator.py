"""Host page allocator: exact page ids, FIFO free-list order, ref counts, bug detection. No JAX."""

import pytest

from runtime.page_allocator import PageAllocator, PageAllocatorError


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
