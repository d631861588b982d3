"""API keys with roles, kept in a file (``HOTWIRE_KEYS_FILE``): the file's format, the edits ``hotwire keys`` makes
to it, and :class:`KeyRing`, which the server asks who a presented key belongs to.

The file is JSON, ``{"keys": [{"name", "role", "tenant"?, "sha256", "created"}]}``: a key's SHA-256, never the key.
A key with a tenant sees that tenant's vectors and the shared ones (``hotwire_api.tenancy``). Keys are
made here (``hw_`` and 32 random bytes), so an unsalted hash is as hard to reverse as the key is to guess. Edits
write a new file beside the old one and rename it over (mode 0600): a server reading the file never sees half of
one. The server reads the file again whenever it changes (its size, modification time or inode), so keys are added,
rotated and revoked without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pydantic

from hotwire_api.json_file import LOOK_S, locked, stamp, write_atomic
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import TENANT_RE

__all__ = ["Key", "KeyRing", "KeysFileError", "Role", "add_key", "find_key", "hash_key", "is_operator_admin", "made_key",
           "read_keys", "revoke_key", "rotate_key"]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class Role(StrEnum):
    """What a key may do; each role may do what the ones before it may."""

    READ = "read"  # the slot bank and the fleet view
    STEER = "steer"  # list and fetch vectors, and steer or read requests with them
    ADMIN = "admin"  # register, replace, delete and extract vectors

    def allows(self, needed: Role) -> bool:
        return _RANK[self] >= _RANK[needed]


_RANK = {role: rank for rank, role in enumerate(Role)}


class Key(pydantic.BaseModel):
    """One entry of the keys file."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = pydantic.Field(pattern=NAME_PATTERN, description="who holds the key: in logs, errors and the audit")
    role: Role
    tenant: str | None = pydantic.Field(default=None, pattern=f"^{TENANT_RE.pattern}$",
                                        description="the tenant whose vectors the key uses and manages; none: the "
                                        "operator's key, which sees every tenant's and manages every key and the monitors")
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$", description="the key's SHA-256, lowercase hex")
    created: str = pydantic.Field(default="", description="when the key was made (UTC, ISO 8601)")


class _KeysFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    keys: list[Key]

    @pydantic.field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[Key]) -> list[Key]:
        for field in ("name", "sha256"):
            seen: set[str] = set()
            for key in keys:
                value = getattr(key, field)
                if value in seen:
                    raise ValueError(f"two keys have the same {field} {value!r}" if field == "name"
                                     else f"two keys ({key.name!r} and another) are the same key")
                seen.add(value)
        return keys


class KeysFileError(ValueError):
    """The keys file cannot be read or is not a keys file (``code`` ``keys_unavailable``), or an edit cannot be
    made: the name is taken (``exists``), not there (``unknown_key``), not a name (``bad_request``), or the key is
    the file's last admin key and may not go (``last_admin``); the message says which."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.KEYS_UNAVAILABLE):
        super().__init__(message)
        self.code = code


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def read_keys(path: str | os.PathLike) -> list[Key]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise KeysFileError(f"the keys file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return _KeysFile.model_validate_json(text).keys
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise KeysFileError(f"the keys file {path} is not valid: {where + ': ' if where else ''}{first['msg']} "
                            "(hotwire keys add/rotate/revoke write it)") from None


def _write(path: Path, keys: list[Key]) -> None:
    write_atomic(path, json.dumps({"keys": [key.model_dump(mode="json") for key in keys]}, indent=2) + "\n")


def _edit(path: str | os.PathLike, name: str, role: Role | None, create: bool, tenant: str | None = None,
          within: str | None = None) -> str:
    """Give ``name`` a new key (of ``role`` and ``tenant``, or of its current ones) and return it."""
    path = Path(path)
    with locked(path):
        keys = read_keys(path) if path.exists() else []
        current = next((key for key in keys if key.name == name), None)
        if create and current is not None:
            raise KeysFileError(f"a key named {name!r} is in {path} already: rotate it, or revoke it first", ErrorCode.EXISTS)
        if not create:
            current = _named(keys, name, path, within)
        secret, new = made_key(name, role or current.role, tenant if create else current.tenant)
        _write(path, [new if key.name == name else key for key in keys] + ([new] if create else []))
    return secret


def _named(keys: list[Key], name: str, path: Path, within: str | None) -> Key:
    """The key named ``name``; with ``within``, only if it is that tenant's: a tenant's admin is told of another's
    key exactly what it is told of a name nobody has."""
    key = next((key for key in keys if key.name == name), None)
    if key is None or (within is not None and key.tenant != within):
        raise KeysFileError(f"no key named {name!r} in {'the keys file' if within else path}", ErrorCode.UNKNOWN_KEY)
    return key


def made_key(name: str, role: Role, tenant: str | None) -> tuple[str, Key]:
    """A new key for ``name`` of ``role`` and ``tenant``: the key itself and its entry; ``bad_request`` for a name
    or tenant that is not one."""
    secret = "hw_" + secrets.token_urlsafe(32)
    try:
        return secret, Key(name=name, role=role, tenant=tenant, sha256=hash_key(secret),
                           created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    except pydantic.ValidationError as exc:
        what = exc.errors()[0]["loc"][0]
        raise KeysFileError(f"key name {name!r}: 1-64 letters, digits, '_', '.' or '-', starting with a letter or "
                            "digit" if what == "name" else f"tenant {tenant!r}: 1-32 letters, digits, '_' or '-', "
                            "starting with a letter or digit", ErrorCode.BAD_REQUEST) from None


def is_operator_admin(key: Key) -> bool:
    """An admin key of no tenant: what manages every key; the last one may not be revoked over HTTP."""
    return key.role is Role.ADMIN and key.tenant is None


def find_key(secret: str | None, keys: tuple[Key, ...]) -> Key | None:
    """The key of ``keys`` that ``secret`` is, if any: its hash is compared with every key's in constant time,
    without an early exit, so the time taken does not say which key matched or how many there are before it."""
    if not secret:
        return None
    digest = hash_key(secret).encode()
    found = None
    for key in keys:
        if hmac.compare_digest(digest, key.sha256.encode()):
            found = key
    return found


def add_key(path: str | os.PathLike, name: str, role: Role, tenant: str | None = None) -> str:
    """Add a key named ``name`` with ``role``, of ``tenant`` (None: an operator's key), creating the file if need
    be; returns the key, shown only now."""
    return _edit(path, name, role, create=True, tenant=tenant)


def rotate_key(path: str | os.PathLike, name: str, within: str | None = None) -> str:
    """Replace ``name``'s key with a new one of the same role: the old one stops working once the server reads the
    file (within ``LOOK_S``). For a rotation without a moment in which neither works, add a second key, move the
    clients to it, then revoke the first. ``within``: only a key of this tenant (another's is unknown)."""
    return _edit(path, name, None, create=False, within=within)


def revoke_key(path: str | os.PathLike, name: str, keep_an_admin: bool = False, within: str | None = None) -> None:
    """Remove ``name``'s key; with ``keep_an_admin``, refuse to remove the file's last admin key. ``within``: only a
    key of this tenant (another's is unknown)."""
    path = Path(path)
    with locked(path):
        keys = read_keys(path)
        key = _named(keys, name, path, within)
        if keep_an_admin and is_operator_admin(key) and sum(map(is_operator_admin, keys)) == 1:
            raise KeysFileError(f"{name!r} is the last admin key in {path}: add another admin key first (without "
                                "one, and without HOTWIRE_API_KEY, nobody could manage keys or vectors over HTTP)",
                                ErrorCode.LAST_ADMIN)
        _write(path, [k for k in keys if k.name != name])


@dataclass(frozen=True)
class _State:
    stamp: tuple[int, int, int]
    keys: tuple[Key, ...]
    error: str | None


class KeyRing:
    """The keys that open the server: the file's (read again when it changes) and ``extra``, keys given otherwise
    (``HOTWIRE_API_KEY``: an admin key that no edit of the file revokes). A file that cannot be read or is not
    valid opens nothing until it is fixed (:attr:`error` says why); ``extra`` keys still work. :attr:`changes`
    lists the keys each new valid file added, rotated, revoked or gave another role, and who did (the caller's key
    for an edit over HTTP, else ``keys file``: the server cannot know who edited it), for the audit trail."""

    def __init__(self, path: str | os.PathLike, extra: tuple[Key, ...] = ()):
        self.path, self.extra = Path(path), extra
        self._state = _State((-1, -1, -1), (), None)
        self._valid: tuple[Key, ...] | None = None  # the keys of the last valid read: what an edit is compared with
        self.changes: list[tuple[str, str, str]] = []  # (action, key name, who) since the caller last took them
        self._authors: dict[str, str] = {}  # key name -> who is editing it over HTTP (else: "keys file")
        self._look_at = 0.0  # time.monotonic() from which identify looks at the file again
        self.refresh()
        if self.error is not None:
            raise KeysFileError(self.error)

    @contextlib.contextmanager
    def editing(self, name: str, who: str) -> Iterator[None]:
        """Attribute the change to ``name`` that the enclosed edit makes to ``who`` (and note it now)."""
        self._authors[name] = who
        try:
            yield
        finally:
            self.refresh()
            self._authors.pop(name, None)

    def _note_changes(self, keys: tuple[Key, ...]) -> None:
        if self._valid is None:
            self._valid = keys
            return
        before, after = {k.name: k for k in self._valid}, {k.name: k for k in keys}
        found = []
        for name, key in after.items():
            old = before.get(name)
            if old is None:
                found.append(("key_added", name))
            else:
                if old.sha256 != key.sha256:
                    found.append(("key_rotated", name))
                if old.role != key.role:
                    found.append(("key_role_changed", name))
                if old.tenant != key.tenant:
                    found.append(("key_tenant_changed", name))
        found += [("key_revoked", name) for name in before if name not in after]
        self.changes += [(action, name, self._authors.get(name, "keys file")) for action, name in found]
        self._valid = keys

    def refresh(self) -> None:
        """Read the file again if it changed (its own edits call this: in force at once)."""
        self._look_at = time.monotonic() + LOOK_S
        try:
            now = stamp(self.path)
        except OSError as exc:
            self._state = _State((-1, -1, -1), (), f"the keys file {self.path} cannot be read ({exc.strerror})")
            return
        if now != self._state.stamp:
            try:
                self._state = _State(now, tuple(read_keys(self.path)), None)
            except KeysFileError as exc:
                self._state = _State(now, (), str(exc))
                return
            self._note_changes(self._state.keys)

    @property
    def error(self) -> str | None:
        return self._state.error

    def identify(self, secret: str | None) -> Key | None:
        """The key ``secret`` is, if any (:func:`find_key`); another process's edit of the file is in force within
        ``LOOK_S``."""
        if time.monotonic() >= self._look_at:
            self.refresh()
        return find_key(secret, (*self.extra, *self._state.keys))

    # The edits of /steer/keys (``hotwire_api.key_routes``), the same for the fleet's keys (``fleet.key_ring``).

    @property
    def kept(self) -> str:
        return str(self.path)

    async def keys(self) -> list[Key]:
        return await asyncio.to_thread(read_keys, self.path)

    async def add(self, name: str, role: Role, tenant: str | None, who: str) -> str:
        with self.editing(name, who):
            return await asyncio.to_thread(add_key, self.path, name, role, tenant)

    async def rotate(self, name: str, who: str, within: str | None = None) -> str:
        with self.editing(name, who):
            return await asyncio.to_thread(rotate_key, self.path, name, within)

    async def revoke(self, name: str, keep_an_admin: bool, who: str, within: str | None = None) -> None:
        with self.editing(name, who):
            await asyncio.to_thread(revoke_key, self.path, name, keep_an_admin, within)
