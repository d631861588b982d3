"""What came back: the content of an answer of the OpenAI routes (whole or streamed as SSE events), and one
request's record (:class:`Observation`), judged after the run."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .steering import Spec

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
TOKEN_ROUTES = ("completions", "chat")  # routes that return token ids and top-2 logprobs


@dataclass
class Content:
    """What a response carried: token ids and runner-up token ids (token routes), text, the output token count
    (responses), whether it ended properly (a whole body, ``[DONE]`` or ``response.completed``), and the error
    event of a stream as (code, message)."""

    tokens: list[int] = field(default_factory=list)
    second: list[int | None] = field(default_factory=list)
    text: str = ""
    output_tokens: int | None = None
    complete: bool = False
    error: tuple[str, str] | None = None
    finish: str | None = None  # the last finish_reason (responses: the response's status)
    events: int = 0  # SSE data events read

    @property
    def has_output(self) -> bool:
        return bool(self.tokens or self.text or self.output_tokens)


@dataclass
class Observation:
    """One request and its outcome, judged after the run (times in seconds since the soak started)."""

    client: int
    route: str
    stream: bool
    spec: Spec
    prompt: int  # index into the prompts
    start: float
    end: float = 0.0
    ttft: float | None = None  # seconds to the first output event (streams)
    status: int | None = None
    receipt: str | None = None
    error_code: str | None = None  # of a non-200 body
    error_text: str = ""
    failure: tuple[str, str, str] | None = None  # (kind, reason, detail) of a transport failure or unreadable 200
    content: Content = field(default_factory=Content)


def token_id(text: str) -> int:
    """``"token_id:42"`` (vLLM's ``return_tokens_as_token_ids``) -> 42."""
    prefix, _, number = text.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise ValueError(f"not a token id: {text!r}")
    return int(number)


def runner_up(candidates: Iterable[tuple[str, float]]) -> int | None:
    """The second most likely token among (token, logprob) pairs, or None when there is none."""
    ranked = sorted(candidates, key=lambda c: c[1], reverse=True)
    return token_id(ranked[1][0]) if len(ranked) > 1 else None


def read_completion_choice(choice: dict[str, Any], content: Content) -> bool:
    """Add a /v1/completions choice (whole or a stream chunk); True when it carried output."""
    content.text += choice.get("text") or ""
    content.finish = choice.get("finish_reason") or content.finish
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    for token, top in zip(tokens, tops):
        content.tokens.append(token_id(token))
        content.second.append(runner_up((top or {}).items()))
    return bool(tokens or choice.get("text"))


def read_chat_choice(choice: dict[str, Any], content: Content) -> bool:
    """Add a /v1/chat/completions choice (``message``, or a stream chunk's ``delta``); True when it carried output."""
    message = choice.get("message") or choice.get("delta") or {}
    content.text += message.get("content") or ""
    content.finish = choice.get("finish_reason") or content.finish
    items = (choice.get("logprobs") or {}).get("content") or []
    for item in items:
        content.tokens.append(token_id(item["token"]))
        content.second.append(runner_up((t["token"], t["logprob"]) for t in item.get("top_logprobs") or []))
    return bool(items or message.get("content"))


def read_response_body(body: dict[str, Any], content: Content) -> None:
    """Add a whole /v1/responses answer (also ``response.completed``'s): its message text and output tokens."""
    content.text = "".join(
        part.get("text") or ""
        for item in body.get("output") or [] if item.get("type") == "message"
        for part in item.get("content") or [] if part.get("type") == "output_text"
    )  # fmt: skip
    content.output_tokens = (body.get("usage") or {}).get("output_tokens")
    content.finish = body.get("status") or content.finish
    error = body.get("error")
    if isinstance(error, dict):
        content.error = (str(error.get("code") or "error"), str(error.get("message") or ""))


def read_whole(route: str, body: dict[str, Any]) -> Content:
    """The content of a non-streamed 200 answer."""
    content = Content(complete=True)
    if route == "responses":
        read_response_body(body, content)
        return content
    (choice,) = body["choices"]
    (read_completion_choice if route == "completions" else read_chat_choice)(choice, content)
    return content


def read_event(route: str, event: str | None, data: str, content: Content) -> bool:
    """Add one SSE event (``event:`` name, ``data:`` payload) to ``content``; True when it carried output."""
    if data == "[DONE]":
        content.complete = True
        return False
    content.events += 1
    payload = json.loads(data)
    if route == "responses":
        kind = payload.get("type") or event
        if kind == "response.output_text.delta":
            content.text += payload.get("delta") or ""
            return bool(payload.get("delta"))
        if kind in ("response.completed", "response.incomplete"):
            text = content.text
            read_response_body(payload.get("response") or {}, content)
            content.text = content.text or text
            content.complete = True
        elif kind in ("error", "response.failed"):
            error = payload if kind == "error" else (payload.get("response") or {}).get("error") or {}
            content.error = (str(error.get("code") or kind), str(error.get("message") or ""))
        return False
    if "error" in payload:
        error = payload["error"] if isinstance(payload["error"], dict) else {"message": str(payload["error"])}
        content.error = (str(error.get("type") or error.get("code") or "error"), str(error.get("message") or ""))
        return False
    reader = read_completion_choice if route == "completions" else read_chat_choice
    return any([reader(choice, content) for choice in payload.get("choices") or []])


def error_code(body: bytes) -> tuple[str, str]:
    """(code, message) of an error body: hotwire's ``{"error": {"code": str, ...}}``, vLLM's OpenAI-shaped
    ``{"error": {"type": str, "code": int, ...}}``, or whatever else came."""
    try:
        error = json.loads(body)["error"]
        code = error.get("code")
        return (code if isinstance(code, str) else str(error.get("type") or code)), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unparseable", body[:200].decode(errors="replace")
