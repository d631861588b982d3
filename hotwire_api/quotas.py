"""A tenant's quotas on what it registers (``hotwire_api.tenancy``): the vectors and bytes it holds registered
(``HOTWIRE_TENANT_VECTORS``, ``HOTWIRE_TENANT_MB``) and its registrations per minute
(``HOTWIRE_TENANT_REGISTRATIONS_PER_MIN``), or its own where ``HOTWIRE_TENANT_LIMITS`` names it; past one, 429
``quota_exceeded``. The bank rows a tenant's requests pin at once are the engine's to limit
(``HOTWIRE_TENANT_ROWS``, ``hotwire_core.slots``). A quota is the namespace's,
whichever key registers into it; shared vectors have none.

A tenant's registrations are checked and made one at a time, each against the registry as its engine holds it once
the one before is done (an extraction is checked before its captures too). In a fleet (``HOTWIRE_REGISTRY``) that
holds for every replica together: a registration takes the tenant's turn in Redis, waits until this replica's
engine holds every version of the tenant's ids that Redis calls current (another replica's registration reaches it
through the follower a few ms later), and the registrations per minute are counted in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hotwire_api.errors import HotwireError
from hotwire_api.models import VectorMeta
from hotwire_api.settings import Settings
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import tenant_of

__all__ = ["Quotas", "size_of"]

logger = logging.getLogger(__name__)

Held = Callable[[str], Awaitable[list[VectorMeta]]]  # a tenant's current vectors, asked for when needed
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WINDOW_S = 60.0
TURN_WAIT_S = 10.0  # how long a registration waits for another API server's turn on the same tenant
TURN_TTL_S = 60.0  # a turn outlives a registration; it frees itself should its API server stop while holding it
CATCH_UP_S = 5.0  # how long a registration waits for this replica's engine to hold the fleet's versions


def size_of(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a vector of ``dtype`` and ``shape`` holds."""
    return math.prod(shape) * _ITEM_BYTES.get(dtype, 4)


class Quotas:
    """Every tenant's registrations through this API server."""

    def __init__(self, settings: Settings):
        # Each limit: everyone's value, the variable that sets it, and its name in HOTWIRE_TENANT_LIMITS.
        self._everyones = {"vectors": (settings.tenant_vectors, "HOTWIRE_TENANT_VECTORS", "vectors"),
                           "bytes": (settings.tenant_bytes, "HOTWIRE_TENANT_MB", "mb"),
                           "registrations_per_min": (settings.tenant_per_minute, "HOTWIRE_TENANT_REGISTRATIONS_PER_MIN",
                                                     "registrations_per_min")}
        self._own = dict(settings.tenant_limits or {})
        self._recent: defaultdict[str, deque[float]] = defaultdict(deque)  # tenant -> when it registered (no fleet)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @contextlib.asynccontextmanager
    async def registering(self, vector_id: str, nbytes: int, held: Held, fleet: Any = None) -> AsyncIterator[None]:
        """Around the registration of ``nbytes`` as ``vector_id``: raise 429 ``quota_exceeded`` if it would take the
        id's tenant past a quota. ``held``: the tenant's current vectors, asked for once the tenant's registrations
        before this one are done. ``fleet``: the fleet's Redis registry (``VectorRegistry.fleet_store``), which holds the
        tenant's turn and counts its registrations per minute; None: this server alone. A registration that fails
        is not counted."""
        tenant = tenant_of(vector_id)
        if not tenant:
            yield
            return
        async with self._locks[tenant], _fleet_turn(tenant, fleet):
            self._check_held(tenant, vector_id, nbytes, await (held(tenant) if fleet is None else _fleet_held(tenant, held, fleet)))
            give_back = await self._count(tenant, fleet)
            try:
                yield
            except BaseException:
                await give_back()
                raise

    def limits(self, tenant: str) -> tuple[int, int, int]:
        """``tenant``'s ``(vectors, bytes, registrations per minute)``: its own where it has them, else everyone's."""
        return tuple(self._limit(tenant, name)[0] for name in self._everyones)  # type: ignore[return-value]

    def _limit(self, tenant: str, name: str) -> tuple[int, str]:
        """``tenant``'s limit ``name`` and where it is set: its own in HOTWIRE_TENANT_LIMITS, else everyone's."""
        value, variable, own_name = self._everyones[name]
        own = getattr(self._own.get(tenant), name, None)
        return (value, variable) if own is None else (own, f"HOTWIRE_TENANT_LIMITS.{tenant}.{own_name}")

    async def _count(self, tenant: str, fleet: Any) -> Any:
        """Count one registration of ``tenant`` (or raise); returns how to take it back."""
        per_minute = self._limit(tenant, "registrations_per_min")[0]
        if fleet is not None:
            token = uuid.uuid4().hex
            full = await fleet.take_registration(tenant, time.time(), WINDOW_S, per_minute, token)
            if full is not None:
                raise self._too_many(tenant, *full, time.time())
            return lambda: fleet.give_back_registration(tenant, token)
        recent, now = self._recent[tenant], time.monotonic()
        while recent and recent[0] <= now - WINDOW_S:
            recent.popleft()
        if len(recent) >= per_minute:
            raise self._too_many(tenant, len(recent), recent[0], now)
        recent.append(now)

        async def give_back() -> None:
            if now in recent:  # (not yet a minute old)
                recent.remove(now)

        return give_back

    async def admissible(self, vector_id: str, held: Held, fleet: Any = None) -> None:
        """Raise 429 ``quota_exceeded`` now if registering ``vector_id`` would take its tenant past its vectors or
        its registrations per minute (before an extraction's captures: its bytes are checked when it registers)."""
        tenant = tenant_of(vector_id)
        if tenant:
            self._check_held(tenant, vector_id, 0, await held(tenant))
            count = await self.recent(tenant, fleet)
            if count >= self._limit(tenant, "registrations_per_min")[0]:
                raise self._too_many(tenant, count)

    async def recent(self, tenant: str, fleet: Any = None) -> int:
        """``tenant``'s registrations in the last minute (``fleet``: counted in its Redis)."""
        if fleet is not None:
            return await fleet.registrations_since(tenant, time.time() - WINDOW_S)
        now = time.monotonic()
        return sum(1 for at in self._recent[tenant] if at > now - WINDOW_S)

    def _too_many(self, tenant: str, count: int, oldest: float | None = None, now: float = 0.0) -> HotwireError:
        """``oldest``: when the oldest registration in the window was made (None: unknown)."""
        retry = "within a minute" if oldest is None else f"in {max(0.0, oldest + WINDOW_S - now):.0f} s"
        per_minute, source = self._limit(tenant, "registrations_per_min")
        return _exceeded(f"tenant {tenant!r} made {count} registrations in the last minute, its quota "
                         f"({source}={per_minute}); retry {retry}")

    def _check_held(self, tenant: str, vector_id: str, nbytes: int, held: list[VectorMeta]) -> None:
        own = [m for m in held if tenant_of(m.id) == tenant and m.id != vector_id]  # a replaced one makes way
        vectors, source = self._limit(tenant, "vectors")
        if len(own) + 1 > vectors:
            raise _exceeded(f"tenant {tenant!r} holds {len(own)} vectors, its quota ({source}={vectors}); delete one "
                            "first, or ask the operator to raise it")
        used = sum(size_of(m.dtype, m.shape) for m in own)
        allowed, source = self._limit(tenant, "bytes")
        if used + nbytes > allowed:
            raise _exceeded(f"tenant {tenant!r} holds {used:,} bytes of vectors and this one has {nbytes:,}: more "
                            f"than its quota of {allowed:,} ({source}); delete some first, or ask the operator to "
                            "raise it")


@contextlib.asynccontextmanager
async def _fleet_turn(tenant: str, fleet: Any) -> AsyncIterator[None]:
    """``tenant``'s registration turn across the fleet (nothing to take without one)."""
    if fleet is None:
        yield
        return
    token, deadline, pause = uuid.uuid4().hex, time.monotonic() + TURN_WAIT_S, 0.005
    while not await fleet.take_turn(tenant, token, TURN_TTL_S):
        if time.monotonic() > deadline:
            raise HotwireError(503, ErrorCode.REGISTRY_UNAVAILABLE, f"another API server of the fleet has been "
                               f"registering for tenant {tenant!r} for over {TURN_WAIT_S:.0f} s; retry shortly")
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.1)
    try:
        yield
    finally:
        try:
            await fleet.end_turn(tenant, token)
        except HotwireError as exc:  # the turn frees itself after TURN_TTL_S
            logger.warning("hotwire: tenant %r's registration turn not ended in the registry: %s", tenant, exc.message)


async def _fleet_held(tenant: str, held: Held, fleet: Any) -> list[VectorMeta]:
    """The tenant's current vectors, once this replica's engine holds each version of ``tenant``'s ids that the
    fleet's Redis calls current (ids it still holds that Redis deleted count against the tenant: refused, never over)."""
    deadline = time.monotonic() + CATCH_UP_S
    while True:
        wanted = [(i, version) for i, (version, _) in (await fleet.current()).items() if tenant_of(i) == tenant]
        vectors = await held(tenant)
        have = {m.id: m.version for m in vectors}
        if all(have.get(i, -1) >= version for i, version in wanted):
            return vectors
        if time.monotonic() > deadline:
            raise HotwireError(503, ErrorCode.REGISTRY_UNAVAILABLE, f"this replica's engine has not applied the "
                               f"fleet's latest changes to tenant {tenant!r}'s vectors within {CATCH_UP_S:.0f} s, so "
                               "its quotas cannot be checked here; retry shortly")
        await asyncio.sleep(0.01)


def _exceeded(message: str) -> HotwireError:
    return HotwireError(429, ErrorCode.QUOTA_EXCEEDED, message)
