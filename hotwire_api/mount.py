"""Serve hotwire from a plain ``vllm serve``: the ``hotwire_api`` general plugin (:func:`register`, run by vLLM in
every process) attaches the HTTP control plane to every app vLLM's API server builds. Where and how is vLLM's
business, known to :mod:`hotwire_core.vllm_glue.api_server`."""

from __future__ import annotations

import logging
import os

from hotwire_core.settings import default_store_root
from hotwire_core.vllm_glue import inactive_reason
from hotwire_core.vllm_glue.api_server import attach_to_app_builder, guard_engine_requests, is_api_server_process

__all__ = ["install", "register"]

logger = logging.getLogger(__name__)


def _attach(app) -> None:
    from hotwire_api.server import attach  # not at import: every vLLM process loads this module
    from hotwire_api.tickets import TICKETS

    attach(app)
    if inactive_reason() is None:  # (elsewhere hotwire hooks nothing, and admission answers steering 503)
        guard_engine_requests(TICKETS.check)  # no spec reaches the engine unless admission decided it


def install() -> bool:
    """Make vLLM's app builder attach hotwire; returns whether the hook is in place. Does nothing outside the
    API server, and nothing the second time."""
    if not is_api_server_process():
        return False
    try:
        attach_to_app_builder(_attach)
    except (ImportError, AttributeError) as exc:
        reason = inactive_reason()
        if reason is None:
            raise
        logger.warning("hotwire's HTTP control plane cannot attach to this vLLM's app (%s: %s): steered requests are "
                       "served as plain ones, without a receipt", reason, exc)
        return False
    return True


def register() -> None:
    """vLLM general-plugin entry point ``hotwire_api``: in the API server, mount the HTTP control plane and turn
    the vector store on by default (the engine processes it spawns later inherit the setting). With a fleet
    registry (``HOTWIRE_REGISTRY``) Redis is the store: the engine keeps no store of its own and preloads nothing
    (its versions must all be the registry's)."""
    if not install():
        return
    from hotwire_api.fleet.config import REGISTRY

    if REGISTRY.read() is None:
        os.environ.setdefault("HOTWIRE_STORE", default_store_root())
        return
    for name in ("HOTWIRE_STORE", "HOTWIRE_VECTORS"):
        if os.environ.get(name, "off").strip().lower() not in ("", "off"):
            logger.warning("hotwire: %s is ignored with HOTWIRE_REGISTRY: the fleet's registry holds the vectors "
                           "(register them over HTTP once, on any replica)", name)
    os.environ["HOTWIRE_STORE"] = "off"
    os.environ.pop("HOTWIRE_VECTORS", None)
