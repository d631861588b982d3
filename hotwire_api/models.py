"""Pydantic models of the ``/steer/*`` API (they are what its OpenAPI schema shows, and what the client returns)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hotwire_core.spec import VECTOR_ID_RE


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong and what to do about it.")
    code: str = Field(description="Stable slug, e.g. `exists`, `unknown_vector`, `not_finite`, `slots_exhausted`.")
    field: str | None = Field(None, description="The request field at fault, when there is one.")


class ErrorBody(BaseModel):
    """Body of every error response."""

    error: ErrorDetail


class _EngineResult(BaseModel):
    model_config = ConfigDict(extra="ignore")


class VectorMeta(_EngineResult):
    """A registered steering vector."""

    id: str
    version: int = Field(description="Bumped on every replace; receipts name the version they steered with.")
    sha256: str = Field(description="SHA-256 of the vector's dtype, shape, layers and raw bytes.")
    dtype: str
    shape: list[int]
    layers: list[int] | None = Field(description="Layers naming the rows; null: a row per layer, or any layer.")
    norms: dict[str, float] = Field(description="L2 norm of each row, keyed by layer.")
    in_flight: int = Field(0, description="Requests currently steered by this vector.")
    created_at: float = Field(description="Registration time, seconds since the epoch.")
    tenant: str | None = Field(None, description="The tenant whose vector it is; null: a shared one (the id of a "
                               "tenant's vector is its name for that tenant's keys, `<tenant>/<name>` for others).")

    @field_validator("norms", mode="before")
    @classmethod
    def _layer_keys_as_strings(cls, value: Any) -> Any:
        return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


class VectorList(BaseModel):
    vectors: list[VectorMeta]


class DeleteResult(BaseModel):
    """Body of a 202 from ``DELETE``: the vector is gone for new requests, its storage is freed when the
    requests still using it finish."""

    id: str
    in_flight: int


class SlotRow(_EngineResult):
    """One occupied row of the steering bank."""

    slot: int
    id: str
    version: int
    layer: int
    refcount: int = Field(description="Running requests pinning this row.")
    last_use: float
    engine: int = Field(0, description="Position of the data-parallel engine core whose bank holds the row among "
                        "those this API server drives (its DP rank with one API server; 0 without DP).")


class ModelSteering(_EngineResult):
    """Whether the served model can be steered, and its geometry."""

    steerable: bool
    reason: str | None = None
    n_layers: int | None = None
    hidden_size: int | None = None
    max_stack: int | None = Field(None, description="Most entries one request may stack on one layer.")
    norm: bool | None = Field(None, description="Whether norm-relative entries are allowed (HOTWIRE_NORM).")
    layers: str | None = Field(None, description="The layers this server steers, e.g. 0-35 (HOTWIRE_LAYERS).")
    capture_rows: int | None = Field(None, description="Examples captured at once for vector extraction "
                                     "(HOTWIRE_CAPTURE_ROWS); 0: capture is off (HOTWIRE_CAPTURE).")
    readout_probes: int | None = Field(None, description="Probes one request may read (HOTWIRE_READOUT_PROBES); "
                                       "0: readout is off (HOTWIRE_READOUT).")
    readout_layers: str | None = Field(None, description="The layers probes and gate conditions may read, e.g. 18 "
                                       "(HOTWIRE_READOUT_LAYERS; by default every steered layer); empty while "
                                       "readout is off.")
    gates: list[str] | None = Field(None, description="The conditions gated steering takes: token (per token) and "
                                    "latch; none while readout is off, under pipeline parallelism (and no latch "
                                    "under speculative decoding).")


class SlotStats(_EngineResult):
    """The steering bank: capacity and use, evictions, refusals, and its rows."""

    capacity: int
    used: int
    pinned: int
    free: int
    evictions: int
    tenant_shares: dict[str, int] = Field(default_factory=dict, description="The bank rows the tenants named in "
                                          "HOTWIRE_TENANT_LIMITS may pin at once in each engine core, where they "
                                          "have their own (a tenant's key sees its own only).")
    tenant_rows: int = Field(0, description="Bank rows one tenant's vectors may pin at once in each engine core "
                             "(HOTWIRE_TENANT_ROWS).")
    refused: dict[str, int] = Field(
        description="Requests the engine refused at admission, by reason (HTTP refusals: /metrics hotwire_refusals_total)."
    )
    steered_requests: int
    deferred: int = Field(0, description="Requests admitted over HTTP now waiting in the engine for bank rows.")
    deferrals: int = Field(0, description="Requests that have had to wait for bank rows, since start.")
    suspended: int = Field(0, description="Preempted requests whose rows are unpinned until they resume.")
    resumptions: int = Field(0, description="Preempted requests that pinned their rows again, since start.")
    capturing: int = Field(0, description="Capture requests of vector extractions now running (at most "
                           "HOTWIRE_CAPTURE_ROWS per engine core).")
    vectors: int = Field(description="Registered vectors.")
    rows: list[SlotRow]
    model: ModelSteering
    engines: int = Field(1, description="Engine cores counted (data parallelism): each has its own bank of "
                         "HOTWIRE_SLOTS rows, and the counters are their sums.")
    age_ms: float = Field(0.0, description="How old these numbers are (see GET /steer/slots?max_age_ms).")
    registry: RegistryStatus | None = Field(None, description="Where the vectors live (HOTWIRE_REGISTRY) and "
                                            "whether it answers.")


class RegistryStatus(BaseModel):
    """The vector registry: ``local`` (each engine's own) or ``redis`` (one for the fleet: docs/fleet.md)."""

    kind: Literal["local", "redis"]
    url: str | None = Field(None, description="The registry's URL, secrets masked.")
    reachable: bool | None = Field(None, description="Whether it answered the last command (redis only).")
    error: str | None = Field(None, description="Why it did not, when it did not.")
    replica: str | None = Field(None, description="This replica's id in the fleet (HOTWIRE_REPLICA_ID).")
    position: str | None = Field(None, description="The last registry event this replica applied.")
    events_applied: int = 0
    resyncs: int = Field(0, description="Full comparisons with the registry's current versions (at start, and "
                         "after an absence the event stream no longer covers).")
    reset: bool = Field(False, description="Redis came back without something this replica had applied "
                        "(restarted from older data, or lost hotwire's keys); the replicas put back what they had "
                        "applied.")
    seeded: int = Field(0, description="Versions and deletions this replica put back into a registry that lacked them.")


class ReplicaSlots(BaseModel):
    capacity: int
    used: int
    pinned: int
    free: int
    evictions: int
    steered_requests: int
    deferred: int = 0
    engines: int = 1

    @classmethod
    def of(cls, stats: SlotStats) -> ReplicaSlots:
        return cls(**{name: getattr(stats, name) for name in cls.model_fields})


class HeldVector(BaseModel):
    """A version a replica holds, in its heartbeat."""

    id: str
    version: int
    sha256: str
    in_flight: int = 0

    @classmethod
    def of(cls, meta: VectorMeta) -> HeldVector:
        return cls(id=meta.id, version=meta.version, sha256=meta.sha256, in_flight=meta.in_flight)


class PinnedRow(BaseModel):
    """A bank row running requests pin, in a replica's heartbeat."""

    model_config = ConfigDict(extra="ignore")

    id: str
    version: int
    layer: int
    refcount: int
    engine: int = 0

    @classmethod
    def of(cls, row: SlotRow) -> PinnedRow:
        return cls(id=row.id, version=row.version, layer=row.layer, refcount=row.refcount, engine=row.engine)


class ReplicaState(BaseModel):
    """One replica's last heartbeat."""

    model_config = ConfigDict(extra="allow")

    replica: str
    url: str | None = None
    age_ms: float = Field(description="How old its last heartbeat is; one older than 3 intervals has expired.")
    in_sync: bool = Field(description="It holds exactly the registry's current versions.")
    slots: ReplicaSlots
    refused: dict[str, int]
    pinned_rows: list[PinnedRow]
    vectors: list[HeldVector]


class FleetVector(BaseModel):
    id: str
    version: int
    sha256: str
    held_by: list[str] = Field(description="Replicas holding this version.")
    missing_on: list[str] = Field(description="Live replicas not holding it (yet).")


class FleetView(BaseModel):
    """``GET /steer/fleet``: the registry's current versions and every replica that heartbeats."""

    registry: RegistryStatus
    vectors: list[FleetVector]
    replicas: list[ReplicaState]


class ChatMessage(BaseModel):
    role: str
    content: str


Example = str | list[ChatMessage]


class ExtractRequest(BaseModel):
    id: str = Field(pattern=f"^{VECTOR_ID_RE.pattern}$", description="The id to register the vector under.")
    positive: list[Example] = Field(description="Prompts (or chat message lists) showing the behaviour.")
    negative: list[Example] = Field(description="Prompts showing its opposite; paired with positive by index for pca.")
    layers: list[int] | str = Field("all", description="'all' (every hooked layer), a range like '8-20', or a list.")
    method: Literal["mean_diff", "pca"] = Field("mean_diff", description="mean_diff (CAA) or pca (repeng's pca_diff).")
    position: Literal["last", "mean"] = Field("last", description="The last prompt token's activation, or the mean "
                                              "over the prompt.")
    normalize: bool = Field(False, description="Unit length at every layer.")
    replace: bool = Field(False, description="Replace a vector with the same id (its version goes up).")


class LayerSeparation(BaseModel):
    layer: int
    separation: float | None = Field(description="(mean positive - mean negative projection) / pooled std: Cohen's "
                                     "d along the vector; null when neither set has any spread.")
    gap: float = Field(description="Mean positive minus mean negative projection onto the unit direction.")
    accuracy: float = Field(description="Share of examples on their own side of the midpoint of the two means.")
    norm: float = Field(description="The vector's norm at this layer.")


class ExtractResult(BaseModel):
    vector: VectorMeta
    method: str
    position: str
    examples: dict[str, int]
    layers: list[LayerSeparation]


class ReadoutValues(BaseModel):
    score: list[float] = Field(description="Per token: the dot product of the residual stream with the probe, plus "
                               "its bias.")
    cosine: list[float] = Field(description="Per token: the cosine between the residual stream and the probe.")


class ProbeReadout(BaseModel):
    probe: str = Field(description="id@version:L<layer>, as receipts name steering.")
    bias: float
    prompt: ReadoutValues | None = Field(None, description="One value per prompt token (tokens prompt or all).")
    generated: ReadoutValues | None = Field(None, description="One value per generated token, read at the position "
                                            "that predicted it (tokens generated or all).")


class Readout(BaseModel):
    """``hotwire_readout`` of a chat or completions response (docs/usage.md, "Readout")."""

    tokens: str
    probes: list[ProbeReadout]


class Monitor(BaseModel):
    """``POST /steer/monitors``: a registered vector read as a probe on every request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=f"^{VECTOR_ID_RE.pattern}$", description="the monitor's name (metrics label)")
    probe: str = Field(pattern=f"^{VECTOR_ID_RE.pattern}$", description="the registered vector read as "
                                "a probe (its current version when each request is admitted)")
    layer: int = Field(ge=0, description="the layer after which the residual stream is read")
    bias: float = Field(0.0, allow_inf_nan=False, description="added to the dot product (a linear probe)")
    threshold: float = Field(allow_inf_nan=False, description="a score past it flags the request")
    flag: Literal["above", "below"] = Field("above", description="flag scores at or above the threshold, "
                                                      "or at or below it")
    scope: Literal["prompt", "generated"] = Field(
        "generated", description="prompt: the last prompt token's score; generated: the generated tokens' scores, "
        "reduced")
    reduce: Literal["max", "mean", "min"] = Field("max", description="how the generated tokens' scores "
                                                            "make the request's (scope generated)")


class MonitorList(BaseModel):
    kept: str = Field(description="`redis` (a fleet's: every replica reads them), `file <path>` (monitors.json in "
                      "the model's store folder) or `memory` (this API server's: the store is off)")
    monitors: list[Monitor]


class MonitorScore(BaseModel):
    """One monitor's verdict on one request (``hotwire_monitors`` in the response)."""

    monitor: str
    probe: str = Field(description="the probe read: id@version:L<layer>")
    score: float
    flagged: bool


class GateReceipt(BaseModel):
    """``hotwire_gate`` of a response whose steering is gated (docs/usage.md, "Gated steering")."""

    condition: str = Field(description="The probe read: id@version:L<layer>.")
    fired: bool
    position: int | None = Field(description="The first position where the condition held (below prompt_tokens: "
                                 "that prompt token; else the token generated position - prompt_tokens-th).")
    positions_held: int
    prompt_tokens: int
    latch: bool = Field(description="Latched: every position from `position` on was steered; else those where "
                        "the condition held.")


class Completion(BaseModel):
    """What ``HotwireClient.complete`` returns: one completion, its receipt, its readout, the monitors' verdicts and
    what its gate did."""

    model: str
    text: str
    finish_reason: str | None
    receipt: str | None = Field(description="x-hotwire-receipt: the versions that steered it (None: unsteered).")
    readout: Readout | None = Field(description="hotwire_readout, when probes were read.")
    monitors: list[MonitorScore] | None = Field(None, description="hotwire_monitors, when the server's monitors read "
                                                "the request.")
    gate: GateReceipt | None = Field(None, description="hotwire_gate, when the steering is gated.")
    prompt_tokens: int
    completion_tokens: int


class TenantUsage(BaseModel):
    """What one tenant holds and uses now, beside its quotas (docs/security.md, "Tenants")."""

    tenant: str
    vectors: int = Field(description="Vectors it holds registered (at most limits.vectors: HOTWIRE_TENANT_VECTORS, "
                         "or its own in HOTWIRE_TENANT_LIMITS).")
    bytes: int = Field(description="Their bytes (at most limits.bytes: HOTWIRE_TENANT_MB, or its own).")
    registrations_last_minute: int = Field(description="Its registrations in the last 60 s (at most "
                                           "limits.registrations_per_minute; in a fleet, on every replica).")
    pinned_rows: int = Field(description="Bank rows its vectors' running requests pin now, summed over engine cores.")
    limits: dict[str, int] = Field(description="Its quotas: vectors, bytes, registrations_per_minute, and rows (pinned "
                                   "at once in each engine core).")


class UsageList(BaseModel):
    tenants: list[TenantUsage] = Field(description="A tenant's key: its own; the operator's: every tenant that holds "
                                       "a vector or pins a row.")
