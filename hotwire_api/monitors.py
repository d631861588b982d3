"""Monitors: probes an operator runs on every chat and completions request, steered or not. Each request is read
like a request with its own readout (``hotwire_api.reading`` adds the monitors' probes to it at admission); when
it is whole, each monitor's score is put in the response (``hotwire_monitors``), on ``/metrics`` (a histogram of
scores and a count of the requests it flagged) and, when it crosses the monitor's threshold, in the log.

A monitor reads generated tokens only (positions from the last prompt token on), so a monitored request keeps the
prefix cache: ``scope`` ``prompt`` scores the last prompt token (whose residual stream has attended to the whole
prompt; the position that predicts the first generated token), ``generated`` reduces the scores of every
generated token (``max``, ``mean`` or ``min``).

Monitors are kept in ``monitors.json`` in the served model's store folder (``HOTWIRE_STORE``), edited under a lock
and read again when it changes (looked at no more often than every ``json_file.LOOK_S``: it is on every request's path),
so every API server of a host sees the same ones; in a fleet (``HOTWIRE_REGISTRY``), in its Redis, which every API
server polls for changes (``HOTWIRE_CATALOG_REFRESH_MS``); with the store off elsewhere, each API server keeps its
own in memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic
from prometheus_client import Counter, Histogram

from hotwire_api.errors import HotwireError
from hotwire_api.json_file import LOOK_S, locked, stamp, write_atomic
from hotwire_api.models import Monitor, MonitorScore
from hotwire_core.settings import Settings as CoreSettings
from hotwire_core.vllm_glue.api_server import served_port_and_model

__all__ = ["Monitor", "MonitorBook", "probes_of", "score_of", "skipped"]

logger = logging.getLogger(__name__)

_SCORES = Histogram("hotwire_monitor_score", "Per-request score of each monitor.", ["monitor"],
                    buckets=(-1000, -300, -100, -30, -10, -3, -1, -0.3, 0, 0.3, 1, 3, 10, 30, 100, 300, 1000))
_REQUESTS = Counter("hotwire_monitor_requests", "Requests each monitor scored, by whether it flagged them.",
                    ["monitor", "flagged"])
_SKIPPED = Counter("hotwire_monitor_skipped", "Chat and completions requests the monitors could not read, by "
                   "reason.", ["reason"])


class _MonitorsFile(pydantic.BaseModel):
    monitors: list[Monitor]


def score_of(monitor: Monitor, read: dict[str, Any]) -> MonitorScore | None:
    """``monitor``'s verdict from its probe's readout (``readout_results.readout_of``'s entry, generated tokens
    read); None when the request generated nothing."""
    scores = read["generated"]["score"]
    if not scores:
        return None
    if monitor.scope == "prompt":
        value = scores[0]
    else:
        value = {"max": max, "min": min, "mean": lambda s: sum(s) / len(s)}[monitor.reduce](scores)
    flagged = value >= monitor.threshold if monitor.flag == "above" else value <= monitor.threshold
    _SCORES.labels(monitor.id).observe(value)
    _REQUESTS.labels(monitor.id, "true" if flagged else "false").inc()
    return MonitorScore(monitor=monitor.id, probe=read["probe"], score=value, flagged=flagged)


def probes_of(monitors: Sequence[Monitor]) -> dict[str, Any]:
    """The readout that reads ``monitors``' probes (``readout_spec`` form, unpinned)."""
    return {"probes": [{"id": m.probe, "layer": m.layer, "bias": m.bias} for m in monitors]}


def skipped(reason: str) -> None:
    """Count a request the monitors could not read (``hotwire_monitor_skipped_total{reason}``)."""
    _SKIPPED.labels(reason).inc()


class MonitorBook:
    """The monitors (see the module docstring): the fleet's, a file, or this API server's memory until
    :meth:`start` finds where they are kept."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.fleet: Any = None  # the fleet's RedisRegistry (``monitors``, ``edit_monitor``)
        self._edits = -1  # the fleet's count of monitor edits when last read
        self._monitors: tuple[Monitor, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        self._look_at = 0.0  # when the file is next looked at
        self.state = 0  # changes whenever the monitors may have: what admission caches their decision under

    @property
    def kept(self) -> str:
        return "redis" if self.fleet is not None else f"file {self.path}" if self.path else "memory"

    async def start(self, app: Any) -> None:
        self.fleet = app.state.hotwire_registry.fleet_store()
        if self.fleet is not None:
            try:
                await self.refresh()
            except HotwireError as exc:  # the registry is down: the poll reads them once it answers
                logger.error("hotwire: the fleet's monitors cannot be read yet: %s", exc.message)
            return
        model = served_port_and_model(app)[1]
        folder = CoreSettings.from_env().store_dir(model) if model else None
        if folder is not None:
            self.path = folder / "monitors.json"
            self.current()

    async def refresh(self) -> None:
        """Read the fleet's monitors if they changed since the last read (one round trip when they did not)."""
        edits, docs = await self.fleet.monitors()
        if edits != self._edits:
            self._set(sorted((Monitor.model_validate_json(doc) for doc in docs), key=lambda m: m.id), None)
            self._edits = edits

    async def run(self, interval_s: float) -> None:
        """In a fleet, follow the other API servers' edits (a lifespan task); elsewhere nothing to do."""
        while self.fleet is not None:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except HotwireError as exc:  # the registry is down: the monitors read last stay on
                logger.debug("hotwire: the fleet's monitors not read this time: %s", exc.message)

    def current(self) -> tuple[Monitor, ...]:
        """The monitors now (the file read again if it changed; one that cannot be read keeps the last good ones,
        with an error in the log)."""
        if self.path is None or time.monotonic() < self._look_at:
            return self._monitors
        self._look_at = time.monotonic() + LOOK_S
        try:
            now = stamp(self.path)
        except FileNotFoundError:
            now = None
        except OSError as exc:
            logger.error("hotwire: the monitors file %s cannot be read (%s); the last monitors read stay on",
                         self.path, exc.strerror)
            return self._monitors
        if now != self._stamp:
            try:
                self._set(self._read(), now)
            except (OSError, ValueError) as exc:
                logger.error("hotwire: the monitors file %s is not valid (%s); the last monitors read stay on",
                             self.path, str(exc)[:200])
                self._stamp = now
        return self._monitors

    def _set(self, monitors: Sequence[Monitor], now: tuple[int, int, int] | None) -> None:
        self._monitors, self._stamp = tuple(monitors), now
        self.state += 1

    def _read(self) -> list[Monitor]:
        assert self.path is not None  # (in memory, the monitors are self._monitors)
        if not self.path.exists():
            return []
        return _MonitorsFile.model_validate_json(self.path.read_text(encoding="utf-8")).monitors

    async def edit(self, monitor_id: str, new: Monitor | None) -> Monitor | None:
        """Put ``new`` in place of the monitor ``monitor_id`` (added when there is none; removed when ``new`` is
        None); returns the monitor it replaced. The caller checked ``new``."""
        if self.fleet is not None:
            old = await self.fleet.edit_monitor(monitor_id, new.model_dump_json() if new is not None else None)
            await self.refresh()
            return Monitor.model_validate_json(old) if old is not None else None
        old = await asyncio.to_thread(self._edit_here, monitor_id, new)
        self._look_at = 0.0  # the file as this edit left it, in force here at once (on the loop: current()'s thread)
        self.current()
        return old

    def _edit_here(self, monitor_id: str, new: Monitor | None) -> Monitor | None:
        if self.path is None:
            return self._apply(list(self._monitors), monitor_id, new, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self.path):
            return self._apply(self._read(), monitor_id, new, self.path)

    def _apply(self, monitors: list[Monitor], monitor_id: str, new: Monitor | None, path: Path | None) -> Monitor | None:
        old = next((m for m in monitors if m.id == monitor_id), None)
        if old is None and new is None:
            return None
        kept = [m for m in monitors if m.id != monitor_id] + ([new] if new is not None else [])
        if path is None:
            self._set(kept, None)
        else:
            write_atomic(path, json.dumps({"monitors": [m.model_dump() for m in kept]}, indent=2) + "\n")
        return old
