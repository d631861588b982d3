"""The GPU bank as a cache: rows keyed by (vector id, version, layer), pinned while a request uses them,
evicted least-recently-used otherwise. Pure bookkeeping: the controller turns its decisions into bank writes.

Slot 0 of the bank is the all-zero "no steer" row and is never handed out, so slots run 1..capacity.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Collection, NamedTuple

from .spec import tenant_of


class RowKey(NamedTuple):
    vector_id: str
    version: int
    layer: int  # -1: a layer-agnostic vector's single row


class SlotsExhausted(Exception):
    def __init__(self, needed: int, available: int, capacity: int):
        super().__init__(
            f"steering needs {needed} new bank rows but only {available} of {capacity} can be freed now "
            "(the rest are pinned by running requests); retry shortly or raise HOTWIRE_SLOTS"
        )
        self.needed, self.available, self.capacity = needed, available, capacity


class TenantFull(SlotsExhausted):
    """Pinning would take a tenant's vectors past their share of the bank (``SlotCache.shares``, ``tenant_rows``)."""

    def __init__(self, tenant: str, pinned: int, needed: int, limit: int, capacity: int, source: str):
        Exception.__init__(
            self,
            f"tenant {tenant!r}'s vectors hold {pinned} of the {limit} bank rows it may pin at once ({source}) and "
            f"this request would pin {needed} more; it waits until the tenant's running requests finish",
        )
        self.tenant, self.pinned, self.limit = tenant, pinned, limit
        self.needed, self.available, self.capacity = needed, max(0, limit - pinned), capacity


@dataclass
class _Row:
    key: RowKey
    refcount: int = 0
    last_use: float = 0.0


class SlotCache:
    """LRU cache of bank rows with pins. ``acquire`` is all-or-nothing. The rows of one tenant's vectors
    (``spec.tenant_of``) pinned at once are at most its share: ``shares`` for the tenants named there, else
    ``tenant_rows``. A tenant flooding distinct vectors leaves the rest of the bank to the others. Shared vectors
    are no tenant's."""

    def __init__(self, capacity: int, tenant_rows: int | None = None, shares: dict[str, int] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.tenant_rows = capacity if tenant_rows is None else tenant_rows
        self.shares = dict(shares or {})
        self._pinned_by: Counter[str] = Counter()  # tenant -> rows of its vectors pinned
        self._slot_of: dict[RowKey, int] = {}
        self._rows: dict[int, _Row] = {}
        self._free: list[int] = list(range(capacity, 0, -1))  # pop() hands out 1, 2, ...
        self._unpinned: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.evictions = 0

    def missing(self, keys: Collection[RowKey]) -> int:
        return sum(1 for key in keys if key not in self._slot_of)

    def available(self, keys: Collection[RowKey] = frozenset()) -> int:
        """Rows a request for ``keys`` could take for its missing rows: free plus evictable, not counting its
        own resident rows, which it pins rather than evicts."""
        own = sum(1 for key in keys if self._slot_of.get(key) in self._unpinned)
        return len(self._free) + len(self._unpinned) - own

    @property
    def pinned(self) -> int:
        """Rows some request pins."""
        return len(self._rows) - len(self._unpinned)

    def pinned_by(self, tenant: str) -> int:
        return self._pinned_by[tenant]

    def over_share(self, keys: Collection[RowKey]) -> TenantFull | None:
        """Why pinning ``keys`` would take a tenant past its share; None when it would not."""
        new = Counter(tenant_of(key.vector_id) for key in keys
                      if (slot := self._slot_of.get(key)) is None or self._rows[slot].refcount == 0)
        for tenant, needed in sorted(new.items()):
            share = self.shares.get(tenant, self.tenant_rows)
            if tenant and self._pinned_by[tenant] + needed > share:
                source = ("its rows in HOTWIRE_TENANT_LIMITS" if tenant in self.shares else "HOTWIRE_TENANT_ROWS")
                return TenantFull(tenant, self._pinned_by[tenant], needed, share, self.capacity,
                                  f"{source}, never below HOTWIRE_MAX_ROWS")
        return None

    def shortage(self, keys: Collection[RowKey]) -> SlotsExhausted | None:
        """Why ``keys`` cannot all be pinned now (the bank, or their tenant's share of it); None when they can."""
        needed, available = self.missing(keys), self.available(keys)
        if needed > available:
            return SlotsExhausted(needed, available, self.capacity)
        return self.over_share(keys)

    def acquire(self, keys: Collection[RowKey]) -> tuple[dict[RowKey, int], list[tuple[int, RowKey]]]:
        """Pin ``keys``; returns ``(slot of each key, [(slot, key) rows that must be loaded])``."""
        shortage = self.shortage(keys)
        if shortage is not None:
            raise shortage
        now = time.time()
        slots: dict[RowKey, int] = {}
        loads: list[tuple[int, RowKey]] = []
        # Pin resident rows first so the evictions below cannot take them.
        for key in sorted(keys, key=lambda k: k not in self._slot_of):
            slot = self._slot_of.get(key)
            if slot is None:
                slot = self._take_slot()
                self._slot_of[key] = slot
                self._rows[slot] = _Row(key)
                loads.append((slot, key))
            row = self._rows[slot]
            if row.refcount == 0:
                self._unpinned.pop(slot, None)
                self._pinned_by[tenant_of(key.vector_id)] += 1
            row.refcount += 1
            row.last_use = now
            slots[key] = slot
        return slots, loads

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot, _ = self._unpinned.popitem(last=False)
        del self._slot_of[self._rows.pop(slot).key]
        self.evictions += 1
        return slot

    def release(self, keys: Collection[RowKey]) -> None:
        now = time.time()
        for key in keys:
            slot = self._slot_of[key]
            row = self._rows[slot]
            row.refcount -= 1
            row.last_use = now
            if row.refcount == 0:
                self._unpinned[slot] = None
                self._pinned_by[tenant_of(key.vector_id)] -= 1

    def drop(self, vector_id: str, version: int) -> None:
        """Free the unpinned rows of a version that no request can name again."""
        for key in [k for k in self._slot_of if k.vector_id == vector_id and k.version == version]:
            slot = self._slot_of[key]
            if self._rows[slot].refcount == 0:
                del self._slot_of[key], self._rows[slot]
                self._unpinned.pop(slot, None)
                self._free.append(slot)

    def stats(self) -> dict:
        rows = [
            {
                "slot": slot,
                "id": row.key.vector_id,
                "version": row.key.version,
                "layer": row.key.layer,
                "refcount": row.refcount,
                "last_use": row.last_use,
            }
            for slot, row in sorted(self._rows.items())
        ]
        return {
            "capacity": self.capacity,
            "used": len(self._rows),
            "pinned": self.pinned,
            "free": len(self._free),
            "evictions": self.evictions,
            "tenant_rows": self.tenant_rows,
            "tenant_shares": dict(self.shares),
            "rows": rows,
        }
