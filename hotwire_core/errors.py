"""The one error shape of the engine side: it travels back through ``collective_rpc`` as a plain dict."""

from __future__ import annotations

from .contract import Failure


class EngineError(ValueError):
    """Something the engine cannot honour; ``status`` is the HTTP status the control plane answers with."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field

    def to_result(self) -> Failure:
        out = Failure(ok=False, status=self.status, code=self.code, error=self.message)
        if self.field:
            out["field"] = self.field
        return out
