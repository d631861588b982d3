"""The Lua scripts hotwire runs in Redis (``redis_registry`` sends them): each one atomic, so replicas never see
half a change. Key names: ``config.Keys``; each script's comment lists its KEYS and ARGV in order.

The restart gate: ``boot`` holds the run id of the Redis process whose data every live replica has confirmed.
A Redis that restarted (from an older snapshot, a restored backup, an append-only file that missed its last
second) has another run id, and a wiped one has no ``boot``: register and delete then refuse to change anything
(answer 503) until the replicas have put back what they hold and :data:`GATE` sets ``boot`` again. The scripts
read the run id themselves: a client's word cannot be trusted, as an old snapshot holds an old ``boot``."""

from __future__ import annotations

__all__ = ["COLLECT", "DELETE_ONCE", "FORGET_RETIRED", "GATE", "HEARTBEAT", "MARK_REPAIRED", "PUT_BLOB",
           "EDIT_KEY", "END_TURN", "RAISE_FLOOR", "RECONCILE", "REFUSED", "REGISTER_ONCE", "RESTORE_KEYS",
           "TAKE_REGISTRATION", "TRACK_DELETED"]

REFUSED = 503  # a register's or delete's answer while the gate is closed: nothing was changed

# The parts of a `current` value ("<version>:<sha256>"); the record of a version that stopped being current at
# `at` (KEYS `retired`, `retired_since`); the running Redis process's run id; Redis's clock in seconds.
_HELPERS = """
local function sha_of(value) return string.sub(value, string.find(value, ':', 1, true) + 1) end
local function version_of(value) return string.sub(value, 1, string.find(value, ':', 1, true) - 1) end
local function retire(retired, since, id, value, at)
  local member = id .. '@' .. version_of(value)
  redis.call('HSET', retired, member, sha_of(value) .. ':' .. at)
  redis.call('ZADD', since, at, member)
end
-- The numbering (KEYS `last_version`, `deleted`, `version_floor`, `deleted_floor`, ``config.Keys``): an id left
-- without a current version keeps its last version among the last `kept` such ids, by when (Redis's clock); older
-- ones are forgotten, raising the floor every id's next version goes on above and `deleted_floor`: an id Redis has
-- no last version for, at or below it, may have been deleted and forgotten, so a repair does not put it back.
-- Forgetting happens only while the restart gate is open (a gated DELETE; TRACK_DELETED when it finds the gate open):
-- while a repair runs, a fold could forget a deletion a replica that was away is about to undo, or raise
-- `deleted_floor` above a version Redis lost that a replica is about to put back; a repair only marks ids deleted,
-- and the next deletions forget the backlog. `limit` bounds the ids one call forgets.
local function floor_of(floor) return tonumber(redis.call('GET', floor) or '0') end
local function raise_floor(floor, version)
  if floor_of(floor) < version then redis.call('SET', floor, version) end
end
local function fold_deleted(last, deleted, floor, deleted_floor, kept, limit)
  local excess = math.min(redis.call('ZCARD', deleted) - tonumber(kept), limit)
  if excess <= 0 then return end
  local top = 0
  local oldest = redis.call('ZPOPMIN', deleted, excess)
  for i = 1, #oldest, 2 do
    top = math.max(top, tonumber(redis.call('HGET', last, oldest[i]) or '0'))
    redis.call('HDEL', last, oldest[i])
  end
  raise_floor(floor, top)
  raise_floor(deleted_floor, top)
end
local function mark_deleted(deleted, id)
  local t = redis.call('TIME')
  redis.call('ZADD', deleted, tonumber(t[1]) + tonumber(t[2]) / 1000000, id)
end
local function run_id() return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') end
-- The restart gate is open while `boot` names the running Redis process (GATE opens it).
local function gate_open(boot) return redis.call('GET', boot) == run_id() end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS: current, last_version, events, blob, orphans, retired, retired_since, audit, deleted, version_floor,
# deleted_floor (numbering goes on above both floors, and above a version a repair left alone). ARGV: id, sha256,
# replace (0|1), maxlen, at, floor (the newest version the caller knows of: numbering goes on above it), who,
# replica, via. Returns {status, version, previous "<version>:<sha>" or ""}: 201/200 registered, 409 taken, 424 blob
# missing. The blob the id stops using becomes an orphan, the registered one is not; a replaced version is
# recorded as retired. The audit stream (never trimmed) gets the change in the same step.
_REGISTER = """
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous and ARGV[3] ~= '1' then return {409, 0, previous} end
if redis.call('EXISTS', KEYS[4]) == 0 then return {424, 0, ''} end
local version = math.max(tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0'), floor_of(KEYS[10]),
                         floor_of(KEYS[11]), tonumber(ARGV[6])) + 1
redis.call('HSET', KEYS[2], ARGV[1], version)
redis.call('ZREM', KEYS[9], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], version .. ':' .. ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
if previous and sha_of(previous) ~= ARGV[2] then redis.call('ZADD', KEYS[5], ARGV[5], sha_of(previous)) end
if previous then retire(KEYS[6], KEYS[7], ARGV[1], previous, ARGV[5]) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'op', 'register', 'id', ARGV[1],
           'version', version, 'sha256', ARGV[2], 'at', ARGV[5])
redis.call('XADD', KEYS[8], '*', 'at', ARGV[5], 'who', ARGV[7], 'action', previous and 'replace' or 'register',
           'id', ARGV[1], 'version', version, 'sha256', ARGV[2], 'via', ARGV[9], 'replica', ARGV[8])
if previous then return {200, version, previous} end
return {201, version, ''}
"""

# KEYS: current, events, orphans, retired, retired_since, audit, last_version, deleted, version_floor,
# deleted_floor. ARGV: id, maxlen, at, who, replica, kept. Returns {status, "<version>:<sha>"}: 200 deleted (and
# recorded as retired, and in the audit stream), 404 unknown.
_DELETE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return {404, ''} end
redis.call('HDEL', KEYS[1], ARGV[1])
local sha = sha_of(current)
redis.call('ZADD', KEYS[3], ARGV[3], sha)
retire(KEYS[4], KEYS[5], ARGV[1], current, ARGV[3])
mark_deleted(KEYS[8], ARGV[1])
fold_deleted(KEYS[7], KEYS[8], KEYS[9], KEYS[10], ARGV[6], 100)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'delete', 'id', ARGV[1],
           'version', version_of(current), 'sha256', sha, 'at', ARGV[3])
redis.call('XADD', KEYS[6], '*', 'at', ARGV[3], 'who', ARGV[4], 'action', 'delete', 'id', ARGV[1],
           'version', version_of(current), 'sha256', sha, 'replica', ARGV[5])
return {200, current}
"""


def _once(script: str, n_keys: int, n_args: int) -> str:
    """``script`` (``n_keys`` KEYS, ``n_args`` ARGV) gated and run at most once per operation: two more KEYS,
    ``op:<token>`` (a token the caller draws per operation) and ``boot``, and one more ARGV, the seconds the answer
    is kept. While the gate is closed the answer is {REFUSED} and nothing changes (not kept: the same operation
    may run once the gate opens). Otherwise the first answer is kept under the token, and the same operation
    sent again gets it back instead of running twice: a caller whose command timed out cannot know whether it
    ran, and with this it may send it again."""
    op, boot, ttl = n_keys + 1, n_keys + 2, n_args + 1
    return f"""{_HELPERS}
local done = redis.call('GET', KEYS[{op}])
if done then return cjson.decode(done) end
if not gate_open(KEYS[{boot}]) then return {{{REFUSED}}} end
local function run()
{script}
end
local answer = run()
redis.call('SET', KEYS[{op}], cjson.encode(answer), 'EX', ARGV[{ttl}])
return answer
"""


REGISTER_ONCE = _once(_REGISTER, 11, 9)
DELETE_ONCE = _once(_DELETE, 10, 6)

# KEYS: current, last_version, events, blob, orphans, retired, retired_since, deleted, deleted_floor. ARGV: id, op,
# version, sha256, maxlen, at. Puts back into a Redis that came back with older data (or none) what one replica
# knows of one id, unless Redis knows as much: op `register` (the replica holds version@sha256 as current) makes
# it current when Redis never numbered that version (its last_version is lower), retiring the older one; op
# `delete` (the replica applied the deletion of that version) deletes the id's current version when it is that
# one or older; op `floor` changes only the numbering. Every op raises last_version to the version, so numbers go
# on above every version a replica knew. Whether Redis numbered a version is judged by the id's own last_version, and
# for an id without one by `deleted_floor` alone (a version at or below it may have been deleted and forgotten: a
# replica that missed that deletion must not bring it back, nor set a last version another's higher one would pass;
# every op leaves such a version alone, the numbering being above it already), never by the floor, which another
# replica's repair may have raised above a version Redis lost. An id it leaves without a current version is marked
# deleted, to be forgotten later (the numbering, above). Returns 1 when it changed the current versions, 0 when
# not, 424 when the blob is missing. Not gated: it is the repair the gate waits for.
RECONCILE = _HELPERS + """
local numbered = redis.call('HGET', KEYS[2], ARGV[1])
local previous = redis.call('HGET', KEYS[1], ARGV[1])
local version = tonumber(ARGV[3])
if not numbered and not previous and version <= floor_of(KEYS[9]) then return 0 end  -- maybe deleted, forgotten
local last = tonumber(numbered or '0')
local changed = 0
if ARGV[2] == 'register' and last < version then
  if redis.call('EXISTS', KEYS[4]) == 0 then return 424 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ':' .. ARGV[4])
  redis.call('ZREM', KEYS[5], ARGV[4])
  if previous then
    if sha_of(previous) ~= ARGV[4] then redis.call('ZADD', KEYS[5], ARGV[6], sha_of(previous)) end
    retire(KEYS[6], KEYS[7], ARGV[1], previous, ARGV[6])
  end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'op', 'register', 'id', ARGV[1],
             'version', ARGV[3], 'sha256', ARGV[4], 'at', ARGV[6])
  changed = 1
elseif ARGV[2] == 'delete' and previous and tonumber(version_of(previous)) <= version then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[5], ARGV[6], sha_of(previous))
  retire(KEYS[6], KEYS[7], ARGV[1], previous, ARGV[6])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'op', 'delete', 'id', ARGV[1],
             'version', version_of(previous), 'sha256', sha_of(previous), 'at', ARGV[6])
  changed = 1
end
if last < version then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[8], ARGV[1])
elseif changed == 1 or not redis.call('ZSCORE', KEYS[8], ARGV[1]) then
  mark_deleted(KEYS[8], ARGV[1])
end
return changed
"""

# KEYS: version_floor. ARGV: version. Raises the floor to a version a replica forgot the id of (repair).
RAISE_FLOOR = _HELPERS + """
raise_floor(KEYS[1], tonumber(ARGV[1]))
"""

# KEYS: current, last_version, deleted, version_floor, deleted_floor, boot. ARGV: kept, cursor ("": no scan),
# batch. Counts among the deleted ids, as the oldest, the ids of one HSCAN batch of last_version from the cursor
# that have no current version and are not counted yet (a Redis an earlier hotwire wrote), then, while the restart
# gate is open, forgets up to twice a batch of the oldest past `kept`; returns {the next cursor ("0": the scan is
# done), how many it added, how many are left to forget now (-1 while the gate is closed: nothing was forgotten)}.
# In batches, so that a hash of a million ids never holds Redis for seconds in one script.
TRACK_DELETED = _HELPERS + """
local added, cursor = 0, '0'
if ARGV[2] ~= '' then
  local scan = redis.call('HSCAN', KEYS[2], ARGV[2], 'COUNT', ARGV[3])
  cursor = scan[1]
  for i = 1, #scan[2], 2 do
    local id = scan[2][i]
    if redis.call('HEXISTS', KEYS[1], id) == 0 and not redis.call('ZSCORE', KEYS[3], id) then
      redis.call('ZADD', KEYS[3], 0, id)
      added = added + 1
    end
  end
end
if not gate_open(KEYS[6]) then return {cursor, added, -1} end
fold_deleted(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 2 * tonumber(ARGV[3]))
return {cursor, added, math.max(redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[1]), 0)}
"""

# KEYS: boot, closing, repaired, live. ARGV: settle_s, limit_s, replica id ("" for none). Opens the gate when it
# may: once `closing` (set now if it names no closing of this process) is settle_s old and every live replica has
# marked itself repaired for it, or once it is limit_s old whatever is missing. Returns {state, run id, closing,
# this replica's mark, the live replicas not repaired...}: state 1 open, 0 closed, 2 opened now, 3 opened now at
# the limit (the missing replicas follow).
GATE = _HELPERS + """
local id = run_id()
if redis.call('GET', KEYS[1]) == id then return {1, id, '', ''} end
local t = now()
local closing = redis.call('GET', KEYS[2])
if not closing or string.sub(closing, 1, #id + 1) ~= id .. ':' then
  closing = id .. ':' .. string.format('%.6f', t)
  redis.call('SET', KEYS[2], closing)
end
local mark = redis.call('HGET', KEYS[3], ARGV[3]) or ''
local missing = {}
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], t, '+inf')) do
  if redis.call('HGET', KEYS[3], replica) ~= closing then table.insert(missing, replica) end
end
local waited = t - tonumber(string.sub(closing, #id + 2))
if waited < tonumber(ARGV[1]) or (#missing > 0 and waited < tonumber(ARGV[2])) then
  return {0, id, closing, mark, unpack(missing)}
end
redis.call('SET', KEYS[1], id)
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', t)
if #missing > 0 then return {3, id, closing, mark, unpack(missing)} end
return {2, id, closing, mark}
"""

# KEYS: closing, repaired. ARGV: replica id, closing. Marks the replica repaired for that closing, if it is still
# the one in progress (not when Redis restarted or was wiped again meanwhile); returns 1 marked, 0 not.
MARK_REPAIRED = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS: replica, live. ARGV: state (JSON), ttl_ms, replica id. A replica's heartbeat, and its place among the live
# replicas until it expires (Redis's clock, as GATE reads it).
HEARTBEAT = _HELPERS + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = now()
redis.call('ZADD', KEYS[2], t + tonumber(ARGV[2]) / 1000, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t)
"""

# KEYS: retired, retired_since. ARGV: cutoff. Forgets the versions retired before the cutoff; returns how many.
FORGET_RETIRED = """
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 1000)
for _, member in ipairs(old) do redis.call('HDEL', KEYS[1], member) end
if #old > 0 then redis.call('ZREM', KEYS[2], unpack(old)) end
return #old
"""

# KEYS: blob, orphans. ARGV: bytes, sha256, at. Stores a blob once and makes it an orphan as of now, atomically: it
# stays one until a version uses it (register and reconcile take it off), so a blob whose registration never
# ran (a timeout, a refusal) is collected like any other, the grace counted from its last upload.
PUT_BLOB = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
"""

# KEYS: current, orphans, blob of each candidate. ARGV: cutoff, then each candidate's sha256. Deletes the blobs of
# candidates still orphaned since before the cutoff that no id's current version uses; returns how many.
COLLECT = _HELPERS + """
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

# KEYS: monitors (hash id -> JSON), monitor edits (counter). ARGV: id, the monitor's JSON ("": delete it).
# Returns the JSON it replaced (nil: none); a change bumps the counter the API servers poll.
EDIT_MONITOR = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  if not old then return nil end
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('INCR', KEYS[2])
return old
"""

# KEYS: a tenant's registrations (sorted set: a token per registration, scored by when). ARGV: now (seconds),
# window (seconds), limit, token. Those older than the window go; with `limit` left, returns {count, the oldest's
# time} and adds nothing; else adds the token and returns {-1, "0"} (``hotwire_api.quotas``).
TAKE_REGISTRATION = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[3]) then
  return {n, redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]}
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000) + 1000)
return {-1, '0'}
"""

# KEYS: a tenant's turn. ARGV: the token that took it. Ends the turn only if that token still holds it (one whose
# turn ran out and went to another API server must not end the other's).
END_TURN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: api_keys (hash: name -> the key's JSON, ``hotwire_api.keys.Key``), api_key_edits, audit, boot. ARGV: op
# ("add", "rotate", "revoke"), name, the new entry's JSON (add, rotate), keep_an_admin (1|0), who, at, replica,
# within (a tenant: only its keys; "": any), gated (1: refused while the restart gate is closed, as an API server's
# edits are; the CLI's are not, so that it can make a new Redis's first key). Returns 200 once made, 409 a name taken
# (add), 404 no such key, or not within's (rotate, revoke), 423 the last operator admin key (revoke with
# keep_an_admin), 503 the gate closed. A rotation keeps the entry's role and tenant. The audit stream gets the change
# in the same step.
EDIT_KEY = _HELPERS + """
if ARGV[9] == '1' and not gate_open(KEYS[4]) then return 503 end
local old = redis.call('HGET', KEYS[1], ARGV[2])
local op, action = ARGV[1], 'key_added'
if op == 'add' and old then return 409 end
if op ~= 'add' and not old then return 404 end
if op ~= 'add' and ARGV[8] ~= '' and cjson.decode(old).tenant ~= ARGV[8] then return 404 end
local function operator_admin(doc)
  local key = cjson.decode(doc)
  return key.role == 'admin' and (key.tenant == nil or key.tenant == cjson.null)
end
if op == 'revoke' then
  if ARGV[4] == '1' and operator_admin(old) then
    local admins = 0
    for _, doc in ipairs(redis.call('HVALS', KEYS[1])) do
      if operator_admin(doc) then admins = admins + 1 end
    end
    if admins == 1 then return 423 end
  end
  redis.call('HDEL', KEYS[1], ARGV[2])
  action = 'key_revoked'
else
  local new = ARGV[3]
  if op == 'rotate' then
    local key, made = cjson.decode(old), cjson.decode(ARGV[3])
    key.sha256, key.created = made.sha256, made.created
    new, action = cjson.encode(key), 'key_rotated'
  end
  redis.call('HSET', KEYS[1], ARGV[2], new)
end
redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[3], '*', 'at', ARGV[6], 'who', ARGV[5], 'action', action, 'id', ARGV[2], 'replica', ARGV[7])
return 200
"""

# KEYS: api_keys, api_key_edits, boot. ARGV: the count of key edits an API server read its keys at, then each key's
# name and entry (JSON). While the restart gate is closed (``boot``: Redis restarted or lost its data) and Redis
# holds the keys of fewer edits, replaces them with these (``fleet.key_ring``): the API server that read the most
# edits wins, whatever the order. Returns 1 if it replaced them, else 0.
RESTORE_KEYS = _HELPERS + """
if gate_open(KEYS[3]) then return 0 end
if tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""
