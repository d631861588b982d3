"""The lifecycle of admitted requests' bindings in one engine core: bind (pin rows, reference versions, load what
is missing), suspend on preemption, resume (pin again, maybe into other slots), release; and what the next step
carries to the workers (bank writes, new configs of resumed requests). See docs/architecture.md (the slot model)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .admission import Resolved, receipt, row_key
from .contract import BINDING_KEY, Config, SteerItem
from .engine_requests import EngineRequests
from .registry import HostVector, VectorRegistry
from .slots import RowKey, SlotCache, SlotsExhausted
from .spec import Phase

__all__ = ["BankWrite", "Binding", "Bindings", "BoundEntry"]


@dataclass(frozen=True)
class BankWrite:
    """Load ``row`` into bank slot ``slot`` before the step that carries this write."""

    slot: int
    row: torch.Tensor  # [hidden] on the host, in the registered dtype (the worker casts it to the model's)
    inv_norm: float


@dataclass(frozen=True)
class BoundEntry:
    """One (entry, layer) of an admitted request: which row it reads and how."""

    key: RowKey
    layer: int
    scale: float  # absolute scale (0 for a norm-relative entry)
    rel: float  # norm-relative scale (0 for an absolute entry)
    phases: str  # "p", "d" or "pd"
    gated: int = 0  # 1: steers only where the request's condition lets it (``gates``)


@dataclass
class Binding:
    """What one admitted request holds: pinned rows, referenced versions, and its per-phase config.

    A preempted request is ``suspended``: its rows are unpinned (others may evict them) but its versions stay
    referenced, so :meth:`Bindings.resume` can pin them again, reloading evicted rows, before it runs."""

    vectors: list[HostVector]
    receipt: str
    entries: list[BoundEntry]
    sources: dict[RowKey, tuple[HostVector, int]]  # its rows, and where their values come from: (vector, layer)
    config: Config = field(default_factory=dict)
    reads: list[tuple[RowKey, int]] = field(default_factory=list)  # its readout probes' rows and layers, in order
    suspended: bool = False

    @property
    def keys(self) -> Collection[RowKey]:
        return self.sources.keys()


_PHASES = {Phase.ALL: "pd", Phase.PREFILL: "p", Phase.DECODE: "d"}


class Bindings(Mapping[str, Binding]):
    """The bindings of the admitted requests, by request id, over one registry and slot cache."""

    def __init__(self, registry: VectorRegistry, slots: SlotCache, requests: EngineRequests):
        self.registry = registry
        self.slots = slots
        self.requests = requests
        self._by_id: dict[str, Binding] = {}
        self._writes: list[BankWrite] = []
        self._rebinds: dict[str, Config] = {}  # resumed request id -> its new config
        self.waiting_to_resume: set[str] = set()  # preempted requests whose rows could not be pinned again yet
        self.resumptions = 0

    def __getitem__(self, request_id: str) -> Binding:
        return self._by_id[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def bind(
        self,
        request: Any,
        resolved: Resolved,
        sources: dict[RowKey, tuple[HostVector, int]],
        slot_of: dict[RowKey, int],
        loads: list[tuple[int, RowKey]],
        probes: Sequence[tuple[Any, HostVector]] = (),
    ) -> Binding:
        """Bind a request whose rows ``SlotCache.acquire`` pinned (``slot_of``, ``loads``): reference its versions,
        queue the loads, and give the request its config. ``probes``: its readout's ``(Probe, version)`` pairs
        (``readout_admission``), whose rows ``sources`` holds too."""
        vectors = []
        for _, vector in [*resolved, *probes]:
            if vector not in vectors:
                self.registry.acquire(vector)
                vectors.append(vector)
        self._load(loads, sources)
        entries = [
            BoundEntry(row_key(v, layer), layer, 0.0 if e.norm else e.scale, e.scale if e.norm else 0.0, _PHASES[e.phase],
                       int(e.when is not None))
            for e, v in resolved for layer in e.layers
        ]
        reads = [(row_key(v, p.layer), p.layer) for p, v in probes]
        config = self._config(entries, reads, slot_of)
        binding = Binding(vectors, receipt(resolved), entries, sources, config, reads)
        self._by_id[self.requests.request_id(request)] = binding
        self.give_config(request, config)
        return binding

    def give_config(self, request: Any, config: Config) -> None:
        """Give a request its config: the workers read it from the request's ``extra_args``."""
        self.requests.set_extra(request, BINDING_KEY, config)

    def _load(self, loads: list[tuple[int, RowKey]], sources: dict[RowKey, tuple[HostVector, int]]) -> None:
        for slot, key in loads:
            vector, layer = sources[key]
            # A copy: a view would carry the whole vector's storage when the write is pickled to the workers.
            row = vector.row(layer).clone()
            self._writes.append(BankWrite(slot, row, 1.0 / max(vector.row_norm(layer), 1e-30)))

    @staticmethod
    def _config(entries: list[BoundEntry], reads: list[tuple[RowKey, int]], slot_of: dict[RowKey, int]) -> Config:
        """The workers' per-phase items, and the readout's rows (``"r"``) where it reads."""
        config: Config = {"p": [], "d": []}
        for e in entries:
            for phase in e.phases:
                config[phase].append(SteerItem(e.layer, slot_of[e.key], e.scale, e.rel, e.gated))
        if reads:
            config["r"] = [SteerItem(layer, slot_of[key], 0.0, 0.0) for key, layer in reads]
        return config

    def suspend(self, request_id: str) -> None:
        """A preempted request: unpin its rows until ``resume``; its versions stay referenced."""
        binding = self._by_id.get(request_id)
        if binding is not None and not binding.suspended:
            self.slots.release(binding.keys)
            binding.suspended = True

    def resume(self, request: Any) -> bool:
        """Pin a preempted request's rows again before the scheduler lets it run; False (and nothing changes)
        while they cannot all be pinned. Rows evicted meanwhile are reloaded, possibly into other slots: the
        request and, through ``take_rebinds``, the workers then get the new config."""
        request_id = self.requests.request_id(request)
        binding = self._by_id.get(request_id)
        if binding is None or not binding.suspended:
            return True
        try:
            slot_of, loads = self.slots.acquire(binding.keys)
        except SlotsExhausted:
            self.waiting_to_resume.add(request_id)
            return False
        self.waiting_to_resume.discard(request_id)
        self._load(loads, binding.sources)
        binding.suspended = False
        self.resumptions += 1
        config = self._config(binding.entries, binding.reads, slot_of)
        if config != binding.config:
            binding.config = config
            self.give_config(request, config)
            self._rebinds[request_id] = config
        return True

    def release(self, request_id: str) -> None:
        """A request that finished, was aborted, or was refused after it was bound."""
        binding = self._by_id.pop(request_id, None)
        self._rebinds.pop(request_id, None)
        self.waiting_to_resume.discard(request_id)
        if binding is None:
            return
        if not binding.suspended:
            self.slots.release(binding.keys)
        self.release_versions(binding.vectors)

    def release_versions(self, vectors: Collection[HostVector]) -> None:
        """Let go of references to versions; a retired version nobody uses any more leaves the bank."""
        for vector in vectors:
            if self.registry.release(vector):
                self.slots.drop(vector.vector_id, vector.version)

    @property
    def step_payload_pending(self) -> bool:
        """Whether the next step has bank writes or rebinds to carry (most steps have neither)."""
        return bool(self._writes or self._rebinds)

    def take_writes(self) -> list[BankWrite]:
        """Bank writes since the last step; a slot reloaded twice in between keeps only its last row."""
        writes, self._writes = self._writes, []
        return list({w.slot: w for w in writes}.values())

    def take_rebinds(self) -> dict[str, Config]:
        """New configs of resumed requests since the last step (their rows moved while they were preempted)."""
        rebinds, self._rebinds = self._rebinds, {}
        return rebinds
