"""A typed wrapper over ``engine_client.collective_rpc`` for the ``hotwire_*`` methods that the engine core
answers (contract in docs/architecture.md). Every failure surfaces as a :class:`HotwireError`.

With data parallelism each engine core has its own registry copy and slot bank. Registrations and deletions go
to the first engine core, which numbers the version, then to every other one with that number, so that all agree
whatever the order in which concurrent registrations reach them (a version that arrives after a newer one is
only retained: ``hotwire_core.registry``); slot statistics are summed (rows carry their engine core's position),
and a vector's in-flight users are counted on every engine core, so ``DELETE`` answers 202 while any of them
still uses it. The catalog comes from the first engine core; kept refusals are asked of all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from hotwire_api.codec import VectorPayload
from hotwire_api.errors import HotwireError
from hotwire_api.models import SlotStats, VectorMeta
from hotwire_core.error_codes import ErrorCode
from hotwire_core.vllm_glue.api_server import PerEngineRPC, engine_client, per_engine_rpc
from hotwire_core import contract

_Model = TypeVar("_Model", bound=BaseModel)


class RPCClient(Protocol):
    """The part of vLLM's ``EngineClient`` (``AsyncLLM``) that hotwire uses."""

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...


class HotwireEngine:
    """The ``hotwire_*`` RPCs of one engine client. ``per_engine`` (see ``hotwire_core.vllm_glue.api_server.per_engine_rpc``)
    gathers every engine core's answer under data parallelism; without it there is one engine core."""

    def __init__(self, client: RPCClient, per_engine: PerEngineRPC | None = None):
        self._client = client
        self._per_engine = per_engine

    @property
    def client(self) -> RPCClient:
        """The engine client these RPCs go to."""
        return self._client

    @classmethod
    def of(cls, app: Any) -> HotwireEngine:
        """The engine of a vLLM app (its engine client, set once the engine runs). Raises 503
        ``hotwire_inactive`` on a vLLM hotwire does not support (its engine side then hooks nothing)."""
        from hotwire_core.vllm_glue import inactive_reason

        reason = inactive_reason()
        if reason is not None:
            raise HotwireError(503, ErrorCode.HOTWIRE_INACTIVE, f"hotwire is inactive on this server: {reason}")
        client = engine_client(app)
        if client is None:
            raise HotwireError(503, ErrorCode.ENGINE_UNAVAILABLE, "the engine is not running; retry once /health is OK")
        return cls(client, per_engine_rpc(client))

    async def _call(self, method: str, *args: Any) -> dict[str, Any]:
        """The first engine core's answer."""
        return (await self._call_each(method, *args, which=slice(1)))[0]

    async def _call_each(
        self, method: str, *args: Any, which: slice = slice(None), answered_only: bool = False
    ) -> list[dict[str, Any]]:
        """One answer per engine core ``which`` selects (all by default); any refusal is raised. With
        ``answered_only``, the answers of the engine cores that answered; a failure is raised only when every
        engine core failed."""
        try:
            if self._per_engine is not None:  # vLLM's own call would ask every engine core but read one answer
                answers = await self._per_engine(method, args, which, answered_only)
            elif which.start:  # the other engine cores: there are none
                answers = []
            else:
                answers = [await self._client.collective_rpc(method, args=args)]
        except Exception as exc:
            raise self._unavailable(method, exc) from exc
        results: list[dict[str, Any]] = []
        failed: list[HotwireError] = []
        for answer in answers:
            try:
                if isinstance(answer, BaseException):  # only with answered_only: see per_engine_rpc
                    raise self._unavailable(method, answer) from answer
                results.append(self._checked(method, answer))
            except HotwireError as exc:
                if not answered_only:
                    raise
                failed.append(exc)
        if failed and not results:
            raise failed[0]
        return results

    @staticmethod
    def _unavailable(method: str, exc: BaseException) -> HotwireError:
        """An engine (core) that did not answer: it is dead, or it does not know the method."""
        return HotwireError(
            503,
            ErrorCode.ENGINE_UNAVAILABLE,
            f"the engine did not answer {method} ({type(exc).__name__}: {exc}); check that the hotwire plugin "
            "is installed where the engine runs and not excluded by VLLM_PLUGINS",
        )

    @staticmethod
    def _checked(method: str, results: Any) -> dict[str, Any]:
        """One engine core's answer (its first worker's), or its refusal raised."""
        result = results[0] if isinstance(results, list) and results else results
        if not isinstance(result, dict):
            raise HotwireError(
                502,
                ErrorCode.BAD_ENGINE_RESULT,
                f"{method} returned {type(result).__name__}; hotwire_core and hotwire_api are from different versions",
            )
        if not result.get("ok"):
            raise HotwireError.from_result(result, f"{method} failed")
        return result

    @staticmethod
    def _parse(model: type[_Model], value: Any, method: str) -> _Model:
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            raise HotwireError(
                502, ErrorCode.BAD_ENGINE_RESULT, f"{method} returned a malformed {model.__name__}: {exc.errors()[0]['msg']}"
            ) from exc

    async def register(
        self, vector_id: str, payload: VectorPayload, replace: bool, version: int | None = None,
        retired_at: float | None = None,
    ) -> tuple[bool, VectorMeta]:
        """Register (or with ``replace`` re-register) a vector; returns (created, meta). ``version``: the number
        a fleet's registry gave it (``hotwire_api.fleet``): every engine core takes it, and one that holds that
        version already changes nothing. ``retired_at`` (wall-clock seconds): the fleet retired that version
        then; it is held as retired for the rest of its retention (410 ``version_gone`` when that is over)."""
        layers = list(payload.layers) if payload.layers is not None else None
        args = (vector_id, payload.data, payload.dtype, list(payload.shape), layers, replace)
        try:
            if version is None:
                first = await self._call(contract.REGISTER, *args)
                meta = self._parse(VectorMeta, first.get("vector"), contract.REGISTER)
                others = await self._call_each(contract.REGISTER, *args, meta.version, which=slice(1, None))
            else:
                extra = (version,) if retired_at is None else (version, retired_at)
                first, *others = await self._call_each(contract.REGISTER, *args, *extra)
                meta = self._parse(VectorMeta, first.get("vector"), contract.REGISTER)
        except HotwireError as exc:
            # The engine names the base64 upload's fields; a file or per-layer lists carried all of them.
            if exc.field == "data" or (exc.field in ("shape", "dtype") and payload.source != "data"):
                exc.field = payload.source
            raise
        metas = [self._parse(VectorMeta, a.get("vector"), contract.REGISTER) for a in others]
        if any(m.sha256 != meta.sha256 for m in metas):
            raise HotwireError(
                500,
                ErrorCode.ENGINES_DISAGREE,
                f"the data-parallel engine cores decoded {vector_id!r}@{meta.version} to different contents: "
                "hotwire_core differs between them; install one version everywhere and restart the server",
            )
        return bool(first.get("created")), meta

    async def unregister(self, vector_id: str, version: int | None = None) -> int:
        """Unregister a vector; returns how many requests still use it, on every engine core. ``version``: the
        version a fleet's registry deleted (every engine core deletes up to it; a newer one stays)."""
        if version is None:
            first = await self._call(contract.UNREGISTER, vector_id)
            others = await self._call_each(contract.UNREGISTER, vector_id, int(first["version"]), which=slice(1, None))
            answers = [first, *others]
        else:
            answers = await self._call_each(contract.UNREGISTER, vector_id, version)
        return sum(int(a.get("in_flight") or 0) for a in answers)

    async def export(self, vector_id: str, version: int | None) -> tuple[VectorMeta, VectorPayload]:
        """A version the first engine core holds (None: its current one), with its bytes (rows in layer order): 404
        when it holds none."""
        answer = await self._call(contract.EXPORT, vector_id, version)
        meta = self._parse(VectorMeta, answer.get("vector"), contract.EXPORT)
        data = answer.get("data")
        if not isinstance(data, (bytes, bytearray)):
            raise HotwireError(502, ErrorCode.BAD_ENGINE_RESULT, f"{contract.EXPORT} returned no bytes")
        return meta, VectorPayload(bytes(data), meta.dtype, tuple(meta.shape),
                                   None if meta.layers is None else tuple(meta.layers))

    async def vectors(self, tenant: str | None = None) -> list[VectorMeta]:
        """Every current vector, or ``tenant``'s alone ("": the shared ones)."""
        answers = await self._call_each(contract.LIST, tenant)
        return [self._parse(VectorMeta, v, contract.LIST) for v in merge_vector_lists(answers)]

    async def stats(self) -> SlotStats:
        return self._parse(SlotStats, merge_stats(await self._call_each(contract.STATS)), contract.STATS)

    async def check(self, spec: str) -> tuple[str, str]:
        """Decide a request's spec in the engine (for versions the API's catalog does not hold): its receipt for
        ``x-hotwire-receipt`` and the spec pinned to the versions the receipt names."""
        result = await self._call(contract.CHECK, spec, False)  # no 429: a request waits for its rows
        return str(result.get("receipt", "")), str(result.get("spec", spec))

    async def catalog(self, generation: int) -> dict[str, Any]:
        """The first engine core's catalog (``unchanged`` when it is still at ``generation``)."""
        return await self._call(contract.CATALOG, generation)

    async def other_catalogs(self) -> list[dict[str, Any]]:
        """The full catalogs of the engine cores after the first (none without data parallelism)."""
        return await self._call_each(contract.CATALOG, -1, which=slice(1, None))

    async def take_captures(self, tags: list[str]) -> list[dict[str, Any]]:
        """Every worker's ``hotwire_take_captures`` answer, on every engine core (a capture is held where its request
        ran; with pipeline parallelism each rank holds its own layers)."""
        return await self._take(contract.TAKE_CAPTURES, tags)

    async def take_readouts(self, tags: list[str], wait: bool = True) -> list[dict[str, Any]]:
        """Every worker's ``hotwire_take_readouts`` answer, on every engine core (as :meth:`take_captures`); not
        waiting, a worker may answer ``pending`` (``readout_takes``)."""
        return await self._take(contract.TAKE_READOUTS, tags, wait)

    async def peek_readouts(self, since: dict[str, int]) -> list[dict[str, Any]]:
        """Every worker's ``hotwire_peek_readouts`` answer, on every engine core: streamed readouts' values so far."""
        return await self._take(contract.PEEK_READOUTS, since)

    async def _take(self, method: str, *args: Any) -> list[dict[str, Any]]:
        try:
            if self._per_engine is not None:
                answers = await self._per_engine(method, args, slice(None), False)
            else:
                answers = [await self._client.collective_rpc(method, args=args)]
        except Exception as exc:
            raise self._unavailable(method, exc) from exc
        ranks = [rank for answer in answers for rank in (answer if isinstance(answer, list) else [answer])]
        if not all(isinstance(rank, dict) and rank.get("ok") for rank in ranks):
            raise HotwireError(502, ErrorCode.BAD_ENGINE_RESULT, f"{method} returned something else than its results")
        return ranks

    async def refusals(self, tickets: list[str]) -> dict[str, HotwireError]:
        """The refusals the engine cores kept for these tickets (``hotwire_core.spec.TICKET_KEY``). An engine core
        that fails to answer is left out: it cannot hold a refusal that another one would lose by answering."""
        found: dict[str, HotwireError] = {}
        for answer in await self._call_each(contract.REFUSALS, tickets, answered_only=True):
            for ticket, r in (answer.get("refusals") or {}).items():
                found[ticket] = HotwireError.from_result(r, "the engine refused the request")
        return found


# Counters of a hotwire_stats answer that add up across engine cores (each has its own bank).
_SUMMED_STATS = (
    "capacity", "used", "pinned", "free", "evictions", "steered_requests", "deferred", "deferrals", "suspended",
    "resumptions", "capturing",
)


def merge_stats(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``hotwire_stats`` answer for several engine cores: counters and refusals summed, rows concatenated with
    their engine's index; the registry (``vectors``) and the model are the same everywhere, so the first's."""
    if len(answers) == 1:
        return answers[0]
    merged = dict(answers[0])
    for key in _SUMMED_STATS:
        merged[key] = sum(int(a.get(key) or 0) for a in answers)
    refused: dict[str, int] = {}
    for answer in answers:
        for reason, count in (answer.get("refused") or {}).items():
            refused[reason] = refused.get(reason, 0) + int(count)
    merged["refused"] = refused
    merged["rows"] = [{**row, "engine": i} for i, a in enumerate(answers) for row in a.get("rows") or []]
    merged["engines"] = len(answers)
    return merged


def merge_vector_lists(answers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first engine core's vector list with each vector's in-flight users (of any of its versions) counted
    on every engine core."""
    in_flight: dict[str, int] = {}
    for answer in answers:
        for v in answer.get("vectors") or []:
            in_flight[v.get("id")] = in_flight.get(v.get("id"), 0) + int(v.get("in_flight") or 0)
    return [{**v, "in_flight": in_flight[v.get("id")]} for v in answers[0].get("vectors") or []]
