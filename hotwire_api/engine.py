"""A typed wrapper over ``engine_client.collective_rpc`` for the ``hotwire_*`` methods that the engine core
answers (contract in docs/architecture.md). Every failure surfaces as a :class:`HotwireError`."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from hotwire_api.codec import VectorPayload
from hotwire_api.errors import HotwireError
from hotwire_api.models import SlotStats, VectorMeta

_Model = TypeVar("_Model", bound=BaseModel)


class RPCClient(Protocol):
    """The part of vLLM's ``EngineClient`` (``AsyncLLM``) that hotwire uses."""

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...


class HotwireEngine:
    """The ``hotwire_*`` RPCs of one engine client."""

    def __init__(self, client: RPCClient):
        self._client = client

    @classmethod
    def of(cls, app: Any) -> HotwireEngine:
        """The engine of a vLLM app (``app.state.engine_client``, set by ``init_app_state``)."""
        client = getattr(app.state, "engine_client", None)
        if client is None:
            raise HotwireError(503, "engine_unavailable", "the engine is not running; retry once /health is OK")
        return cls(client)

    async def _call(self, method: str, *args: Any) -> dict[str, Any]:
        try:
            results = await self._client.collective_rpc(method, args=args)
        except Exception as exc:  # the engine is dead, or it does not know the method
            raise HotwireError(
                503,
                "engine_unavailable",
                f"the engine did not answer {method} ({type(exc).__name__}: {exc}); check that the hotwire plugin "
                "is installed where the engine runs and not excluded by VLLM_PLUGINS",
            ) from exc
        result = results[0] if isinstance(results, list) and results else results
        if not isinstance(result, dict):
            raise HotwireError(
                502,
                "bad_engine_result",
                f"{method} returned {type(result).__name__}; hotwire_core and hotwire_api are from different versions",
            )
        if not result.get("ok"):
            raise HotwireError(
                int(result.get("status") or 500),
                str(result.get("code") or "engine_error"),
                str(result.get("error") or f"{method} failed"),
                result.get("field"),
            )
        return result

    @staticmethod
    def _parse(model: type[_Model], value: Any, method: str) -> _Model:
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            raise HotwireError(
                502, "bad_engine_result", f"{method} returned a malformed {model.__name__}: {exc.errors()[0]['msg']}"
            ) from exc

    async def register(self, vector_id: str, payload: VectorPayload, replace: bool) -> tuple[bool, VectorMeta]:
        """Register (or with ``replace`` re-register) a vector; returns (created, meta)."""
        layers = list(payload.layers) if payload.layers is not None else None
        result = await self._call(
            "hotwire_register", vector_id, payload.data, payload.dtype, list(payload.shape), layers, replace
        )
        return bool(result.get("created")), self._parse(VectorMeta, result.get("vector"), "hotwire_register")

    async def unregister(self, vector_id: str) -> int:
        """Unregister a vector; returns how many requests still use it."""
        result = await self._call("hotwire_unregister", vector_id)
        return int(result.get("in_flight") or 0)

    async def vectors(self) -> list[VectorMeta]:
        result = await self._call("hotwire_list")
        return [self._parse(VectorMeta, v, "hotwire_list") for v in result.get("vectors") or []]

    async def stats(self) -> SlotStats:
        return self._parse(SlotStats, await self._call("hotwire_stats"), "hotwire_stats")

    async def check(self, spec: str) -> str:
        """Admit a request's spec; returns the receipt for ``x-hotwire-receipt``."""
        result = await self._call("hotwire_check", spec)
        return str(result.get("receipt", ""))
