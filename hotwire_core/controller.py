"""The steering controller of one engine: the RPC surface and admission into the engine, over the registry,
the slot cache and the bindings (``hotwire_core.bindings``). The vectors at start come from
``hotwire_core.vectors``, the decision procedure from ``hotwire_core.admission``, requests waiting for rows are
held by ``hotwire_core.deferral``, and streaming-input sessions' rules live in ``hotwire_core.sessions``.

It runs in the engine-core process, in the thread that admits requests and answers utility RPCs, so every
decision (versions, slots, evictions) is made once, in request order, and reaches every TP/PP rank through the
same ``SchedulerOutput``. See docs/architecture.md.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Collection, Iterable, Sequence

import torch

from . import contract
from .admission import (ModelInfo, Refusal, Resolved, Rules, cache_salt, check_client_fields, check_rows, pinned_spec,
                        presalt, receipt, resolve, row_sources)
from .bindings import BankWrite, Binding, Bindings
from .capture_admission import CaptureRequests
# BINDING_KEY and USER_SALT_ATTR are re-exported: the benchmarks import them from here
from .contract import BINDING_KEY, USER_SALT_ATTR, Config
from .deferral import DeferredRequests
from .engine_requests import EngineRequests
from .error_codes import ErrorCode
from .errors import EngineError, internal_failure
from .handouts import Handouts
from .registry import VectorRegistry
from .gates import condition_of, gated_reading
from .sessions import EndedSessions, same_steering
from .settings import Settings
from .slots import RowKey, SlotCache, SlotsExhausted
from .readout_admission import Reading, refuse_in_session
from .readout_spec import READOUT_KEY
from .spec import SPEC_KEY, TICKET_KEY
from .store import VectorStore
from .vector_changes import VectorChanges
from .vectors import restore

__all__ = ["BINDING_KEY", "USER_SALT_ATTR", "SteeringController", "WaitForRows"]


REFUSALS_KEPT = 4096  # refusals of ticketed requests, kept until the API server that sent them asks


class WaitForRows(Refusal):
    """``admit``'s refusal of a request that fits once running requests release their rows: it waits (see
    ``SteeringController.defer``). ``resolved``: what its spec resolved to, so deferring it resolves nothing again."""

    def __init__(self, message: str, resolved: Resolved, rows: Collection[RowKey] = ()):
        super().__init__(429, ErrorCode.SLOTS_EXHAUSTED, message)
        self.resolved, self.rows = resolved, rows


class SteeringController:
    """``requests``: how to read and change the engine's requests (``vllm_glue.requests.VLLM_REQUESTS``)."""

    def __init__(self, model: ModelInfo, settings: Settings, model_name: str, requests: EngineRequests):
        self.model = model
        self.settings = settings
        self.requests = requests
        self.registry = VectorRegistry(model.n_layers, model.hidden_size, model.dtype, settings.retain_s)
        self.rules = Rules(model, settings.max_stack, settings.slots, settings.rows_per_request(len(model.layers)),
                           settings.layers is not None)
        self.slots = SlotCache(settings.slots, settings.rows_per_tenant(len(model.layers)),
                               settings.tenant_shares(len(model.layers)))
        self.bindings = Bindings(self.registry, self.slots, requests)
        self.captures = CaptureRequests(model.capture_rows, requests)
        self.refused: Counter[str] = Counter()
        self.steered_requests = 0
        # requests waiting for slots
        self.deferred = DeferredRequests(self.bindings, requests, settings.max_wait_s, self.refused)
        self._refusals = Handouts(REFUSALS_KEPT)  # ticket -> refusal (see note_refusal)
        # Set by the engine glue: finishes a deferred request that can no longer be admitted with an error.
        self.on_refused: Callable[[Any, Refusal], None] = lambda request, exc: None
        self._ended_sessions = EndedSessions()
        store_dir = settings.store_dir(model_name)
        self.store = VectorStore(store_dir) if store_dir is not None else None
        restore(self.registry, self.store, settings.preload)
        self.changes = VectorChanges(self.registry, self.store, self.slots, settings.retain_s)

    # -- RPC surface (msgpack-native in and out) -------------------------------------------------------------

    def answer(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict | Future:
        """The answer to RPC ``hotwire_<method>``: always a dict (or a ``Future`` of one while a registration's
        store write is under way: ``vector_changes``), never an exception (one leaving ``collective_rpc`` reaches
        the API server as an engine that does not answer). Refusals are failure dicts already; anything else that
        goes wrong becomes a 500 naming the exception, its traceback logged here."""
        if contract.rpc_name(method) not in contract.ENGINE_METHODS:
            return EngineError(
                501, ErrorCode.UNKNOWN_METHOD, f"hotwire_{method} is not an engine method: are hotwire_core and its caller from different versions?"
            ).to_result()
        try:
            return getattr(self, method)(*args, **kwargs)
        except Exception as exc:
            return internal_failure(f"hotwire_{method}", exc)

    def register(self, *args: Any, **kwargs: Any) -> contract.RegisterResult | contract.Failure | Future:
        """``hotwire_register``: :meth:`VectorChanges.register`."""
        return self.changes.register(*args, **kwargs)

    def unregister(self, *args: Any, **kwargs: Any) -> contract.UnregisterResult | contract.Failure | Future:
        """``hotwire_unregister``: :meth:`VectorChanges.unregister`."""
        return self.changes.unregister(*args, **kwargs)

    def export(self, vector_id: str, version: int | None) -> contract.ExportResult | contract.Failure:
        """A version this engine holds (current or retained; None: the current one, read in the same call so a
        replace cannot retire it in between), as the bytes ``register`` takes: what a fleet's replica puts back
        into a registry that lost its data, and what ``GET /steer/vectors/{id}/file`` serves."""
        vector = self.registry.lookup(vector_id, None if version is None else int(version))
        if vector is None:
            held = vector_id if version is None else f"{vector_id}@{version}"
            return EngineError(404, ErrorCode.UNKNOWN_VECTOR, f"this engine holds no {held}; GET /steer/vectors lists the "
                               "vectors", "id").to_result()
        data = vector.rows.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return contract.ExportResult(ok=True, vector=vector.meta(), data=data)

    def list(self, tenant: str | None = None) -> contract.ListResult:
        """Every current vector, or ``tenant``'s alone: a quota check needs its tenant's, not the registry's."""
        in_flight = self.registry.in_flight
        vectors = [{**v.meta(), "in_flight": in_flight(v.vector_id)} for v in self.registry.vectors(tenant)]
        return contract.ListResult(ok=True, vectors=vectors)

    def stats(self) -> contract.StatsResult:
        """``SlotStats`` (docs/architecture.md)."""
        return contract.StatsResult(
            ok=True,
            **self.slots.stats(),
            refused=dict(self.refused),
            steered_requests=self.steered_requests,
            deferred=len(self.deferred),
            deferrals=self.deferred.deferrals,
            suspended=sum(b.suspended for b in self.bindings.values()),
            resumptions=self.bindings.resumptions,
            capturing=len(self.captures.live),
            vectors=len(self.registry.vectors()),
            model=self.model.to_json(self.settings.max_stack),
        )

    def check(self, spec: str, slots: bool = True) -> contract.CheckResult | contract.Failure:
        """Would a request with this spec be admitted now? With ``slots`` (``offline.check_steering``), 429
        ``slots_exhausted`` says it would wait for bank rows; without (the HTTP admission, whose requests wait)
        only what can never be served is refused."""
        needed = 0
        try:
            entries = self._resolve(spec)
            keys = row_sources(entries).keys()
            if slots:
                self.deferred.wait_turn(None, keys)
                needed, shortage = self.slots.missing(keys), self.slots.shortage(keys)
                if shortage is not None:
                    raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, str(shortage))
        except Refusal as exc:
            return exc.to_result()
        return contract.CheckResult(ok=True, receipt=receipt(entries), spec=pinned_spec(entries), new_rows=needed)

    def catalog(self, generation: int = -1) -> contract.CatalogResult:
        """What an API server needs to decide steered requests itself (``hotwire_core.admission``): the rules and
        the current versions' metadata (``VectorRegistry.catalog_vectors``: what changed after ``generation``, or
        all); just ``unchanged`` when the caller holds ``generation`` already."""
        if generation == self.registry.generation:
            return contract.CatalogResult(ok=True, generation=generation, unchanged=True)
        rules = self.rules
        return contract.CatalogResult(
            ok=True,
            generation=self.registry.generation,
            model=self.model.to_json(rules.max_stack),
            capacity=rules.capacity,
            max_rows=rules.max_rows,
            layers_setting=rules.layers_setting,
            **self.registry.catalog_vectors(generation),
        )

    def note_refusal(self, request: Any, exc: Refusal) -> None:
        """Keep the refusal of a request the HTTP admission ticketed, for ``refusals``: vLLM reports a refused
        request to its client only as a failed one."""
        extra = self.requests.extra_args(request)
        ticket = extra.get(TICKET_KEY) if extra else None
        if isinstance(ticket, str):
            self._refusals.put(ticket, exc.to_result())

    def refusals(self, tickets: list[str]) -> contract.RefusalsResult:
        """The refusals kept for ``tickets`` (each handed out once)."""
        return contract.RefusalsResult(ok=True, refusals=self._refusals.take(tickets))

    # -- admission -------------------------------------------------------------------------------------------

    def _resolve(self, spec: Any) -> Resolved:
        return resolve(spec, self.registry.lookup, self.rules)

    def cache_salt_for(self, spec: Any, user_salt: str | None, prompt_len: int) -> str | None:
        """``admission.presalt`` over this registry: vLLM's input thread calls it while the engine steps."""
        return presalt(spec, user_salt, prompt_len, self.registry.lookup)

    def admit(self, request: Any) -> Binding | None:
        """Bind a new engine request to its steering, or raise :class:`Refusal` (code ``slots_exhausted`` when it
        would fit once running requests release their rows: see ``defer``).

        On success the request carries the binding for the workers and a cache salt that separates its KV from every
        other steering config (none included); one built with that salt already (``cache_salt_for``) keeps its hashes."""
        requests = self.requests
        user_salt = requests.user_salt(request)
        extra = requests.extra_args(request) or {}
        try:
            check_client_fields(user_salt, extra)
            if self.captures.requested(request):
                self.captures.admit(request, self.rules)
                return None
        except Refusal as exc:
            self.refused[exc.code] += 1
            raise
        spec, readout = extra.get(SPEC_KEY), extra.get(READOUT_KEY)
        if spec is None and readout is None:
            return None
        request_id, resolved, sources = requests.request_id(request), [], {}
        try:
            resolved = self._resolve(spec) if spec is not None else []
            reading = (Reading.of(readout, self.registry.lookup, self.rules, self.model.readout_probes,
                                  requests.expects_more_input(request)) if readout is not None else None)
            if (when := condition_of(resolved)) is not None:  # a gated request reads its condition
                reading = gated_reading(reading, when, self.registry.lookup, self.rules, self.model.readout_probes,
                                        requests.expects_more_input(request))
            sources = {**row_sources(resolved), **(reading.sources() if reading else {})}
            if reading:  # (resolve checked the steering's rows alone)
                check_rows(len(sources), self.rules, READOUT_KEY)
            self.deferred.wait_turn(request_id, sources.keys())  # first come, first served
            try:
                slot_of, loads = self.slots.acquire(sources.keys())
            except SlotsExhausted as exc:
                raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED, str(exc)) from None
        except Refusal as exc:
            if exc.code == ErrorCode.SLOTS_EXHAUSTED:  # deferred, not refused (see defer); resolve raises no such code
                raise WaitForRows(exc.message, resolved, sources.keys()) from None
            self.refused[exc.code] += 1
            raise
        try:
            binding = self.bindings.bind(request, resolved, sources, slot_of, loads, reading.probes if reading else ())
            for key, value in (reading.worker_args(request_id) if reading else {}).items():
                requests.set_extra(request, key, value)
            # Hashed again only if it was hashed without this salt (or the registry changed since).
            salt = reading.own_salt() if reading else None
            if salt is None and resolved:
                salt = cache_salt(user_salt, resolved, requests.prompt_length(request))
            if salt is not None:
                requests.set_cache_salt(request, salt)
        except BaseException:
            self.release(request_id)  # the glue refuses the request: its pins and versions must not leak
            raise
        self.steered_requests += 1
        return binding

    def admit_update(self, update: Any, session: Any | None) -> None:
        """A streaming-input chunk for a session vLLM's scheduler holds already (``session``; None while the
        session's first chunk waits here for rows), or the session's end marker (not ``resumable``).

        The session keeps the binding of its first chunk (versions, rows and cache salt), so every chunk must ask
        for the same steering; nothing is pinned or released in between (the chunk before may still be running),
        and ``keep_binding`` restores the binding when vLLM applies the chunk. Raises :class:`Refusal` otherwise."""
        request_id = self.requests.request_id(update)
        if session is None:  # its first chunk is deferred: vLLM never saw the session
            self.deferred.take(request_id)
            raise Refusal(429, ErrorCode.SLOTS_EXHAUSTED,
                          "this streaming-input session's first chunk was still waiting for bank rows when more input "
                          "came; start the session again once rows are free")  # fmt: skip
        if not self.requests.expects_more_input(update):
            return  # the end marker: vLLM finishes the session, which releases its binding
        if READOUT_KEY in (self.requests.extra_args(update) or {}):
            self.refused[ErrorCode.READOUT_UNSUPPORTED] += 1
            refuse_in_session()
        if not same_steering(self._spec_of(update), self._spec_of(session)):
            self.refused[ErrorCode.STEERING_CHANGED] += 1
            raise Refusal(400, ErrorCode.STEERING_CHANGED,
                          "every chunk of a streaming-input session must carry the steering its first chunk had "
                          "(or none, if it had none); start a new request to steer differently", SPEC_KEY)  # fmt: skip

    def _spec_of(self, request: Any) -> Any:
        """The request's raw spec (None: unsteered)."""
        return (self.requests.steering_args(request) or {}).get(SPEC_KEY)

    def note_ended_session(self, request_id: str) -> None:
        """A refusal ended this streaming-input session; vLLM's client will still send its end marker."""
        self._ended_sessions.note(request_id)

    def session_ended(self, request_id: str, final: bool) -> bool:
        """Whether ``request_id`` is a session a refusal ended; ``final`` (its end marker came): forget it."""
        return self._ended_sessions.ended(request_id, final)

    def keep_binding(self, session: Any) -> None:
        """vLLM gave a session its next chunk's sampling params: put the session's binding back in them (its
        current config: rows may have moved while it was preempted)."""
        binding = self.bindings.get(self.requests.request_id(session))
        if binding is not None:
            self.bindings.give_config(session, binding.config)

    def suspend(self, request_id: str) -> None:
        self.bindings.suspend(request_id)

    def resume(self, request: Any) -> bool:
        return self.bindings.resume(request)

    def release(self, request_id: str) -> None:
        self.bindings.release(request_id)
        self.captures.release(request_id)

    # -- requests waiting for slots ----------------------------------------------------------------------------

    def defer(self, request: Any, resolved: Resolved | None = None, rows: Collection[RowKey] = ()) -> None:
        """Hold a request whose rows cannot be pinned now; ``admit_deferred`` adds it once they can. It keeps the
        versions it resolved to (``resolved`` and ``rows``: by ``admit``, in its :class:`WaitForRows`; None: resolve
        its spec now), its spec pinned to them and held, whatever is registered while it waits."""
        if resolved is None:
            resolved = self._resolve(self.requests.steering_args(request)[SPEC_KEY])
        self.deferred.hold(request, resolved, rows)

    def admit_deferred(self) -> list[Any]:
        """Deferred requests that could be admitted now, in arrival order (the first that still does not fit
        stops the scan, so later small requests cannot starve an earlier large one); those that waited
        ``HOTWIRE_MAX_WAIT_S`` for rows are refused (``DeferredRequests.admit_ready``)."""
        return self.deferred.admit_ready(self.admit, lambda request, exc: self.on_refused(request, exc))

    def drop_deferred(self, request_ids: str | Iterable[str] | None) -> list[Any]:
        """Forget deferred requests that were aborted (``None``: all); returns them."""
        return self.deferred.drop(request_ids)

    @property
    def step_payload_pending(self) -> bool:
        return self.bindings.step_payload_pending

    def take_writes(self) -> list[BankWrite]:
        return self.bindings.take_writes()

    def take_rebinds(self) -> dict[str, Config]:
        return self.bindings.take_rebinds()
