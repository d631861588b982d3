"""A fleet's API keys (``HOTWIRE_FLEET_KEYS=1``): kept in its Redis (``api_keys``, a key's entry as the keys file
holds it: ``hotwire_api.keys.Key``), so one key with its role and tenant opens every replica, and an edit through any
replica (or ``hotwire keys --fleet``) reaches all of them. Each edit and its audit entry are one script
(``lua.EDIT_KEY``). Every API server polls the count of edits every ``HOTWIRE_CATALOG_REFRESH_MS`` and reads the keys
again when it moved; until it has read them once, or while Redis does not answer at the start, only
``HOTWIRE_API_KEY`` opens hotwire (503 ``keys_unavailable``); keys read once stay on while Redis is away.

The keys are behind the registry's restart gate (``repair``): a Redis that restarted from older data, or lost it,
holds the keys of fewer edits than an API server has read. While the gate is closed, that API server keeps its keys
and puts them back (``lua.RESTORE_KEYS``: the one that read the most edits wins), and edits over HTTP wait for the
gate (503). An API server that reads such keys only after the gate opened takes them as they are."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pydantic

from hotwire_api.errors import HotwireError
from hotwire_api.keys import Key, KeysFileError, Role, find_key, made_key
from hotwire_core.error_codes import ErrorCode

__all__ = ["FleetKeys"]

logger = logging.getLogger(__name__)

_REFUSED = {503: ("the fleet's Redis restarted or lost its data and the replicas are putting back what they hold: "
                  "retry the edit of {name!r} in a few seconds", ErrorCode.KEYS_UNAVAILABLE),
            409: ("a key named {name!r} is in the fleet's keys already: rotate it, or revoke it first", ErrorCode.EXISTS),
            404: ("no key named {name!r} in the fleet's keys", ErrorCode.UNKNOWN_KEY),
            423: ("{name!r} is the fleet's last operator admin key: add another admin key first (without one, and "
                  "without HOTWIRE_API_KEY, nobody could manage keys or vectors over HTTP)", ErrorCode.LAST_ADMIN)}


class FleetKeys:
    """The keys in the fleet's Redis and ``extra`` (``HOTWIRE_API_KEY``), as ``hotwire_api.keys.KeyRing`` offers
    them: ``identify``, ``error`` and the edits of ``/steer/keys``. ``changes`` stays empty: the script that makes
    an edit writes its audit entry."""

    kept = "redis"

    def __init__(self, extra: tuple[Key, ...] = (), replica: str = "local", gated: bool = True):
        """``gated``: edits wait for the registry's restart gate (an API server's; the CLI's do not)."""
        self.extra, self.replica, self.gated = extra, replica, gated
        self.fleet: Any = None  # the fleet's RedisRegistry, once the app started
        self.changes: list[tuple[str, str, str]] = []
        self._keys: tuple[Key, ...] = ()
        self._edits = -1
        self.error: str | None = "the fleet's keys (HOTWIRE_FLEET_KEYS) are not read yet: the registry does not answer"

    async def start(self, fleet: Any, replica: str) -> None:
        self.fleet, self.replica = fleet, replica
        try:
            await self.refresh()
        except HotwireError as exc:  # the poll reads them once the registry answers
            logger.error("hotwire: the fleet's keys cannot be read yet: %s", exc.message)

    async def refresh(self) -> None:
        """Read the keys again if they changed since the last read (one round trip when they did not)."""
        edits, docs = await self.fleet.api_keys()
        if edits < self._edits:  # Redis lost edits read here: put them back while the gate lets us, else take its keys
            if await self.fleet.restore_keys(self._edits, [(key.name, key.model_dump_json()) for key in self._keys]):
                logger.warning("hotwire: the fleet's Redis came back with the keys of %d edits; put back the %d keys "
                               "of the %d edits this API server had read", edits, len(self._keys), self._edits)
                return
            edits, docs = await self.fleet.api_keys()
        if edits != self._edits:
            keys = []
            for doc in docs:
                try:
                    keys.append(Key.model_validate_json(doc))
                except pydantic.ValidationError as exc:  # written by hand into Redis: it opens nothing, the rest apply
                    logger.error("hotwire: a key in the fleet's Redis is not valid and opens nothing (%s): %.200s",
                                 exc.errors()[0]["msg"], doc)
            self._keys = tuple(sorted(keys, key=lambda k: k.name))
            self._edits, self.error = edits, None

    async def run(self, interval_s: float) -> None:
        """Follow the edits made through other replicas (a lifespan task)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except HotwireError as exc:  # the keys read last stay on
                logger.debug("hotwire: the fleet's keys not read this time: %s", exc.message)

    def identify(self, secret: str | None) -> Key | None:
        return find_key(secret, (*self.extra, *self._keys))

    async def keys(self) -> list[Key]:
        await self.refresh()
        return list(self._keys)

    async def add(self, name: str, role: Role, tenant: str | None, who: str) -> str:
        secret, key = made_key(name, role, tenant)
        await self._edit("add", name, key.model_dump_json(), False, who)
        return secret

    async def rotate(self, name: str, who: str, within: str | None = None) -> str:
        secret, key = made_key(name, Role.READ, None)  # the script keeps the entry's role and tenant
        await self._edit("rotate", name, key.model_dump_json(), False, who, within)
        return secret

    async def revoke(self, name: str, keep_an_admin: bool, who: str, within: str | None = None) -> None:
        await self._edit("revoke", name, "", keep_an_admin, who, within)

    async def _edit(self, op: str, name: str, doc: str, keep_an_admin: bool, who: str, within: str | None = None) -> None:
        status = await self.fleet.edit_key(op, name, doc, keep_an_admin, who, self.replica, within, self.gated)
        if status in _REFUSED:
            message, code = _REFUSED[status]
            raise KeysFileError(message.format(name=name), code)
        await self.refresh()  # in force here at once
