"""Admission of steered requests on the OpenAI routes.

A pure ASGI middleware (responses, streamed or not, pass through untouched) for ``POST /v1/chat/completions``,
``/v1/completions`` and ``/v1/responses``. A body that mentions ``hotwire`` is parsed; when it carries
``vllm_xargs.hotwire`` (a JSON string spec) the engine admits it with ``hotwire_check`` before vLLM sees the
request: 400 for a bad spec, an unknown vector or layer; 429 (``Retry-After: 1``) when its rows cannot be pinned
now; 503 when the model cannot be steered. Admitted requests reach vLLM with their body unchanged and the
response carries ``x-hotwire-receipt``. With lenient mode a 4xx instead strips the spec, serves the request
unsteered and adds ``x-hotwire-lenient: <reason>``.

The engine checks again when it admits the request; if the spec changed meanwhile (its vector deleted, say)
the engine finishes the request with an error, which vLLM answers with a bare 500 "Internal server error" (or,
in a stream that has sent its 200 already, an error event with that message). The middleware then asks the
engine once more and, when the spec is now refused with a 4xx, answers that refusal instead: the 4xx response
for a non-streamed request; for a streamed chat or text completion whose events so far carried no generated
text, vLLM's error event in vLLM's shape with the refusal's message, its code as ``type``, its field as
``param`` and its status as ``code``. (``/v1/responses`` streams end without an error event in vLLM 0.25.1.)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.metrics import STATS
from hotwire_core.spec import SALT_PREFIX, SPEC_KEY

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_STREAM_ERROR = b'data: {"error"'  # how vLLM's error events in a stream begin
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
            if not isinstance(spec, str):
                raise HotwireError(
                    400,
                    "bad_spec",
                    f"{_FIELD} must be a JSON string, e.g. "
                    '"vllm_xargs": {"hotwire": "{\\"id\\": \\"happy\\", \\"layer\\": 10, \\"scale\\": 4.0}"}',
                    _FIELD,
                )
            engine = HotwireEngine.of(scope["app"])
            receipt = await _check(engine, spec)
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
        explained = _explain_engine_refusal(send, scope, receive, lambda: _refusal_now(engine, spec))
        await self.app(scope, _replay(body, receive), _add_header(explained, RECEIPT_HEADER, receipt))


async def _check(engine: HotwireEngine, spec: str) -> str:
    """The engine's receipt for ``spec``, or its refusal with the field named as in the request body."""
    try:
        return await engine.check(spec)
    except HotwireError as err:
        if err.field is not None and err.field.startswith(SPEC_KEY):
            err.field = f"vllm_xargs.{err.field}"
        raise


async def _refusal_now(engine: HotwireEngine, spec: str) -> HotwireError | None:
    """The 4xx the engine would give ``spec`` now (429 aside: a busy bank did not fail the request), else None."""
    try:
        await _check(engine, spec)
    except HotwireError as err:
        if 400 <= err.status < 500 and err.status != 429:
            err.message += " (the engine refused the steering after this request passed admission)"
            return err
    return None


def _explain_engine_refusal(
    send: Send, scope: Scope, receive: Receive, refusal_now: Callable[[], Awaitable[HotwireError | None]]
) -> Send:
    """Hold a 500 response until its last body part and send the spec's current refusal instead when there is
    one; in a stream, explain vLLM's error event the same way while no event before it carried generated output
    (an engine refusal comes with the request's first output: a later error is about something else)."""
    held: list[Message] = []
    generated = False

    async def send_explained(message: Message) -> None:
        nonlocal generated
        if message["type"] == "http.response.start" and message.get("status") == 500:
            held.append(message)
            return
        if not held:
            if not generated and message["type"] == "http.response.body":  # once output flowed: pass through
                body = message.get("body", b"")
                if body.startswith(_STREAM_ERROR):
                    message = await _explained_stream_error(message, refusal_now)
                elif body.startswith(b"data: "):
                    generated = _carries_output(body)
            await send(message)
            return
        held.append(message)
        if message["type"] == "http.response.body" and message.get("more_body", False):
            return
        refusal = await refusal_now()
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        for kept in held:
            await send(kept)

    return send_explained


async def _explained_stream_error(
    message: Message, refusal_now: Callable[[], Awaitable[HotwireError | None]]
) -> Message:
    """vLLM's event for a request the engine failed, ``data: {"error": {... "type": "InternalServerError" ...}}``,
    with the spec's current refusal in its place when there is one; any other event unchanged."""
    try:
        error = json.loads(message["body"][len(b"data: "):])["error"]
    except (ValueError, KeyError, TypeError):
        return message
    if not isinstance(error, dict) or error.get("type") != "InternalServerError":
        return message
    refusal = await refusal_now()
    if refusal is None:
        return message
    explained = {"message": refusal.message, "type": refusal.code, "param": refusal.field, "code": refusal.status}
    return {**message, "body": b"data: " + json.dumps({"error": explained}).encode() + b"\n\n"}


def _carries_output(event: bytes) -> bool:
    """Whether an OpenAI stream event carries generated text (completions ``text``, chat ``delta.content`` or
    tool calls); chat's opening role-only chunk does not. Unknown events count as output."""
    try:
        choices = json.loads(event[len(b"data: "):]).get("choices")
    except (ValueError, AttributeError):
        return True
    if not isinstance(choices, list):
        return True
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("text") or (isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
        )):
            return True
    return False


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
