"""The contract between hotwire's processes: the ``collective_rpc`` methods the API server (or an offline ``LLM``)
calls on the engine core and its workers, the shapes of their answers, and the names hotwire adds to vLLM's own
objects on their way from the engine core to the workers.

Everything here crosses a process boundary as msgpack or pickle, so results are plain dicts: the TypedDicts name
their keys for type checkers and readers, and build them (``RegisterResult(ok=True, ...)`` is a ``dict``). vLLM's
``MsgpackEncoder`` sends a utility result's own types only under ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (it then
records each value's class, ``vllm.v1.serial_utils.UtilityResult``), so a dataclass or msgspec struct would reach
the API server as a dict anyway: the API server validates what it reads into its own models
(``hotwire_api.models``, whose fields tests/unit/test_contract.py pins to these). Each shape is written here once,
and both sides build or read it through these names. The table in docs/architecture.md ("RPC contract")
describes each call.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, NotRequired, TypedDict

__all__ = [
    "ADMISSION_ONLY_KEYS", "BINDING_KEY", "CAPTURE_KEY", "CATALOG", "CHECK", "ENGINE_METHODS", "EXPORT", "GRAPH_SETS", "LIST", "PREFIX",
    "PEEK_READOUTS", "READOUT_ARGS_KEY", "REBINDS_ATTR", "REFUSALS", "REGISTER", "STATS", "TAKE_CAPTURES", "TAKE_READOUTS", "UNREGISTER", "USER_SALT_ATTR", "WORKER_INFO",
    "WORKER_METHODS", "WRITES_ATTR",
    "CatalogResult", "CheckResult", "Config", "ExportResult", "Failure", "GateArgs", "ListResult", "ModelView", "ReadoutArgs",
    "ReadoutProbe", "RefusalsResult",
    "RegisterResult", "SlotRow", "StatsResult", "SteerItem", "TakeCapturesResult", "TakeReadoutsResult", "UnregisterResult", "VectorMeta",
    "WorkerInfo",
    "engine_method", "rpc_name",
]

PREFIX = "hotwire_"  # every hotwire RPC's name starts with it; the engine core answers those it does not forward

# Answered by the engine core's controller (``SteeringController.answer``).
REGISTER = "hotwire_register"
UNREGISTER = "hotwire_unregister"
LIST = "hotwire_list"
STATS = "hotwire_stats"
CHECK = "hotwire_check"
CATALOG = "hotwire_catalog"
REFUSALS = "hotwire_refusals"
EXPORT = "hotwire_export"
ENGINE_METHODS = frozenset({REGISTER, UNREGISTER, LIST, STATS, CHECK, CATALOG, REFUSALS, EXPORT})

# Answered by every worker (methods vllm_glue adds to vLLM's ``WorkerBase``).
WORKER_INFO = "hotwire_worker_info"
GRAPH_SETS = "hotwire_graph_sets"
TAKE_CAPTURES = "hotwire_take_captures"  # args: tags: list[str]; every rank answers with the layers it holds
TAKE_READOUTS = "hotwire_take_readouts"  # args: tags: list[str], wait=True; every rank answers with the probes it reads
PEEK_READOUTS = "hotwire_peek_readouts"  # args: since: dict[tag, first generated token]; as TAKE_READOUTS, left in place
WORKER_METHODS = frozenset({WORKER_INFO, GRAPH_SETS, TAKE_CAPTURES, TAKE_READOUTS, PEEK_READOUTS})

# Riding on vLLM's objects from the engine core to the workers.
BINDING_KEY = "hotwire.binding"  # sampling_params.extra_args: a request's per-phase bank config
WRITES_ATTR = "hotwire_writes"  # SchedulerOutput: bank rows to load before the step
REBINDS_ATTR = "hotwire_rebinds"  # SchedulerOutput: new configs of resumed requests whose rows moved
CAPTURE_KEY = "hotwire.capture"  # sampling_params.extra_args: {"tag", "layers", "position"} of a capture request
USER_SALT_ATTR = "hotwire_user_salt"  # Request built with hotwire's cache salt: the user's own salt
READOUT_ARGS_KEY = "hotwire.readout"  # sampling_params.extra_args: a readout request's ReadoutArgs
# Set by the engine core's admission only: a client's own would steer or read bank rows it was never given.
ADMISSION_ONLY_KEYS = (BINDING_KEY, READOUT_ARGS_KEY)


class SteerItem(NamedTuple):
    """One entry of a request's phase config, as the workers apply it: after decoder layer ``layer``, add bank row
    ``slot`` times ``scale`` (absolute; 0 for a norm-relative entry) or times ``rel`` and the token's norm; ``gated``
    (1): only at the tokens the request's condition lets through (``gates``). A tuple, so pickle (the scheduler
    output to the workers) keeps it, and msgpack would give a list that unpacks alike."""

    layer: int
    slot: int
    scale: float
    rel: float
    gated: int = 0


# A request's binding (``sampling_params.extra_args[BINDING_KEY]``, ``REBINDS_ATTR``): phase "p" (its prompt) and
# "d" (after it) -> the items steering its tokens in that phase, and "r" -> its readout probes' rows in probe order
# (``layer`` and ``slot``; scales 0). Built by ``bindings``, read by ``runtime``.
Config = dict[str, list[SteerItem]]


def rpc_name(method: str) -> str:
    """The RPC name of a controller method (``"register"`` -> ``"hotwire_register"``)."""
    return PREFIX + method


def engine_method(rpc: Any) -> str | None:
    """The controller method an RPC name asks for (``"hotwire_stats"`` -> ``"stats"``), or None for a call that
    is not hotwire's engine-core business (vLLM's own, or a worker method). An unknown ``hotwire_*`` name is
    returned too: the controller answers it with 501."""
    if isinstance(rpc, str) and rpc.startswith(PREFIX) and rpc not in WORKER_METHODS:
        return rpc.removeprefix(PREFIX)
    return None


class _Failure(TypedDict):
    ok: Literal[False]
    status: int  # the HTTP status the control plane answers with
    code: str  # an ``error_codes.ErrorCode`` value
    error: str  # for people


class Failure(_Failure, total=False):
    """What every call answers when it refuses (``hotwire_core.errors.EngineError.to_result``)."""

    field: str  # the request field at fault


class VectorMeta(TypedDict):
    """A registered vector (``registry.HostVector.meta``); the API server reads it as ``hotwire_api.models.VectorMeta``
    and, for its catalog, as ``hotwire_api.catalog.CatalogVector``."""

    id: str
    version: int
    sha256: str
    dtype: str
    shape: list[int]
    layers: list[int] | None  # the layers naming the rows; None: a [hidden] vector, or one row per layer
    norms: dict[str, float]  # each row's L2 norm by str(layer) ("*" for a [hidden] vector)
    in_flight: int  # requests steered by it now
    created_at: float  # seconds since the epoch
    tenant: str | None  # the tenant whose namespace holds it (spec.tenant_of); None: a shared vector


class WorkerInfo(TypedDict):
    """``hotwire_worker_info``: what one worker hooked (``runtime.WorkerSteering.info``), and the settings its
    buffers were sized by, which the engine core checks against its own (``vllm_glue.engine_core``)."""

    steerable: bool
    reason: str  # why not, when not
    layers: list[int]  # the layers hooked on this rank
    n_layers: int
    hidden_size: int
    dtype: str
    norm: bool  # norm-relative entries supported
    slots: int  # HOTWIRE_SLOTS
    max_stack: int  # HOTWIRE_MAX_STACK
    capture_rows: int  # HOTWIRE_CAPTURE_ROWS where the capture op is compiled in (HOTWIRE_CAPTURE), else 0
    readout_probes: int  # HOTWIRE_READOUT_PROBES where the readout op is compiled in (HOTWIRE_READOUT), else 0
    readout_layers: list[int]  # the hooked layers the readout op runs at on this rank (HOTWIRE_READOUT_LAYERS)
    gates: list[str]  # the conditions this rank can gate on: "token", "latch" (not under speculation); [] with readout off


class ModelView(TypedDict):
    """The served model as steering sees it (``admission.ModelInfo.to_json``): in ``hotwire_stats`` (the API's
    ``models.ModelSteering``) and ``hotwire_catalog`` (read back by ``hotwire_api.catalog.rules_of``)."""

    steerable: bool
    reason: str
    n_layers: int
    hidden_size: int
    dtype: str
    max_stack: int
    norm: bool
    layers: str  # the hooked layers, "0-35" (``settings.format_layers``)
    capture_rows: int  # captures at once for vector extraction (0: capture off)
    readout_probes: int  # probes one request may read (0: readout off)
    readout_layers: str  # the layers probes may read, "0-35" ("" with readout off)
    gates: list[str]  # gated steering's conditions: "token" (per token), "latch"; []: gates are off


class RegisterResult(TypedDict):
    ok: Literal[True]
    created: bool
    vector: VectorMeta


class UnregisterResult(TypedDict):
    ok: Literal[True]
    in_flight: int  # requests still using the vector, on this engine core
    version: int | None  # the version deleted (the other data-parallel engine cores delete up to it)


class ExportResult(TypedDict):
    ok: Literal[True]
    vector: VectorMeta
    data: bytes  # the rows in layer order, as ``hotwire_register`` takes them


class ListResult(TypedDict):
    ok: Literal[True]
    vectors: list[VectorMeta]


class CheckResult(TypedDict):
    ok: Literal[True]
    receipt: str
    spec: str  # the spec with every entry pinned to the version it resolved to
    new_rows: int


class CatalogResult(TypedDict, total=False):
    """The catalog, or only ``ok``, ``generation`` and ``unchanged`` when the caller holds it already. With
    ``since``, ``vectors`` and ``removed`` are what changed after that generation (the caller's); else ``vectors``
    is every current version."""

    ok: Literal[True]
    generation: int
    unchanged: bool
    model: ModelView
    capacity: int
    max_rows: int  # bank rows one request may pin (HOTWIRE_MAX_ROWS)
    layers_setting: bool
    vectors: list[VectorMeta]
    since: int
    removed: list[str]


class SlotRow(TypedDict):
    """One occupied bank row."""

    slot: int
    id: str
    version: int
    layer: int
    refcount: int
    last_use: int


class StatsResult(TypedDict):
    """``hotwire_stats``: the slot bank, refusals by reason, waiting and preempted requests, the model
    (``SlotStats`` in docs/architecture.md; the HTTP route adds ``age_ms``, data parallelism ``engine``/``engines``)."""

    ok: Literal[True]
    capacity: int
    used: int
    pinned: int
    free: int
    evictions: int
    tenant_rows: int  # bank rows one tenant's vectors may pin at once (HOTWIRE_TENANT_ROWS)
    tenant_shares: dict[str, int]  # the named tenants' own shares (HOTWIRE_TENANT_LIMITS rows)
    rows: list[SlotRow]
    refused: dict[str, int]
    steered_requests: int
    deferred: int
    deferrals: int
    suspended: int
    resumptions: int
    capturing: int  # capture requests admitted and not finished (at most HOTWIRE_CAPTURE_ROWS)
    vectors: int
    model: ModelView


class TakeCapturesResult(TypedDict):
    """One rank's answer to ``hotwire_take_captures``: per tag, ``{"layers": [...], "tokens": n, "data": bytes}``
    (float32 sums over the captured tokens, ``[len(layers), hidden]``, the layers this rank hooks) or ``{"error"}``;
    tags whose request has not finished are absent."""

    ok: Literal[True]
    captures: dict[str, dict[str, Any]]


class ReadoutProbe(TypedDict):
    """One probe of a readout request as the engine core resolved it."""

    name: str  # "id@version:L<layer>"
    layer: int
    bias: float  # added to the dot product
    norm: float  # the probe row's L2 norm (for cosines)


class GateArgs(TypedDict):
    """A gated request's condition as the workers evaluate it (``gates.gate_args``) on readout probe ``probe``."""

    probe: int
    threshold: float
    below: bool
    cosine: bool  # the cosine rather than the dot product plus bias
    latch: bool
    prompt: bool  # only prompt tokens are evaluated


class _ReadoutArgs(TypedDict):
    tag: str
    tokens: str  # "prompt", "generated" or "all"
    probes: list[ReadoutProbe]


class ReadoutArgs(_ReadoutArgs, total=False):
    """``extra_args[READOUT_ARGS_KEY]`` of an admitted readout request (``readout_admission.worker_args``)."""

    gate: GateArgs  # a gated request's condition


class TakeReadoutsResult(TypedDict):
    """One rank's answer to ``hotwire_take_readouts``: per tag, ``{"args": ReadoutArgs, "prompt_len": n,
    "held": [probe indices this rank reads], "positions": bytes, "values": bytes}`` (``positions``: int32 ``[m]``,
    the token positions read, ascending; ``values``: float32 ``[m, len(probes), 2]``, each probe's dot product and
    the stream's norm at its layer) or ``{"error"}``; tags whose request has not finished are absent.
    ``pending``: asked not to wait, the rank handed out nothing, as a tag's values were still on their way."""

    ok: Literal[True]
    readouts: dict[str, dict[str, Any]]
    pending: NotRequired[bool]


class RefusalsResult(TypedDict):
    ok: Literal[True]
    refusals: dict[str, Failure]  # ticket -> the refusal kept for it
