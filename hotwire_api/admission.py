"""Admission of steered requests, on every route of vLLM's app.

A pure ASGI middleware that reads the body of every ``POST`` (but ``/steer/*`` and multipart uploads) and
decides, once, whether it asks for steering: a spec is ``vllm_xargs.hotwire`` (or
``sampling_params.extra_args.hotwire``) in a JSON object, whatever the body's encoding (escapes such as
``hot\\u0077ire``, UTF-16 and UTF-32 are read as vLLM reads them). A body that asks for steering is:

- refused 400 ``steering_unsupported`` on a route that cannot steer (only ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/responses`` and ``/invocations`` generate with the request's ``vllm_xargs``), or
  with beam search (which generates with sampling parameters of its own);
- refused 401 without vLLM's API key when one is set (``--api-key``, ``VLLM_API_KEY``): vLLM's own check
  does not cover ``/invocations``;
- decided against this process's copy of the engine's catalog (``hotwire_api.catalog``; no engine round trip):
  400 for a bad spec, an unknown vector or layer, too strong a spec; 503 when the model cannot be steered.

An admitted request reaches vLLM re-encoded, with its spec pinned to the versions decided here (``"version"``
in each entry) and a ticket (``vllm_xargs.hotwire_ticket``, ``hotwire_api.tickets``), which the guard on the
engine client requires of every spec that reaches the engine; the response carries ``x-hotwire-receipt``
naming those versions (``hotwire_api.answer`` replaces an answer that is not the steered one). A request whose
bank rows are taken waits in the engine until they free up. With lenient mode a 4xx instead strips the spec,
serves the request unsteered and adds ``x-hotwire-lenient: <reason>``. A ``cache_salt`` with hotwire's reserved
prefix, or a client's own ``hotwire_ticket``, is refused on every route. With monitors (``hotwire_api.monitors``)
every chat and completions body is read, and one they can read is admitted as a reading request
(``hotwire_api.reading``), whatever the client asked.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotwire_api.answer import Answer, header_value, with_header
from hotwire_api.auth import authorize_steering, record_key_changes
from hotwire_api.catalog import CATALOG
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError, in_body
from hotwire_api.headers import KEY_HEADER, LENIENT_HEADER, RECEIPT_HEADER
from hotwire_api.monitors import Monitor, MonitorBook, skipped
from hotwire_api.reading import Reading, authorize_gate, authorize_readout, decide_reading, monitored
from hotwire_api.stats_cache import STATS
from hotwire_api.tenancy import OPERATOR, Tenancy
from hotwire_api.tickets import TICKETS
from hotwire_core.admission import Refusal, pinned_spec, receipt, resolve
from hotwire_core.contract import ADMISSION_ONLY_KEYS
from hotwire_core.error_codes import ErrorCode
from hotwire_core.readout_spec import READOUT_KEY
from hotwire_core.gates import condition_of
from hotwire_core.spec import SALT_PREFIX, SPEC_KEY, TICKET_KEY, Condition, SpecError, parse_spec

__all__ = ["AdmissionMiddleware", "STEERABLE_ROUTES"]

logger = logging.getLogger(__name__)
STEERABLE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/invocations"})
_FIELD = f"vllm_xargs.{SPEC_KEY}"


@dataclass
class _Steering:
    """Where a JSON body asks for steering: ``holder`` is the dict that holds the spec (``vllm_xargs``, or
    ``sampling_params.extra_args``), found at ``where``."""

    request: dict[str, Any]
    holder: dict[str, Any]
    where: str

    @property
    def spec(self) -> Any:
        return self.holder.get(SPEC_KEY)

    @property
    def readout(self) -> Any:
        return self.holder.get(READOUT_KEY)


class AdmissionMiddleware:
    """Admit or refuse steered requests before vLLM handles them (see the module docstring)."""

    def __init__(self, app: ASGIApp, lenient: bool = False):
        self.app = app
        self.lenient = lenient

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or scope["method"] != "POST" or path.startswith("/steer/") or _is_form(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before sending the whole body
            return
        book: MonitorBook = scope["app"].state.hotwire_monitors
        monitors: tuple[Monitor, ...] = book.current() if path in STEERABLE_ROUTES else ()
        request = _json_object(body) if monitors or _may_name_hotwire(body) else None
        steering = _steering(request) if request is not None else None
        tenancy = OPERATOR
        try:
            if request is not None:
                _refuse_reserved(request, steering)
            monitors = monitored(monitors, path, request, _as_pydantic_bool((request or {}).get("use_beam_search")))
            if steering is None:
                await self._serve_monitored(scope, receive, send, path, body, request, monitors, book.state)
                return
            reads = READOUT_KEY in steering.holder
            if reads:
                authorize_readout(path, steering.where, steering.request)
            tenancy = self._authorize(scope, path, steering)
            await record_key_changes(scope["app"])
            engine = HotwireEngine.of(scope["app"])
            if tenancy.tenant is not None:
                await _name_for_engine(engine, tenancy, steering.holder)
            # Present, whatever its value: a spec that is not a JSON string is hotwire's 400, not vLLM's.
            decided, pinned, when = await _decide(engine, steering.spec) if SPEC_KEY in steering.holder else ("", None, None)
            if when is not None:
                authorize_gate(path, steering.request)
            reading = await decide_reading(engine, steering.readout if reads else None, monitors, book.state, when) \
                if reads or monitors or when else None
        except HotwireError as err:
            err = tenancy.error(err)
            STATS.count_refusal(err.code)
            if err.code in _NEVER_LENIENT or not (self.lenient and 400 <= err.status < 500):
                await err.response()(scope, receive, send)
                return
            if monitors:
                skipped("lenient")  # served as it came, without hotwire
            steering.holder.pop(SPEC_KEY, None)
            steering.holder.pop(READOUT_KEY, None)
            body = json.dumps(steering.request, separators=(",", ":")).encode()
            lenient_send = _add_header(send, LENIENT_HEADER.encode(), f"{err.code}: {err.message}")
            await self.app(_with_length(scope, len(body)), _replay(body, receive), lenient_send)
            return
        await self._serve_admitted(scope, receive, send, path, engine, steering, tenancy.localize(decided), pinned,
                                   reading, tenancy=tenancy)

    async def _serve_monitored(self, scope: Scope, receive: Receive, send: Send, path: str, body: bytes,
                               request: dict[str, Any] | None, monitors: tuple[Monitor, ...], state: int) -> None:
        """A request that asks nothing of hotwire: read by the monitors where they can, else passed on as it came."""
        reading = None
        if monitors:
            assert request is not None
            try:
                engine = HotwireEngine.of(scope["app"])
                reading = await decide_reading(engine, None, monitors, state)
            except HotwireError as err:  # the engine is not there to read it: vLLM answers it as it would anyway
                skipped("unavailable")
                logger.debug("hotwire: monitors skip a request: %s", err.message)
        if reading is None:
            await self.app(scope, _replay(body, receive), send)
            return
        steering = _Steering(request, request.setdefault("vllm_xargs", {}), "vllm_xargs")
        await self._serve_admitted(scope, receive, send, path, engine, steering, "", None, reading, required=False)

    @staticmethod
    def _authorize(scope: Scope, path: str, steering: _Steering) -> Tenancy:
        """Steering is only for the routes and requests that generate with the request's parameters, and only
        with the keys ``auth.authorize_steering`` asks for; returns whose vectors the request may name."""
        if path not in STEERABLE_ROUTES or steering.where != "vllm_xargs":
            raise HotwireError(
                400, ErrorCode.STEERING_UNSUPPORTED,
                f"POST {path} cannot steer: only vllm_xargs.{SPEC_KEY} of POST {', '.join(sorted(STEERABLE_ROUTES))} "
                "is applied; send the request without it, or to one of those routes", f"{steering.where}.{SPEC_KEY}",
            )
        if _as_pydantic_bool(steering.request.get("use_beam_search")):
            raise HotwireError(400, ErrorCode.STEERING_UNSUPPORTED, "beam search cannot be steered: vLLM runs it with "
                               "sampling parameters of its own; drop use_beam_search or the steering", "use_beam_search")
        return authorize_steering(scope["app"], _header(scope, b"authorization"),
                                  _header(scope, KEY_HEADER.lower().encode()) or None)

    async def _serve_admitted(self, scope: Scope, receive: Receive, send: Send, path: str, engine: HotwireEngine,
                              steering: _Steering, decided: str, pinned: str | None, reading: Reading | None,
                              required: bool = True, tenancy: Tenancy = OPERATOR) -> None:
        ticket_id = TICKETS.issue(pinned, reading.value if reading else None)
        ticket = TICKETS.get(ticket_id)
        assert ticket is not None
        receipt = None if pinned is None else (RECEIPT_HEADER.encode(), header_value(decided))
        if pinned is not None:
            steering.holder[SPEC_KEY] = pinned
        usage_wanted = True
        if reading is not None:
            steering.holder[READOUT_KEY] = reading.value
            options = steering.request.get("stream_options")
            if _as_pydantic_bool(steering.request.get("stream")) and isinstance(options or {}, dict):
                # The usage chunk says how many tokens the stream generated: what the readout is cut to.
                usage_wanted = _as_pydantic_bool((options or {}).get("include_usage"))
                steering.request["stream_options"] = {**(options or {}), "include_usage": True}
        steering.holder[TICKET_KEY] = ticket_id
        body = json.dumps(steering.request, separators=(",", ":")).encode()
        answer = Answer(engine, ticket_id, ticket, scope, receive, send, path, reading, usage_wanted, required, tenancy,
                        receipt)
        try:
            await self.app(_with_length(scope, len(body)), _replay(body, receive), answer.send)
        except Exception:
            # vLLM's /v1/responses stream raises while it turns a failed request into an event (0.25.1: a
            # pydantic ValidationError), which would end the connection without a response.
            if not await answer.explain_crash():
                raise
            return
        finally:
            answer.close()
            # A success that never reached the engine and delivered nothing may still generate (a background
            # /v1/responses job): its ticket stays valid for that job's request.
            TICKETS.close(ticket_id, keep=not ticket.presented and not answer.output and 200 <= answer.status < 300)
        await answer.finish()


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _as_pydantic_bool(value: Any) -> bool:
    """Whether vLLM's request model (pydantic, lax mode) reads ``value`` as ``True``: JSON ``true``, ``1``, ``1.0``
    and the strings ``"true"``, ``"yes"``, ``"on"``, ... in any case (``"use_beam_search": "true"`` runs beam
    search)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE_STRINGS


_NEVER_LENIENT = frozenset({ErrorCode.RESERVED_SALT, ErrorCode.RESERVED_FIELD})  # forged cache keys and tickets: never served


def _refuse_reserved(request: dict[str, Any], steering: _Steering | None) -> None:
    """A client may not set what only hotwire sets: a cache salt with its prefix (it could forge a steered
    request's cache key), a ticket, or what the engine's admission gives a request (a binding to bank rows)."""
    params = request.get("sampling_params")
    for holder, where in ((request.get("vllm_xargs"), "vllm_xargs"),
                          (params.get("extra_args") if isinstance(params, dict) else None, "sampling_params.extra_args")):
        if not isinstance(holder, dict):
            continue
        for key in ADMISSION_ONLY_KEYS:
            if key in holder:  # the engine refuses them too, but only as a failed request
                raise HotwireError(400, ErrorCode.RESERVED_FIELD, f"{key} is set by hotwire's admission, not by "
                                   "clients: remove it", f"{where}.{key}")
    salt = request.get("cache_salt")
    if isinstance(salt, str) and salt.startswith(SALT_PREFIX):
        raise HotwireError(400, ErrorCode.RESERVED_SALT, f"cache_salt may not start with {SALT_PREFIX!r}", "cache_salt")
    if steering is not None and TICKET_KEY in steering.holder:
        raise HotwireError(400, ErrorCode.RESERVED_FIELD, f"{TICKET_KEY} is set by the server, not by clients: remove it",
                           f"{steering.where}.{TICKET_KEY}")


async def _name_for_engine(engine: HotwireEngine, tenancy: Tenancy, holder: dict[str, Any]) -> None:
    """A tenant's spec and readout, with the names it uses made the engine's ids (``hotwire_api.tenancy``)."""
    await CATALOG.ready(engine)
    for field, rename in ((SPEC_KEY, tenancy.spec), (READOUT_KEY, tenancy.readout)):
        value = holder.get(field)
        if value is None:
            continue
        key = (tenancy.tenant, field, value, CATALOG.state) if isinstance(value, str) and len(value) <= _CACHED_SPEC_CHARS else None
        renamed = _RENAMED.get(key) if key else None
        if renamed is None:
            renamed = rename(value, CATALOG.holds)
            if key:  # (as the catalog is now: no await since)
                if len(_RENAMED) >= _DECIDED_KEPT:
                    _RENAMED.clear()
                _RENAMED[key] = renamed
        holder[field] = renamed


# A tenant's specs and readouts renamed for the engine, by (tenant, field, string, catalog state), as _DECIDED.
_RENAMED: dict[tuple[str | None, str, str, int], Any] = {}


async def _decide(engine: HotwireEngine, spec: Any) -> tuple[str, str, Condition | None]:
    """The receipt and the pinned spec of an admitted request, or its refusal (:class:`HotwireError`, with the
    field named as in the request body)."""
    if not isinstance(spec, str):
        raise HotwireError(
            400, ErrorCode.BAD_SPEC,
            f"{_FIELD} must be a JSON string, e.g. "
            '"vllm_xargs": {"hotwire": "{\\"id\\": \\"happy\\", \\"layer\\": 10, \\"scale\\": 4.0}"}',
            _FIELD,
        )
    arrived = time.monotonic()
    try:
        try:
            entries = parse_spec(spec)
        except SpecError as exc:
            raise Refusal(400, ErrorCode.BAD_SPEC, str(exc), exc.field) from None
        if any(e.version is not None and CATALOG.lookup(e.vector_id, e.version) is None for e in entries):
            # A version the catalog does not hold as current may be retained in the engine: it decides.
            decided, pinned = await engine.check(spec)
            return decided, pinned, next((e.when for e in parse_spec(pinned) if e.when is not None), None)
        await CATALOG.ready(engine)  # (a catalog of another engine is started afresh: a new state)
        hit = _DECIDED.get((spec, CATALOG.state))
        if hit is not None:
            return hit
        resolved = await CATALOG.decide(engine, arrived, lambda rules: resolve(spec, CATALOG.lookup, rules),
                                        (ErrorCode.UNKNOWN_VECTOR,))
    except (Refusal, HotwireError) as exc:
        raise in_body(exc) from None
    decided = receipt(resolved), pinned_spec(resolved), condition_of(resolved)
    if len(spec) <= _CACHED_SPEC_CHARS:  # (resolved against the catalog as it is now: no await since)
        if len(_DECIDED) >= _DECIDED_KEPT:
            _DECIDED.clear()
        _DECIDED[(spec, CATALOG.state)] = decided
    return decided


# The admissions decided against the catalog, by (spec string, catalog state): a server sees the same few specs
# over and over, and deciding one anew (resolve, the strength bound, receipt and pinned spec) was most of the host
# time admission adds to a steered request. A change of the catalog starts afresh; only admitted short specs are
# kept (a client chooses the keys), at most _DECIDED_KEPT of them.
_DECIDED: dict[tuple[str, int], tuple[str, str, Condition | None]] = {}
_DECIDED_KEPT = 1024
_CACHED_SPEC_CHARS = 1024


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", ""))


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _is_form(scope: Scope) -> bool:
    """A multipart upload (vLLM's audio routes): not read here; the engine client's guard refuses a spec in one."""
    return _header(scope, b"content-type").lower().startswith("multipart/")


def _may_name_hotwire(body: bytes) -> bool:
    """Whether a JSON body could hold the name ``hotwire`` (a key, or a salt's prefix): JSON spells it literally
    in UTF-8, or with an escape (``\\u0068otwire``); a body with a NUL in its first bytes is UTF-16 or UTF-32,
    which Python's json reads too. Anything else is a plain request and is passed on unread."""
    return b"hotwire" in body or b"\\u" in body or b"\x00" in body[:4]


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, parsed as vLLM parses it (``json.loads`` of the bytes); None when it is not one
    (vLLM reports that itself)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return request if isinstance(request, dict) else None


def _steering(request: dict[str, Any]) -> _Steering | None:
    """Where the request asks for steering (holds a spec or a ticket): ``vllm_xargs`` (the OpenAI routes) or
    ``sampling_params.extra_args`` (vLLM's token-in, token-out route); None when neither does."""
    params = request.get("sampling_params")
    for holder, where in ((request.get("vllm_xargs"), "vllm_xargs"),
                          (params.get("extra_args") if isinstance(params, dict) else None, "sampling_params.extra_args")):
        if isinstance(holder, dict) and (SPEC_KEY in holder or TICKET_KEY in holder or READOUT_KEY in holder):
            return _Steering(request, holder, where)
    return None


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then defers to the real one (so disconnects still arrive)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"transfer-encoding")]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _add_header(send: Send, name: bytes, value: str) -> Send:
    header = (name, header_value(value))

    async def send_with_header(message: Message) -> None:
        await send(with_header(message, header))

    return send_with_header
