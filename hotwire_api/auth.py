"""Who may use ``/steer/*`` and steering, by API key.

With ``HOTWIRE_KEYS_FILE``, keys carry roles (``hotwire_api.keys``): ``read`` opens the slot bank and the fleet
view, ``steer`` also lists and fetches vectors and steers or reads requests, ``admin`` also registers, replaces,
deletes and extracts vectors; ``HOTWIRE_API_KEY``, if set too, is one more admin key. A steered request carries its
key in ``X-Hotwire-Key``, or in ``Authorization: Bearer`` where vLLM has no key of its own.

Without a keys file, one key opens everything, as before roles: ``HOTWIRE_API_KEY`` when set, otherwise vLLM's
own keys, in vLLM's order: ``--api-key`` (in vLLM 0.25.1 a list, ``app.state.args.api_key``) and else the
``VLLM_API_KEY`` environment variable; none set: open. vLLM's own ``AuthenticationMiddleware`` only guards
``/v1``, ``/v2`` and ``/inference``, so ``/steer/*`` is checked here, and a steered request needs vLLM's key on
every route (``/invocations`` is not guarded by vLLM) whatever hotwire's keys are.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import Any

from fastapi import Depends, Request

from hotwire_api.audit import entry
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.key_ring import FleetKeys
from hotwire_api.headers import KEY_HEADER
from hotwire_api.keys import Key, KeyRing, Role, hash_key
from hotwire_api.settings import Settings
from hotwire_api.tenancy import OPERATOR, Tenancy
from hotwire_core.error_codes import ErrorCode
from hotwire_core.vllm_glue.api_server import cli_api_keys

__all__ = ["Access", "authorize_steering", "bearer_matches", "caller_name", "record_key_changes", "require",
           "tenancy", "vllm_keys"]

logger = logging.getLogger(__name__)


def vllm_keys(app: Any) -> list[str]:
    """vLLM's own keys, which guard its OpenAI routes: ``--api-key`` and else ``VLLM_API_KEY``; empty when unset."""
    return [key for key in (cli_api_keys(app) or [os.environ.get("VLLM_API_KEY")]) if key]


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_matches(authorization: str, keys: list[str]) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of keys>``, compared in constant time."""
    token = _bearer(authorization)
    if token is None:
        return False
    presented = token.encode()
    match = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        match |= hmac.compare_digest(presented, key.encode())
    return match


class Access:
    """The app's keys: a :class:`KeyRing` with a keys file, :class:`FleetKeys` with the fleet's, else the one-key
    setting (read per request, since vLLM's keys live in its app state)."""

    def __init__(self, settings: Settings):
        self.api_key = settings.api_key
        extra = ()
        if settings.api_key:
            extra = (Key(name="HOTWIRE_API_KEY", role=Role.ADMIN, sha256=hash_key(settings.api_key)),)
        if settings.fleet_keys and (settings.keys_file or not settings.registry_url):
            raise ValueError("HOTWIRE_FLEET_KEYS=1 keeps the keys in the fleet's Redis: it needs HOTWIRE_REGISTRY, and "
                             "HOTWIRE_KEYS_FILE unset (copy a file's keys over with hotwire keys --fleet add)")
        self.ring: KeyRing | FleetKeys | None = FleetKeys(extra) if settings.fleet_keys else \
            KeyRing(settings.keys_file, extra) if settings.keys_file else None

    async def start(self, app: Any) -> list[asyncio.Task[None]]:
        """In the app's lifespan, once the vector registry started: a fleet's keys are read, then followed."""
        if not isinstance(self.ring, FleetKeys):
            return []
        registry = app.state.hotwire_registry
        await self.ring.start(registry.fleet_store(), registry.replica_name())
        return [asyncio.create_task(self.ring.run(app.state.hotwire_settings.catalog_refresh_s))]

    def one_key(self, app: Any) -> list[str]:
        return [self.api_key] if self.api_key else vllm_keys(app)

    def caller(self, secret: str | None, needed: Role, what: str) -> Key:
        """The key of role ``needed`` or above that ``secret`` is; 401, 403 or 503 ``keys_unavailable`` otherwise."""
        assert self.ring is not None
        key = self.ring.identify(secret)
        if key is None and self.ring.error is not None:
            raise HotwireError(503, ErrorCode.KEYS_UNAVAILABLE, f"{self.ring.error}; until it is fixed only "
                               "HOTWIRE_API_KEY opens hotwire (no restart needed: the server reads it again)")
        if key is None:
            raise HotwireError(401, ErrorCode.UNAUTHORIZED, f"missing or unknown API key: {what}")
        if not key.role.allows(needed):
            raise HotwireError(403, ErrorCode.FORBIDDEN, f"the key {key.name!r} has role {key.role.value!r}; this "
                               f"needs {needed.value!r} or above: use a key with that role (hotwire keys add)")
        return key


def _access(app: Any) -> Access:
    return app.state.hotwire_access


async def record_key_changes(app: Any) -> None:
    """Put the key changes the keys file's last edits made into the audit trail (``who``: the caller's key for an
    edit over HTTP, else ``keys file``); kept for the next request if the trail cannot take them now."""
    ring = _access(app).ring
    if ring is None or not ring.changes:
        return
    changes, ring.changes = ring.changes, []
    for n, (action, name, who) in enumerate(changes):
        try:
            await app.state.hotwire_registry.record(entry(who, action, name))
        except HotwireError as exc:
            logger.error("hotwire: key changes not yet in the audit trail: %s", exc.message)
            ring.changes[:0] = changes[n:]
            return


def require(role: Role, operator: bool = False) -> Any:
    """A route dependency: the caller's key must have ``role`` or above (any valid key without a keys file), and
    with ``operator`` belong to no tenant (monitors are the operator's)."""

    async def check(request: Request) -> None:
        access = _access(request.app)
        authorization = request.headers.get("authorization", "")
        request.state.hotwire_tenancy = OPERATOR
        if access.ring is not None:
            key = access.caller(_bearer(authorization), role, "send 'Authorization: Bearer <key>' with a key from "
                                "HOTWIRE_KEYS_FILE (or HOTWIRE_API_KEY)")
            if operator and key.tenant is not None:
                raise HotwireError(403, ErrorCode.FORBIDDEN, f"the key {key.name!r} belongs to tenant {key.tenant!r}; "
                                   "this route is the operator's: use a key without a tenant")
            request.state.hotwire_caller = key.name
            request.state.hotwire_tenancy = Tenancy(key.tenant)
            await record_key_changes(request.app)
            return
        keys = access.one_key(request.app)
        if keys and not bearer_matches(authorization, keys):
            raise HotwireError(401, ErrorCode.UNAUTHORIZED, "missing or wrong API key: send 'Authorization: Bearer "
                               "<key>' (HOTWIRE_API_KEY, or vLLM's --api-key when HOTWIRE_API_KEY is not set)")
        request.state.hotwire_caller = "api-key" if keys else "anonymous"

    check.role = role  # type: ignore[attr-defined]  # what tests read to check every route declares one
    check.operator = operator  # type: ignore[attr-defined]
    return Depends(check)


def caller_name(request: Request) -> str:
    """The name of the key that :func:`require` let in (for the audit trail)."""
    return request.state.hotwire_caller


def tenancy(request: Request) -> Tenancy:
    """Whose vectors the key that :func:`require` let in sees (``hotwire_api.tenancy``)."""
    return request.state.hotwire_tenancy


def authorize_steering(app: Any, authorization: str, hotwire_key: str | None) -> Tenancy:
    """A steered or reading request on an OpenAI route: vLLM's key where one is set (vLLM checks it on ``/v1``
    only), and with a keys file a key of role ``steer`` or above (``X-Hotwire-Key``, else the bearer token).
    Returns whose vectors the request may name."""
    keys = vllm_keys(app)
    if keys and not bearer_matches(authorization, keys):
        raise HotwireError(401, ErrorCode.UNAUTHORIZED, "a steered request needs vLLM's API key (--api-key or "
                           "VLLM_API_KEY) on every route: send 'Authorization: Bearer <key>'")
    access = _access(app)
    if access.ring is not None:
        where = f"{KEY_HEADER}: <key>" if keys else f"'Authorization: Bearer <key>' (or {KEY_HEADER}: <key>)"
        key = access.caller(hotwire_key or _bearer(authorization), Role.STEER,
                            f"a steered request needs a key of role 'steer' or 'admin' from HOTWIRE_KEYS_FILE: send {where}")
        return Tenancy(key.tenant)
    return OPERATOR
