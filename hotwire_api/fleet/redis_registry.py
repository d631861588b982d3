"""Every Redis command hotwire sends (``redis.asyncio``): blobs and their collection, the atomic register and
delete scripts (``lua``), the restart gate and the repair's reconcile, the current versions, the event stream,
heartbeats, monitors; the fleet's API keys and tenants' registrations come from ``access_commands``, the version
numbering's floors and the count of an earlier hotwire's deleted ids from ``numbering_commands``. A Redis that
does not answer raises :class:`Unavailable`, a 503 ``registry_unavailable`` naming the registry (secrets masked); a
register or delete refused while the gate is closed raises :class:`Restarting`; what the caller does then is its
business (``replica``, ``repair``). Key layout: ``config.Keys``."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from hotwire_api.audit import AuditEntry, Author
from hotwire_api.errors import HotwireError
from hotwire_api.fleet import lua
from hotwire_api.fleet.access_commands import AccessCommands
from hotwire_api.fleet.config import FleetConfig, Keys, redacted, scrubbed
from hotwire_api.fleet.numbering_commands import NumberingCommands
from hotwire_api.fleet.records import Event, Gate, text as _str
from hotwire_core.error_codes import ErrorCode

__all__ = ["Event", "Gate", "RedisRegistry", "Restarting", "Unavailable"]

logger = logging.getLogger(__name__)

OP_TTL_S = 300  # how long Redis remembers an operation's answer: far beyond a retry's last attempt
RETRY_PAUSES_S = (0.1, 0.3)  # a register or delete that timed out (or lost its connection) is sent again after these
GATE_WAIT_S = 5.0  # how long a register or delete refused by the closed restart gate waits for it before a 503
GATE_POLL_S = 0.1


class Unavailable(HotwireError):
    """The registry did not answer: 503 ``registry_unavailable``. ``unsure``: a change was sent but no answer
    came back, so whether Redis made it is unknown."""

    def __init__(self, url: str, exc: BaseException, unsure: bool = False):
        what = ("this change was sent but not answered, so it may have been made: GET /steer/vectors/<id> shows "
                "the registry's version once it answers" if unsure else
                "vectors cannot be registered or deleted until it answers again")  # fmt: skip
        super().__init__(
            503, ErrorCode.REGISTRY_UNAVAILABLE,
            f"the vector registry at {redacted(url)} is unreachable ({type(exc).__name__}: {scrubbed(str(exc), url)}); "
            f"{what}; every replica keeps serving the vectors it holds",
        )


class Restarting(HotwireError):
    """A register or delete refused because Redis restarted (or lost hotwire's keys) and the replicas have not
    yet put back what it may have lost (``repair``): 503 ``registry_unavailable`` with ``Retry-After``."""

    RETRY_AFTER_S = 2

    def __init__(self, url: str):
        super().__init__(
            503, ErrorCode.REGISTRY_UNAVAILABLE,
            f"the vector registry at {redacted(url)} restarted (or lost hotwire's keys) and the replicas are putting "
            "back what it may have lost; nothing was changed: retry in a few seconds",
        )

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Retry-After": str(self.RETRY_AFTER_S)}


def _parse_current(value: Any) -> tuple[int, str]:
    version, _, sha = _str(value).partition(":")
    return int(version), sha


def _parse_heartbeat(value: Any) -> Any:
    """A heartbeat's JSON, or None for a value that is not JSON (not hotwire's: skipped)."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


def _parse_retired(value: Any) -> tuple[str, float]:
    sha, _, at = _str(value).partition(":")
    return sha, float(at)


class RedisRegistry(AccessCommands, NumberingCommands):
    """hotwire's view of one Redis for one served model. Two connections pools: one for commands, one for the
    follower's blocking ``XREAD`` (so a read that blocks never delays a registration)."""

    def __init__(self, config: FleetConfig, keys: Keys):
        try:
            import redis.asyncio as aioredis
            import redis.exceptions as redis_errors
        except ImportError as exc:
            raise RuntimeError(
                "HOTWIRE_REGISTRY names a Redis but the redis package is not installed: pip install 'hotwire-vllm[fleet]'"
            ) from exc
        self.config, self.keys = config, keys
        self.url = config.url
        self.gate_wait_s = GATE_WAIT_S
        self._errors = (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.AuthenticationError,
                        redis_errors.BusyLoadingError, redis_errors.ReadOnlyError, OSError, TimeoutError)
        # What may leave a command's outcome unknown (sent, no answer): worth sending a once-only script again.
        self._no_answer = (redis_errors.TimeoutError, TimeoutError, redis_errors.ConnectionError, OSError)
        self._no_retry = (redis_errors.AuthenticationError, redis_errors.ReadOnlyError)
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # One retry on a dropped connection (a pooled connection to a Redis that restarted fails once), none on a
        # timeout (redis-py's Retry takes timeouts too unless told otherwise): a command that ran but answered late
        # must not be sent again blindly; register and delete are, by _once_per_operation, as they run once.
        options = dict(socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
                       health_check_interval=0, retry_on_timeout=False,
                       retry=Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,)),
                       retry_on_error=[redis_errors.ConnectionError])
        self._redis = aioredis.from_url(config.url, **options)
        self._reader = aioredis.from_url(config.url, **{**options, "socket_timeout": config.timeout_s + 5, "retry": None})
        script = self._redis.register_script
        self._register, self._delete = script(lua.REGISTER_ONCE), script(lua.DELETE_ONCE)
        self._put_blob, self._collect, self._forget_retired = script(lua.PUT_BLOB), script(lua.COLLECT), script(lua.FORGET_RETIRED)
        self._reconcile, self._gate, self._mark = script(lua.RECONCILE), script(lua.GATE), script(lua.MARK_REPAIRED)
        self._heartbeat, self._edit_monitor = script(lua.HEARTBEAT), script(lua.EDIT_MONITOR)
        self._access_scripts(script)
        self._numbering_scripts(script)

    @property
    def display_url(self) -> str:
        return redacted(self.url)

    async def close(self) -> None:
        for client in (self._redis, self._reader):
            try:
                await asyncio.wait_for(client.aclose(), self.config.timeout_s)
            except Exception:  # closing a pool whose server is gone
                pass

    async def _do(self, coro: Any) -> Any:
        try:
            return await coro
        except self._errors as exc:
            raise Unavailable(self.url, exc) from exc

    async def _once_per_operation(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a change script under a fresh operation token; should no answer come back (a timeout, a dropped
        connection: it may have run), send it again after RETRY_PAUSES_S: Redis runs it at most once and answers
        every copy alike. Unavailable when no copy was answered (``unsure`` when one may have reached Redis).
        Refused while the restart gate is closed: wait up to ``gate_wait_s`` for it to open and send it once more
        (the same token: a copy that ran before a restart Redis came back from intact is not run twice), else
        Restarting."""
        keys = [*keys, self.keys.op(secrets.token_hex(16)), self.keys.boot]
        args = [*args, OP_TTL_S]
        sent = False  # a copy may have reached Redis (redis-py's connect failures say "connecting to")
        pauses, waited = list(RETRY_PAUSES_S), False
        while True:
            try:
                answer = await script(keys=keys, args=args)
            except self._no_retry as exc:
                raise Unavailable(self.url, exc) from exc
            except self._no_answer as exc:
                sent = sent or "connecting to" not in str(exc)
                if not pauses:
                    raise Unavailable(self.url, exc, unsure=sent) from exc
                await asyncio.sleep(pauses.pop(0))
                continue
            if int(answer[0]) != lua.REFUSED:
                return answer
            if waited or not await self._gate_opens():
                raise Restarting(self.url)
            waited = True

    async def _gate_opens(self) -> bool:
        """Look at the restart gate (which opens it when it may) every GATE_POLL_S for up to ``gate_wait_s``."""
        deadline = time.monotonic() + self.gate_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(GATE_POLL_S)
            if (await self.gate()).open:
                return True
        return False

    async def ping(self) -> None:
        await self._do(self._redis.ping())

    # -- the restart gate (lua.GATE; repair) -----------------------------------------------------------------

    async def gate(self, replica_id: str = "") -> Gate:
        """Look at the gate, opening it when it may (whoever looks: a warning names the replicas it did not wait
        for); ``replica_id``: whose repair mark to return."""
        k, c = self.keys, self.config
        answer = [_str(a) for a in await self._do(self._gate(
            keys=[k.boot, k.closing, k.repaired, k.live], args=[c.restart_settle_s, c.restart_limit_s, replica_id]))]
        state = int(answer[0])
        gate = Gate(state != 0, state >= 2, answer[1], answer[2], answer[3], tuple(answer[4:]))
        if gate.opened and gate.missing:
            logger.warning("hotwire: registrations and deletions at the vector registry at %s resume after %.0f s "
                           "without the repair of replica(s) %s: what only they knew may be lost",
                           self.display_url, c.restart_limit_s, ", ".join(gate.missing))
        elif gate.opened:
            logger.info("hotwire: every live replica confirmed the vector registry at %s; registrations and "
                        "deletions resume", self.display_url)
        return gate

    async def mark_repaired(self, replica_id: str, closing: str) -> bool:
        """Mark ``replica_id`` repaired for ``closing``; False when another restart or wipe began meanwhile."""
        k = self.keys
        return bool(await self._do(self._mark(keys=[k.closing, k.repaired], args=[replica_id, closing])))

    async def reconcile(self, vector_id: str, op: str, version: int, sha256: str = "") -> bool:
        """Put back what a replica knows of one id (``lua.RECONCILE``; ``op``: register | delete | floor, the
        blob of a register stored already); returns whether the current versions changed."""
        k = self.keys
        answer = int(await self._do(self._reconcile(
            keys=[k.current, k.last_version, k.events, k.blob(sha256), k.orphans, k.retired, k.retired_since,
                  k.deleted, k.deleted_floor],
            args=[vector_id, op, version, sha256, self.config.stream_maxlen, f"{time.time():.6f}"],
        )))
        if answer == 424:
            raise HotwireError(503, ErrorCode.REGISTRY_UNAVAILABLE, f"the vector registry at {self.display_url} lost a blob "
                               "as it was written (is Redis evicting keys? hotwire needs maxmemory-policy noeviction)")
        return answer == 1

    # -- vectors -----------------------------------------------------------------------------------------------

    async def put_blob(self, sha256: str, blob: bytes) -> None:
        """Store a blob under its content hash (once: the same hash is the same bytes); it is an orphan, as of
        now, until a version uses it."""
        await self._do(self._put_blob(keys=[self.keys.blob(sha256), self.keys.orphans],
                                      args=[blob, sha256, f"{time.time():.6f}"]))

    async def get_blob(self, sha256: str) -> bytes | None:
        return await self._do(self._redis.get(self.keys.blob(sha256)))

    async def register(
        self, vector_id: str, sha256: str, replace: bool, floor: int = 0, by: Author = Author()
    ) -> tuple[int, int, tuple[int, str] | None]:
        """Make ``sha256`` (its blob stored already) the next version of ``vector_id``, atomically, and record it in
        the audit stream as ``by``'s: returns (201 created | 200 replaced | 409 taken, the new version (0 on 409),
        the version it replaced or holds). The new version is above ``floor`` too."""
        k = self.keys
        status, version, previous = await self._once_per_operation(
            self._register,
            keys=[k.current, k.last_version, k.events, k.blob(sha256), k.orphans, k.retired, k.retired_since, k.audit,
                  k.deleted, k.version_floor, k.deleted_floor],
            args=[vector_id, sha256, "1" if replace else "0", self.config.stream_maxlen, f"{time.time():.6f}", floor,
                  by.who, by.replica, by.via],
        )
        if int(status) == 424:
            raise HotwireError(503, ErrorCode.REGISTRY_UNAVAILABLE,
                               f"the vector registry at {self.display_url} lost the vector's blob before it was "
                               "registered (is Redis evicting keys? hotwire needs maxmemory-policy noeviction); retry")
        return int(status), int(version), (_parse_current(previous) if previous else None)

    async def delete(self, vector_id: str, by: Author = Author()) -> tuple[int, str] | None:
        """Delete the current version of ``vector_id`` atomically, recorded in the audit stream as ``by``'s;
        returns (version, sha256), None if unknown."""
        k = self.keys
        status, current = await self._once_per_operation(
            self._delete,
            keys=[k.current, k.events, k.orphans, k.retired, k.retired_since, k.audit, k.last_version, k.deleted,
                  k.version_floor, k.deleted_floor],
            args=[vector_id, self.config.stream_maxlen, f"{time.time():.6f}", by.who, by.replica,
                  self.config.history_kept],
        )
        return _parse_current(current) if int(status) == 200 else None

    async def retired_version(self, vector_id: str, version: int) -> tuple[str, float] | None:
        """(sha256, when) of a version the fleet replaced or deleted within the retention, or None."""
        value = await self._do(self._redis.hget(self.keys.retired, f"{vector_id}@{version}"))
        return _parse_retired(value) if value is not None else None

    async def retired_since(self, since: float) -> dict[tuple[str, int], tuple[str, float]]:
        """Every version retired after ``since`` (wall-clock seconds): (id, version) -> (sha256, when)."""
        members = await self._do(self._redis.zrangebyscore(self.keys.retired_since, f"({since:.6f}", "+inf"))
        if not members:
            return {}
        values = await self._do(self._redis.hmget(self.keys.retired, members))
        out: dict[tuple[str, int], tuple[str, float]] = {}
        for member, value in zip(members, values):
            if value is not None:
                vector_id, _, version = _str(member).rpartition("@")
                out[(vector_id, int(version))] = _parse_retired(value)
        return out

    async def forget_retired(self, before: float) -> int:
        """Forget the versions retired before ``before`` (their retention is over); returns how many."""
        k = self.keys
        return int(await self._do(self._forget_retired(keys=[k.retired, k.retired_since], args=[f"{before:.6f}"])))

    async def collect_blobs(self, grace_s: float, batch: int = 200) -> int:
        """Delete the blobs that no id's current version has used for ``grace_s`` seconds (up to ``batch`` per
        call); returns how many. Any replica may run it at any time: one script decides, atomically."""
        cutoff = time.time() - grace_s
        shas = [_str(s) for s in await self._do(
            self._redis.zrangebyscore(self.keys.orphans, "-inf", cutoff, start=0, num=batch))]
        if not shas:
            return 0
        keys = [self.keys.current, self.keys.orphans, *(self.keys.blob(sha) for sha in shas)]
        return int(await self._do(self._collect(keys=keys, args=[f"{cutoff:.6f}", *shas])))

    async def current_version(self, vector_id: str) -> tuple[int, str] | None:
        """The live version of one id, or None."""
        value = await self._do(self._redis.hget(self.keys.current, vector_id))
        return _parse_current(value) if value is not None else None

    async def current(self) -> dict[str, tuple[int, str]]:
        """Every live vector: id -> (version, sha256)."""
        raw = await self._do(self._redis.hgetall(self.keys.current))
        return {_str(k): _parse_current(v) for k, v in raw.items()}

    # -- the audit stream --------------------------------------------------------------------------------------

    async def record(self, change: AuditEntry) -> None:
        """Append a change made outside the register and delete scripts (a key's) to the audit stream."""
        fields = {k: str(v) for k, v in change.model_dump(exclude_none=True).items()}
        await self._do(self._redis.xadd(self.keys.audit, fields))

    async def audit(self, limit: int) -> list[AuditEntry]:
        """The newest ``limit`` changes, newest first."""
        entries = await self._do(self._redis.xrevrange(self.keys.audit, count=limit))
        return [AuditEntry.model_validate({_str(k): _str(v) for k, v in fields.items() if _str(v) != ""})
                for _, fields in entries]

    # -- monitors (``hotwire_api.monitors``) --------------------------------------------------------------------

    async def monitors(self) -> tuple[int, list[str]]:
        """The count of monitor edits so far, and every monitor's JSON, read together."""
        pipe = self._redis.pipeline(transaction=True).get(self.keys.monitor_edits).hvals(self.keys.monitors)
        edits, docs = await self._do(pipe.execute())
        return int(edits or 0), [_str(doc) for doc in docs]

    async def edit_monitor(self, monitor_id: str, doc: str | None) -> str | None:
        """Put a monitor's JSON under its id (None: delete it); returns the JSON it replaced, if any."""
        keys = [self.keys.monitors, self.keys.monitor_edits]
        old = await self._do(self._edit_monitor(keys=keys, args=[monitor_id, doc or ""]))
        return _str(old) if old is not None else None

    # -- the event stream --------------------------------------------------------------------------------------

    async def last_event_id(self) -> str:
        """The id of the stream's newest entry ("0-0" when empty): reading after it misses nothing newer."""
        entries = await self._do(self._redis.xrevrange(self.keys.events, count=1))
        return _str(entries[0][0]) if entries else "0-0"

    async def covers(self, after: str) -> bool:
        """Whether the stream still holds every entry after ``after`` (the last entry the caller read): it does
        while that entry is still there, since trimming removes the oldest entries first and a Redis that came
        back with older data lacks it. When it is gone the answer is no even if nothing after it was lost: the
        caller resyncs, which is always correct."""
        if after == "0-0":  # nothing read: covered while there is nothing to read
            return not await self._do(self._redis.xlen(self.keys.events))
        return bool(await self._do(self._redis.xrange(self.keys.events, after, after, count=1)))

    async def read_events(self, after: str, block_ms: int, count: int = 256) -> list[Event]:
        """The entries after ``after``, waiting up to ``block_ms`` for one (an empty list when none came)."""
        answer = await self._do(self._reader.xread({self.keys.events: after}, count=count, block=block_ms))
        return [Event.parse(i, f) for _, entries in answer or [] for i, f in entries]

    # -- heartbeats --------------------------------------------------------------------------------------------

    async def heartbeat(self, replica_id: str, state: dict[str, Any], ttl_s: float) -> None:
        """This replica's state, and its place among the live replicas (``Keys.live``), for ``ttl_s``."""
        k = self.keys
        await self._do(self._heartbeat(keys=[k.replica(replica_id), k.live],
                                       args=[json.dumps(state), max(1, int(ttl_s * 1000)), replica_id]))

    async def replica_state(self, replica_id: str) -> dict[str, Any] | None:
        """One replica's last heartbeat, or None when it has expired."""
        value = await self._do(self._redis.get(self.keys.replica(replica_id)))
        beat = _parse_heartbeat(value) if value is not None else None
        return beat if isinstance(beat, dict) else None

    async def replicas(self) -> list[dict[str, Any]]:
        """The heartbeats that have not expired."""
        names = [k async for k in self._scan(self.keys.replica_pattern)]
        if not names:
            return []
        values = await self._do(self._redis.mget(names))
        return [beat for v in values if v is not None and isinstance(beat := _parse_heartbeat(v), dict)]

    async def _scan(self, pattern: str):
        try:
            async for key in self._redis.scan_iter(match=pattern, count=500):
                yield key
        except self._errors as exc:
            raise Unavailable(self.url, exc) from exc
