"""vLLM 0.25.1 glue: serve hotwire from a plain ``vllm serve`` (with :mod:`hotwire_api.vllm_process`, the only
vLLM-version-specific code of hotwire_api).

vLLM has no endpoint-plugin group. The ``hotwire_api`` general plugin (:func:`register`, run in every vLLM
process) calls :func:`install`. In the API server that wraps ``vllm.entrypoints.serve.register_vllm_serve_api_routers``,
which ``build_app`` imports at call time right after creating the FastAPI app and setting ``app.state.args``,
so every app it builds gets hotwire attached. Being the first middleware ``build_app`` adds, admission is the
innermost: vLLM's HTTP metrics, CORS, ``--api-key`` auth (``/v1`` only), scaling middleware and any
``--middleware`` all run before it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

from hotwire_api.vllm_process import is_api_server_process
from hotwire_core.settings import default_store_root
from hotwire_core.vllm_glue import inactive_reason

__all__ = ["install", "register"]

_SERVE_MODULE = "vllm.entrypoints.serve"
_HOOK = "register_vllm_serve_api_routers"
_MARK = "__hotwire_attached__"

logger = logging.getLogger(__name__)


def install() -> bool:
    """Make vLLM's app builder attach hotwire; returns whether the hook is in place. Does nothing outside the
    API server, and nothing the second time."""
    if not is_api_server_process():
        return False
    try:
        serve = importlib.import_module(_SERVE_MODULE)
        original = getattr(serve, _HOOK)
    except (ImportError, AttributeError) as exc:
        reason = inactive_reason()
        if reason is None:
            raise
        logger.warning("hotwire's HTTP control plane cannot attach to this vLLM's app (%s: %s): steered requests are "
                       "served as plain ones, without a receipt", reason, exc)
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def register_hotwire_and_routers(app: Any) -> None:
        from hotwire_api.server import attach  # not at import: every vLLM process loads this module

        attach(app)  # first, so that vLLM's HTTP metrics middleware also sees admission refusals
        original(app)

    setattr(register_hotwire_and_routers, _MARK, True)
    setattr(serve, _HOOK, register_hotwire_and_routers)
    return True


def register() -> None:
    """vLLM general-plugin entry point ``hotwire_api``: in the API server, mount the HTTP control plane and turn
    the vector store on by default (the engine processes it spawns later inherit the setting)."""
    if install():
        os.environ.setdefault("HOTWIRE_STORE", default_store_root())
