"""Requests held in the engine core until their bank rows can be pinned (see docs/architecture.md, "the slot
model"): first come, first served, each keeping the vector versions it resolved while it waits, and refused
(503 ``slots_busy``) once it has waited ``HOTWIRE_MAX_WAIT_S``."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Collection, Iterable, Iterator, NamedTuple

from .admission import Refusal, Resolved, pinned_spec, row_keys
from .bindings import Bindings
from .engine_requests import EngineRequests
from .error_codes import ErrorCode
from .registry import HostVector
from .slots import RowKey
from .spec import SPEC_KEY

__all__ = ["DeferredRequests"]


class _Held(NamedTuple):
    request: Any  # the engine's request (opaque: see EngineRequests)
    vectors: list[HostVector]  # the versions it resolved, referenced while it waits
    rows: set[RowKey]
    since: float  # time.monotonic() when it began to wait


class DeferredRequests:
    """The held requests, in arrival order."""

    def __init__(self, bindings: Bindings, requests: EngineRequests, max_wait_s: float, refused: Counter[str]):
        self._bindings = bindings
        self._requests = requests
        self.max_wait_s = max_wait_s
        self._refused = refused  # the controller's refusals by reason, where requests that waited too long count
        self._held: OrderedDict[str, _Held] = OrderedDict()  # request id -> what it holds
        self.deferrals = 0  # requests ever held

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def wait_turn(self, request_id: str | None) -> None:
        """Raise a ``slots_exhausted`` :class:`Refusal` (the request waits) while steered requests that came
        earlier wait for rows: a preempted one waiting to pin its rows again, or held ones (``request_id``: a held
        request, which is not behind itself). Even a request that only shares rows pinned already waits: it would
        keep those rows pinned, and a stream of such requests could keep an earlier one waiting for ever."""
        if self._bindings.waiting_to_resume:
            raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, "a preempted steered request is waiting for bank rows; this one waits behind it")
        if self._held and request_id not in self._held:
            raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, "steered requests that came earlier are waiting for bank rows "
                          f"({len(self._held)} held); this one waits behind them")  # fmt: skip

    def hold(self, request: Any, resolved: Resolved, rows: Collection[RowKey] = ()) -> None:
        """Hold ``request`` with the versions it resolved to: its spec (if it steers) is pinned to them and each is
        referenced, whatever is registered while it waits. ``rows``: bank rows it needs beside its spec's (a
        readout's probes, resolved again when it is admitted)."""
        vectors = list({id(v): v for _, v in resolved}.values())
        for vector in vectors:
            self._bindings.registry.acquire(vector)
        if resolved:
            self._requests.set_extra(request, SPEC_KEY, pinned_spec(resolved))
        held = _Held(request, vectors, row_keys(resolved) | set(rows), time.monotonic())
        self._held[self._requests.request_id(request)] = held
        self.deferrals += 1

    def take(self, request_id: str) -> Any:
        """Stop holding a request (None if it was not held), letting go of the versions it kept."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self._bindings.release_versions(held.vectors)
        return held.request

    def admit_ready(self, admit: Callable[[Any], object], on_refused: Callable[[Any, Refusal], None]) -> list[Any]:
        """Admit held requests in arrival order with ``admit`` until one still has to wait (it raises a
        ``slots_exhausted`` :class:`Refusal`), so later small requests cannot starve an earlier large one. One that
        has waited ``max_wait_s`` is refused with 503 ``slots_busy`` instead (the oldest first: the deadlines come
        in arrival order), and so is one refused for another reason; each is let go and reported to
        ``on_refused``. Returns the admitted ones."""
        admitted = []
        while self._held:
            request_id, held = next(iter(self._held.items()))
            try:
                admit(held.request)
            except Refusal as exc:
                if exc.code == ErrorCode.SLOTS_EXHAUSTED:
                    waited = time.monotonic() - held.since
                    if waited < self.max_wait_s:
                        break
                    exc = self._gave_up(held, waited)
                    self._refused[exc.code] += 1
                self.take(request_id)
                on_refused(held.request, exc)
                continue
            self.take(request_id)
            admitted.append(held.request)
        return admitted

    def _gave_up(self, held: _Held, waited: float) -> Refusal:
        """The refusal of a request that waited too long: why it waited, and what holds the bank."""
        slots = self._bindings.slots
        needed, available = slots.missing(held.rows), slots.available(held.rows)
        if needed > available:
            why = f"it needs {needed} more bank rows and only {available} can be freed now"
        else:
            why = "preempted steered requests are waiting to pin their rows again, and new ones queue behind them"
        running = [len(b.keys) for b in self._bindings.values() if not b.suspended]
        return Refusal(
            503, ErrorCode.SLOTS_BUSY,
            f"this steered request waited {waited:.1f} s for bank rows (HOTWIRE_MAX_WAIT_S={self.max_wait_s:g}): "
            f"{why}; {slots.pinned} of the {slots.capacity} rows are pinned by {len(running)} running steered "
            f"request(s), the largest holding {max(running, default=0)}. Retry later or steer fewer layers or vectors; "
            "the operator can raise HOTWIRE_SLOTS, or lower HOTWIRE_MAX_ROWS so that one request holds less of the bank",
        )  # fmt: skip

    def drop(self, request_ids: str | Iterable[str] | None) -> list[Any]:
        """Let go of held requests that were aborted (``None``: all); returns them."""
        if request_ids is None:
            request_ids = list(self._held)
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        return [r for r in (self.take(request_id) for request_id in ids) if r is not None]
