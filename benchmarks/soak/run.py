"""One soak: calibrate, register the ids, run the clients, churn and poller for the duration, drain, and
judge every response into the report."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.server_processes import ServerWatch

from .calibration import CalibrationError, calibrate, read_model, served_model, single_token_texts, steerable_layers
from .churn import Churn, delete_all, delete_loop, register_all, replace_loop
from .clients import Clock, clients, http_client
from .control_plane import Poller, drain_all
from .markers import MarkerBook
from .plan import Plan, SoakConfig, soak_ids
from .processes import Job, in_processes, process_count
from .report import report
from .responses import Observation


async def run_soak(config: SoakConfig, urls: Sequence[str], model_dir: Path, watch: ServerWatch | None = None
                   ) -> dict[str, Any]:  # fmt: skip
    """Calibrate, register the ids, run clients, churn and poller for ``duration`` s, drain, and judge every
    response; returns the report (see :func:`report`). ``urls``: one server, or the replicas of a fleet on one
    registry (see the package's docstring); calibration and the poller use the first. ``watch``: on the soak's own
    server (the report then says how busy its API server and engine core were, and where their profiles are)."""
    if not urls:
        raise ValueError("run_soak needs at least one server URL")
    url = urls[0]
    facts = read_model(model_dir)
    texts = single_token_texts(model_dir, facts.unembedding.shape[0])
    static, churned = soak_ids(config)
    async with http_client(url, config) as http:
        model = await served_model(http)
        layers = steerable_layers(((await http.get("/steer/slots")).json().get("model") or {}).get("layers", ""))
    layer = facts.n_layers - 1
    if layer not in layers:
        raise CalibrationError(f"the server does not steer layer {layer} (the last one): it steers {sorted(layers)}")
    plan = Plan(model, layer, config.strength or 0.0, static, churned, config)
    pools = {i: 1 for i in static} | {i: config.pool for i in churned}
    book, calibration = await calibrate(url, plan, facts, texts, pools)

    clock = Clock()  # the report's times count from here
    await register_all(urls, config, book, facts.unembedding, static + churned, clock)
    crowd = Crowd(plan, book)
    poller = Poller(url, config)
    began = clock.now()
    poller.start()
    if watch is not None:
        watch.start(config.duration)
    try:
        _, busy = await traffic(urls, {"soak": crowd}, facts.unembedding, clock, began + config.duration)
    finally:
        elapsed = clock.now() - began
        watched = watch.finish() if watch is not None else {}
        poller.halt.set()
        poller.join(timeout=35)
    drained = await drain_all(urls, config)
    if not config.keep_vectors:
        await delete_all(url, config, static + churned)
    return report(config, urls, plan, calibration, book, crowd.observations, crowd.churn, poller, drained, elapsed,
                  busy) | {"server_busy": watched.get("busy"), "server_profiles": watched.get("profiles")}


@dataclass
class Crowd:
    """The clients of one plan and the churn of its ids (which keeps its book): a soak's, or one tenant's."""

    plan: Plan
    book: MarkerBook
    churn: Churn = field(default_factory=Churn)
    observations: list[Observation] = field(default_factory=list)


async def traffic(urls: Sequence[str], crowds: Mapping[str, Crowd], rows: np.ndarray, clock: Clock, until: float,
                  extra: Sequence[Job] = ()) -> tuple[list[Any], list[float]]:  # fmt: skip
    """Until ``until``: every crowd's clients, spread over client processes (``--client-processes``; client i on
    server i mod n), its churn tasks on the two halves of its churned ids here, and each ``extra`` job in a process
    of its own. Returns the extra jobs' results and the share of a core each process used."""
    seats = [(key, i) for key, crowd in crowds.items() for i in range(crowd.plan.config.clients)]
    n = process_count(len(seats), next(iter(crowds.values())).plan.config.client_processes)
    jobs: list[Job] = []
    for p in range(n):
        mine = seats[p::n]
        groups = [(key, list(urls), crowd.plan, [i for k, i in mine if k == key]) for key, crowd in crowds.items()]
        jobs.append((clients, ([g for g in groups if g[3]], clock, until)))
    churn = []
    for crowd in crowds.values():
        half, plan = len(crowd.plan.churned) // 2, crowd.plan
        churn += [replace_loop(urls, plan.churned[:half], crowd.book, rows, plan, crowd.churn, clock, until),
                  delete_loop(urls, plan.churned[half:], crowd.book, rows, plan, crowd.churn, clock, until)]
    done, *_ = await asyncio.gather(in_processes([*jobs, *extra]), *churn)
    for observed, _ in done[:n]:
        for key, observations in observed.items():
            crowds[key].observations.extend(observations)
    return [result for result, _ in done[n:]], [round(busy, 3) for _, busy in done]
