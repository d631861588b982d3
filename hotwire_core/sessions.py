"""Streaming-input sessions (``AsyncLLM.generate`` fed chunk by chunk) under steering: a session keeps the
binding of its first chunk, so every later chunk must ask for the same steering, and a session a refusal ended
is remembered until its end marker comes (see docs/architecture.md, "the slot model")."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .spec import SpecError, parse_spec

__all__ = ["ENDED_SESSIONS_KEPT", "EndedSessions", "same_steering"]

ENDED_SESSIONS_KEPT = 4096  # streaming-input sessions ended by a refusal, remembered until their end marker comes


def same_steering(chunk: Any, session: Any) -> bool:
    """Whether a streaming-input chunk's spec asks for the steering its session has (raw ``extra_args`` values;
    None: unsteered). The session's spec may be pinned to versions (a deferred first chunk): an entry of the
    chunk that names no version matches any."""
    if chunk == session:
        return True
    if chunk is None or session is None:
        return False
    try:
        ours, theirs = parse_spec(chunk), parse_spec(session)
    except SpecError:
        return False
    return len(ours) == len(theirs) and all(
        a.steering() == b.steering() and a.version in (None, b.version) for a, b in zip(ours, theirs)
    )


class EndedSessions:
    """Sessions a refusal ended: vLLM's client still sends their further input and end marker, which must get an
    error rather than run as requests of their own. Bounded: the markers of cancelled sessions never come."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def note(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > ENDED_SESSIONS_KEPT:
            self._ids.popitem(last=False)

    def ended(self, request_id: str, final: bool) -> bool:
        """Whether ``request_id`` is a session a refusal ended; ``final`` (its end marker came): forget it."""
        if final:
            return self._ids.pop(request_id, 0) is None
        return request_id in self._ids
