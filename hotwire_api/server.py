"""Attach hotwire to a FastAPI app: the ``/steer`` router (whose lifespan keeps the metrics snapshot fresh),
the admission middleware on the OpenAI routes, and the Prometheus collector. Independent of vLLM's version;
``mount.py`` decides where this is called."""

from __future__ import annotations

from fastapi import FastAPI

from hotwire_api.admission import AdmissionMiddleware
from hotwire_api.auth import Access
from hotwire_api.key_routes import router as key_router
from hotwire_api.monitor_routes import router as monitor_router
from hotwire_api.monitors import MonitorBook
from hotwire_api.readout_stream import ReadoutStreams
from hotwire_api.readout_takes import ReadoutTakes
from hotwire_api.metrics import register_collector
from hotwire_api.routes import router
from hotwire_api.settings import Settings
from hotwire_api.quotas import Quotas
from hotwire_api.usage_routes import router as usage_router
from hotwire_api.vector_registry import registry_for


def attach(app: FastAPI, settings: Settings | None = None) -> None:
    """Add hotwire to ``app`` (``settings`` default to the environment). Middleware added now sits inside
    any added later, so the host's auth, CORS and error middleware run before admission."""
    settings = settings or Settings.from_env()
    app.state.hotwire_settings = settings
    app.state.hotwire_access = Access(settings)  # a keys file that cannot be read stops the start
    app.state.hotwire_registry = registry_for(settings)
    app.state.hotwire_quotas = Quotas(settings)
    app.state.hotwire_monitors = MonitorBook()
    app.state.hotwire_streams = ReadoutStreams()
    app.state.hotwire_takes = ReadoutTakes()
    app.include_router(router)
    app.include_router(key_router)
    app.include_router(monitor_router)
    app.include_router(usage_router)
    app.add_middleware(AdmissionMiddleware, lenient=settings.lenient)
    register_collector()
