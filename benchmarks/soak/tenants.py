"""A soak of several tenants on one server (``--tenants N``): each tenant ``t0``, ``t1``, ... gets an admin key of
its own (made over ``/steer/keys`` with the operator's ``--api-key``), registers the same ids as every other tenant
(``soak-s00`` is ``t0/soak-s00`` to the engine, ``t1/soak-s00`` to the next) with markers of its own, and runs the
soak's clients and churn with them, all tenants at once. Each tenant's responses are judged against its own book,
which also knows the other tenants' markers (as ``t1/soak-s00`` and so on): a response showing another tenant's
marker is a ``wrong_vector`` named after that tenant's id (a cross-tenant leak). With ``--flood``, one more tenant
registers distinct vectors as fast as the server takes them, from FLOOD_WORKERS loops at once in a client process
of its own (so that its client work cannot slow the other tenants' clients), and steers one request
with each, then deletes it (its refusals, 429 ``quota_exceeded`` among them, are counted, not failures): past its
share of the bank (``--tenant-rows`` for a server of the soak's own) its requests wait in its own lane, and the other
tenants' latencies beside it are what that share protects. With ``--flood-windows S`` it floods in every other
window of S seconds only, and each tenant's report splits its requests by window (``windows``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.server_processes import ServerWatch

from .calibration import calibrate, read_model, served_model, single_token_texts, steerable_layers
from .churn import delete_all, register_all
from .clients import Clock, http_client
from .control_plane import Poller, drain_all
from .markers import MarkerBook, unit, vector_body
from .plan import Plan, SoakConfig, soak_ids
from .report import busiest, report, server_busy_text
from .run import Crowd, traffic
from .windows import Windows, compare

__all__ = ["Flood", "flood", "run_tenant_soak", "tenant_book", "tenant_names", "tenants_table"]

FLOOD = "flood"
FLOOD_WORKERS = 24


def tenant_names(config: SoakConfig) -> list[str]:
    return [f"t{k}" for k in range(config.tenants)]


def tenant_book(combined: MarkerBook, tenant: str) -> MarkerBook:
    """``tenant``'s book: its own ids by their plain names, the other tenants' by their full ids."""
    prefix = f"{tenant}/"
    return MarkerBook(combined.text, {i.removeprefix(prefix): pool for i, pool in combined.pools.items()})


async def make_keys(url: str, config: SoakConfig, tenants: Sequence[str]) -> dict[str, str]:
    """An admin key for each tenant, made with the operator's key (``soak-<tenant>``, replacing one left over)."""
    keys = {}
    async with http_client(url, config) as http:
        for tenant in tenants:
            name = f"soak-{tenant}"
            await http.delete(f"/steer/keys/{name}")
            made = await http.post("/steer/keys", json={"name": name, "role": "admin", "tenant": tenant})
            if made.status_code != 201:
                raise RuntimeError(f"the operator key cannot make {name} ({made.status_code}): {made.text[:300]} "
                                   "(--tenants needs a server with HOTWIRE_KEYS_FILE and --api-key an operator admin key)")
            keys[tenant] = made.json()["key"]
    return keys


async def revoke_keys(url: str, config: SoakConfig, tenants: Sequence[str]) -> None:
    async with http_client(url, config) as http:
        for tenant in tenants:
            await http.delete(f"/steer/keys/soak-{tenant}")


@dataclasses.dataclass
class Flood:
    """What the flooding tenant did."""

    registered: int = 0
    steered: int = 0
    refused: Counter[str] = dataclasses.field(default_factory=Counter)
    errors: Counter[str] = dataclasses.field(default_factory=Counter)  # rounds without an answer: failures
    most_pinned: int = 0  # the most bank rows its vectors pinned at once, as GET /steer/usage said
    share: int = 0  # its share (HOTWIRE_TENANT_ROWS)

    async def run(self, url: str, config: SoakConfig, plan: Plan, rows: np.ndarray, until: float, clock: Clock,
                  windows: Windows | None = None) -> None:  # fmt: skip
        """``FLOOD_WORKERS`` loops at once, each: register a new id, steer one request with it, delete it; again
        until ``until`` (within the flood ``windows`` only, when given). Together they pin more rows than a
        tenant's share once it is below FLOOD_WORKERS. A round that gets no answer (a dropped connection, a timeout)
        counts in ``errors`` and its worker goes on."""
        await asyncio.gather(*(self._worker(k, url, config, plan, rows, until, clock, windows)
                               for k in range(FLOOD_WORKERS)),
                             self._watch(url, config, until, clock))

    async def _watch(self, url: str, config: SoakConfig, until: float, clock: Clock) -> None:
        async with http_client(url, config) as http:
            while clock.now() < until:
                (usage,) = (await http.get("/steer/usage")).json()["tenants"]
                self.most_pinned, self.share = max(self.most_pinned, usage["pinned_rows"]), usage["limits"]["rows"]
                await asyncio.sleep(0.1)

    async def _worker(self, k: int, url: str, config: SoakConfig, plan: Plan, rows: np.ndarray, until: float,
                      clock: Clock, windows: Windows | None) -> None:  # fmt: skip
        rng = np.random.default_rng(config.seed * 1000 + k)
        async with http_client(url, config) as http:
            for i in itertools.count():
                if clock.now() >= until:
                    return
                if windows is not None and not windows.flooding(clock.now()):
                    await asyncio.sleep(min(windows.next_flood(clock.now()), until) - clock.now())
                    continue
                try:
                    row = rows[rng.integers(len(rows))]
                    await self._round(http, f"{config.id_prefix}-flood-{k}-{i}", config, plan, row)
                except httpx.TransportError as exc:
                    self.errors[type(exc).__name__] += 1
                    await asyncio.sleep(0.05)  # (a server gone: no spin)

    async def _round(self, http: httpx.AsyncClient, vector_id: str, config: SoakConfig, plan: Plan, row: np.ndarray
                     ) -> None:  # fmt: skip
        made = await http.post("/steer/vectors", json=vector_body(vector_id, unit(row)))
        if made.status_code != 201:
            self.refused[f"register {made.status_code} {_code(made)}"] += 1
            await asyncio.sleep(0.05)
            return
        self.registered += 1
        spec = f'{{"id": "{vector_id}", "layer": {plan.layer}, "scale": {plan.strength}}}'
        body = {"model": plan.model, "prompt": "flood", "max_tokens": config.max_tokens, "temperature": 0,
                "vllm_xargs": {"hotwire": spec}}
        try:
            steered = await http.post("/v1/completions", json=body)
            if steered.status_code == 200:
                self.steered += 1
            else:
                self.refused[f"steer {steered.status_code} {_code(steered)}"] += 1
        finally:  # (a request without an answer still deletes: the id would hold the tenant's quota)
            await http.delete(f"/steer/vectors/{vector_id}")


async def flood(url: str, config: SoakConfig, plan: Plan, rows: np.ndarray, until: float, clock: Clock,
                windows: Windows | None = None) -> Flood:  # fmt: skip
    """The flooding tenant, as a job of its own process (``processes.in_processes``): what it did."""
    done = Flood()
    await done.run(url, config, plan, rows, until, clock, windows)
    return done


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def run_tenant_soak(config: SoakConfig, url: str, model_dir: Path, watch: ServerWatch | None = None
                          ) -> dict[str, Any]:  # fmt: skip
    """The soak of ``config.tenants`` tenants (and a flooding one with ``config.flood``) on the server at ``url``;
    returns every tenant's report (``report.report``) with their failures summed in ``failed``, and what ``watch``
    saw of the soak's own server (``run.run_soak``)."""
    facts = read_model(model_dir)
    texts = single_token_texts(model_dir, facts.unembedding.shape[0])
    static, churned = soak_ids(config)
    tenants = tenant_names(config)
    async with http_client(url, config) as http:
        model = await served_model(http)
        layers = steerable_layers(((await http.get("/steer/slots")).json().get("model") or {}).get("layers", ""))
    layer = facts.n_layers - 1
    assert layer in layers, f"the server does not steer layer {layer}"
    plan = Plan(model, layer, config.strength or 0.0, static, churned, config)
    pools = {f"{t}/{i}": 1 for t in tenants for i in static} | {f"{t}/{i}": config.pool for t in tenants for i in churned}
    combined, calibration = await calibrate(url, plan, facts, texts, pools)
    keys = await make_keys(url, config, [*tenants, *([FLOOD] if config.flood else [])])
    clock = Clock()
    crowds = {}
    for k, tenant in enumerate(tenants):
        own = dataclasses.replace(config, api_key=keys[tenant], clients=max(1, config.clients // len(tenants)),
                                  seed=config.seed * 100 + k)
        book = tenant_book(combined, tenant)
        await register_all([url], own, book, facts.unembedding, static + churned, clock)
        crowds[tenant] = Crowd(Plan(model, layer, plan.strength, static, churned, own), book)
    poller = Poller(url, config)
    began = clock.now()
    until = began + config.duration
    windows = Windows(began, config.flood_windows) if config.flood and config.flood_windows else None
    poller.start()
    if watch is not None:
        watch.start(config.duration)
    try:
        extra = []
        if config.flood:  # in a process of its own: its client work does not slow the other tenants' clients
            flooding = dataclasses.replace(config, api_key=keys[FLOOD])
            extra.append((flood, (url, flooding, dataclasses.replace(plan, config=flooding), facts.unembedding, until,
                                  clock, windows)))  # fmt: skip
        flooded, busy = await traffic([url], crowds, facts.unembedding, clock, until, extra)
    finally:
        elapsed = clock.now() - began
        watched = watch.finish() if watch is not None else {}
        poller.halt.set()
        poller.join(timeout=35)
    drained = await drain_all([url], config)
    for crowd in crowds.values():
        if not config.keep_vectors:
            await delete_all(url, crowd.plan.config, static + churned)
    await revoke_keys(url, config, [*tenants, *([FLOOD] if config.flood else [])])
    reports = {t: report(c.plan.config, [url], c.plan, calibration, c.book, c.observations, c.churn, poller, drained,
                         elapsed, busy, windows)
               for t, c in crowds.items()}  # fmt: skip
    flood_done = flooded[0] if flooded else Flood()
    flooded_s = windows.seconds_of(elapsed)["flood"] if windows is not None else elapsed  # (per second of flooding)
    failed = sum(r["failed"] for r in reports.values()) + sum(flood_done.errors.values())
    return {"tenants": reports, "failed": failed, "elapsed_s": round(elapsed, 2),
            "client_processes_busy": busy, "server_busy": watched.get("busy"),
            "server_profiles": watched.get("profiles"),
            "flood": {"registered": flood_done.registered, "steered": flood_done.steered,
                      "refused": dict(flood_done.refused), "errors": dict(flood_done.errors),
                      "most_pinned_rows": flood_done.most_pinned,
                      "share_rows": flood_done.share,
                      "registrations_per_s": round(flood_done.registered / flooded_s, 2) if flooded_s else None}
            if config.flood else None,
            "flood_windows": compare({t: r["by_window"] for t, r in reports.items()}) if windows is not None else None,
            "config": dataclasses.asdict(config) | {"api_key": bool(config.api_key)}, "at": time.time()}


def tenants_table(result: dict[str, Any]) -> str:
    """One line per tenant: requests, failures by kind, latency p50/p99 of plain and steered requests."""
    lines = [f"soak: {len(result['tenants'])} tenants for {result['elapsed_s']} s, failed {result['failed']}; "
             f"{busiest(result['client_processes_busy'])}; {server_busy_text(result['server_busy'])}"]
    for tenant, r in result["tenants"].items():
        failures = ", ".join(f"{k} {v}" for k, v in r["failures"].items() if v) or "none"
        lat = r["latency_ms"]
        lines.append(f"  {tenant}: {r['requests']['total']} requests, ok {r['requests']['ok']}, refused_expected "
                     f"{r['requests']['refused_expected']}, failures: {failures}; total ms p50/p99 plain "
                     f"{lat['plain']['total']['p50']}/{lat['plain']['total']['p99']}, steered "
                     f"{lat['steered']['total']['p50']}/{lat['steered']['total']['p99']}; churn "
                     f"{r['churn']['replaced']} replaced, {r['churn']['deleted']} deleted")
        if "by_window" in r:
            quiet, flood = (r["by_window"][kind]["total_ms"] for kind in ("quiet", "flood"))
            lines.append(f"    total ms p99 quiet/flood windows: plain {quiet['plain']['p99']}/{flood['plain']['p99']}, "
                         f"steered {quiet['steered']['p99']}/{flood['steered']['p99']}; ok req/s "
                         f"{r['by_window']['quiet']['ok_rps']}/{r['by_window']['flood']['ok_rps']}")
    if result["flood"]:
        f = result["flood"]
        lines.append(f"  flood: {f['registered']} distinct vectors registered ({f['registrations_per_s']}/s), "
                     f"{f['steered']} steered requests, refused {f['refused'] or 'none'}, failed {f['errors'] or 'none'}; "
                     f"at most {f['most_pinned_rows']} rows pinned at once, its share {f['share_rows']}")
    if result.get("flood_windows"):
        worst = result["flood_windows"]["worst"]
        lines.append("  flood windows against quiet ones, the worst tenant: " + ", ".join(
            f"{key.replace('_', ' ')} x{value}" for key, value in worst.items() if value is not None))
    return "\n".join(lines)

