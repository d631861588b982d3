"""How the engine core's steering (``controller``, ``bindings``, ``deferral``) reads and changes the engine's
requests, which stay opaque to it: the glue makes the implementation for vLLM's ``Request`` /
``EngineCoreRequest`` (``vllm_glue.requests.VLLM_REQUESTS``) and hands it to the controller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["EngineRequests"]


class EngineRequests(Protocol):
    def request_id(self, request: Any) -> str: ...

    def extra_args(self, request: Any) -> Mapping[str, Any] | None:
        """The request's sampling params' ``extra_args`` (None: none, or a pooling request)."""

    def steering_args(self, request: Any) -> Mapping[str, Any] | None:
        """:meth:`extra_args` if they hold a steering spec (``spec.SPEC_KEY``), else None."""

    def set_extra(self, request: Any, key: str, value: Any) -> None:
        """Set one of the request's ``extra_args`` (on copied params: a caller's object is never modified)."""

    def prompt_length(self, request: Any) -> int: ...

    def user_salt(self, request: Any) -> str | None:
        """The cache salt the request's sender gave it (the glue may have salted it for hotwire since)."""

    def set_cache_salt(self, request: Any, salt: str) -> None:
        """Give the request cache salt ``salt``; its prompt's block hashes are computed again if it had another."""

    def expects_more_input(self, request: Any) -> bool:
        """Whether more input of this streaming-input session may come (False: a plain request, or the end marker)."""
