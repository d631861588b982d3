"""``HOTWIRE_REGISTRY``: where a replica's vectors live. Unset or ``local``: the embedded registry of each engine
(and its ``HOTWIRE_STORE``); ``redis://`` / ``rediss://`` (TLS) / ``unix://`` URLs: one Redis for the fleet.
Also the names of hotwire's keys, and the URL's secrets (:func:`url_secrets`) masked for messages and logs."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

from hotwire_core.env import Float, Parsed, Text, load, setting
from hotwire_core.settings import RETAIN_S
from hotwire_core.version_history import HISTORY_KEPT

__all__ = ["REGISTRY", "REPLICA_ID", "SCHEMA", "FleetConfig", "Keys", "default_replica_name", "redacted",
           "registry_url", "scrubbed", "url_secrets"]

_SCHEMES = ("redis", "rediss", "unix")
# Query parameters whose value is a secret: redis-py passes every one to the connection (``password``,
# ``ssl_password``, ...), so any name that says so counts.
_SECRET_PARAM = re.compile(r"pass|secret|token|credential", re.IGNORECASE)


def registry_url(raw: str) -> str | None:
    """The Redis URL ``HOTWIRE_REGISTRY`` names, or None for the embedded registry; ValueError for anything else."""
    value = raw.strip()
    if value in ("", "local"):
        return None
    if urlsplit(value).scheme not in _SCHEMES:
        raise ValueError(
            f"HOTWIRE_REGISTRY must be 'local' or a redis://, rediss:// or unix:// URL, got {redacted(value)!r}"
        )
    return value


# The layout of hotwire's keys and what its scripts keep there, in every replica's heartbeat: replicas of other
# schemas must not share a Redis (schema 2: the bounded numbering, ``deleted`` and the floors; before it, none).
SCHEMA = 2

REGISTRY = Parsed("HOTWIRE_REGISTRY", parse_with=registry_url,
                  doc="'local' (unset: each engine's embedded registry) or the fleet's Redis URL")
REPLICA_ID = Text("HOTWIRE_REPLICA_ID", doc="this replica's name (default: host:port)")


def default_replica_name(port: int | None) -> str:
    """A replica's name when ``HOTWIRE_REPLICA_ID`` is unset: ``<host name>:<port>`` (the process id without a port),
    so replicas on one host differ."""
    return f"{socket.gethostname()}:{port or os.getpid()}"


def _masked_user(parts) -> bool:
    """A user name without a password (``redis://secret@host``) may be the password put in the wrong place."""
    return parts.password is None and bool(parts.username) and "@" in parts.netloc


def _secret_param(piece: str) -> str | None:
    """The value of one ``name=value`` of a query string when the name says it is a secret, else None."""
    name, _, value = piece.partition("=")
    return value if _SECRET_PARAM.search(unquote_plus(name)) else None


def url_secrets(url: str) -> list[str]:
    """Every secret ``url`` carries, as written and percent-decoded, longest first: the password (or a user name
    alone), and the value of each query parameter whose name says it is one (``?password=``, ``?ssl_password=``)."""
    parts = urlsplit(url)
    found = {parts.password or "", (parts.username or "") if _masked_user(parts) else ""}
    found |= {value for piece in parts.query.split("&") if (value := _secret_param(piece)) is not None}
    found |= {unquote_plus(s) for s in found} | {unquote(s) for s in found}
    return sorted((s for s in found if s and s != "***"), key=len, reverse=True)


def redacted(url: str) -> str:
    """``url`` with every secret (:func:`url_secrets`) replaced by ``***``: safe for logs and answers."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None or _masked_user(parts):
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = f"{parts.username}:" if parts.username and parts.password is not None else ""
        netloc = f"{user}***@{host}"
    query = "&".join(piece if _secret_param(piece) is None else f"{piece.partition('=')[0]}=***"
                     for piece in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scrubbed(text: str, url: str) -> str:
    """``text`` (an error message of redis-py, a traceback) with ``url`` and every secret of it masked."""
    text = text.replace(url, redacted(url))
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text


@dataclass(frozen=True)
class FleetConfig:
    """``url``: the Redis; ``heartbeat_s``: ``HOTWIRE_FLEET_HEARTBEAT_S`` (default 1), a replica whose heartbeat is
    3 intervals old drops out of the fleet view; ``stream_maxlen``: ``HOTWIRE_REGISTRY_STREAM_MAXLEN`` (default
    100000), the events Redis keeps (a replica further behind resyncs from the current versions);
    ``replica_id``: ``HOTWIRE_REPLICA_ID`` (default host name and port); ``timeout_s``: how long one Redis
    command may take before the registry counts as unreachable; ``blob_grace_s``: ``HOTWIRE_REGISTRY_BLOB_GRACE_S``
    (default 3600), how long a blob no id's current version uses stays in Redis before it is collected;
    ``retain_s``: ``HOTWIRE_RETAIN_S`` (the engine's setting, default 60), how long the fleet keeps a replaced or
    deleted version usable by requests pinned to it; ``history_kept``: the deleted ids whose last version Redis and
    each follower keep by id (older ones only raise a floor every id's next version goes on above). After Redis
    restarted (or lost hotwire's keys) changes wait until every live replica has put back what it holds
    (``repair``): at least ``restart_settle_s`` (two heartbeat intervals: every live replica has heartbeat by then),
    at most ``restart_limit_s`` (a replica that does not report cannot hold changes back for longer)."""

    url: str = field(repr=False)  # it may carry a password
    heartbeat_s: float = setting(Float("HOTWIRE_FLEET_HEARTBEAT_S", default=1.0, lo=0.05, hi=3600,
                                       doc="seconds between a replica's heartbeats"))
    stream_maxlen: int = setting(Float("HOTWIRE_REGISTRY_STREAM_MAXLEN", default=100_000, lo=10, hi=1e9, to=int,
                                       doc="the registry events Redis keeps"))
    replica_id: str | None = setting(REPLICA_ID)
    replica_url: str | None = setting(Text("HOTWIRE_REPLICA_URL", doc="this replica's URL, shown in the fleet view"))
    timeout_s: float = setting(Float("HOTWIRE_REGISTRY_TIMEOUT_S", default=2.0, lo=0.05, hi=60,
                                     doc="seconds one Redis command may take"))
    blob_grace_s: float = setting(Float("HOTWIRE_REGISTRY_BLOB_GRACE_S", default=3600.0, lo=0, hi=30 * 86400,
                                        doc="seconds an unused blob stays in Redis before it is collected"))
    retain_s: float = setting(RETAIN_S)
    history_kept: int = HISTORY_KEPT  # the ids without a current version whose last version is kept (``Keys``)
    restart_settle_s: float = 2.0
    restart_limit_s: float = 30.0

    @classmethod
    def from_env(cls, url: str, env: Mapping[str, str] = os.environ) -> FleetConfig:
        config = load(cls, env, url=url)
        return dataclasses.replace(config, restart_settle_s=2 * config.heartbeat_s,
                                   restart_limit_s=max(30.0, 4 * config.heartbeat_s))


@dataclass(frozen=True)
class Keys:
    """hotwire's keys for one served model, all under ``hotwire:{<model>}:`` (the braces are a Redis Cluster
    hash tag: every key of a model lands on one node, so the Lua scripts may touch them together)."""

    prefix: str

    @classmethod
    def for_model(cls, model: str) -> Keys:
        return cls(f"hotwire:{{{re.sub(r'[{}]', '_', model)}}}:")

    def blob(self, sha256: str) -> str:
        """A vector's safetensors bytes, by content hash (``blobs``); written once, never changed."""
        return f"{self.prefix}blob:{sha256}"

    @property
    def current(self) -> str:
        """Hash: id -> ``<version>:<sha256>`` of every live vector."""
        return f"{self.prefix}current"

    @property
    def last_version(self) -> str:
        """Hash: id -> the last version of every live id and of the last ``FleetConfig.history_kept`` ids without
        one (``deleted``); older ones only raised ``version_floor``: versions never repeat."""
        return f"{self.prefix}last_version"

    @property
    def deleted(self) -> str:
        """Sorted set: the ids of ``last_version`` without a current version -> when they lost it, oldest first."""
        return f"{self.prefix}deleted"

    @property
    def version_floor(self) -> str:
        """The highest version of the ids forgotten from ``last_version``: every id's next version is above it."""
        return f"{self.prefix}version_floor"

    @property
    def deleted_floor(self) -> str:
        """The highest version of the ids forgotten from ``deleted`` (only while the restart gate is open): a repair
        changes nothing of an id ``last_version`` lacks at or below it (it may have been deleted and forgotten)."""
        return f"{self.prefix}deleted_floor"

    @property
    def events(self) -> str:
        """Stream of ``op`` (register | delete), ``id``, ``version``, ``sha256``, ``created`` in the order Redis
        accepted them."""
        return f"{self.prefix}events"

    @property
    def audit(self) -> str:
        """Stream of every change with who made it (``hotwire_api.audit``), appended by the register and delete
        scripts and for key changes; never trimmed."""
        return f"{self.prefix}audit"

    @property
    def monitors(self) -> str:
        """Hash: monitor id -> its JSON (``hotwire_api.monitors``); ``monitor_edits`` counts the changes."""
        return f"{self.prefix}monitors"

    @property
    def monitor_edits(self) -> str:
        return f"{self.prefix}monitor_edits"

    @property
    def api_keys(self) -> str:
        """Hash: key name -> its entry's JSON (``HOTWIRE_FLEET_KEYS``, ``fleet.key_ring``); ``api_key_edits``
        counts the changes."""
        return f"{self.prefix}api_keys"

    @property
    def api_key_edits(self) -> str:
        return f"{self.prefix}api_key_edits"

    def registrations(self, tenant: str) -> str:
        """Sorted set: a tenant's registrations of the last minute, for its quota (``hotwire_api.quotas``)."""
        return f"{self.prefix}registrations:{tenant}"

    def turn(self, tenant: str) -> str:
        """String with a TTL: the token of the API server whose registration for ``tenant`` is being checked against
        its quotas and made, one at a time across the fleet (``hotwire_api.quotas``)."""
        return f"{self.prefix}turn:{tenant}"

    @property
    def orphans(self) -> str:
        """Sorted set: sha256 -> when its blob stopped being any id's current version (replaced, deleted, or a
        registration that lost its race); the blobs the collection may delete once they are older than the grace."""
        return f"{self.prefix}orphans"

    @property
    def retired(self) -> str:
        """Hash: ``<id>@<version>`` -> ``<sha256>:<when>`` of each version replaced or deleted within the
        retention (``HOTWIRE_RETAIN_S``): what a replica that never held it needs to honour a request pinned to it."""
        return f"{self.prefix}retired"

    @property
    def retired_since(self) -> str:
        """Sorted set: ``<id>@<version>`` -> when it was retired; the entries of ``retired`` by age, for resyncs
        and for forgetting them once their retention is over."""
        return f"{self.prefix}retired_since"

    @property
    def boot(self) -> str:
        """The run id of the Redis process whose data the fleet last confirmed (every live replica put back what
        it holds): while the running process has another (it restarted) or none is set (a new or wiped Redis),
        register and delete refuse to change anything (``repair``)."""
        return f"{self.prefix}boot"

    @property
    def closing(self) -> str:
        """``<run id>:<time>``: the Redis process that was first found unconfirmed, and when (Redis's clock):
        names one restart or wipe; replicas mark themselves repaired for it."""
        return f"{self.prefix}closing"

    @property
    def repaired(self) -> str:
        """Hash: replica id -> the ``closing`` it has put back what it holds for."""
        return f"{self.prefix}repaired"

    @property
    def live(self) -> str:
        """Sorted set: replica id -> when its heartbeat expires (Redis's clock): the replicas a repair waits for."""
        return f"{self.prefix}live"

    def op(self, token: str) -> str:
        """A register's or delete's answer under its operation token, for a few minutes: the same operation sent
        again (its first answer never came) is answered alike instead of running twice."""
        return f"{self.prefix}op:{token}"

    def replica(self, replica_id: str) -> str:
        """A replica's heartbeat (JSON; expires after 3 intervals)."""
        return f"{self.prefix}replica:{replica_id}"

    @property
    def replica_pattern(self) -> str:
        """SCAN's pattern for every replica's heartbeat (glob characters of the prefix escaped)."""
        return re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "replica:*"
