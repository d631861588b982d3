"""Bearer-token auth for ``/steer/*``.

The key is ``HOTWIRE_API_KEY`` when set; otherwise vLLM's own keys, in vLLM's order: ``--api-key`` (in vLLM
0.25.1 a list, ``app.state.args.api_key``) and else the ``VLLM_API_KEY`` environment variable. vLLM's own
``AuthenticationMiddleware`` only guards ``/v1``, ``/v2`` and ``/inference``, so ``/steer/*`` must check here, and
admission checks vLLM's keys for a steered request on any route (``/invocations`` is not guarded by vLLM).
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from fastapi import Request

from hotwire_api.errors import HotwireError
from hotwire_api.settings import Settings
from hotwire_core.error_codes import ErrorCode
from hotwire_core.vllm_glue.api_server import cli_api_keys


def vllm_keys(app: Any) -> list[str]:
    """vLLM's own keys, which guard its OpenAI routes: ``--api-key`` and else ``VLLM_API_KEY``; empty when unset."""
    return [key for key in (cli_api_keys(app) or [os.environ.get("VLLM_API_KEY")]) if key]


def api_keys(app: Any) -> list[str]:
    """The keys that open ``/steer/*``: ``HOTWIRE_API_KEY``, else vLLM's; empty means auth is off."""
    settings: Settings = app.state.hotwire_settings
    return [settings.api_key] if settings.api_key else vllm_keys(app)


def bearer_matches(authorization: str, keys: list[str]) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of keys>``, compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode()
    match = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        match |= hmac.compare_digest(presented, key.encode())
    return match


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless ``Authorization: Bearer <key>`` carries a valid key (when auth is on)."""
    keys = api_keys(request.app)
    if keys and not bearer_matches(request.headers.get("authorization", ""), keys):
        raise HotwireError(
            401,
            ErrorCode.UNAUTHORIZED,
            "missing or wrong API key: send 'Authorization: Bearer <key>' (HOTWIRE_API_KEY, "
            "or vLLM's --api-key when HOTWIRE_API_KEY is not set)",
        )
