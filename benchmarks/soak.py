"""Soak benchmark: many concurrent clients on every OpenAI route of a real ``vllm serve`` with hotwire, while
steering vectors are registered, replaced and deleted, with every response checked from its content.

What it measures
    Requests, failures by kind, throughput (req/s), latencies (TTFT of streams and total, p50/p99, plain vs
    steered), the API server's own ``GET /health`` beside ``GET /steer/slots?max_age_ms=1000`` (p50/p99, polled
    by a thread of its own, on its own connection), and at the end whether ``/steer/slots`` drains to 0 pinned.
    Writes a JSON report (``--out``) and a table on stdout; exits 1 when any failure count is non-zero
    (``--no-fail-exit``: report only).

How a response tells which vector and version steered it ("marker" vectors)
    Every vector is the direction of one LM-head row ``W_U[T]`` (``lm_head.weight``, or the embeddings when they
    are tied), registered as a ``[hidden]`` vector and steered at the last decoder layer with a scale far above
    the residual stream's own norm (calibrated at start). After the last layer there is only the final RMSNorm
    and the LM head, so the greedy token at every steered position is T, with a margin of several nats that
    batching numerics cannot move, and no KV changes. Hence, at temperature 0 with ``ignore_eos``:

    - one entry for both phases: every generated token is T;
    - ``decode_only``: token 0 is the model's own, every later one is T;
    - ``prefill_only``: token 0 is T (the last prompt token is steered), the rest is the model's own;
    - stacked, A at scale 2s and B at s: the greedy token is T_A and the runner-up (logprobs top-2) is T_B.

    Each id owns a pool of marker tokens (pools are disjoint); a new version of a churned id takes the next
    marker of its pool, so consecutive versions differ in content. The soak keeps (id, version) -> marker from
    the registration answers, and judges every response after the run against its ``x-hotwire-receipt``.
    Marker tokens decode to distinct printable ASCII, none a prefix or suffix of another (so text alone, on
    ``/v1/responses``, tells them apart), and exclude every token (and runner-up) of the prompts' plain answers.
    Completions and chat return token ids (``return_tokens_as_token_ids``); responses are read from their text.

Failure kinds (see :func:`classify`)
    ``wrong_vector`` (another id's marker, plain content for a steered request, a marker for a plain one),
    ``wrong_phase`` (a decode_only / prefill_only entry that steered the other phase too), ``receipt_mismatch``
    (the right id but another version than the receipt names, a receipt whose layers / scale / flags differ from
    the request, a missing receipt), ``silent_empty``, ``truncated`` (fewer tokens than ``max_tokens``),
    ``dropped`` (connection closed without a complete response), ``http_error`` (by status and code),
    ``stream_error`` (an error event after the 200), ``timeout``, ``rejected_429``, plus ``churn_error`` (a
    register / replace / delete that failed), ``poll_error`` and ``not_drained``. A 400 ``unknown_vector`` for a
    request one of whose ids was deleted while it was in flight is ``refused_expected``, not a failure.

Traffic
    ``--clients`` asyncio clients, each with its own ``httpx.AsyncClient`` (one keep-alive connection per client,
    as independent users have), each looping until ``--duration``: a spec class (plain 25 %, single 50 %, stacked
    10 %, decode_only 7.5 %, prefill_only 7.5 %; ``--mix plain|steered`` for throughput comparisons), a route
    (completions / chat completions / responses, uniform; stacked only on the first two), streamed or not
    (50/50), a prompt, and a scale drawn uniformly in [s, 1.5 s]. Two churn tasks replace one churned id every
    ``--replace-every`` s and delete and re-register another every ``--delete-every`` s (also under
    ``--mix plain``). A request whose bank rows are taken waits in the engine for them, whatever the number of
    clients against ``HOTWIRE_SLOTS`` (a server of its own gets ``--slots 16``): a 429 is a failure
    (``rejected_429``).

A fleet (several ``--url``: the replicas of one registry, ``HOTWIRE_REGISTRY``)
    Client i sends to server i mod n; each churned id's changes go through the servers in turn; versions are the
    fleet's, so one book of (id, version) -> marker judges every server's receipts. A re-registered id counts as
    present once every server holds its version (``GET /steer/vectors/ID``; a churn error after
    ``PROPAGATION_TIMEOUT_S``); the time that took is reported (``churn.latency_ms.propagation``). The poller and
    the calibration use the first server; every server must drain.

Run it::

    # starts its own server (tiny float32 model with random weights; CPU: --enforce-eager), HOTWIRE_SLOTS=16
    python benchmarks/soak.py --duration 60 --out soak.json
    # saturation, plain vs steered throughput: more clients than the engine's batch
    python benchmarks/soak.py --slots 64 --clients 32 --mix plain --out plain.json --server-arg=--max-num-seqs=8
    python benchmarks/soak.py --slots 64 --clients 32 --mix steered --out steered.json --server-arg=--max-num-seqs=8
    # an already running server: --model names the served folder (the LM head weights give the markers)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --model /models/qwen3-8b --clients 64
    # the replicas of a fleet (one Redis registry), each addressed directly
    python benchmarks/soak.py --url http://10.0.0.1:8000 --url http://10.0.0.2:8000 --model /models/qwen3-8b
    # a bigger model on a GPU, extra server arguments passed through
    python benchmarks/soak.py --model /models/qwen3-8b --server-arg=--max-num-seqs=128 --clients 128
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hotwire_api.server_process import ServerExited
from hotwire_core.cpu_env import with_cpu_env

RECEIPT_HEADER = "x-hotwire-receipt"
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
TOKEN_ROUTES = ("completions", "chat")  # routes that return token ids and top-2 logprobs
CLASS_WEIGHTS = {"plain": 0.25, "single": 0.5, "stacked": 0.10, "decode_only": 0.075, "prefill_only": 0.075}
PHASE_OF = {"single": "all", "stacked": "all", "decode_only": "decode", "prefill_only": "prefill"}
FAILURE_KINDS = (
    "wrong_vector", "wrong_phase", "receipt_mismatch", "silent_empty", "truncated", "dropped", "http_error",
    "stream_error", "timeout", "rejected_429", "churn_error", "poll_error", "not_drained",
)  # fmt: skip
PROMPTS = (
    "The quick brown fox jumps over",
    "Hello, how are you today?",
    "Once upon a time there was a tiny model",
    "Steering vectors nudge the residual stream of a language model.",
    "0123456789 + - * / = ( ) [ ] { }",
    "vLLM serves many requests at once with continuous batching and CUDA graphs. " * 6,
)
STRENGTH_GRID = tuple(4.0**k for k in range(-2, 10))  # candidate steering norms, up to ~2.6e5
STRENGTH_FACTOR = 128.0  # the soak steers this much harder than the weakest grid strength that already wins
MAX_ADDED = {"float16": 4096.0}  # hotwire's too_strong limit on the norm a request adds (1e6 otherwise)
PROPAGATION_TIMEOUT_S = 5.0  # a fleet serves a change everywhere within 1 s p99: five times that is a churn error
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "HOTWIRE_STORE": "off"}  # values set already win


class CalibrationError(RuntimeError):
    """The model or server cannot give the soak markers that steer as it needs: no verdict could be trusted."""


# -- receipts ----------------------------------------------------------------------------------------------------

_RECEIPT_ENTRY = re.compile(
    r"(?P<id>[A-Za-z0-9_][A-Za-z0-9._-]{0,63})@(?P<version>\d+):L(?P<layers>\d+(?:\+\d+)*)"
    r"x(?P<scale>[^,;]+)(?P<flags>(?:,[a-z_]+)*)"
)


@dataclass(frozen=True)
class ReceiptEntry:
    """One entry of ``x-hotwire-receipt``: ``id@version:L<layers joined by +>x<scale :g>`` and flags ``,norm``,
    ``,decode_only`` / ``,prefill_only`` (hotwire_core/admission.py ``receipt``; before 528d6ca controller.py)."""

    vector_id: str
    version: int
    layers: tuple[int, ...]
    scale: float
    flags: frozenset[str]


def parse_receipt(text: str) -> tuple[ReceiptEntry, ...]:
    """Entries of a receipt (joined by ``;``); raises ValueError for one that does not read."""
    entries = []
    for part in text.split(";"):
        match = _RECEIPT_ENTRY.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"unreadable receipt entry {part!r}")
        layers = tuple(int(x) for x in match["layers"].split("+"))
        flags = frozenset(f for f in match["flags"].split(",") if f)
        entries.append(ReceiptEntry(match["id"], int(match["version"]), layers, float(match["scale"]), flags))
    return tuple(entries)


# -- what a request asks for -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One steering entry as sent; ``phase`` is ``all``, ``decode`` or ``prefill``; ``as_list`` sends the layer
    as ``[layer]``."""

    vector_id: str
    layer: int
    scale: float
    phase: str = "all"
    as_list: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.vector_id, "layer": [self.layer] if self.as_list else self.layer,
                               "scale": self.scale}  # fmt: skip
        if self.phase != "all":
            out[f"{self.phase}_only"] = True
        return out

    @property
    def flags(self) -> frozenset[str]:
        return frozenset() if self.phase == "all" else frozenset({f"{self.phase}_only"})


@dataclass(frozen=True)
class Spec:
    """A request's steering: ``kind`` is a key of :data:`CLASS_WEIGHTS`; no entries for ``plain``."""

    kind: str
    entries: tuple[Entry, ...] = ()

    def wire(self) -> str | None:
        """The ``vllm_xargs.hotwire`` string, or None for a plain request."""
        if not self.entries:
            return None
        values = [e.to_json() for e in self.entries]
        return json.dumps(values[0] if len(values) == 1 else values)

    @property
    def steered(self) -> bool:
        return bool(self.entries)


def receipt_problem(entries: Sequence[Entry], receipt: Sequence[ReceiptEntry]) -> str | None:
    """How a receipt disagrees with the request's entries (ids, layers, float32 scale to 6 digits, flags), or None."""
    if len(entries) != len(receipt):
        return f"receipt has {len(receipt)} entries for {len(entries)} requested"
    for i, (sent, got) in enumerate(zip(entries, receipt)):
        scale32 = float(np.float32(sent.scale))
        if got.vector_id != sent.vector_id:
            return f"entry {i}: receipt names id {got.vector_id!r}, request {sent.vector_id!r}"
        if got.layers != (sent.layer,):
            return f"entry {i}: receipt layers {got.layers}, request {(sent.layer,)}"
        if not math.isclose(got.scale, scale32, rel_tol=1e-5, abs_tol=1e-30):
            return f"entry {i}: receipt scale {got.scale:g}, request {scale32:g}"
        if got.flags != sent.flags:
            return f"entry {i}: receipt flags {sorted(got.flags)}, request {sorted(sent.flags)}"
    return None


# -- which marker means which (id, version) ------------------------------------------------------------------------


class MarkerBook:
    """Marker tokens: their text, the id that owns each (pools are disjoint), the token each registered (id,
    version) carries, and when each id was (possibly) unregistered."""

    def __init__(self, texts: dict[int, str], pools: dict[str, list[int]]):
        self.text = texts
        self.pools = pools
        self.owner = {token: vector_id for vector_id, pool in pools.items() for token in pool}
        assert len(self.owner) == sum(len(p) for p in pools.values()), "marker pools overlap"
        self.versions: dict[tuple[str, int], int] = {}
        self.current: dict[str, int] = {}  # id -> marker of its latest registered version
        self.conflicts: list[str] = []  # one (id, version) answered twice with different markers
        self._absent: dict[str, list[list[float]]] = defaultdict(list)

    def next_marker(self, vector_id: str) -> int:
        """The marker the next version of ``vector_id`` takes: the one after its current version's."""
        pool = self.pools[vector_id]
        current = self.current.get(vector_id)
        return pool[0] if current is None else pool[(pool.index(current) + 1) % len(pool)]

    def record(self, vector_id: str, version: int, token: int) -> None:
        known = self.versions.get((vector_id, version))
        if known is not None and known != token:
            self.conflicts.append(f"{vector_id}@{version} answered with markers {known} and {token}")
        self.versions[(vector_id, version)] = token
        self.current[vector_id] = token

    def marker(self, vector_id: str, version: int) -> int | None:
        return self.versions.get((vector_id, version))

    def versions_with(self, vector_id: str, token: int) -> list[int]:
        return sorted(v for (i, v), t in self.versions.items() if i == vector_id and t == token)

    def absent_from(self, vector_id: str, at: float) -> None:
        """``vector_id`` may be unregistered from ``at`` (its delete was sent) until :meth:`present_again`."""
        self._absent[vector_id].append([at, math.inf])

    def present_again(self, vector_id: str, at: float) -> None:
        if self._absent[vector_id]:
            self._absent[vector_id][-1][1] = at

    def was_absent(self, vector_ids: Iterable[str], start: float, end: float) -> bool:
        """Whether any of the ids may have been unregistered at some moment of [start, end]."""
        return any(a <= end and start <= b for i in vector_ids for a, b in self._absent.get(i, ()))

    def describe(self, token: int | None) -> str:
        if token is None:
            return "no marker"
        owner = self.owner.get(token)
        if owner is None:
            return f"token {token} (no marker)"
        versions = ",".join(map(str, self.versions_with(owner, token))) or "?"
        return f"marker {self.text.get(token, '?')!r} of {owner}@{versions}"


# -- what came back --------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Verdict:
    """``kind``: "ok", "refused_expected" or one of FAILURE_KINDS; ``reason``: a short fixed phrase to count by;
    ``detail``: what exactly was seen."""

    kind: str
    reason: str = ""
    detail: str = ""


OK = Verdict("ok")


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


# -- judging a response ---------------------------------------------------------------------------------------------


def classify(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict:
    """The verdict on one response: its transport, then emptiness, then content against the receipt."""
    verdict = _transport_verdict(obs, book) or _size_verdict(obs, max_tokens)
    if verdict is None:
        verdict = _steered_verdict(obs, book, max_tokens) if obs.spec.steered else _plain_verdict(obs, book, max_tokens)
    return verdict or OK


def _transport_verdict(obs: Observation, book: MarkerBook) -> Verdict | None:
    if obs.failure is not None:
        return Verdict(*obs.failure)
    if obs.status != 200:
        if obs.status == 429:
            return Verdict("rejected_429", str(obs.error_code), obs.error_text[:200])
        ids = [e.vector_id for e in obs.spec.entries]
        if obs.status == 400 and obs.error_code == "unknown_vector" and book.was_absent(ids, obs.start, obs.end):
            return Verdict("refused_expected", "unknown_vector while its id was deleted")
        return Verdict("http_error", f"{obs.status}:{obs.error_code}", obs.error_text[:300])
    if obs.content.error is not None:  # an error event, or an error in a 200's body
        code, message = obs.content.error
        if obs.stream:
            return Verdict("stream_error", code, message[:300])
        return Verdict("http_error", f"200:{code}", message[:300])
    if obs.stream and not obs.content.complete:
        if obs.content.has_output:
            return Verdict("dropped", "stream ended without its final event")
        return Verdict("silent_empty", "stream ended with no output and no error event")
    return None


def _size_verdict(obs: Observation, max_tokens: int) -> Verdict | None:
    content = obs.content
    if not content.has_output:
        return Verdict("silent_empty", "200 with no generated token")
    count = len(content.tokens) if obs.route in TOKEN_ROUTES else content.output_tokens
    if count is not None and count < max_tokens:
        return Verdict("truncated", "fewer tokens than max_tokens", f"{count} of {max_tokens} tokens")
    return None


def _plain_verdict(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict | None:
    if obs.receipt is not None:
        return Verdict("receipt_mismatch", "receipt on a plain request", obs.receipt)
    threshold = max(2, max_tokens // 2)
    if obs.route in TOKEN_ROUTES:
        counts = Counter(t for t in obs.content.tokens if t in book.owner)
        shown = [t for t, n in counts.items() if n >= threshold]
    else:
        shown = [t for t in book.owner if book.text[t] * threshold in obs.content.text]
    if shown:
        return Verdict("wrong_vector", "plain request shows a marker", book.describe(shown[0]))
    return None


def _steered_verdict(obs: Observation, book: MarkerBook, max_tokens: int) -> Verdict | None:
    receipt, problem = _read_receipt(obs, book)
    if problem is None:
        expected = [book.marker(r.vector_id, r.version) for r in receipt]
    else:
        expected = [None] * len(obs.spec.entries)
    verdict = _content_verdict(obs, book, max_tokens, expected)
    if verdict is None and problem is not None:
        return Verdict("receipt_mismatch", *problem)
    return verdict


def _read_receipt(obs: Observation, book: MarkerBook) -> tuple[tuple[ReceiptEntry, ...], tuple[str, str] | None]:
    """The receipt's entries, and (reason, detail) when it cannot vouch for the content: missing, unreadable,
    not matching the request, or naming a version the soak never registered."""
    if obs.receipt is None:
        return (), ("no receipt on a steered answer", "")
    try:
        receipt = parse_receipt(obs.receipt)
    except ValueError as exc:
        return (), ("unreadable receipt", str(exc))
    problem = receipt_problem(obs.spec.entries, receipt)
    if problem is not None:
        return receipt, ("receipt differs from the request", problem)
    unknown = [f"{r.vector_id}@{r.version}" for r in receipt if book.marker(r.vector_id, r.version) is None]
    if unknown:
        return receipt, ("receipt names a version never registered", ", ".join(unknown))
    return receipt, None


def _content_verdict(obs: Observation, book: MarkerBook, n: int, expected: list[int | None]) -> Verdict | None:
    """Whether what steered each entry's region is the marker its receipt version carries."""
    entries = obs.spec.entries
    content = obs.content
    if obs.spec.kind == "stacked":
        first, second = entries
        return (_judge_region(content.tokens[:n], expected[0], first.vector_id, book, "top-1")
                or _judge_region(content.second[:n], expected[1], second.vector_id, book, "runner-up"))  # fmt: skip
    (entry,) = entries
    if obs.route in TOKEN_ROUTES:
        region = {"all": content.tokens[:n], "decode": content.tokens[1:n], "prefill": content.tokens[:1]}[entry.phase]
    else:
        region = text_region(content.text, entry.phase, n, book)
    return _judge_region(region, expected[0], entry.vector_id, book, entry.phase) or _off_phase(obs, entry, book, n)


def text_region(text: str, phase: str, n: int, book: MarkerBook) -> list[int | None]:
    """The markers a text shows where ``phase`` steers, as if read token by token: ``[m] * k`` when that region
    is k copies of marker m's text (all: the whole text, n copies; decode: its end, n - 1; prefill: its start,
    one), else ``[None]``. Marker texts are prefix- and suffix-free, so at most one marker fits."""
    for token, mark in book.text.items():
        if phase == "all" and text == mark * n:
            return [token] * n
        if phase == "decode" and n > 1 and text.endswith(mark * (n - 1)) and text != mark * n:
            return [token] * (n - 1)
        if phase == "prefill" and text.startswith(mark):
            return [token]
    return [None]


def _judge_region(
    region: Sequence[int | None], expected: int | None, vector_id: str, book: MarkerBook, where: str
) -> Verdict | None:
    """None when every token of the region is ``expected``; with ``expected`` None (no usable receipt), when
    they are all one marker of ``vector_id``."""
    if expected is not None and region and all(t == expected for t in region):
        return None
    foreign = [t for t in region if t is not None and book.owner.get(t) not in (None, vector_id)]
    if foreign:
        return Verdict("wrong_vector", f"{where}: another id's marker",
                       f"{vector_id} requested, content shows {book.describe(foreign[0])}")  # fmt: skip
    unsteered = sum(1 for t in region if t is None or t not in book.owner)
    if unsteered or not region:
        return Verdict("wrong_vector", f"{where}: unsteered content",
                       f"{unsteered} of {len(region)} steered positions unsteered ({vector_id})")  # fmt: skip
    shown = sorted(set(region), key=str)
    if expected is None and len(shown) == 1:
        return None
    return Verdict(
        "receipt_mismatch",
        f"{where}: content of another version",
        f"content shows {', '.join(book.describe(t) for t in shown)}; "
        f"the receipt's version carries {book.describe(expected)}",
    )


def _off_phase(obs: Observation, entry: Entry, book: MarkerBook, n: int) -> Verdict | None:
    """A decode_only entry that steered token 0 too, or a prefill_only one that steered the generated tokens."""
    if entry.phase == "all":
        return None
    mine = set(book.pools[entry.vector_id])
    if obs.route in TOKEN_ROUTES:
        tokens = obs.content.tokens
        off = tokens[:1] if entry.phase == "decode" else tokens[1:n]
        steered_off = bool(off) and all(t in mine for t in off)
    else:
        steered_off = any(obs.content.text == book.text[t] * n for t in mine)
    if steered_off:
        return Verdict("wrong_phase", f"{entry.phase}_only steered the other phase too", entry.vector_id)
    return None


# -- summaries -------------------------------------------------------------------------------------------------------


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p99 and max in milliseconds (None when empty)."""
    if not seconds:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ms = np.asarray(seconds) * 1e3
    return {"n": len(ms), "p50": round(float(np.percentile(ms, 50)), 2), "p99": round(float(np.percentile(ms, 99)), 2),
            "max": round(float(ms.max()), 2)}  # fmt: skip


def example(obs: Observation, verdict: Verdict, book: MarkerBook) -> dict[str, Any]:
    """What to show of one judged request."""
    content = obs.content
    error = content.error or ((obs.error_code, obs.error_text[:300]) if obs.error_code else None)
    return {
        "reason": verdict.reason,
        "detail": verdict.detail,
        "route": obs.route,
        "stream": obs.stream,
        "class": obs.spec.kind,
        "spec": obs.spec.wire(),
        "prompt": obs.prompt,
        "t_start": round(obs.start, 3),
        "t_end": round(obs.end, 3),
        "status": obs.status,
        "receipt": obs.receipt,
        "tokens": content.tokens,
        "tokens_as": [book.text.get(t, "·") for t in content.tokens],
        "runner_up": content.second if obs.spec.kind == "stacked" else None,
        "text": content.text,
        "output_tokens": content.output_tokens,
        "finish": content.finish,
        "events": content.events,
        "error": error,
    }


def route_key(obs: Observation) -> str:
    return f"{obs.route}{'/stream' if obs.stream else ''}"


def judge_all(observations: Sequence[Observation], book: MarkerBook, max_tokens: int, examples_per_kind: int = 5
              ) -> dict[str, Any]:  # fmt: skip
    """Counts by verdict kind, by detail and by route, and a few examples per failure kind."""
    kinds: Counter[str] = Counter()
    details: dict[str, Counter[str]] = defaultdict(Counter)
    routes: dict[str, Counter[str]] = defaultdict(Counter)
    examples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    verdicts = []
    for obs in observations:
        verdict = classify(obs, book, max_tokens)
        verdicts.append(verdict)
        kinds[verdict.kind] += 1
        if verdict.kind == "ok":
            continue
        details[verdict.kind][verdict.reason] += 1
        routes[verdict.kind][route_key(obs)] += 1
        if len(examples[verdict.kind]) < examples_per_kind:
            examples[verdict.kind].append(example(obs, verdict, book))
    return {"kinds": kinds, "details": details, "routes": routes, "examples": examples, "verdicts": verdicts}


# -- the model's markers and the steering strength -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What the soak reads from the served model's folder."""

    n_layers: int
    dtype: str
    unembedding: np.ndarray  # [vocab, hidden] float32: the LM head rows


def read_model(model_dir: Path) -> ModelFacts:
    """Layer count, dtype and the LM head (or the tied embeddings) of an HF folder with safetensors weights."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    n_layers = int(text.get("num_hidden_layers") or config["num_hidden_layers"])
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16")
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    embeddings = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                  "language_model.model.embed_tokens.weight"]  # fmt: skip
    names = ([] if tied else ["lm_head.weight"]) + embeddings
    return ModelFacts(n_layers, dtype, _read_tensor(model_dir, names))


def _read_tensor(model_dir: Path, names: Sequence[str]) -> np.ndarray:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    files = sorted(model_dir.glob("*.safetensors"))
    for name in names:
        for path in [model_dir / weight_map[name]] if name in weight_map else files:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    return f.get_tensor(name).float().numpy()
    raise CalibrationError(f"none of {list(names)} in {model_dir}'s safetensors files")


def printable_marker_text(text: str) -> bool:
    return bool(text) and all("!" <= c <= "~" for c in text)


def choose_markers(texts: dict[int, str], norms: np.ndarray, excluded: set[int], count: int, seed: int) -> list[int]:
    """``count`` marker tokens: printable ASCII without spaces, none a prefix or suffix of another (nor equal),
    not in ``excluded``, with an LM-head row norm within 0.8-1.25x the candidates' median (so stacked entries
    rank by scale alone). Shortest texts first, in a seeded random order."""
    candidates = [t for t, s in texts.items() if printable_marker_text(s) and t not in excluded]
    if not candidates:
        raise ValueError("no printable marker token outside the excluded ones")
    median = float(np.median(norms[candidates]))
    rng = random.Random(seed)
    ranked = sorted((t for t in candidates if 0.8 * median <= norms[t] <= 1.25 * median),
                    key=lambda t: (len(texts[t]), rng.random()))  # fmt: skip
    chosen: list[int] = []
    for token in ranked:
        text = texts[token]
        if all(not (texts[c].startswith(text) or text.startswith(texts[c]) or texts[c].endswith(text)
                    or text.endswith(texts[c])) for c in chosen):  # fmt: skip
            chosen.append(token)
            if len(chosen) == count:
                return chosen
    raise ValueError(f"only {len(chosen)} marker tokens available, {count} needed: use fewer ids or a smaller --pool")


def single_token_texts(model_dir: Path, vocab_rows: int) -> dict[int, str]:
    """Each ordinary token's text, for tokens whose repetition decodes to the repeated text (byte-level BPE:
    all; SentencePiece word-start tokens: not); special and added tokens left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    skip = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    texts = {}
    for t in range(min(len(tok), vocab_rows)):
        if t in skip:
            continue
        text = tok.decode([t])
        if printable_marker_text(text) and tok.decode([t, t, t]) == text * 3:
            texts[t] = text
    return texts


def unit(row: np.ndarray) -> np.ndarray:
    return (row / np.linalg.norm(row)).astype(np.float32)


# -- the run's plan -------------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    """The knobs of one soak (see ``--help``)."""

    clients: int = 8
    duration: float = 60.0
    ids: int = 40
    churned: int = 8
    pool: int = 3
    max_tokens: int = 8
    replace_every: float = 0.3
    delete_every: float = 0.7
    absent_for: float = 0.05
    churn_share: float = 0.5
    mix: str = "all"
    poll_every: float = 0.05
    request_timeout: float = 120.0
    drain_timeout: float = 30.0
    strength: float | None = None
    seed: int = 0
    api_key: str | None = None
    id_prefix: str = "soak"
    keep_vectors: bool = False


@dataclass
class Plan:
    """What the clients draw from: the served model's name, the steered layer, prompts, ids and the strength."""

    model: str
    layer: int
    strength: float
    static: list[str]
    churned: list[str]
    config: SoakConfig

    def draw(self, rng: random.Random) -> tuple[str, bool, Spec, int]:
        """(route, streamed, spec, prompt index) of one request."""
        kind = self._draw_class(rng)
        route = rng.choice(("completions", "chat") if kind == "stacked" else tuple(PATHS))
        return route, rng.random() < 0.5, self._draw_spec(rng, kind), rng.randrange(len(PROMPTS))

    def _draw_class(self, rng: random.Random) -> str:
        weights = dict(CLASS_WEIGHTS)
        if self.config.mix == "plain":
            return "plain"
        if self.config.mix == "steered":
            weights.pop("plain")
        return rng.choices(list(weights), list(weights.values()))[0]

    def _pick_id(self, rng: random.Random, avoid: str | None = None) -> str:
        while True:
            churned = self.churned and (not self.static or rng.random() < self.config.churn_share)
            vector_id = rng.choice(self.churned if churned else self.static)
            if vector_id != avoid:
                return vector_id

    def _draw_spec(self, rng: random.Random, kind: str) -> Spec:
        if kind == "plain":
            return Spec(kind)
        scale = rng.uniform(1.0, 1.5) * self.strength
        first = self._pick_id(rng)
        as_list = rng.random() < 0.5
        if kind == "stacked":
            second = self._pick_id(rng, avoid=first)
            return Spec(kind, (Entry(first, self.layer, 2 * scale, as_list=as_list), Entry(second, self.layer, scale)))
        return Spec(kind, (Entry(first, self.layer, scale, PHASE_OF[kind], as_list),))


def request_body(plan: Plan, route: str, stream: bool, spec: Spec, prompt: str, top: int = 2) -> dict[str, Any]:
    """The JSON body of one request: temperature 0, ``ignore_eos``, token ids with top-``top`` logprobs."""
    body: dict[str, Any] = {"model": plan.model, "temperature": 0, "ignore_eos": True, "stream": stream}
    n = plan.config.max_tokens
    if route == "completions":
        body |= {"prompt": prompt, "max_tokens": n, "logprobs": top, "return_tokens_as_token_ids": True}
    elif route == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "logprobs": True,
                 "top_logprobs": top, "return_tokens_as_token_ids": True}  # fmt: skip
    else:
        body |= {"input": prompt, "max_output_tokens": n}
    wire = spec.wire()
    if wire is not None:
        body["vllm_xargs"] = {"hotwire": wire}
    return body


# -- sending ---------------------------------------------------------------------------------------------------------


class Clock:
    """Seconds since the soak started."""

    def __init__(self) -> None:
        self.origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.origin


async def send(http: httpx.AsyncClient, plan: Plan, clock: Clock, client: int, draw: tuple[str, bool, Spec, int]
               ) -> Observation:  # fmt: skip
    """Send one request and record what came back (never raises for the server's doing)."""
    route, stream, spec, prompt = draw
    obs = Observation(client, route, stream, spec, prompt, clock.now())
    body = request_body(plan, route, stream, spec, PROMPTS[prompt])
    try:
        if stream:
            await _send_streamed(http, body, obs, clock)
        else:
            await _send_whole(http, body, obs)
    except httpx.TimeoutException as exc:
        obs.failure = ("timeout", type(exc).__name__, str(exc))
    except httpx.TransportError as exc:
        when = "after the headers" if obs.status else "before any response"
        events = f" and {obs.content.events} events" if obs.status else ""
        obs.failure = ("dropped", f"{type(exc).__name__} {when}", f"{exc or '(no message)'} ({when}{events})")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a 200 that does not read
        obs.failure = ("http_error", f"{obs.status}:unreadable", f"{type(exc).__name__}: {exc}")
    obs.end = clock.now()
    return obs


async def _send_whole(http: httpx.AsyncClient, body: dict[str, Any], obs: Observation) -> None:
    response = await http.post(PATHS[obs.route], json=body)
    _note_headers(response, obs)
    if response.status_code == 200:
        obs.content = read_whole(obs.route, response.json())
    else:
        obs.error_code, obs.error_text = error_code(response.content)


async def _send_streamed(http: httpx.AsyncClient, body: dict[str, Any], obs: Observation, clock: Clock) -> None:
    async with http.stream("POST", PATHS[obs.route], json=body) as response:
        _note_headers(response, obs)
        if response.status_code != 200:
            obs.error_code, obs.error_text = error_code(await response.aread())
            return
        event: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if read_event(obs.route, event, line[5:].strip(), obs.content) and obs.ttft is None:
                    obs.ttft = clock.now() - obs.start
                event = None


def _note_headers(response: httpx.Response, obs: Observation) -> None:
    obs.status = response.status_code
    obs.receipt = response.headers.get(RECEIPT_HEADER)


def _client(url: str, config: SoakConfig, connections: int = 1) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=url, headers=headers, timeout=httpx.Timeout(config.request_timeout, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )  # fmt: skip


async def client_loop(index: int, url: str, plan: Plan, clock: Clock, until: float, out: list[Observation]) -> None:
    rng = random.Random(plan.config.seed * 1000 + index)
    async with _client(url, plan.config) as http:
        while clock.now() < until:
            out.append(await send(http, plan, clock, index, plan.draw(rng)))


# -- registering and churning vectors --------------------------------------------------------------------------------


@dataclass
class Churn:
    """What the churn tasks did."""

    replaced: int = 0
    deleted: int = 0
    registered: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[dict[str, Any]] = field(default_factory=list)
    by_server: Counter[str] = field(default_factory=Counter)  # registrations and deletions sent to each server


def server_of(http: httpx.AsyncClient) -> str:
    """The URL a client sends to, as given (httpx adds a slash to a base URL)."""
    return str(http.base_url).rstrip("/")


def vector_body(vector_id: str, vector: np.ndarray) -> dict[str, Any]:
    return {"id": vector_id, "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32",
            "shape": list(vector.shape)}  # fmt: skip


async def register(http: httpx.AsyncClient, book: MarkerBook, rows: np.ndarray, vector_id: str, replace: bool,
                   churn: Churn, clock: Clock) -> int | None:  # fmt: skip
    """Register the next version of ``vector_id`` (its next marker) and note it; its version, None on failure."""
    token = book.next_marker(vector_id)
    began = clock.now()
    what = "replace" if replace else "register"
    churn.by_server[server_of(http)] += 1
    try:
        response = await http.post("/steer/vectors" + ("?replace=true" if replace else ""),
                                   json=vector_body(vector_id, unit(rows[token])))  # fmt: skip
    except httpx.HTTPError as exc:
        churn.errors.append({"what": what, "id": vector_id, "t": round(began, 3),
                             "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        return None
    churn.latencies[what].append(clock.now() - began)
    if response.status_code not in (200, 201):
        churn.errors.append({"what": what, "id": vector_id, "t": round(began, 3), "status": response.status_code,
                             "error": response.text[:300]})  # fmt: skip
        return None
    version = int(response.json()["version"])
    book.record(vector_id, version, token)
    churn.registered += 1
    return version


async def everywhere(https: Sequence[httpx.AsyncClient], vector_id: str, version: int, churn: Churn, clock: Clock
                     ) -> bool:  # fmt: skip
    """Wait until every server (the replicas of a fleet: versions are global) holds ``vector_id`` at ``version``
    or later, up to PROPAGATION_TIMEOUT_S (a churn error after that); notes the time it took. At once with one."""
    if len(https) < 2:
        return True
    began = clock.now()
    pending = list(https)
    while True:
        behind = []
        for http in pending:
            try:
                response = await http.get(f"/steer/vectors/{vector_id}")
                held = int(response.json()["version"]) if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                held = None
            if held is None or held < version:
                behind.append(http)
        if not behind:
            churn.latencies["propagation"].append(clock.now() - began)
            return True
        if clock.now() - began > PROPAGATION_TIMEOUT_S:
            churn.errors.append({"what": "propagation", "id": vector_id, "version": version, "t": round(began, 3),
                                 "error": f"not held by {', '.join(server_of(h) for h in behind)} after "
                                          f"{PROPAGATION_TIMEOUT_S:g} s"})  # fmt: skip
            return False
        pending = behind
        await asyncio.sleep(0.005)


async def delete(http: httpx.AsyncClient, vector_id: str, churn: Churn, clock: Clock) -> bool:
    began = clock.now()
    churn.by_server[server_of(http)] += 1
    try:
        response = await http.delete(f"/steer/vectors/{vector_id}")
    except httpx.HTTPError as exc:
        churn.errors.append({"what": "delete", "id": vector_id, "t": round(began, 3),
                             "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        return False
    churn.latencies["delete"].append(clock.now() - began)
    if response.status_code not in (202, 204):
        churn.errors.append({"what": "delete", "id": vector_id, "t": round(began, 3), "status": response.status_code,
                             "error": response.text[:300]})  # fmt: skip
        return False
    churn.deleted += 1
    return True


Act = Callable[[httpx.AsyncClient, Sequence[httpx.AsyncClient], str], Awaitable[None]]


async def _each_in_turn(urls: Sequence[str], ids: list[str], plan: Plan, clock: Clock, until: float, every: float,
                        act: Act) -> None:  # fmt: skip
    """Every ``every`` s until ``until``, ``act(http, all_https, id)`` on the next id of ``ids`` (round robin),
    through one connection to each server: an id's turns go to the servers in turn (a fleet's changes come from
    every replica)."""
    async with contextlib.AsyncExitStack() as stack:
        https = [await stack.enter_async_context(_client(url, plan.config)) for url in urls]
        for i in itertools.count():
            await asyncio.sleep(every)
            if clock.now() >= until or not ids:
                return
            turn, k = divmod(i, len(ids))
            await act(https[(turn + k) % len(https)], https, ids[k])


async def replace_loop(urls: Sequence[str], ids: list[str], book: MarkerBook, rows: np.ndarray, plan: Plan,
                       churn: Churn, clock: Clock, until: float) -> None:  # fmt: skip
    """Every ``replace_every`` s, replace the next id of ``ids`` with its next marker."""

    async def replace(http: httpx.AsyncClient, https: Sequence[httpx.AsyncClient], vector_id: str) -> None:
        churn.replaced += await register(http, book, rows, vector_id, True, churn, clock) is not None

    await _each_in_turn(urls, ids, plan, clock, until, plan.config.replace_every, replace)


async def delete_loop(urls: Sequence[str], ids: list[str], book: MarkerBook, rows: np.ndarray, plan: Plan,
                      churn: Churn, clock: Clock, until: float) -> None:  # fmt: skip
    """Every ``delete_every`` s, delete the next id of ``ids``, wait ``absent_for`` s, register it again; the id
    counts as present again once every server holds the new version (until then an ``unknown_vector`` for it is
    expected)."""

    async def delete_and_return(http: httpx.AsyncClient, https: Sequence[httpx.AsyncClient], vector_id: str) -> None:
        book.absent_from(vector_id, clock.now())
        await delete(http, vector_id, churn, clock)
        await asyncio.sleep(plan.config.absent_for)
        version = await register(http, book, rows, vector_id, False, churn, clock)
        if version is not None and await everywhere(https, vector_id, version, churn, clock):
            book.present_again(vector_id, clock.now())

    await _each_in_turn(urls, ids, plan, clock, until, plan.config.delete_every, delete_and_return)


# -- polling the control plane ---------------------------------------------------------------------------------------


class Poller(threading.Thread):
    """Polls ``GET /health`` and ``GET /steer/slots?max_age_ms=1000`` in turn on its own connection and thread
    (so the clients' event loop does not delay its timings)."""

    PATHS = {"health": "/health", "slots": "/steer/slots?max_age_ms=1000"}

    def __init__(self, url: str, config: SoakConfig):
        super().__init__(name="soak-poller", daemon=True)
        self.url = url
        self.config = config
        self.latencies: dict[str, list[float]] = {name: [] for name in self.PATHS}
        self.errors: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30.0) as http:
            while not self.halt.is_set():
                for name, path in self.PATHS.items():
                    self._poll(http, name, path)
                self.halt.wait(self.config.poll_every)

    def _poll(self, http: httpx.Client, name: str, path: str) -> None:
        began = time.perf_counter()
        try:
            status = http.get(path).status_code
        except httpx.HTTPError as exc:
            self.errors.append({"path": path, "error": f"{type(exc).__name__}: {exc}"})
            return
        if status == 200:
            self.latencies[name].append(time.perf_counter() - began)
        else:
            self.errors.append({"path": path, "status": status})


# -- calibration ------------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    strength: float
    first_winning: float | None
    excluded: int
    markers: dict[str, list[str]]


async def served_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def steerable_layers(text: str) -> set[int]:
    """``"0-3"`` or ``"8,10,12-15"`` (``/steer/slots`` ``model.layers``) as a set."""
    layers: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        layers.update(range(int(low), int(high or low) + 1))
    return layers


async def plain_tokens(http: httpx.AsyncClient, plan: Plan) -> set[int]:
    """Every token (and runner-up) the prompts' plain answers hold on completions and chat, which markers avoid;
    raises when a plain answer comes back short or unreadable."""
    seen: set[int] = set()
    for route in TOKEN_ROUTES:
        for prompt in PROMPTS:
            response = await http.post(PATHS[route], json=request_body(plan, route, False, Spec("plain"), prompt))
            if response.status_code != 200:
                raise CalibrationError(f"plain {route} answered {response.status_code}: {response.text[:300]}")
            content = read_whole(route, response.json())
            if len(content.tokens) != plan.config.max_tokens:
                raise CalibrationError(f"plain {route} gave {len(content.tokens)} tokens for {prompt!r}")
            seen.update(content.tokens)
            seen.update(t for t in content.second if t is not None)
    return seen


async def steered_content(http: httpx.AsyncClient, plan: Plan, route: str, spec: Spec) -> list[Content]:
    """The content of one steered, non-streamed request per prompt (no receipt check: calibration only)."""
    out = []
    for prompt in PROMPTS:
        response = await http.post(PATHS[route], json=request_body(plan, route, False, spec, prompt))
        if response.status_code != 200:
            raise CalibrationError(f"steered {route} answered {response.status_code}: {response.text[:300]}")
        out.append(read_whole(route, response.json()))
    return out


async def find_strength(http: httpx.AsyncClient, plan: Plan, probe: str, marker: int, limit: float
                        ) -> tuple[float, float]:  # fmt: skip
    """(the weakest grid strength at which the probe's marker takes every position of every prompt, the strength
    the soak uses: STRENGTH_FACTOR times that, within ``limit``)."""
    n = plan.config.max_tokens
    for strength in (s for s in STRENGTH_GRID if s <= limit):
        spec = Spec("single", (Entry(probe, plan.layer, strength),))
        contents = await steered_content(http, plan, "completions", spec)
        if all(c.tokens == [marker] * n for c in contents):
            return strength, min(strength * STRENGTH_FACTOR, limit)
    raise CalibrationError(f"no steering strength up to {limit:g} makes the marker win at layer {plan.layer}")


async def check_markers(http: httpx.AsyncClient, plan: Plan, probes: tuple[str, str], markers: tuple[int, int],
                        texts: dict[int, str]) -> None:  # fmt: skip
    """At the soak's strength (the lower end of its scale range): every route shows the marker, stacked entries
    rank as their scales, decode_only and prefill_only steer only their phase."""
    n, s, layer = plan.config.max_tokens, plan.strength, plan.layer
    a, b = markers
    checks = {
        "single": (Spec("single", (Entry(probes[0], layer, s),)), lambda c: c.tokens == [a] * n),
        "stacked": (Spec("stacked", (Entry(probes[0], layer, 2 * s), Entry(probes[1], layer, s))),
                    lambda c: c.tokens == [a] * n and c.second == [b] * n),
        "decode_only": (Spec("decode_only", (Entry(probes[0], layer, s, "decode"),)),
                        lambda c: c.tokens[1:] == [a] * (n - 1) and c.tokens[0] != a),
        "prefill_only": (Spec("prefill_only", (Entry(probes[0], layer, s, "prefill"),)),
                         lambda c: c.tokens[0] == a and c.tokens[1:] != [a] * (n - 1)),
    }  # fmt: skip
    for route in TOKEN_ROUTES:
        for name, (spec, good) in checks.items():
            for content in await steered_content(http, plan, route, spec):
                if not good(content):
                    raise CalibrationError(f"{name} on {route} at strength {s:g}: tokens {content.tokens}, "
                                           f"runner-up {content.second}, markers {a}, {b}")  # fmt: skip
    for content in await steered_content(http, plan, "responses", checks["single"][0]):
        if content.text != texts[a] * n:
            raise CalibrationError(f"single on responses at strength {s:g}: text {content.text!r}, marker {texts[a]!r}")


async def calibrate(url: str, plan: Plan, facts: ModelFacts, texts: dict[int, str], book_pools: dict[str, int]
                    ) -> tuple[MarkerBook, Calibration]:  # fmt: skip
    """Pick the markers (avoiding the prompts' plain tokens), find the strength (into ``plan.strength``, unless
    ``--strength`` gave it), check every phase, and build the book; ``book_pools`` is the pool size of each id."""
    config = plan.config
    async with _client(url, config) as http:
        excluded = await plain_tokens(http, plan)
        norms = np.linalg.norm(facts.unembedding, axis=1)
        try:
            markers = choose_markers(texts, norms, excluded, sum(book_pools.values()), config.seed)
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
        pools, start = {}, 0
        for vector_id, size in book_pools.items():
            pools[vector_id], start = markers[start:start + size], start + size
        book = MarkerBook({t: texts[t] for t in markers}, pools)
        probes = (f"{config.id_prefix}-probe-a", f"{config.id_prefix}-probe-b")
        for probe, token in zip(probes, markers[:2]):
            body = vector_body(probe, unit(facts.unembedding[token]))
            response = await http.post("/steer/vectors?replace=true", json=body)
            if response.status_code not in (200, 201):
                raise CalibrationError(f"registering {probe} answered {response.status_code}: {response.text[:300]}")
        try:
            first = None
            if config.strength is None:
                limit = MAX_ADDED.get(facts.dtype, 1e6) / 5  # a stacked request adds 2 * 1.5 s + 1.5 s
                first, plan.strength = await find_strength(http, plan, probes[0], markers[0], limit)
            await check_markers(http, plan, probes, (markers[0], markers[1]), texts)
        finally:
            for probe in probes:
                await http.delete(f"/steer/vectors/{probe}")
    shown = {vector_id: [texts[t] for t in pool] for vector_id, pool in pools.items()}
    return book, Calibration(plan.strength, first, len(excluded), shown)


# -- one soak ----------------------------------------------------------------------------------------------------------


def soak_ids(config: SoakConfig) -> tuple[list[str], list[str]]:
    """(static ids, churned ids)."""
    churned = min(config.churned, config.ids)
    static = [f"{config.id_prefix}-s{i:02d}" for i in range(config.ids - churned)]
    return static, [f"{config.id_prefix}-c{i:02d}" for i in range(churned)]


async def drain(url: str, config: SoakConfig) -> dict[str, Any]:
    """Wait until ``/steer/slots`` (fresh) of the server at ``url`` shows no pinned row, up to ``drain_timeout`` s."""
    began = time.monotonic()
    async with _client(url, config) as http:
        while True:
            try:
                stats = (await http.get("/steer/slots")).json()
            except (httpx.HTTPError, ValueError) as exc:
                return {"url": url, "drained": False, "pinned": None, "seconds": None,
                        "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            waited = time.monotonic() - began
            if stats.get("pinned") == 0 or waited > config.drain_timeout:
                keep = ("capacity", "used", "pinned", "free", "evictions", "refused", "steered_requests", "deferrals",
                        "vectors")  # fmt: skip
                return {"url": url, "drained": stats.get("pinned") == 0, "pinned": stats.get("pinned"),
                        "seconds": round(waited, 2), "slots": {k: stats.get(k) for k in keep}}  # fmt: skip
            await asyncio.sleep(0.1)


async def drain_all(urls: Sequence[str], config: SoakConfig) -> dict[str, Any]:
    """:func:`drain` on every server at once: drained when all are; ``pinned`` summed (None when one did not
    answer), ``seconds`` the longest, each server's own answer in ``servers``."""
    each = await asyncio.gather(*(drain(url, config) for url in urls))
    pinned = [d["pinned"] for d in each]
    return {"drained": all(d["drained"] for d in each), "pinned": None if None in pinned else sum(pinned),
            "seconds": max((d["seconds"] for d in each if d["seconds"] is not None), default=None),
            "servers": list(each)}  # fmt: skip


async def run_soak(config: SoakConfig, urls: Sequence[str], model_dir: Path) -> dict[str, Any]:
    """Calibrate, register the ids, run clients, churn and poller for ``duration`` s, drain, and judge every
    response; returns the report (see :func:`report`). ``urls``: one server, or the replicas of a fleet on one
    registry (see the module's docstring); calibration and the poller use the first."""
    if not urls:
        raise ValueError("run_soak needs at least one server URL")
    url = urls[0]
    facts = read_model(model_dir)
    texts = single_token_texts(model_dir, facts.unembedding.shape[0])
    static, churned = soak_ids(config)
    async with _client(url, config) as http:
        model = await served_model(http)
        layers = steerable_layers(((await http.get("/steer/slots")).json().get("model") or {}).get("layers", ""))
    layer = facts.n_layers - 1
    if layer not in layers:
        raise CalibrationError(f"the server does not steer layer {layer} (the last one): it steers {sorted(layers)}")
    plan = Plan(model, layer, config.strength or 0.0, static, churned, config)
    pools = {i: 1 for i in static} | {i: config.pool for i in churned}
    book, calibration = await calibrate(url, plan, facts, texts, pools)

    clock = Clock()  # the report's times count from here
    await register_all(urls, config, book, facts.unembedding, static + churned, clock)
    churn = Churn()
    poller = Poller(url, config)
    observations: list[Observation] = []
    began = clock.now()
    poller.start()
    try:
        await traffic(urls, plan, book, facts.unembedding, churn, clock, began + config.duration, observations)
    finally:
        elapsed = clock.now() - began
        poller.halt.set()
        poller.join(timeout=35)
    drained = await drain_all(urls, config)
    if not config.keep_vectors:
        await delete_all(url, config, static + churned)
    return report(config, urls, plan, calibration, book, observations, churn, poller, drained, elapsed)


async def register_all(urls: Sequence[str], config: SoakConfig, book: MarkerBook, rows: np.ndarray, ids: list[str],
                       clock: Clock) -> None:  # fmt: skip
    """Register (or replace) every id with the first marker of its pool, on the first server, and wait until
    every server holds it."""
    setup = Churn()
    async with contextlib.AsyncExitStack() as stack:
        https = [await stack.enter_async_context(_client(url, config)) for url in urls]
        for vector_id in ids:
            version = await register(https[0], book, rows, vector_id, True, setup, clock)
            if version is None or not await everywhere(https, vector_id, version, setup, clock):
                raise CalibrationError(f"could not register {vector_id}: {setup.errors[-1]}")


async def traffic(urls: Sequence[str], plan: Plan, book: MarkerBook, rows: np.ndarray, churn: Churn, clock: Clock,
                  until: float, out: list[Observation]) -> None:  # fmt: skip
    """The clients (client i on server i mod n), and the churn tasks on the two halves of the churned ids, until
    ``until``."""
    half = len(plan.churned) // 2
    await asyncio.gather(
        *(client_loop(i, urls[i % len(urls)], plan, clock, until, out) for i in range(plan.config.clients)),
        replace_loop(urls, plan.churned[:half], book, rows, plan, churn, clock, until),
        delete_loop(urls, plan.churned[half:], book, rows, plan, churn, clock, until),
    )


async def delete_all(url: str, config: SoakConfig, ids: list[str]) -> None:
    async with _client(url, config) as http:
        for vector_id in ids:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(f"/steer/vectors/{vector_id}")


def report(config: SoakConfig, urls: Sequence[str], plan: Plan, calibration: Calibration, book: MarkerBook,
           observations: list[Observation], churn: Churn, poller: Poller, drained: dict[str, Any], elapsed: float
           ) -> dict[str, Any]:  # fmt: skip
    """The JSON report: counts, failures by kind / detail / route with examples, latencies, throughput, control
    plane latencies, churn and drain."""
    judged = judge_all(observations, book, config.max_tokens)
    kinds: Counter[str] = judged["kinds"]
    failures = {kind: kinds.get(kind, 0) for kind in FAILURE_KINDS}
    failures["churn_error"] = len(churn.errors) + len(book.conflicts)
    failures["poll_error"] = len(poller.errors)
    failures["not_drained"] = 0 if drained.get("drained") else 1
    by_class: dict[str, list[Observation]] = {"plain": [], "steered": []}
    ok_by_class: dict[str, list[Observation]] = {"plain": [], "steered": []}
    for obs, verdict in zip(observations, judged["verdicts"]):
        name = "steered" if obs.spec.steered else "plain"
        by_class[name].append(obs)
        if verdict.kind == "ok":
            ok_by_class[name].append(obs)
    ok = ok_by_class["plain"] + ok_by_class["steered"]
    return {
        "config": asdict(config) | {"api_key": bool(config.api_key)},
        "servers": list(urls),
        "model": plan.model,
        "layer": plan.layer,
        "calibration": asdict(calibration),
        "elapsed_s": round(elapsed, 2),
        "requests": {
            "total": len(observations),
            "ok": kinds.get("ok", 0),
            "refused_expected": kinds.get("refused_expected", 0),
            "by_class": dict(Counter(obs.spec.kind for obs in observations)),
            "by_route": dict(Counter(route_key(obs) for obs in observations)),
            "by_server": dict(Counter(urls[obs.client % len(urls)] for obs in observations)),
        },
        "failures": failures,
        "failed": sum(failures.values()),
        "failure_details": {k: dict(v) for k, v in judged["details"].items()},
        "failures_by_route": {k: dict(v) for k, v in judged["routes"].items()},
        "examples": dict(judged["examples"]) | {"churn_error": churn.errors[:5] + book.conflicts[:5],
                                                "poll_error": poller.errors[:5]},  # fmt: skip
        "latency_ms": {  # of the requests judged ok
            name: {"ttft": summarize_ms([o.ttft for o in group if o.ttft is not None]),
                   "total": summarize_ms([o.end - o.start for o in group])}
            for name, group in ok_by_class.items()
        },  # fmt: skip
        "throughput_rps": {
            "all": round(len(observations) / elapsed, 2) if elapsed else None,
            "ok": round(len(ok) / elapsed, 2) if elapsed else None,
            **{name: round(len(group) / elapsed, 2) if elapsed else None for name, group in by_class.items()},
        },
        "control_plane_ms": {name: summarize_ms(values) for name, values in poller.latencies.items()},
        "churn": {"replaced": churn.replaced, "deleted": churn.deleted, "registered": churn.registered,
                  "errors": len(churn.errors), "by_server": dict(churn.by_server),
                  "latency_ms": {k: summarize_ms(v) for k, v in churn.latencies.items()}},  # fmt: skip
        "drain": drained,
    }


# -- output ----------------------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(result: dict[str, Any]) -> str:
    """A short human-readable summary of a report."""
    requests, rps = result["requests"], result["throughput_rps"]
    lines = [
        f"soak: {requests['total']} requests in {result['elapsed_s']} s ({rps['all']} req/s, ok {rps['ok']} req/s), "
        f"{result['config']['clients']} clients, mix {result['config']['mix']}, "
        f"strength {result['calibration']['strength']:g}",
        f"  ok {requests['ok']}   refused_expected {requests['refused_expected']}   failed {result['failed']}",
        f"  {'kind':<18}{'count':>7}  routes",
    ]
    for kind, count in result["failures"].items():
        routes = ", ".join(f"{r} {n}" for r, n in sorted(result["failures_by_route"].get(kind, {}).items()))
        lines.append(f"  {kind:<18}{count:>7}  {routes}")
    lines.append(f"  {'latency ms':<18}{'n':>7}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}{'total p99':>11}")
    for name, lat in result["latency_ms"].items():
        lines.append(f"  {name:<18}{lat['total']['n']:>7}{_ms(lat['ttft']['p50']):>10}{_ms(lat['ttft']['p99']):>10}"
                     f"{_ms(lat['total']['p50']):>11}{_ms(lat['total']['p99']):>11}")  # fmt: skip
    lines.append(f"  {'control plane ms':<34}{'n':>7}{'p50':>9}{'p99':>9}{'max':>9}")
    for name, path in Poller.PATHS.items():
        lat = result["control_plane_ms"][name]
        lines.append(f"  GET {path:<30}{lat['n']:>7}{_ms(lat['p50']):>9}{_ms(lat['p99']):>9}{_ms(lat['max']):>9}")
    churn, drained = result["churn"], result["drain"]
    lines.append(f"  churn: {churn['replaced']} replaced, {churn['deleted']} deleted and re-registered, "
                 f"{churn['errors']} errors")  # fmt: skip
    spread = churn["latency_ms"].get("propagation")
    if spread:  # several servers: a re-registration until every one held it
        lines.append(f"  on every server after {spread['n']} re-registrations: p50 {_ms(spread['p50'])} ms, "
                     f"p99 {_ms(spread['p99'])} ms, max {_ms(spread['max'])} ms; requests by server "
                     f"{result['requests']['by_server']}")  # fmt: skip
    lines.append(f"  drain: {'ok' if drained.get('drained') else 'NOT DRAINED'}, {drained.get('pinned')} pinned after "
                 f"{drained.get('seconds')} s")  # fmt: skip
    return "\n".join(lines)


def examples_text(result: dict[str, Any], per_kind: int = 2) -> str:
    """A few examples of each failure kind, one JSON line each."""
    lines = []
    for kind, found in result["examples"].items():
        for item in found[:per_kind]:
            lines.append(f"  {kind}: {json.dumps(item)[:600]}")
    return "\n".join(lines)


# -- a server of its own -----------------------------------------------------------------------------------------------


@dataclass
class OwnServer:
    url: str
    log: Path


@contextlib.contextmanager
def own_server(model_dir: Path, slots: int, extra_args: Sequence[str], workdir: Path, built: bool
               ) -> Iterator[OwnServer]:  # fmt: skip
    """``vllm serve`` with hotwire on a free port in its own process group, with the CPU environment of
    scripts/test.sh (values already in the environment win) and ``HOTWIRE_SLOTS``; stopped on exit."""
    import torch

    from hotwire_api.server_process import free_port, start_server, stop_server, vllm_serve_command, wait_until_ready

    port = free_port()
    env = {**SERVER_ENV, **os.environ}
    if not torch.cuda.is_available():
        env = with_cpu_env(env)
    env.update(HOTWIRE_SLOTS=str(slots), PYTHONUNBUFFERED="1")
    defaults = ["--dtype", "float32", "--max-model-len", "4096"] if built else []
    if not torch.cuda.is_available():
        defaults.append("--enforce-eager")  # short engine starts on the CPU
    command = [*vllm_serve_command(str(model_dir)), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               *defaults, *extra_args]  # fmt: skip
    log = workdir / "server.log"
    print(f"soak: starting {' '.join(command[3:])}\nsoak: server log {log}", flush=True)
    proc = start_server(command, env, log)
    try:
        seconds = wait_until_ready(proc, f"http://127.0.0.1:{port}", 600.0)
        print(f"soak: server ready after {seconds:.0f} s", flush=True)
        yield OwnServer(f"http://127.0.0.1:{port}", log)
    finally:
        print(f"soak: {stop_server(proc)}", flush=True)


_ACCESS_LOG = re.compile(r'INFO: +[0-9.]+:\d+ - "')  # uvicorn's one line per request


def log_tail(log: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a server log, uvicorn's access lines left out."""
    if log is None:
        return ""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join([line for line in text.splitlines() if not _ACCESS_LOG.search(line)][-lines:])


# -- command line ----------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    parser.add_argument("--url", action="append", dest="urls",
                        help="drive this running server instead of starting one (needs --model); repeat it for "
                             "each replica of a fleet on one registry")  # fmt: skip
    parser.add_argument("--model", type=Path, help="HF folder with safetensors weights (default: build the tiny model)")
    parser.add_argument("--workdir", type=Path, help="for the built model and the server log (default: a temp folder)")
    parser.add_argument("--slots", type=int, default=16, help="HOTWIRE_SLOTS of a server the soak starts")
    parser.add_argument("--server-arg", action="append", default=[], help="extra vllm serve argument (repeatable)")
    parser.add_argument("--clients", type=int, default=d.clients)
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of traffic")
    parser.add_argument("--ids", type=int, default=d.ids, help="vector ids in all")
    parser.add_argument("--churned", type=int, default=d.churned, help="of them churned: half replaced, half deleted")
    parser.add_argument("--pool", type=int, default=d.pool, help="markers per churned id (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--replace-every", type=float, default=d.replace_every, help="seconds between replacements")
    parser.add_argument("--delete-every", type=float, default=d.delete_every, help="seconds between delete + register")
    parser.add_argument("--absent-for", type=float, default=d.absent_for, help="seconds a deleted id stays away")
    parser.add_argument("--churn-share", type=float, default=d.churn_share,
                        help="share of steered picks on churned ids")  # fmt: skip
    parser.add_argument("--mix", choices=("all", "plain", "steered"), default=d.mix)
    parser.add_argument("--strength", type=float, help="steering norm (default: calibrated)")
    parser.add_argument("--poll-every", type=float, default=d.poll_every, help="seconds between control-plane polls")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout)
    parser.add_argument("--api-key", default=os.environ.get("HOTWIRE_API_KEY"))
    parser.add_argument("--id-prefix", default=d.id_prefix)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--keep-vectors", action="store_true", help="leave the soak's vectors registered")
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument("--no-fail-exit", action="store_true", help="exit 0 whatever the failure counts")
    args = parser.parse_args(argv)
    if args.urls and not args.model:
        parser.error("--url needs --model: the markers come from the served model's LM head weights")
    if args.pool < 2 and args.churned:
        parser.error("--pool must be at least 2: consecutive versions need different markers")
    return args


def config_of(args: argparse.Namespace) -> SoakConfig:
    names = SoakConfig.__dataclass_fields__
    return SoakConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_of(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hotwire-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    built = args.model is None
    if built:
        from hotwire_core.tiny_model import build_model

        args.model = build_model(workdir / "tiny", "tiny", weights=True)
    log: Path | None = None
    try:
        with contextlib.ExitStack() as stack:
            urls = args.urls
            if not urls:
                server = stack.enter_context(own_server(args.model, args.slots, args.server_arg, workdir, built))
                urls, log = [server.url], server.log
            result = asyncio.run(run_soak(config, urls, args.model))
    except (CalibrationError, ServerExited) as exc:
        print(f"soak: {type(exc).__name__}: {exc}\n{log_tail(log or workdir / 'server.log')}", file=sys.stderr)
        return 2
    result["server_log"] = str(log) if log else None
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    if result["failed"]:
        print("soak: failures (examples):\n" + examples_text(result))
        if log is not None:
            print(f"soak: last lines of the server log {log}:\n{log_tail(log)}")
    print(f"soak: report {args.out}" + (f", server log {log}" if log else ""))
    return 1 if result["failed"] and not args.no_fail_exit else 0


if __name__ == "__main__":
    sys.exit(main())
