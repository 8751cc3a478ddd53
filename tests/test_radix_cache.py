"""The radix prefix cache on plain data."""

from __future__ import annotations

import numpy as np

from scheduler_proc.radix_cache import DisabledCache, RadixCache


def a(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def test_match_insert_and_split():
    c = RadixCache()
    assert c.insert(a(1, 2, 3, 4), a(11, 12, 13, 14)).adopted_from == 0
    m = c.match_prefix(a(1, 2, 9))
    assert m.slots.tolist() == [11, 12] and len(m) == 2
    # The partial match split the edge: the matched node ends exactly at the match.
    assert m.node.key.tolist() == [1, 2] and c.total_size == 4
    c.lock(m.node)  # a running request reads 1, 2
    inserted = c.insert(a(1, 2, 5), a(21, 22, 25))
    assert inserted.adopted_from == 2  # the tree keeps its own slots for 1, 2
    assert len(inserted.replaced) == 0
    assert c.match_prefix(a(1, 2, 5, 6)).slots.tolist() == [11, 12, 25]
    assert c.total_size == 5 and c.match_len(a(1, 2, 3, 4, 5)) == 4
    c.unlock(m.node)


def test_an_insert_takes_the_callers_slots_where_no_request_reads_the_trees():
    """A request that recomputed cached positions (its hit was cut back) leaves the tree
    its fresh copy, not a duplicate beside a copy nobody reads."""
    c = RadixCache()
    c.insert(a(1, 2, 3, 4), a(11, 12, 13, 14))
    c.lock(c.match_prefix(a(1)).node)  # a running request reads position 0
    inserted = c.insert(a(1, 2, 3, 7), a(21, 22, 23, 27))
    assert inserted.adopted_from == 1
    assert sorted(inserted.replaced.tolist()) == [12, 13]  # 1 stays: it is read
    assert c.match_prefix(a(1, 2, 3, 4)).slots.tolist() == [11, 22, 23, 14]
    assert c.match_prefix(a(1, 2, 3, 7)).slots.tolist() == [11, 22, 23, 27]
    assert c.total_size == 5
    same = c.insert(a(1, 2, 3), a(11, 22, 23))  # its own slots: nothing to give back
    assert same.adopted_from == 1 and len(same.replaced) == 0


def test_locked_paths_are_never_evicted_and_lru_goes_first():
    c = RadixCache()
    c.insert(a(1, 2, 3), a(11, 12, 13))
    c.insert(a(7, 8), a(17, 18))
    c.insert(a(1, 2, 4), a(11, 12, 24))  # touches 1, 2 again
    m = c.match_prefix(a(7, 8))
    c.lock(m.node)
    assert c.protected_size == 2 and c.evictable_size == 4
    first = c.evict(1)
    assert first.tolist() == [13]  # the least recently used leaf
    rest = c.evict(100)
    assert sorted(rest.tolist()) == [11, 12, 24]  # the parent goes once its children have
    assert c.match_prefix(a(7, 8)).slots.tolist() == [17, 18]
    c.unlock(m.node)
    assert c.flush().tolist() == [17, 18] and c.total_size == 0


def test_lock_counts_nest_along_the_path():
    c = RadixCache()
    deep = c.insert(a(1, 2, 3, 4), a(1, 2, 3, 4)).node
    shallow = c.match_prefix(a(1, 2)).node
    c.lock(deep)
    c.lock(shallow)
    c.unlock(deep)
    assert c.protected_size == 2 and sorted(c.evict(10).tolist()) == [3, 4]
    c.unlock(shallow)
    assert c.protected_size == 0 and sorted(c.flush().tolist()) == [1, 2]


def test_all_slots_and_disabled_cache():
    c = RadixCache()
    c.insert(a(1, 2), a(5, 6))
    c.insert(a(1, 3), a(5, 7))
    assert sorted(c.all_slots().tolist()) == [5, 6, 7]
    d = DisabledCache()
    assert d.insert(a(1, 2), a(5, 6)).adopted_from == 2 and len(d.match_prefix(a(1, 2))) == 0
    assert d.total_size == 0 and len(d.flush()) == 0
