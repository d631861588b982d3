"""hotwire's one error shape: a status, a code, a message and maybe a field. The engine side sends it back
through ``collective_rpc`` as a plain dict (``to_result``); the callers (the control plane's
``hotwire_api.errors.HotwireError``, the offline API's ``hotwire_core.offline.HotwireError``) raise it again
(``from_result``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from .contract import Failure
from .error_codes import ErrorCode, known_code


_Error = TypeVar("_Error", bound="EngineError")

__all__ = ["EngineError", "internal_failure"]

logger = logging.getLogger(__name__)


class EngineError(ValueError):
    """Something the engine cannot honour; ``status`` is the HTTP status the control plane answers with. ``code``
    is an ``ErrorCode``; one read off the wire that hotwire does not know (another server's) stays a string."""

    def __init__(self, status: int, code: ErrorCode | str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, known_code(code), message, field

    def to_result(self) -> Failure:
        out = Failure(ok=False, status=self.status, code=str(self.code), error=self.message)  # a plain str on the wire
        if self.field:
            out["field"] = self.field
        return out

    @classmethod
    def from_result(cls: type[_Error], result: Mapping[str, Any], default_message: str = "hotwire call failed") -> _Error:
        """The error a failure dict (``contract.Failure``) describes; missing keys get defaults."""
        return cls(int(result.get("status") or 500), str(result.get("code") or ErrorCode.INTERNAL),
                   str(result.get("error") or default_message), result.get("field"))


def internal_failure(what: str, exc: BaseException) -> Failure:
    """The 500 for ``what`` (say ``hotwire_register``) failing in the engine with ``exc``, whose traceback is logged
    here: the failure dict an engine method answers with instead of raising (an exception leaving
    ``collective_rpc`` reaches the API server as an engine that does not answer)."""
    logger.error("hotwire: %s failed", what, exc_info=exc)
    return EngineError(500, ErrorCode.INTERNAL, f"{what} failed in the engine ({type(exc).__name__}: {exc}); its "
                       "log has the traceback").to_result()
