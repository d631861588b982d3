"""Admission of steered requests on the OpenAI routes.

A pure ASGI middleware for ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``. A body
that carries ``vllm_xargs.hotwire`` (a JSON string spec) is decided here, once, against this process's copy of
the engine's catalog (``hotwire_api.catalog``; no engine round trip): 400 for a bad spec, an unknown vector or
layer, too strong a spec; 503 when the model cannot be steered. An admitted request reaches vLLM with its spec
pinned to the versions decided here (``"version"`` in each entry) and a ticket (``vllm_xargs.hotwire_ticket``);
the response carries ``x-hotwire-receipt`` naming those versions, and the engine applies exactly them. A request
whose bank rows are taken waits in the engine until they free up. With lenient mode a 4xx instead strips the
spec, serves the request unsteered and adds ``x-hotwire-lenient: <reason>``.

The engine can still refuse a request it gets (a pinned version past its retention, say). vLLM reports that as
a failed request: a bare 500, or a stream that ends with an error event or none at all. The engine keeps the
refusal under the request's ticket, and this middleware answers with it: as the refusal's own status and body
when nothing of the response has reached the client yet (a stream's start is held until its first event that
carries output), else as an error event in the stream (OpenAI's shape: message, ``type`` = hotwire's code,
``param`` = field, ``code`` = status). No request that was refused ends as a success.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotwire_api.catalog import CATALOG
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.metrics import STATS
from hotwire_core.admission import Refusal, pinned_spec, receipt, resolve
from hotwire_core.spec import SALT_PREFIX, SPEC_KEY, TICKET_KEY, SpecError, parse_spec

__all__ = ["AdmissionMiddleware", "LENIENT_HEADER", "RECEIPT_HEADER", "ROUTES"]

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_FIELD = f"vllm_xargs.{SPEC_KEY}"
RECEIPT_HEADER = b"x-hotwire-receipt"
LENIENT_HEADER = b"x-hotwire-lenient"


class AdmissionMiddleware:
    """Admit or refuse steered requests before vLLM handles them."""

    def __init__(self, app: ASGIApp, lenient: bool = False):
        self.app = app
        self.lenient = lenient

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or _path(scope) not in ROUTES:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before sending the whole body
            return
        found = _find_spec(body) if b"hotwire" in body else None
        if found is None:
            await self.app(scope, _replay(body, receive), send)
            return
        request, spec = found
        salt = request.get("cache_salt")
        if isinstance(salt, str) and salt.startswith(SALT_PREFIX):  # could forge a steered request's salt
            STATS.count_refusal("reserved_salt")
            refusal = HotwireError(400, "reserved_salt", f"cache_salt may not start with {SALT_PREFIX!r}", "cache_salt")
            await refusal.response()(scope, receive, send)
            return
        if spec is None:
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            engine = HotwireEngine.of(scope["app"])
            decided, pinned = await _decide(engine, spec)
        except HotwireError as err:
            STATS.count_refusal(err.code)
            if not (self.lenient and 400 <= err.status < 500):
                await err.response()(scope, receive, send)
                return
            del request["vllm_xargs"][SPEC_KEY]
            body = json.dumps(request, separators=(",", ":")).encode()
            lenient_send = _add_header(send, LENIENT_HEADER, f"{err.code}: {err.message}")
            await self.app(_with_length(scope, len(body)), _replay(body, receive), lenient_send)
            return
        ticket = secrets.token_hex(16)
        request["vllm_xargs"][SPEC_KEY] = pinned
        request["vllm_xargs"][TICKET_KEY] = ticket
        body = json.dumps(request, separators=(",", ":")).encode()
        answer = _Answer(engine, ticket, scope, receive, _add_header(send, RECEIPT_HEADER, decided))
        try:
            await self.app(_with_length(scope, len(body)), _replay(body, receive), answer.send)
        except Exception:
            # vLLM's /v1/responses stream raises while it turns a failed request into an event (0.25.1: a
            # pydantic ValidationError), which would end the connection without a response.
            if not await answer.explain_crash():
                raise
            return
        await answer.finish()


async def _decide(engine: HotwireEngine, spec: Any) -> tuple[str, str]:
    """The receipt and the pinned spec of an admitted request, or its refusal (:class:`HotwireError`, with the
    field named as in the request body)."""
    if not isinstance(spec, str):
        raise HotwireError(
            400, "bad_spec",
            f"{_FIELD} must be a JSON string, e.g. "
            '"vllm_xargs": {"hotwire": "{\\"id\\": \\"happy\\", \\"layer\\": 10, \\"scale\\": 4.0}"}',
            _FIELD,
        )
    arrived = time.monotonic()
    try:
        try:
            entries = parse_spec(spec)
        except SpecError as exc:
            raise Refusal(400, "bad_spec", str(exc), exc.field) from None
        if any(e.version is not None and CATALOG.lookup(e.vector_id, e.version) is None for e in entries):
            # A version the catalog does not hold as current may be retained in the engine: it decides.
            return await engine.check(spec)
        rules = await CATALOG.ready(engine)
        try:
            resolved = resolve(spec, CATALOG.lookup, rules)
        except Refusal as exc:
            if exc.code != "unknown_vector":
                raise
            # Registered since the last refresh (through another API server)? Only an answer the engine gave
            # after this request arrived can say no: a fetch already in flight may predate the registration.
            await CATALOG.refresh(engine, not_before=arrived)
            resolved = resolve(spec, CATALOG.lookup, rules)
    except (Refusal, HotwireError) as exc:
        raise _in_body(exc) from None
    return receipt(resolved), pinned_spec(resolved)


def _in_body(exc: Refusal | HotwireError) -> HotwireError:
    """A refusal with its field named as in the request body (``vllm_xargs.hotwire[0].id``)."""
    field = exc.field
    if field is not None and field.startswith(SPEC_KEY):
        field = f"vllm_xargs.{field}"
    return HotwireError(exc.status, exc.code, exc.message, field)


class _Answer:
    """The response to an admitted request, on its way to the client. A failed request's answer is replaced by
    the refusal the engine kept under the request's ticket, if it kept one (see the module docstring)."""

    def __init__(self, engine: HotwireEngine, ticket: str, scope: Scope, receive: Receive, send: Send):
        self.engine, self.ticket, self.scope, self.receive, self._send = engine, ticket, scope, receive, send
        self.responses_api = _path(scope) == "/v1/responses"
        self.held: list[Message] = []  # what the client has not been sent yet
        self.streaming = False
        self.started = False  # whether anything went to the client
        self.output = False  # whether a stream event carried output
        self.failed = False  # a 5xx start, or an error event
        self.explained = False
        self.replaced = False  # the refusal went out instead: the rest of vLLM's answer is dropped

    async def send(self, message: Message) -> None:
        if self.replaced:
            return
        if message["type"] == "http.response.start":
            self.streaming = _is_event_stream(message)
            self.failed = message.get("status", 200) >= 500
            self.held.append(message)
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        if self.streaming and not self.failed:
            await self._stream_body(message)
            return
        self.held.append(message)
        if not message.get("more_body", False):
            await self._end()

    async def _stream_body(self, message: Message) -> None:
        events = message.get("body", b"")
        if _is_error_event(events):
            refusal = await self._refusal()
            if refusal is not None and not self.started:
                await self._refuse(refusal)
                return
            if refusal is not None:
                message = {**message, "body": _error_event(refusal, self.responses_api)}
        elif not self.output and _carries_output(events):
            self.output = True
        if not self.started and not self.output and message.get("more_body", False):
            self.held.append(message)  # the start and the events before the first output wait
            return
        if not self.started and not self.output:  # the stream ended without output: refused?
            refusal = await self._refusal()
            if refusal is not None:
                await self._refuse(refusal)
                return
        await self._flush()
        await self._send(message)

    async def _end(self) -> None:
        """A whole (non-streamed or failed) response has been produced: send it, or the refusal behind it."""
        if self.failed:
            refusal = await self._refusal()
            if refusal is not None:
                await self._refuse(refusal)
                return
        await self._flush()

    async def _flush(self) -> None:
        held, self.held = self.held, []
        for message in held:
            await self._send(message)
        self.started = True

    async def _refusal(self) -> HotwireError | None:
        if self.explained:
            return None
        self.explained = True
        try:
            found = await self.engine.refusals([self.ticket])
        except HotwireError:
            return None
        refusal = found.get(self.ticket)  # counted by the engine (/steer/slots refused, /metrics)
        return None if refusal is None else _in_body(refusal)

    async def _refuse(self, refusal: HotwireError) -> None:
        self.held = []
        self.started = self.replaced = True
        await refusal.response()(self.scope, self.receive, self._send)

    async def explain_crash(self) -> bool:
        """The app raised: answer with the ticket's refusal if the engine kept one (the response, or the rest of
        the stream as an error event); False when it kept none (the crash is not about steering)."""
        if self.replaced:
            return True
        refusal = await self._refusal()
        if refusal is None:
            return False
        if not self.started:
            await self._refuse(refusal)
        else:
            await self._send({"type": "http.response.body", "body": _error_event(refusal, self.responses_api)})
        return True

    async def finish(self) -> None:
        """After the app returned: what is still held goes out (a stream the app left without a last body part)."""
        if self.held:
            await self._flush()


def _is_event_stream(start: Message) -> bool:
    for name, value in start.get("headers", []):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


def _event_data(events: bytes) -> list[Any]:
    """The JSON payloads of the ``data:`` lines of one or more SSE events (``[DONE]`` and junk left out)."""
    out = []
    for line in events.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            try:
                out.append(json.loads(line[len(b"data: "):]))
            except ValueError:
                out.append(None)
    return out


def _is_error_event(events: bytes) -> bool:
    """vLLM's error events: chat and completions ``data: {"error": {...}}``, responses ``"type": "error"``."""
    return any(isinstance(d, dict) and ("error" in d and "choices" not in d or d.get("type") == "error")
               for d in _event_data(events))


def _carries_output(events: bytes) -> bool:
    """Whether SSE events report generated tokens (their text may still be empty: a token can end inside a UTF-8
    character): completions' choices, chat's choices after its opening role chunk, a responses ``*.delta``.
    Responses' lifecycle events do not. An event that is not JSON counts as output."""
    for data in _event_data(events):
        if not isinstance(data, dict):
            return True
        if isinstance(data.get("type"), str):  # /v1/responses
            if data["type"].endswith(".delta"):
                return True
            continue
        choices = data.get("choices")
        if isinstance(choices, list) and any(
            not isinstance(c, dict) or not isinstance(c.get("delta"), dict) or "role" not in c["delta"] for c in choices
        ):
            return True
    return False


def _error_event(refusal: HotwireError, responses_api: bool) -> bytes:
    """An SSE error event with the refusal: OpenAI's ``error`` event on /v1/responses, else vLLM's chat and
    completions error chunk (``type`` = hotwire's code, ``param`` = field, ``code`` = status)."""
    if responses_api:
        event = {"type": "error", "code": refusal.code, "message": refusal.message, "param": refusal.field}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    error = {"message": refusal.message, "type": refusal.code, "param": refusal.field, "code": refusal.status}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", ""))


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _find_spec(body: bytes) -> tuple[dict[str, Any], Any] | None:
    """The parsed body and its ``vllm_xargs.hotwire`` (None when absent), or None when the body is not a JSON
    object (vLLM reports that itself)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    xargs = request.get("vllm_xargs")
    return request, (xargs.get(SPEC_KEY) if isinstance(xargs, dict) else None)


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
    # Header values must be printable ASCII on one line; engine messages and receipts are not trusted to be.
    encoded = "".join(c if " " <= c <= "~" else "?" for c in value)[:512].encode()

    async def send_with_header(message: Message) -> None:
        # Only on success: a request vLLM itself rejects was never steered.
        if message["type"] == "http.response.start" and message.get("status", 200) < 400:
            message = {**message, "headers": [*message.get("headers", []), (name, encoded)]}
        await send(message)

    return send_with_header
