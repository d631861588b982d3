"""Watching the control plane: ``GET /health`` and ``GET /steer/slots`` latencies polled during the run, and
the drain of every server (no pinned row) after it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from .clients import http_client
from .plan import SoakConfig


class Poller(threading.Thread):
    """Polls ``GET /health`` and ``GET /steer/slots?max_age_ms=1000`` in turn on its own connection and thread
    (so the clients' event loop does not delay its timings)."""

    PATHS = {"health": "/health", "slots": "/steer/slots?max_age_ms=1000"}

    def __init__(self, url: str, config: SoakConfig):
        super().__init__(name="soak-poller", daemon=True)
        self.url = url
        self.config = config
        self.latencies: dict[str, list[float]] = {name: [] for name in self.PATHS}
        self.errors: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30.0) as http:
            while not self.halt.is_set():
                for name, path in self.PATHS.items():
                    self._poll(http, name, path)
                self.halt.wait(self.config.poll_every)

    def _poll(self, http: httpx.Client, name: str, path: str) -> None:
        began = time.perf_counter()
        try:
            status = http.get(path).status_code
        except httpx.HTTPError as exc:
            self.errors.append({"path": path, "error": f"{type(exc).__name__}: {exc}"})
            return
        if status == 200:
            self.latencies[name].append(time.perf_counter() - began)
        else:
            self.errors.append({"path": path, "status": status})


async def drain(url: str, config: SoakConfig) -> dict[str, Any]:
    """Wait until ``/steer/slots`` (fresh) of the server at ``url`` shows no pinned row, up to ``drain_timeout`` s."""
    began = time.monotonic()
    async with http_client(url, config) as http:
        while True:
            try:
                stats = (await http.get("/steer/slots")).json()
            except (httpx.HTTPError, ValueError) as exc:
                return {"url": url, "drained": False, "pinned": None, "seconds": None,
                        "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            waited = time.monotonic() - began
            if stats.get("pinned") == 0 or waited > config.drain_timeout:
                keep = ("capacity", "used", "pinned", "free", "evictions", "refused", "steered_requests", "deferrals",
                        "vectors")  # fmt: skip
                return {"url": url, "drained": stats.get("pinned") == 0, "pinned": stats.get("pinned"),
                        "seconds": round(waited, 2), "slots": {k: stats.get(k) for k in keep}}  # fmt: skip
            await asyncio.sleep(0.1)


async def drain_all(urls: Sequence[str], config: SoakConfig) -> dict[str, Any]:
    """:func:`drain` on every server at once: drained when all are; ``pinned`` summed (None when one did not
    answer), ``seconds`` the longest, each server's own answer in ``servers``."""
    each = await asyncio.gather(*(drain(url, config) for url in urls))
    pinned = [d["pinned"] for d in each]
    return {"drained": all(d["drained"] for d in each), "pinned": None if None in pinned else sum(pinned),
            "seconds": max((d["seconds"] for d in each if d["seconds"] is not None), default=None),
            "servers": list(each)}  # fmt: skip
