"""The fleet's version numbering in Redis (``lua``'s numbering: ``last_version``, ``deleted`` and the floors): the
commands :class:`~hotwire_api.fleet.redis_registry.RedisRegistry` offers the repair and the follower for it,
written here to keep that module to its registry. They use its connection, key layout, config and error mapping
(``_redis``, ``keys``, ``config``, ``_do``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hotwire_api.fleet import lua
from hotwire_api.fleet.records import text as _str

__all__ = ["NumberingCommands"]


class NumberingCommands:
    """Mixed into ``RedisRegistry``; ``_numbering_scripts`` registers its scripts there."""

    _redis: Any
    keys: Any
    config: Any
    _do: Callable[[Any], Awaitable[Any]]

    def _numbering_scripts(self, script: Any) -> None:
        self._raise_floor, self._track_deleted = script(lua.RAISE_FLOOR), script(lua.TRACK_DELETED)

    async def last_versions(self) -> tuple[dict[str, int], int]:
        """(id -> the last version the registry gave it, live ids and the last ``history_kept`` deleted ones; the
        floor every id's next version goes on above)."""
        pipe = self._redis.pipeline(transaction=True).hgetall(self.keys.last_version).get(self.keys.version_floor)
        last, floor = await self._do(pipe.execute())
        return {_str(k): int(v) for k, v in last.items()}, int(floor or 0)

    async def raise_floor(self, version: int) -> None:
        """Raise the floor every id's next version goes on above to ``version`` (repair: ids a replica forgot)."""
        await self._do(self._raise_floor(keys=[self.keys.version_floor], args=[version]))

    async def track_deleted(self, batch: int = 1000) -> int | None:
        """Count the ids an earlier hotwire left in ``last_version`` without a current version among the deleted
        ones, so that they too are forgotten into the floor past ``history_kept`` (``batch`` ids a script); returns
        how many it added, or None when the restart gate was closed (nothing forgotten: call it again later)."""
        k, cursor, added, left = self.keys, "0", 0, 0  # cursor: "0" starts the scan, "" once it is done
        while cursor or left > 0:
            answer = await self._do(self._track_deleted(
                keys=[k.current, k.last_version, k.deleted, k.version_floor, k.deleted_floor, k.boot],
                args=[self.config.history_kept, cursor, batch]))
            cursor = "" if _str(answer[0]) == "0" else _str(answer[0])
            added, left = added + int(answer[1]), int(answer[2])
        return None if left < 0 else added
