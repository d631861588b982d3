"""Requests held in the engine core until their bank rows can be pinned (see docs/architecture.md, "the slot
model"): first come, first served, each keeping the vector versions it resolved while it waits."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

from .admission import Refusal, Resolved, pinned_spec
from .bindings import Bindings, set_extra
from .registry import HostVector
from .spec import SPEC_KEY

__all__ = ["DeferredRequests"]


class DeferredRequests:
    """The held requests, in arrival order, with the versions each one keeps referenced in the registry."""

    def __init__(self, bindings: Bindings):
        self._bindings = bindings
        self._requests: OrderedDict[str, Any] = OrderedDict()  # request id -> vLLM Request
        self._holds: dict[str, list[HostVector]] = {}
        self.deferrals = 0  # requests ever held

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def hold(self, request: Any, resolved: Resolved) -> None:
        """Hold ``request`` with the versions it resolved to: its spec is pinned to them and each is referenced,
        whatever is registered while it waits."""
        holds = list({id(v): v for _, v in resolved}.values())
        for vector in holds:
            self._bindings.registry.acquire(vector)
        set_extra(request, SPEC_KEY, pinned_spec(resolved))
        self._holds[request.request_id] = holds
        self._requests[request.request_id] = request
        self.deferrals += 1

    def take(self, request_id: str) -> Any:
        """Stop holding a request (None if it was not held), letting go of the versions it kept."""
        self._bindings.release_versions(self._holds.pop(request_id, ()))
        return self._requests.pop(request_id, None)

    def admit_ready(self, admit: Callable[[Any], object], on_refused: Callable[[Any, Refusal], None]) -> list[Any]:
        """Admit held requests in arrival order with ``admit`` until one still has to wait (it raises a
        ``slots_exhausted`` :class:`Refusal`), so later small requests cannot starve an earlier large one; a
        request refused for another reason is let go and reported to ``on_refused``. Returns the admitted ones."""
        admitted = []
        while self._requests:
            request_id, request = next(iter(self._requests.items()))
            try:
                admit(request)
            except Refusal as exc:
                if exc.code == "slots_exhausted":
                    break
                self.take(request_id)
                on_refused(request, exc)
                continue
            self.take(request_id)
            admitted.append(request)
        return admitted

    def drop(self, request_ids: str | Iterable[str] | None) -> list[Any]:
        """Let go of held requests that were aborted (``None``: all); returns them."""
        if request_ids is None:
            request_ids = list(self._requests)
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        return [r for r in (self.take(request_id) for request_id in ids) if r is not None]
