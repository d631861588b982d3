"""``/steer/keys``: admins list, add, rotate and revoke keys over HTTP: those of ``HOTWIRE_KEYS_FILE``
(``hotwire_api.keys``: the edits ``hotwire keys`` makes, under the file's lock, written atomically) or a fleet's
(``HOTWIRE_FLEET_KEYS``, ``hotwire_api.fleet.key_ring``). The operator's admins (keys of no tenant) manage every key;
a tenant's admins only their tenant's, and another tenant's key is to them as a name nobody has. Each edit takes
effect at once in the API server process that made it, within ``json_file.LOOK_S`` (50 ms) in the other processes
reading the keys file, and on a fleet's other replicas once they poll; it goes into the audit trail under the
caller's key name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import pydantic
from fastapi import Request, Response

from hotwire_api.auth import caller_name, record_key_changes, require, tenancy
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.key_ring import FleetKeys
from hotwire_api.keys import NAME_PATTERN, KeyRing, KeysFileError, Role
from hotwire_api.steer_router import error_doc, steer_router
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import TENANT_RE

__all__ = ["AddKey", "KeyInfo", "KeyList", "NewKey", "router"]

T = TypeVar("T")


class KeyInfo(pydantic.BaseModel):
    name: str
    role: Role
    tenant: str | None = pydantic.Field(default=None, description="the tenant the key belongs to; none: an "
                                        "operator's key")
    created: str = pydantic.Field(description="when the key was made (UTC, ISO 8601)")


class KeyList(pydantic.BaseModel):
    file: str = pydantic.Field(description="where the keys are kept: the keys file (HOTWIRE_KEYS_FILE), or `redis` "
                               "(HOTWIRE_FLEET_KEYS)")
    keys: list[KeyInfo] = pydantic.Field(description="its keys, without their hashes (HOTWIRE_API_KEY, an admin key "
                                         "too where set, is not among them)")


class NewKey(KeyInfo):
    key: str = pydantic.Field(description="the key itself: shown only in this answer, kept only as its hash")


class AddKey(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(pattern=NAME_PATTERN, description="who will hold the key: named in logs, errors and "
                               "the audit trail")
    role: Role = pydantic.Field(description="read: slots and fleet; steer: also vectors and steering; admin: "
                                "everything")
    tenant: str | None = pydantic.Field(default=None, pattern=f"^{TENANT_RE.pattern}$",
                                        description="the tenant the key belongs to (its vectors and the shared "
                                        "ones); none: an operator's key")


router = steer_router("`keys_off`: the server has no HOTWIRE_KEYS_FILE; `keys_unavailable`: the file cannot be "
                      "read or is not valid.")

_STATUS = {ErrorCode.EXISTS: 409, ErrorCode.UNKNOWN_KEY: 404, ErrorCode.BAD_REQUEST: 400, ErrorCode.LAST_ADMIN: 409,
           ErrorCode.KEYS_UNAVAILABLE: 503}


def _ring(request: Request) -> KeyRing | FleetKeys:
    ring = request.app.state.hotwire_access.ring
    if ring is None:
        raise HotwireError(503, ErrorCode.KEYS_OFF, "this server has no keys file: start it with HOTWIRE_KEYS_FILE "
                           "(hotwire keys add NAME --role admin --file F makes one), or HOTWIRE_FLEET_KEYS=1 in a "
                           "fleet, to manage keys over HTTP")
    return ring


def _tenant(request: Request) -> str | None:
    """The caller's tenant: the only one whose keys it manages (None: the operator's, every key)."""
    return tenancy(request).tenant


async def _edit(request: Request, name: str, edit: Callable[[KeyRing | FleetKeys], Awaitable[T]]) -> T:
    """Make ``edit`` to the keys in the caller's name."""
    try:
        result = await edit(_ring(request))
    except KeysFileError as exc:
        field = None if exc.code is ErrorCode.KEYS_UNAVAILABLE else "name"
        message = str(exc)
        if exc.code is ErrorCode.EXISTS and _tenant(request) is not None:
            # Key names are one namespace: say no more than that this one is taken (not where, not whose).
            message = f"a key named {name!r} exists: choose another name (key names are one namespace for every tenant)"
        raise HotwireError(_STATUS[exc.code], exc.code, message, field) from None
    await record_key_changes(request.app)
    return result


async def _new(ring: KeyRing | FleetKeys, name: str, secret: str) -> NewKey:
    """``name``'s key as the edit that made ``secret`` wrote it (read again: only its date may have moved)."""
    key = next((key for key in await ring.keys() if key.name == name), None)
    if key is None:  # revoked by another edit in the moment since
        raise KeysFileError(f"the key {name!r} was revoked as it was made: make it again",
                            ErrorCode.UNKNOWN_KEY)
    return NewKey(name=key.name, role=key.role, tenant=key.tenant, created=key.created, key=secret)


@router.get("/keys", response_model=KeyList, summary="The keys of the keys file: names, roles, dates",
            dependencies=[require(Role.ADMIN)])
async def list_keys(request: Request) -> KeyList:
    ring, tenant = _ring(request), _tenant(request)
    try:
        keys = await ring.keys()
    except KeysFileError as exc:
        raise HotwireError(503, ErrorCode.KEYS_UNAVAILABLE, str(exc)) from None
    return KeyList(file="the keys file" if tenant and ring.kept != "redis" else ring.kept,
                   keys=[KeyInfo(name=k.name, role=k.role, tenant=k.tenant, created=k.created)
                         for k in keys if tenant is None or k.tenant == tenant])


@router.post("/keys", status_code=201, response_model=NewKey, summary="Add a key (shown once, in this answer)",
             responses={400: error_doc("`bad_request`: a name or role that is not one."),
                        403: error_doc("`forbidden`: a tenant's admin asked for a key of another tenant (a "
                                       "body without a tenant makes one of the caller's)."),
                        409: error_doc("`exists`: a key has this name; rotate it, or revoke it first.")},
             dependencies=[require(Role.ADMIN)])
async def create_key(body: AddKey, request: Request) -> NewKey:
    who, tenant = caller_name(request), _tenant(request) or body.tenant
    if tenant != body.tenant and body.tenant is not None:
        raise HotwireError(403, ErrorCode.FORBIDDEN, f"the key {who!r} belongs to tenant {tenant!r} and makes keys of "
                           f"that tenant only: leave out tenant, or ask the operator for a key of {body.tenant!r}",
                           "tenant")

    async def add(ring: KeyRing | FleetKeys) -> NewKey:
        return await _new(ring, body.name, await ring.add(body.name, body.role, tenant, who))

    return await _edit(request, body.name, add)


@router.post("/keys/{name}/rotate", response_model=NewKey,
             summary="Replace a key with a new one of the same role; the old one stops working at once in this API "
                     "server process, in the others within 50 ms (a fleet's replicas: when they poll)",
             responses={404: error_doc("`unknown_key`: no key has this name.")},
             dependencies=[require(Role.ADMIN)])
async def rotate(name: str, request: Request) -> NewKey:
    who, tenant = caller_name(request), _tenant(request)

    async def rotate_it(ring: KeyRing | FleetKeys) -> NewKey:
        return await _new(ring, name, await ring.rotate(name, who, tenant))

    return await _edit(request, name, rotate_it)


@router.delete("/keys/{name}", status_code=204, response_class=Response,
               summary="Revoke a key: it stops working at once in this API server process, in the others within "
                       "50 ms (a fleet's replicas: when they poll)",
               responses={404: error_doc("`unknown_key`: no key has this name."),
                          409: error_doc("`last_admin`: the last operator admin key, on a server without "
                                      "HOTWIRE_API_KEY; add another admin key first.")},
               dependencies=[require(Role.ADMIN)])
async def revoke(name: str, request: Request) -> Response:
    keep, who, tenant = not request.app.state.hotwire_settings.api_key, caller_name(request), _tenant(request)
    await _edit(request, name, lambda ring: ring.revoke(name, keep, who, tenant))
    return Response(status_code=204)
