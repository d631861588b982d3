"""Requests held in the engine core until their bank rows can be pinned (see docs/architecture.md, "the slot
model"): first come, first served, each keeping the vector versions it resolved while it waits, and refused (503
``slots_busy``; 429 ``quota_exceeded`` when its tenant's share of the bank held it) once it has waited
``HOTWIRE_MAX_WAIT_S``. A request steering with a tenant's vectors is in that tenant's lane, any other in the shared
one; one that waits only for its tenant's share of the bank (``SlotCache.tenant_rows``) holds up only its own lane,
so a tenant flooding distinct vectors never holds up the others."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Collection, Iterable, Iterator, NamedTuple

from .admission import Refusal, Resolved, pinned_spec, row_keys
from .bindings import Bindings
from .engine_requests import EngineRequests
from .error_codes import ErrorCode
from .registry import HostVector
from .slots import RowKey, TenantFull
from .spec import SPEC_KEY, tenant_of

__all__ = ["DeferredRequests"]


class _Held(NamedTuple):
    request: Any  # the engine's request (opaque: see EngineRequests)
    vectors: list[HostVector]  # the versions it resolved, referenced while it waits
    rows: set[RowKey]
    since: float  # time.monotonic() when it began to wait
    lane: str


def lane_of(rows: Collection[RowKey]) -> str:
    """The tenant whose vectors a request pins ("" for none: the shared lane)."""
    return min((t for t in (tenant_of(key.vector_id) for key in rows) if t), default="")


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

    def wait_turn(self, request_id: str | None, rows: Collection[RowKey]) -> None:
        """Raise a ``slots_exhausted`` :class:`Refusal` (the request waits) while steered requests that came
        earlier wait for rows it would compete for (:meth:`_blocks`): a preempted one waiting to pin its rows again,
        or held ones (``request_id``: a held request, which is not behind itself). Even a request that only shares
        rows pinned already waits: it would keep those rows pinned, and a stream of such requests could keep an
        earlier one waiting for ever."""
        lane = lane_of(rows)
        if any(self._blocks(self._bindings[rid].keys, lane) for rid in self._bindings.waiting_to_resume):
            raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, "a preempted steered request is waiting for bank rows; this one waits behind it")
        if request_id in self._held:  # admit_ready tries the held requests in order
            return
        ahead = sum(1 for held in self._held.values() if self._blocks(held.rows, lane))
        if ahead:
            raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, "steered requests that came earlier are waiting for bank rows "
                          f"({ahead} held); this one waits behind them")  # fmt: skip

    def _blocks(self, waiting: Collection[RowKey], lane: str) -> bool:
        """Whether a request waiting to pin ``waiting`` holds up one in ``lane``: one that waits only for its tenant's
        share of the bank holds up only its own lane; one that waits for the bank, every lane."""
        return lane_of(waiting) == lane or not isinstance(self._bindings.slots.shortage(waiting), TenantFull)

    def hold(self, request: Any, resolved: Resolved, rows: Collection[RowKey] = ()) -> None:
        """Hold ``request`` with the versions it resolved to: its spec (if it steers) is pinned to them and each is
        referenced, whatever is registered while it waits. ``rows``: bank rows it needs beside its spec's (a
        readout's probes, resolved again when it is admitted)."""
        vectors = list({id(v): v for _, v in resolved}.values())
        for vector in vectors:
            self._bindings.registry.acquire(vector)
        if resolved:
            self._requests.set_extra(request, SPEC_KEY, pinned_spec(resolved))
        keys = row_keys(resolved) | set(rows)
        held = _Held(request, vectors, keys, time.monotonic(), lane_of(keys))
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
        ``slots_exhausted`` :class:`Refusal`), so later small requests cannot starve an earlier large one; one that
        waits only for its tenant's share holds up only the later ones of its lane. One that has waited
        ``max_wait_s`` is refused instead (the oldest first: the deadlines come in arrival order), and so is one
        refused for another reason; each is let go and reported to ``on_refused``. Returns the admitted ones."""
        admitted, waiting = [], set()
        for request_id, held in list(self._held.items()):
            if held.lane in waiting:
                continue
            try:
                admit(held.request)
            except Refusal as exc:
                if exc.code == ErrorCode.SLOTS_EXHAUSTED:
                    waited = time.monotonic() - held.since
                    if waited < self.max_wait_s:
                        if not isinstance(self._bindings.slots.shortage(held.rows), TenantFull):
                            break  # it waits for the bank: every later one waits behind it
                        waiting.add(held.lane)  # for its tenant's share: the later ones of its lane
                        continue
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
        full = slots.shortage(held.rows)
        if isinstance(full, TenantFull):
            return Refusal(
                429, ErrorCode.QUOTA_EXCEEDED,
                f"this steered request waited {waited:.1f} s (HOTWIRE_MAX_WAIT_S={self.max_wait_s:g}) for its tenant's "
                f"share of the bank: {full}. Retry when fewer of the tenant's requests run, or steer with fewer "
                "vectors; the operator can raise HOTWIRE_TENANT_ROWS",
            )
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
