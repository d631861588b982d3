"""Every Redis command hotwire sends (``redis.asyncio``): blobs and their collection, the atomic register and
delete scripts, the current versions, the event stream, heartbeats. A Redis that does not answer raises :class:`Unavailable`,
a 503 ``registry_unavailable`` naming the registry (password masked); what the caller does then is its business
(``replica``). Key layout: ``config.Keys``."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hotwire_api.errors import HotwireError
from hotwire_api.fleet.config import FleetConfig, Keys, redacted

__all__ = ["Event", "RedisRegistry", "Unavailable"]

# Lua for the scripts below: the parts of a `current` value ("<version>:<sha256>"), and the record of a version
# that stopped being current at `at` (KEYS `retired`, `retired_since`: see config.Keys).
_SHA_OF = """
local function sha_of(value) return string.sub(value, string.find(value, ':', 1, true) + 1) end
local function version_of(value) return string.sub(value, 1, string.find(value, ':', 1, true) - 1) end
local function retire(retired, since, id, value, at)
  local member = id .. '@' .. version_of(value)
  redis.call('HSET', retired, member, sha_of(value) .. ':' .. at)
  redis.call('ZADD', since, at, member)
end
"""

# KEYS: current, last_version, events, blob, orphans, retired, retired_since, op. ARGV: id, sha256, replace (0|1),
# maxlen, created_at, floor (the newest version the caller knows of: after Redis lost its keys, versions go on from there
# instead of repeating), op_ttl. Returns {status, version, previous "<version>:<sha>" or ""}: 201/200 registered, 409 taken,
# 424 blob missing. The blob a version stops using (replaced, or the loser's of a 409) becomes an orphan; the
# registered one is not. A replaced version is recorded as retired. Runs once per operation (_once).
_REGISTER = _SHA_OF + """
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous and ARGV[3] ~= '1' then
  if sha_of(previous) ~= ARGV[2] and not redis.call('ZSCORE', KEYS[5], ARGV[2]) then
    redis.call('ZADD', KEYS[5], ARGV[5], ARGV[2])
  end
  return {409, 0, previous}
end
if redis.call('EXISTS', KEYS[4]) == 0 then return {424, 0, ''} end
local version = math.max(tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0'), tonumber(ARGV[6])) + 1
redis.call('HSET', KEYS[2], ARGV[1], version)
redis.call('HSET', KEYS[1], ARGV[1], version .. ':' .. ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
if previous and sha_of(previous) ~= ARGV[2] then redis.call('ZADD', KEYS[5], ARGV[5], sha_of(previous)) end
if previous then retire(KEYS[6], KEYS[7], ARGV[1], previous, ARGV[5]) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'op', 'register', 'id', ARGV[1],
           'version', version, 'sha256', ARGV[2], 'at', ARGV[5])
if previous then return {200, version, previous} end
return {201, version, ''}
"""

# KEYS: current, events, orphans, retired, retired_since, op. ARGV: id, maxlen, at, op_ttl. Returns {status,
# "<version>:<sha>"}: 200 deleted (and recorded as retired), 404 unknown. Runs once per operation (_once).
_DELETE = _SHA_OF + """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return {404, ''} end
redis.call('HDEL', KEYS[1], ARGV[1])
local sha = sha_of(current)
redis.call('ZADD', KEYS[3], ARGV[3], sha)
retire(KEYS[4], KEYS[5], ARGV[1], current, ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'delete', 'id', ARGV[1],
           'version', version_of(current), 'sha256', sha, 'at', ARGV[3])
return {200, current}
"""


def _once(script: str, op_key: int, ttl_arg: int) -> str:
    """``script`` run at most once per operation: its answer is kept under KEYS[op_key] (a token the caller draws
    per operation) for ARGV[ttl_arg] seconds, and the same operation sent again gets that answer back instead of
    running twice. A caller whose command timed out cannot know whether it ran; with this it may send it again."""
    return f"""
local done = redis.call('GET', KEYS[{op_key}])
if done then return cjson.decode(done) end
local function run()
{script}
end
local answer = run()
redis.call('SET', KEYS[{op_key}], cjson.encode(answer), 'EX', ARGV[{ttl_arg}])
return answer
"""


_REGISTER_ONCE = _once(_REGISTER, 8, 7)
_DELETE_ONCE = _once(_DELETE, 6, 4)
OP_TTL_S = 300  # how long Redis remembers an operation's answer: far beyond a retry's last attempt
RETRY_PAUSES_S = (0.1, 0.3)  # a register or delete that timed out (or lost its connection) is sent again after these

# KEYS: current, last_version, events, blob, orphans, retired, retired_since. ARGV: id, version, sha256, maxlen, at.
# Puts back a version a replica holds into a registry that lost its data: it becomes current unless the registry
# knows that version of the id or a newer one (another replica put back a newer one, or the id was registered or
# deleted since); an older one put back before is replaced. Returns 1 put back, 0 not, 424 blob missing.
_SEED = _SHA_OF + """
if redis.call('EXISTS', KEYS[4]) == 0 then return 424 end
if tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') >= tonumber(ARGV[2]) then return 0 end
local previous = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. ARGV[3])
redis.call('ZREM', KEYS[5], ARGV[3])
if previous then
  if sha_of(previous) ~= ARGV[3] then redis.call('ZADD', KEYS[5], ARGV[5], sha_of(previous)) end
  retire(KEYS[6], KEYS[7], ARGV[1], previous, ARGV[5])
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'op', 'register', 'id', ARGV[1],
           'version', ARGV[2], 'sha256', ARGV[3], 'at', ARGV[5])
return 1
"""

# KEYS: retired, retired_since. ARGV: cutoff. Forgets the versions retired before the cutoff; returns how many.
_FORGET_RETIRED = """
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 1000)
for _, member in ipairs(old) do redis.call('HDEL', KEYS[1], member) end
if #old > 0 then redis.call('ZREM', KEYS[2], unpack(old)) end
return #old
"""

# KEYS: blob, orphans. ARGV: bytes, sha256. Stores a blob once and takes it off the orphans (a registration is about
# to use it), atomically, so a collection running meanwhile cannot delete it.
_PUT_BLOB = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('ZREM', KEYS[2], ARGV[2])
"""

# KEYS: current, orphans, blob of each candidate. ARGV: cutoff, then each candidate's sha256. Deletes the blobs of
# candidates still orphaned since before the cutoff that no id's current version uses; returns how many.
_COLLECT = _SHA_OF + """
local used = {}
for _, value in ipairs(redis.call('HVALS', KEYS[1])) do used[sha_of(value)] = true end
local deleted = 0
for i = 2, #ARGV do
  local sha = ARGV[i]
  local since = redis.call('ZSCORE', KEYS[2], sha)
  if since and tonumber(since) <= tonumber(ARGV[1]) then
    redis.call('ZREM', KEYS[2], sha)
    if not used[sha] then deleted = deleted + redis.call('DEL', KEYS[i + 1]) end
  end
end
return deleted
"""


class Unavailable(HotwireError):
    """The registry did not answer: 503 ``registry_unavailable``. ``unsure``: a change was sent but no answer
    came back, so whether Redis made it is unknown."""

    def __init__(self, url: str, exc: BaseException, unsure: bool = False):
        what = ("this change was sent but not answered, so it may have been made: GET /steer/vectors/<id> shows "
                "the registry's version once it answers" if unsure else
                "vectors cannot be registered or deleted until it answers again")  # fmt: skip
        super().__init__(
            503, "registry_unavailable",
            f"the vector registry at {redacted(url)} is unreachable ({type(exc).__name__}: {_clean(str(exc), url)}); "
            f"{what}; every replica keeps serving the vectors it holds",
        )


def _clean(message: str, url: str) -> str:
    """An error message of redis-py with the URL's password, should it appear, masked."""
    from urllib.parse import urlsplit

    password = urlsplit(url).password
    return message.replace(password, "***") if password else message


@dataclass(frozen=True)
class Event:
    """One entry of the stream: ``op`` is ``register`` or ``delete``."""

    stream_id: str
    op: str
    vector_id: str
    version: int
    sha256: str

    @classmethod
    def parse(cls, stream_id: Any, fields: Mapping[Any, Any]) -> Event:
        f = {_str(k): _str(v) for k, v in fields.items()}
        return cls(_str(stream_id), f["op"], f["id"], int(f["version"]), f["sha256"])


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_current(value: Any) -> tuple[int, str]:
    version, _, sha = _str(value).partition(":")
    return int(version), sha


def _parse_retired(value: Any) -> tuple[str, float]:
    sha, _, at = _str(value).partition(":")
    return sha, float(at)


def _id_tuple(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class RedisRegistry:
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
        self._response_error = redis_errors.ResponseError
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
        self._register = self._redis.register_script(_REGISTER_ONCE)
        self._delete = self._redis.register_script(_DELETE_ONCE)
        self._put_blob = self._redis.register_script(_PUT_BLOB)
        self._collect = self._redis.register_script(_COLLECT)
        self._seed = self._redis.register_script(_SEED)
        self._forget_retired = self._redis.register_script(_FORGET_RETIRED)

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
        every copy alike. Unavailable when no copy was answered (``unsure`` when one may have reached Redis)."""
        keys = [*keys, self.keys.op(secrets.token_hex(16))]
        args = [*args, OP_TTL_S]
        sent = False  # a copy may have reached Redis (redis-py's connect failures say "connecting to")
        for pause in (*RETRY_PAUSES_S, None):
            try:
                return await script(keys=keys, args=args)
            except self._no_retry as exc:
                raise Unavailable(self.url, exc) from exc
            except self._no_answer as exc:
                sent = sent or "connecting to" not in str(exc)
                if pause is None:
                    raise Unavailable(self.url, exc, unsure=sent) from exc
            await asyncio.sleep(pause)

    async def ping(self) -> None:
        await self._do(self._redis.ping())

    async def epoch(self) -> str:
        """The registry's epoch token, set now if Redis has none (a new, or wiped, registry)."""
        await self._do(self._redis.set(self.keys.epoch, secrets.token_hex(8), nx=True))
        return _str(await self._do(self._redis.get(self.keys.epoch)))

    # -- vectors -----------------------------------------------------------------------------------------------

    async def put_blob(self, sha256: str, blob: bytes) -> None:
        """Store a blob under its content hash (once: the same hash is the same bytes); it is no orphan now."""
        await self._do(self._put_blob(keys=[self.keys.blob(sha256), self.keys.orphans], args=[blob, sha256]))

    async def get_blob(self, sha256: str) -> bytes | None:
        return await self._do(self._redis.get(self.keys.blob(sha256)))

    async def register(
        self, vector_id: str, sha256: str, replace: bool, floor: int = 0
    ) -> tuple[int, int, tuple[int, str] | None]:
        """Make ``sha256`` (its blob stored already) the next version of ``vector_id``, atomically: returns
        (201 created | 200 replaced | 409 taken, the new version (0 on 409), the version it replaced or holds).
        The new version is above ``floor`` too."""
        k = self.keys
        status, version, previous = await self._once_per_operation(
            self._register,
            keys=[k.current, k.last_version, k.events, k.blob(sha256), k.orphans, k.retired, k.retired_since],
            args=[vector_id, sha256, "1" if replace else "0", self.config.stream_maxlen, f"{time.time():.6f}", floor],
        )
        if int(status) == 424:
            raise HotwireError(503, "registry_unavailable",
                               f"the vector registry at {self.display_url} lost the vector's blob before it was "
                               "registered (is Redis evicting keys? hotwire needs maxmemory-policy noeviction); retry")
        return int(status), int(version), (_parse_current(previous) if previous else None)

    async def delete(self, vector_id: str) -> tuple[int, str] | None:
        """Delete the current version of ``vector_id`` atomically; returns (version, sha256), None if unknown."""
        k = self.keys
        status, current = await self._once_per_operation(
            self._delete,
            keys=[k.current, k.events, k.orphans, k.retired, k.retired_since],
            args=[vector_id, self.config.stream_maxlen, f"{time.time():.6f}"],
        )
        return _parse_current(current) if int(status) == 200 else None

    async def seed(self, vector_id: str, version: int, sha256: str) -> bool:
        """Put back ``vector_id@version`` (its blob stored already) into a registry that lost its data; returns
        whether it became current (False: the registry knows that version or a newer one, or a deletion)."""
        k = self.keys
        answer = int(await self._do(self._seed(
            keys=[k.current, k.last_version, k.events, k.blob(sha256), k.orphans, k.retired, k.retired_since],
            args=[vector_id, version, sha256, self.config.stream_maxlen, f"{time.time():.6f}"],
        )))
        if answer == 424:
            raise HotwireError(503, "registry_unavailable", f"the vector registry at {self.display_url} lost a blob "
                               "as it was written (is Redis evicting keys? hotwire needs maxmemory-policy noeviction)")
        return answer == 1

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

    # -- the event stream --------------------------------------------------------------------------------------

    async def last_event_id(self) -> str:
        """The id of the stream's newest entry ("0-0" when empty): reading after it misses nothing newer."""
        entries = await self._do(self._redis.xrevrange(self.keys.events, count=1))
        return _str(entries[0][0]) if entries else "0-0"

    async def covers(self, after: str) -> bool:
        """Whether the stream still holds every entry after ``after`` (the last entry the caller read): it does
        while that entry is still there, since trimming removes the oldest entries first. When it is gone the
        answer is no even if nothing after it was trimmed: the caller resyncs, which is always correct."""
        try:
            info = await self._do(self._redis.xinfo_stream(self.keys.events))
        except self._response_error:  # no stream: nothing was ever registered, or Redis lost it
            return after == "0-0"
        seen = _id_tuple(after)
        first = info.get("first-entry")
        if not first:
            return _id_tuple(_str(info.get("last-generated-id", "0-0"))) <= seen
        return _id_tuple(_str(first[0])) <= seen

    async def read_events(self, after: str, block_ms: int, count: int = 256) -> list[Event]:
        """The entries after ``after``, waiting up to ``block_ms`` for one (an empty list when none came)."""
        answer = await self._do(self._reader.xread({self.keys.events: after}, count=count, block=block_ms))
        return [Event.parse(i, f) for _, entries in answer or [] for i, f in entries]

    # -- heartbeats --------------------------------------------------------------------------------------------

    async def heartbeat(self, replica_id: str, state: dict[str, Any], ttl_s: float) -> None:
        await self._do(self._redis.set(self.keys.replica(replica_id), json.dumps(state), px=max(1, int(ttl_s * 1000))))

    async def replica_state(self, replica_id: str) -> dict[str, Any] | None:
        """One replica's last heartbeat, or None when it has expired."""
        value = await self._do(self._redis.get(self.keys.replica(replica_id)))
        return json.loads(value) if value is not None else None

    async def replicas(self) -> list[dict[str, Any]]:
        """The heartbeats that have not expired."""
        names = [k async for k in self._scan(self.keys.replica_pattern)]
        if not names:
            return []
        values = await self._do(self._redis.mget(names))
        return [json.loads(v) for v in values if v is not None]

    async def _scan(self, pattern: str):
        try:
            async for key in self._redis.scan_iter(match=pattern, count=500):
                yield key
        except self._errors as exc:
            raise Unavailable(self.url, exc) from exc
