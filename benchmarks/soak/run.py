"""One soak: calibrate, register the ids, run the clients, churn and poller for the duration, drain, and
judge every response into the report."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .calibration import CalibrationError, calibrate, read_model, served_model, single_token_texts, steerable_layers
from .churn import Churn, delete_all, delete_loop, register_all, replace_loop
from .clients import Clock, client_loop, http_client
from .control_plane import Poller, drain_all
from .markers import MarkerBook
from .plan import Plan, SoakConfig, soak_ids
from .report import report
from .responses import Observation


async def run_soak(config: SoakConfig, urls: Sequence[str], model_dir: Path) -> dict[str, Any]:
    """Calibrate, register the ids, run clients, churn and poller for ``duration`` s, drain, and judge every
    response; returns the report (see :func:`report`). ``urls``: one server, or the replicas of a fleet on one
    registry (see the package's docstring); calibration and the poller use the first."""
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
    churn = Churn()
    poller = Poller(url, config)
    observations: list[Observation] = []
    began = clock.now()
    poller.start()
    try:
        await traffic(urls, plan, book, facts.unembedding, churn, clock, began + config.duration, observations)
    finally:
        elapsed = clock.now() - began
        poller.halt.set()
        poller.join(timeout=35)
    drained = await drain_all(urls, config)
    if not config.keep_vectors:
        await delete_all(url, config, static + churned)
    return report(config, urls, plan, calibration, book, observations, churn, poller, drained, elapsed)


async def traffic(urls: Sequence[str], plan: Plan, book: MarkerBook, rows: np.ndarray, churn: Churn, clock: Clock,
                  until: float, out: list[Observation]) -> None:  # fmt: skip
    """The clients (client i on server i mod n), and the churn tasks on the two halves of the churned ids, until
    ``until``."""
    half = len(plan.churned) // 2
    await asyncio.gather(
        *(client_loop(i, urls[i % len(urls)], plan, clock, until, out) for i in range(plan.config.clients)),
        replace_loop(urls, plan.churned[:half], book, rows, plan, churn, clock, until),
        delete_loop(urls, plan.churned[half:], book, rows, plan, churn, clock, until),
    )
