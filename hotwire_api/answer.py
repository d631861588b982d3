"""The response to an admitted steered request, on its way to the client (``hotwire_api.admission`` admits it).

Two things can make vLLM's answer wrong for such a request, and this module replaces the answer then:

- The engine refused the request (a pinned version past its retention, bank rows it waited for too long). vLLM
  reports that as a failed request: a bare 500, or a stream that ends with an error event or none at all. The
  engine keeps the refusal under the request's ticket; the client gets it as the refusal's own status and body
  when nothing of the response has reached it yet (a stream's start is held until its first event that carries
  output), else as an error event in the stream (OpenAI's shape: message, ``type`` = hotwire's code, ``param`` =
  field, ``code`` = status).
- vLLM delivered output although the request's ticket never reached the engine client (``hotwire_api.tickets``):
  the route dropped the spec on its way (beam search builds its own sampling parameters; a pooling handler has no
  room for one). The client gets 400 ``steering_unsupported`` instead of output that was not steered.

A request that reads probes (``hotwire_readout``) gets its values in the JSON body (``hotwire_readout``), taken from
the workers once the response is whole; if they cannot be had, the readout's error replaces the response. A stream
gets them in a chunk of their own before ``[DONE]`` (or an error event there), cut to the usage chunk's count, which
admission asks vLLM for (and which is dropped when the client did not ask for it). The monitors' verdicts
(``hotwire_monitors``, ``hotwire_api.reading``) come the same way; a request that only the monitors read is never
failed by them: when its values cannot be had, it goes out without verdicts (counted as skipped).

No request that was refused, or not steered or read as admitted, ends as a success.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError, in_body
from hotwire_api.monitors import skipped
from hotwire_api.readout_stream import StreamedReadout
from hotwire_api.tenancy import OPERATOR, Tenancy
from hotwire_api.tickets import Ticket
from hotwire_core.error_codes import ErrorCode
from hotwire_core.errors import EngineError
from hotwire_core.readout_results import readout_of
from hotwire_core.spec import SPEC_KEY

__all__ = ["Answer", "header_value", "with_header"]

if TYPE_CHECKING:
    from hotwire_api.reading import Reading


def _not_steered(path: str) -> HotwireError:
    return HotwireError(
        400, ErrorCode.STEERING_UNSUPPORTED,
        f"POST {path} answered this request without passing its steering to the engine (beam search, for one, "
        "builds sampling parameters of its own), so it was not served: drop the steering, or send it a way that "
        "generates with the request's own parameters", f"vllm_xargs.{SPEC_KEY}",
    )


class Answer:
    """vLLM's answer to one admitted request, passed on or replaced (see the module docstring)."""

    def __init__(self, engine: HotwireEngine, ticket_id: str, ticket: Ticket, scope: Scope, receive: Receive,
                 send: Send, path: str, reading: Reading | None = None, usage_wanted: bool = True,
                 required: bool = True, tenancy: Tenancy = OPERATOR, receipt: tuple[bytes, bytes] | None = None):
        self.engine, self.ticket_id, self.ticket, self.reading = engine, ticket_id, ticket, reading
        self.tenancy = tenancy  # whose names the vectors in refusals and readouts go out under
        self.receipt = receipt  # the steering receipt header, added to a response that is not an error
        self.required = required  # the client asked for steering or a readout (else only the monitors read it)
        self.usage_wanted = usage_wanted  # a stream's usage chunk goes out (admission asks for it for a readout)
        self._generated: int | None = None  # a readout stream's completion tokens, from its usage chunk
        self._chunk: dict[str, Any] = {}  # the id, object, created and model of a readout stream's chunks
        self._streamed: StreamedReadout | None = None  # a stream's readout token by token (readout_stream)
        self.scope, self.receive, self._send, self.path = scope, receive, send, path
        self.responses_api = path == "/v1/responses"
        self.held: list[Message] = []  # what the client has not been sent yet
        self.streaming = False
        self.status = 200
        self.started = False  # whether anything went to the client
        self.output = False  # whether the response delivered generated output
        self.explained = False
        self.replaced = False  # the refusal went out instead: the rest of vLLM's answer is dropped
        # A stream's events go out as they come once it is under way: nothing held, no readout to cut or add
        self._passing = False

    @property
    def failed(self) -> bool:
        return self.status >= 500

    async def send(self, message: Message) -> None:
        if self.replaced:
            return
        if message["type"] == "http.response.start":
            self.streaming = _is_event_stream(message)
            self.status = message.get("status", 200)
            self.held.append(message)
            if self.streaming and self.reading is not None and self.reading.tokens in ("generated", "all"):
                self._streamed = self.scope["app"].state.hotwire_streams.start(self.engine, self.reading.tag)
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        if self.streaming and not self.failed:
            events = message.get("body", b"")
            if self.output and (self._passing or self._unread(events)) and not _is_error_event(events):
                await self._send(message)  # what _stream_body does with such an event, without its checks
                return
            await self._stream_body(message)
            return
        self.held.append(message)
        if not message.get("more_body", False):
            await self._end()

    def _unread(self, events: bytes) -> bool:
        """Whether a read stream under way passes ``events`` on as they are (a monitored one's token events): no
        values stream with its tokens, and they hold neither the usage chunk nor the end, where its readout goes."""
        return (self.started and self.reading is not None and self._streamed is None
                and b'"usage"' not in events and b"[DONE]" not in events)

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
            if not self.ticket.presented and self.required:
                await self._refuse_or_end(_not_steered(self.path))
                return
            if not self.ticket.presented:
                self._unmonitored("not_sent")
        if not self.started and not self.output and message.get("more_body", False):
            self.held.append(message)  # the start and the events before the first output wait
            return
        if not self.started and not self.output:  # the stream ended without output: refused?
            refusal = await self._refusal()
            if refusal is not None:
                await self._refuse(refusal)
                return
        if self.reading is not None or not self.usage_wanted:
            message = await self._readout_in_stream(message)
        await self._flush()
        await self._send(message)

    async def _readout_in_stream(self, message: Message) -> Message:
        """A readout stream's events: its usage chunk read (and dropped when the client did not ask for usage), the
        values that arrived since the last chunk added to the last chunk with choices (``hotwire_readout``: ``from``
        and ``probes``, ``readout_stream``), and the readout's own chunk (``choices`` empty, the whole
        ``hotwire_readout``) or its error event put before ``[DONE]``."""
        events, last_choices = [], None
        for event in message.get("body", b"").split(b"\n\n"):
            if not event.strip():
                continue
            if event.strip() == b"data: [DONE]":
                self.close()
                readout = await self._readout_event() if self.reading is not None else b""
                if readout:
                    events.append(readout)
            elif self._streamed is not None or b'"usage"' in event:  # (else a token's event: nothing to read)
                found = _event_data(event)
                data = found[0] if len(found) == 1 else None
                if isinstance(data, dict) and data.get("usage") and not data.get("choices"):
                    self._generated = data["usage"].get("completion_tokens")
                    self._chunk = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
                    if not self.usage_wanted:
                        continue
                elif isinstance(data, dict) and data.get("choices"):
                    last_choices = (len(events), data)
            events.append(event)
        delta = self._streamed.pop() if self._streamed is not None and last_choices is not None else None
        if delta is not None:  # the client's probes only (the monitors' and a condition's follow them)
            delta["probes"] = delta["probes"][: self.reading.asked]
        if delta is not None and delta["probes"]:
            at, data = last_choices
            events[at] = b"data: " + json.dumps({**data, "hotwire_readout": self._named(delta)}).encode()
        return {**message, "body": b"".join(event + b"\n\n" for event in events)}

    def close(self) -> None:
        """No more chunks will carry streamed values (the stream ends, or its response is replaced)."""
        if self._streamed is not None:
            self.scope["app"].state.hotwire_streams.stop(self.reading.tag)
            self._streamed = None

    async def _readout_event(self) -> bytes:
        try:
            fields = await self._readout_fields(self._generated)
        except HotwireError as exc:
            return _error_event(exc, self.responses_api).strip()
        if not fields:
            return b""
        return b"data: " + json.dumps({**self._chunk, "choices": [], **fields}).encode()

    def _unmonitored(self, reason: str) -> None:
        """A request only the monitors read goes out without their verdicts."""
        skipped(reason)
        self.reading = None

    async def _readout_fields(self, generated: Any) -> dict[str, Any]:
        """The response's fields for the request's readout (``hotwire_core.readout_results``) over ``generated``
        tokens: ``hotwire_readout`` where the client asked for one, ``hotwire_monitors`` where monitors read it,
        ``hotwire_gate`` where the steering is gated. :class:`HotwireError` when the client's readout or the gate's
        receipt cannot be had; without either, no fields then."""
        reading = self.reading
        assert reading is not None
        try:
            if not isinstance(generated, int):
                raise HotwireError(500, ErrorCode.READOUT_LOST, "the response has no token count "
                                   "(usage.completion_tokens) to cut the readout to")
            answers = await self.scope["app"].state.hotwire_takes.take(self.engine, reading.tag)
            readout = readout_of(answers, reading.tag, generated)
            mine, verdicts = reading.split(readout)
        except (EngineError, HotwireError) as exc:
            if reading.owed:
                raise self.tenancy.error(HotwireError(exc.status, exc.code, exc.message, exc.field)) from None
            self._unmonitored("lost")
            return {}
        fields: dict[str, Any] = {} if mine is None else {"hotwire_readout": mine}
        if reading.monitors:
            fields["hotwire_monitors"] = [verdict.model_dump() for verdict in verdicts]
        if "gate" in readout:
            fields["hotwire_gate"] = readout["gate"]
        return self._named(fields)

    def _named(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Readout fields with the probes and conditions in them named as the client names them."""
        if self.tenancy.tenant is None:
            return fields
        return json.loads(self.tenancy.localize(json.dumps(fields)))

    async def _end(self) -> None:
        """A whole (non-streamed or failed) response has been produced: send it, or the refusal behind it."""
        if self.failed:
            refusal = await self._refusal()
            if refusal is not None:
                await self._refuse(refusal)
                return
        elif (not self.ticket.presented and self.status < 300
              and _delivers_output(b"".join(m.get("body", b"") for m in self.held[1:]))):
            if self.required:
                await self._refuse(_not_steered(self.path))
                return
            self._unmonitored("not_sent")
        elif self.reading is not None and self.status < 300:
            try:
                await self._attach_readout()
            except HotwireError as exc:
                await self._refuse(exc)
                return
        await self._flush()

    async def _attach_readout(self) -> None:
        """Put the request's readout fields (``_readout_fields``) into the JSON body, or raise
        :class:`HotwireError`: a response whose client asked for a readout never goes out without it."""
        try:
            data = json.loads(b"".join(m.get("body", b"") for m in self.held[1:]))
            generated = int(data["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            data, generated = None, None
        fields = await self._readout_fields(generated)
        if not fields:
            return
        data.update(fields)
        body = json.dumps(data, separators=(",", ":")).encode()
        start = self.held[0]
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        self.held = [{**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]},
                     {"type": "http.response.body", "body": body}]

    async def _flush(self) -> None:
        held, self.held = self.held, []
        for message in held:
            await self._send(with_header(message, self.receipt) if self.receipt else message)
        self.started = True
        self._passing = self.reading is None and self.usage_wanted and not self.replaced

    async def _refusal(self) -> HotwireError | None:
        if self.explained:
            return None
        self.explained = True
        try:
            found = await self.engine.refusals([self.ticket_id])
        except HotwireError:
            return None
        refusal = found.get(self.ticket_id)  # counted by the engine (/steer/slots refused, /metrics)
        return None if refusal is None else self.tenancy.error(in_body(refusal))

    async def _refuse(self, refusal: HotwireError) -> None:
        self.held = []
        self.started = self.replaced = True
        await refusal.response()(self.scope, self.receive, self._send)

    async def _refuse_or_end(self, refusal: HotwireError) -> None:
        """The refusal as the response if nothing went out yet, else as the stream's last event."""
        if not self.started:
            await self._refuse(refusal)
            return
        self.replaced = True
        await self._send({"type": "http.response.body", "body": _error_event(refusal, self.responses_api)})

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


def with_header(message: Message, header: tuple[bytes, bytes]) -> Message:
    """``message`` with ``header`` added if it starts a successful response: a request vLLM itself refused was
    neither steered nor served leniently."""
    if message["type"] == "http.response.start" and message.get("status", 200) < 400:
        return {**message, "headers": [*message.get("headers", []), header]}
    return message


def header_value(value: str) -> bytes:
    """``value`` as a header value: printable ASCII on one line (engine messages and receipts are not trusted to be),
    at most 512 characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in value)[:512].encode()


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
    if b"error" not in events:  # most events of a stream: no JSON to parse
        return False
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


def _delivers_output(body: bytes) -> bool:
    """Whether a whole JSON response carries results: ``choices`` (chat, completions), ``output`` (responses; a
    queued background response has none yet) or ``data`` (pooling). A body that is not JSON counts as output."""
    try:
        data = json.loads(body)
    except ValueError:
        return bool(body)
    return not isinstance(data, dict) or any(isinstance(data.get(k), list) and data[k] for k in ("choices", "output", "data"))


def _error_event(refusal: HotwireError, responses_api: bool) -> bytes:
    """An SSE error event with the refusal: OpenAI's ``error`` event on /v1/responses, else vLLM's chat and
    completions error chunk (``type`` = hotwire's code, ``param`` = field, ``code`` = status)."""
    if responses_api:
        event = {"type": "error", "code": refusal.code, "message": refusal.message, "param": refusal.field}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    error = {"message": refusal.message, "type": refusal.code, "param": refusal.field, "code": refusal.status}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
