"""Registering, replacing and deleting the soak's vectors: the setup, the two churn tasks during the run
(through the servers of a fleet in turn, waiting until every one holds a change) and the cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from .calibration import CalibrationError
from .clients import Clock, http_client
from .markers import MarkerBook, unit, vector_body
from .plan import Plan, SoakConfig

PROPAGATION_TIMEOUT_S = 5.0  # a fleet serves a change everywhere within 1 s p99: five times that is a churn error


@dataclass
class Churn:
    """What the churn tasks did."""

    replaced: int = 0
    deleted: int = 0
    registered: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[dict[str, Any]] = field(default_factory=list)
    by_server: Counter[str] = field(default_factory=Counter)  # registrations and deletions sent to each server


def server_of(http: httpx.AsyncClient) -> str:
    """The URL a client sends to, as given (httpx adds a slash to a base URL)."""
    return str(http.base_url).rstrip("/")


async def register(http: httpx.AsyncClient, book: MarkerBook, rows: np.ndarray, vector_id: str, replace: bool,
                   churn: Churn, clock: Clock) -> int | None:  # fmt: skip
    """Register the next version of ``vector_id`` (its next marker) and note it; its version, None on failure."""
    token = book.next_marker(vector_id)
    began = clock.now()
    what = "replace" if replace else "register"
    churn.by_server[server_of(http)] += 1
    try:
        response = await http.post("/steer/vectors" + ("?replace=true" if replace else ""),
                                   json=vector_body(vector_id, unit(rows[token])))  # fmt: skip
    except httpx.HTTPError as exc:
        churn.errors.append({"what": what, "id": vector_id, "t": round(began, 3),
                             "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        return None
    churn.latencies[what].append(clock.now() - began)
    if response.status_code not in (200, 201):
        churn.errors.append({"what": what, "id": vector_id, "t": round(began, 3), "status": response.status_code,
                             "error": response.text[:300]})  # fmt: skip
        return None
    version = int(response.json()["version"])
    book.record(vector_id, version, token)
    churn.registered += 1
    return version


async def everywhere(https: Sequence[httpx.AsyncClient], vector_id: str, version: int, churn: Churn, clock: Clock
                     ) -> bool:  # fmt: skip
    """Wait until every server (the replicas of a fleet: versions are global) holds ``vector_id`` at ``version``
    or later, up to PROPAGATION_TIMEOUT_S (a churn error after that); notes the time it took. At once with one."""
    if len(https) < 2:
        return True
    began = clock.now()
    pending = list(https)
    while True:
        behind = []
        for http in pending:
            try:
                response = await http.get(f"/steer/vectors/{vector_id}")
                held = int(response.json()["version"]) if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                held = None
            if held is None or held < version:
                behind.append(http)
        if not behind:
            churn.latencies["propagation"].append(clock.now() - began)
            return True
        if clock.now() - began > PROPAGATION_TIMEOUT_S:
            churn.errors.append({"what": "propagation", "id": vector_id, "version": version, "t": round(began, 3),
                                 "error": f"not held by {', '.join(server_of(h) for h in behind)} after "
                                          f"{PROPAGATION_TIMEOUT_S:g} s"})  # fmt: skip
            return False
        pending = behind
        await asyncio.sleep(0.005)


async def delete(http: httpx.AsyncClient, vector_id: str, churn: Churn, clock: Clock) -> bool:
    began = clock.now()
    churn.by_server[server_of(http)] += 1
    try:
        response = await http.delete(f"/steer/vectors/{vector_id}")
    except httpx.HTTPError as exc:
        churn.errors.append({"what": "delete", "id": vector_id, "t": round(began, 3),
                             "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        return False
    churn.latencies["delete"].append(clock.now() - began)
    if response.status_code not in (202, 204):
        churn.errors.append({"what": "delete", "id": vector_id, "t": round(began, 3), "status": response.status_code,
                             "error": response.text[:300]})  # fmt: skip
        return False
    churn.deleted += 1
    return True


Act = Callable[[httpx.AsyncClient, Sequence[httpx.AsyncClient], str], Awaitable[None]]


async def _each_in_turn(urls: Sequence[str], ids: list[str], plan: Plan, clock: Clock, until: float, every: float,
                        act: Act) -> None:  # fmt: skip
    """Every ``every`` s until ``until``, ``act(http, all_https, id)`` on the next id of ``ids`` (round robin),
    through one connection to each server: an id's turns go to the servers in turn (a fleet's changes come from
    every replica)."""
    async with contextlib.AsyncExitStack() as stack:
        https = [await stack.enter_async_context(http_client(url, plan.config)) for url in urls]
        for i in itertools.count():
            await asyncio.sleep(every)
            if clock.now() >= until or not ids:
                return
            turn, k = divmod(i, len(ids))
            await act(https[(turn + k) % len(https)], https, ids[k])


async def replace_loop(urls: Sequence[str], ids: list[str], book: MarkerBook, rows: np.ndarray, plan: Plan,
                       churn: Churn, clock: Clock, until: float) -> None:  # fmt: skip
    """Every ``replace_every`` s, replace the next id of ``ids`` with its next marker."""

    async def replace(http: httpx.AsyncClient, https: Sequence[httpx.AsyncClient], vector_id: str) -> None:
        churn.replaced += await register(http, book, rows, vector_id, True, churn, clock) is not None

    await _each_in_turn(urls, ids, plan, clock, until, plan.config.replace_every, replace)


async def delete_loop(urls: Sequence[str], ids: list[str], book: MarkerBook, rows: np.ndarray, plan: Plan,
                      churn: Churn, clock: Clock, until: float) -> None:  # fmt: skip
    """Every ``delete_every`` s, delete the next id of ``ids``, wait ``absent_for`` s, register it again; the id
    counts as present again once every server holds the new version (until then an ``unknown_vector`` for it is
    expected)."""

    async def delete_and_return(http: httpx.AsyncClient, https: Sequence[httpx.AsyncClient], vector_id: str) -> None:
        book.absent_from(vector_id, clock.now())
        await delete(http, vector_id, churn, clock)
        await asyncio.sleep(plan.config.absent_for)
        version = await register(http, book, rows, vector_id, False, churn, clock)
        if version is not None and await everywhere(https, vector_id, version, churn, clock):
            book.present_again(vector_id, clock.now())

    await _each_in_turn(urls, ids, plan, clock, until, plan.config.delete_every, delete_and_return)


async def register_all(urls: Sequence[str], config: SoakConfig, book: MarkerBook, rows: np.ndarray, ids: list[str],
                       clock: Clock) -> None:  # fmt: skip
    """Register (or replace) every id with the first marker of its pool, on the first server, and wait until
    every server holds it."""
    setup = Churn()
    async with contextlib.AsyncExitStack() as stack:
        https = [await stack.enter_async_context(http_client(url, config)) for url in urls]
        for vector_id in ids:
            version = await register(https[0], book, rows, vector_id, True, setup, clock)
            if version is None or not await everywhere(https, vector_id, version, setup, clock):
                raise CalibrationError(f"could not register {vector_id}: {setup.errors[-1]}")


async def delete_all(url: str, config: SoakConfig, ids: list[str]) -> None:
    async with http_client(url, config) as http:
        for vector_id in ids:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(f"/steer/vectors/{vector_id}")
