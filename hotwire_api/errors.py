"""The one error type of the control plane, shared by the server (rendered as JSON) and the client (raised): the
engine's error shape (``hotwire_core.errors.EngineError``) with its HTTP rendering."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from hotwire_core.error_codes import ErrorCode
from hotwire_core.errors import EngineError
from hotwire_core.spec import SPEC_KEY

__all__ = ["HotwireError", "in_body"]

_PASSING = frozenset({ErrorCode.SLOTS_BUSY, ErrorCode.ENGINE_UNAVAILABLE, ErrorCode.REGISTRY_UNAVAILABLE})  # 503s worth retrying


class HotwireError(EngineError):
    """An error with an HTTP status, a stable ``code`` slug, a message a person can act on and, where one
    field of the request is at fault, that field's name."""

    def __str__(self) -> str:
        return f"{self.message} (HTTP {self.status} {self.code})"

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "code", "field"?}}``."""
        error: dict[str, Any] = {"message": self.message, "code": self.code}
        if self.field is not None:
            error["field"] = self.field
        return {"error": error}

    def headers(self) -> dict[str, str]:
        """Headers the status calls for: ``Retry-After`` on 429 and on a 503 that passes (the bank busy, the engine
        or the registry not answering), ``WWW-Authenticate`` on 401."""
        if self.status == 429 or self.code in _PASSING:
            return {"Retry-After": "1"}
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def in_body(exc: Any) -> HotwireError:
    """A refusal (``Refusal`` or :class:`HotwireError`) with its field named as in the request body
    (``vllm_xargs.hotwire[0].id``)."""
    field = exc.field
    if field is not None and field.startswith(SPEC_KEY):
        field = f"vllm_xargs.{field}"
    return HotwireError(exc.status, exc.code, exc.message, field)
