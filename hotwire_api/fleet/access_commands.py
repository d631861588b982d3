"""The fleet's API keys (``fleet.key_ring``) and its tenants' registrations (``hotwire_api.quotas``) in Redis: the
commands :class:`~hotwire_api.fleet.redis_registry.RedisRegistry` offers for them, written here to keep that module
to its registry. They use its connection, key layout, error mapping and restart gate (``_redis``, ``keys``, ``_do``,
``_gate_opens``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from hotwire_api.fleet import lua
from hotwire_api.fleet.records import text as _str

__all__ = ["AccessCommands"]


class AccessCommands:
    """Mixed into ``RedisRegistry``; ``_access_scripts`` registers its scripts there."""

    _redis: Any
    keys: Any
    _do: Callable[[Any], Awaitable[Any]]
    _gate_opens: Callable[[], Awaitable[bool]]

    def _access_scripts(self, script: Any) -> None:
        self._take_registration, self._edit_key = script(lua.TAKE_REGISTRATION), script(lua.EDIT_KEY)
        self._end_turn, self._restore_keys = script(lua.END_TURN), script(lua.RESTORE_KEYS)

    # -- the fleet's API keys (``fleet.key_ring``) ---------------------------------------------------------------

    async def api_keys(self) -> tuple[int, list[str]]:
        """The count of key edits so far, and every key's entry (JSON), read together."""
        pipe = self._redis.pipeline(transaction=True).get(self.keys.api_key_edits).hvals(self.keys.api_keys)
        edits, docs = await self._do(pipe.execute())
        return int(edits or 0), [_str(doc) for doc in docs]

    async def edit_key(self, op: str, name: str, doc: str, keep_an_admin: bool, who: str, replica: str,
                       within: str | None = None, gated: bool = True) -> int:
        """One key edit and its audit entry (``lua.EDIT_KEY``; ``within``: a tenant's keys only; ``gated``: while
        the restart gate is closed, waits for it as a register does, then refused); the script's status."""
        args = [op, name, doc, int(keep_an_admin), who, repr(time.time()), replica, within or "", int(gated)]
        keys = [self.keys.api_keys, self.keys.api_key_edits, self.keys.audit, self.keys.boot]
        status = int(await self._do(self._edit_key(keys=keys, args=args)))
        if status == lua.REFUSED and await self._gate_opens():
            status = int(await self._do(self._edit_key(keys=keys, args=args)))
        return status

    async def restore_keys(self, edits: int, entries: list[tuple[str, str]]) -> bool:
        """While the restart gate is closed, put back the keys an API server read at ``edits`` edits (name, entry)
        over those of fewer edits that Redis came back with (``lua.RESTORE_KEYS``); whether it did."""
        args = [edits, *(part for entry in entries for part in entry)]
        keys = [self.keys.api_keys, self.keys.api_key_edits, self.keys.boot]
        return bool(await self._do(self._restore_keys(keys=keys, args=args)))

    # -- tenants' registrations per minute (``hotwire_api.quotas``) ----------------------------------------------

    async def take_registration(self, tenant: str, now: float, window_s: float, limit: int,
                                token: str) -> tuple[int, float] | None:
        """Count ``tenant``'s registration ``token``; with ``limit`` in the window, (their count, the oldest's time)."""
        count, oldest = await self._do(self._take_registration(keys=[self.keys.registrations(tenant)],
                                                               args=[repr(now), repr(window_s), limit, token]))
        return None if int(count) < 0 else (int(count), float(oldest))

    async def give_back_registration(self, tenant: str, token: str) -> None:
        await self._do(self._redis.zrem(self.keys.registrations(tenant), token))

    async def registrations_since(self, tenant: str, since: float) -> int:
        return int(await self._do(self._redis.zcount(self.keys.registrations(tenant), f"({since!r}", "+inf")))

    async def take_turn(self, tenant: str, token: str, ttl_s: float) -> bool:
        """Take ``tenant``'s registration turn for the fleet under ``token`` for at most ``ttl_s`` (a replica that
        stops holding it frees it then); False while another API server holds it."""
        return bool(await self._do(self._redis.set(self.keys.turn(tenant), token, nx=True, px=int(ttl_s * 1000))))

    async def end_turn(self, tenant: str, token: str) -> None:
        await self._do(self._end_turn(keys=[self.keys.turn(tenant)], args=[token]))
