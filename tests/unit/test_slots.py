"""hotwire_core.slots: the bank-row LRU cache with pins."""

from __future__ import annotations

import copy

import pytest

from hotwire_core.slots import RowKey, SlotCache, SlotsExhausted


def K(vid: str, layer: int = 0, version: int = 1) -> RowKey:
    return RowKey(vid, version, layer)


def snapshot(c: SlotCache):
    s = c.stats()
    return s, dict(c._slot_of), copy.deepcopy(c._rows), list(c._free), list(c._unpinned), c.evictions


def check_consistent(c: SlotCache):
    s = c.stats()
    assert s["used"] + s["free"] == s["capacity"] == c.capacity
    assert s["pinned"] == sum(1 for row in s["rows"] if row["refcount"] > 0)
    assert s["used"] == len(s["rows"])
    assert c.available() == s["free"] + s["used"] - s["pinned"]
    slots = [row["slot"] for row in s["rows"]]
    assert len(set(slots)) == len(slots) and all(1 <= x <= c.capacity for x in slots)
    assert set(slots).isdisjoint(c._free)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        SlotCache(0)


def test_first_acquire_loads_from_slot_1():
    c = SlotCache(4)
    slots, loads = c.acquire({K("a"), K("a", 1)})
    assert sorted(slots.values()) == [1, 2]
    assert sorted(loads) == sorted((slot, key) for key, slot in slots.items())
    s = c.stats()
    assert (s["capacity"], s["used"], s["pinned"], s["free"], s["evictions"]) == (4, 2, 2, 2, 0)
    check_consistent(c)


def test_slot_zero_never_handed_out():
    c = SlotCache(3)
    seen = set()
    for i in range(20):
        slots, _ = c.acquire({K(f"v{i}")})
        seen |= set(slots.values())
        c.release({K(f"v{i}")})
    assert seen == {1, 2, 3}
    assert c.evictions == 17


def test_resident_rows_are_reused_with_refcount():
    c = SlotCache(4)
    s1, l1 = c.acquire({K("a")})
    s2, l2 = c.acquire({K("a"), K("b")})
    assert s2[K("a")] == s1[K("a")]
    assert l2 == [(s2[K("b")], K("b"))]  # only the new row is loaded
    rows = {r["id"]: r for r in c.stats()["rows"]}
    assert rows["a"]["refcount"] == 2 and rows["b"]["refcount"] == 1
    c.release({K("a")})
    assert {r["id"]: r["refcount"] for r in c.stats()["rows"]} == {"a": 1, "b": 1}
    assert c.stats()["pinned"] == 2
    c.release({K("a"), K("b")})
    assert c.stats()["pinned"] == 0 and c.stats()["used"] == 2
    s3, l3 = c.acquire({K("a")})  # an unpinned resident row is a hit, not a load
    assert s3 == s1 and l3 == []
    check_consistent(c)


def test_missing_and_available():
    c = SlotCache(3)
    c.acquire({K("a")})
    assert c.missing({K("a"), K("b"), K("c")}) == 2
    assert c.available() == 2
    c.release({K("a")})
    assert c.available() == 3


def test_all_or_nothing():
    c = SlotCache(3)
    c.acquire({K("a"), K("b")})
    before = snapshot(c)
    with pytest.raises(SlotsExhausted) as info:
        c.acquire({K("a"), K("c"), K("d")})
    assert (info.value.needed, info.value.available, info.value.capacity) == (2, 1, 3)
    assert "HOTWIRE_SLOTS" in str(info.value)
    after = snapshot(c)
    assert after[1:] == before[1:]
    assert after[0]["rows"] == before[0]["rows"]
    # still usable for what fits
    slots, _ = c.acquire({K("c")})
    assert slots[K("c")] == 3


def test_all_or_nothing_when_request_pins_its_own_evictable_rows():
    c = SlotCache(1)
    c.acquire({K("a")})
    c.release({K("a")})
    before = snapshot(c)
    with pytest.raises(SlotsExhausted):
        c.acquire({K("a"), K("b")})
    assert snapshot(c)[1:] == before[1:]


def test_lru_evicts_oldest_unpinned_first():
    c = SlotCache(3)
    for vid in "abc":
        c.acquire({K(vid)})
    slot = {r["id"]: r["slot"] for r in c.stats()["rows"]}
    c.release({K("b")})
    c.release({K("a")})
    c.release({K("c")})  # LRU order now b, a, c
    s, loads = c.acquire({K("d")})
    assert s[K("d")] == slot["b"] and loads == [(slot["b"], K("d"))]
    assert c.evictions == 1
    assert c.missing({K("b")}) == 1 and c.missing({K("a"), K("c")}) == 0
    # touching a makes c the oldest
    c.acquire({K("a")})
    c.release({K("a")})
    s, _ = c.acquire({K("e")})
    assert s[K("e")] == slot["c"]
    assert c.evictions == 2
    check_consistent(c)


def test_pinned_rows_never_evicted():
    c = SlotCache(2)
    c.acquire({K("pinned")})
    for i in range(10):
        c.acquire({K(f"x{i}")})
        c.release({K(f"x{i}")})
    assert c.missing({K("pinned")}) == 0
    assert c.evictions == 9
    c.acquire({K("y")})
    with pytest.raises(SlotsExhausted) as info:
        c.acquire({K("z")})
    assert info.value.available == 0
    assert c.missing({K("pinned"), K("y")}) == 0


def test_release_makes_rows_evictable():
    c = SlotCache(1)
    c.acquire({K("a")})
    with pytest.raises(SlotsExhausted):
        c.acquire({K("b")})
    c.release({K("a")})
    s, loads = c.acquire({K("b")})
    assert s == {K("b"): 1} and loads == [(1, K("b"))]
    assert c.evictions == 1


def test_release_decrements_not_frees_until_zero():
    c = SlotCache(1)
    c.acquire({K("a")})
    c.acquire({K("a")})
    c.release({K("a")})
    with pytest.raises(SlotsExhausted):
        c.acquire({K("b")})
    c.release({K("a")})
    c.acquire({K("b")})


def test_drop_frees_only_unpinned_rows_of_that_version():
    c = SlotCache(6)
    c.acquire({K("a", 0, 1), K("a", 1, 1), K("a", 0, 2), K("b", 0, 1)})
    c.release({K("a", 1, 1), K("a", 0, 2), K("b", 0, 1)})  # a@1 L0 stays pinned
    c.drop("a", 1)
    keys = {(r["id"], r["version"], r["layer"]) for r in c.stats()["rows"]}
    assert keys == {("a", 1, 0), ("a", 2, 0), ("b", 1, 0)}
    s = c.stats()
    assert (s["used"], s["pinned"], s["free"], s["evictions"]) == (3, 1, 3, 0)
    check_consistent(c)
    # freed slots are reused without counting as evictions
    c.acquire({K("n1"), K("n2"), K("n3")})
    assert c.evictions == 0
    check_consistent(c)


def test_drop_freed_slot_is_not_also_in_lru():
    c = SlotCache(2)
    c.acquire({K("a"), K("b")})
    c.release({K("a"), K("b")})
    c.drop("a", 1)
    # if 'a' were still in the LRU the cache would hand one slot out twice
    s1, _ = c.acquire({K("c")})
    s2, _ = c.acquire({K("d")})
    assert len(set(s1.values()) | set(s2.values())) == 2
    check_consistent(c)


def test_stats_rows_sorted_and_consistent():
    c = SlotCache(5)
    c.acquire({K("a"), K("b", 2)})
    c.acquire({K("c", -1, 3)})
    c.release({K("b", 2)})
    s = c.stats()
    assert [r["slot"] for r in s["rows"]] == sorted(r["slot"] for r in s["rows"])
    assert (s["capacity"], s["used"], s["pinned"], s["free"], s["evictions"]) == (5, 3, 2, 2, 0)
    row_c = next(r for r in s["rows"] if r["id"] == "c")
    assert (row_c["version"], row_c["layer"], row_c["refcount"]) == (3, -1, 1)
    assert set(row_c) == {"slot", "id", "version", "layer", "refcount", "last_use"}
    assert row_c["last_use"] > 0
    check_consistent(c)


def test_randomised_invariants():
    import random

    rng = random.Random(0)
    c = SlotCache(6)
    held: list[set[RowKey]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            c.release(held.pop(rng.randrange(len(held))))
        else:
            keys = {K(f"v{rng.randrange(8)}", rng.randrange(2)) for _ in range(rng.randint(1, 3))}
            resident_unpinned = sum(1 for k in keys if k in c._slot_of and c._slot_of[k] in c._unpinned)
            if c.missing(keys) > c.available() - resident_unpinned:
                # would need rows it is about to pin itself: test_all_or_nothing_when_request_pins_its_own_evictable_rows covers that path
                continue
            slots, loads = c.acquire(keys)
            assert set(slots) == keys and len(set(slots.values())) == len(keys)
            held.append(keys)
        check_consistent(c)


def test_a_requests_own_resident_row_is_pinned_before_its_missing_rows_evict():
    """Keys in any order (a list naming the missing row first): the request's resident row is pinned first, so
    the missing one evicts another row instead of the request's own."""
    c = SlotCache(2)
    a_slot = c.acquire([K("a")])[0][K("a")]
    c.acquire([K("x")])
    c.release([K("a")])  # a is the least recently used
    c.release([K("x")])
    slots, loads = c.acquire([K("b"), K("a")])
    assert slots[K("a")] == a_slot and loads == [(slots[K("b")], K("b"))]
    assert c.evictions == 1 and K("x") not in c._slot_of
    check_consistent(c)

