"""The clients: each an asyncio task with one keep-alive connection, sending drawn requests until the end
and recording every answer (never raising for the server's doing)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from hotwire_api.client import KEEPALIVE_S
from hotwire_api.headers import RECEIPT_HEADER

from .plan import PROMPTS, Plan, SoakConfig, request_body
from .responses import PATHS, Observation, error_code, read_event, read_whole
from .steering import Spec


class Clock:
    """Seconds since the soak started."""

    def __init__(self) -> None:
        self.origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.origin


async def send(http: httpx.AsyncClient, plan: Plan, clock: Clock, client: int, draw: tuple[str, bool, Spec, int]
               ) -> Observation:  # fmt: skip
    """Send one request and record what came back (never raises for the server's doing)."""
    route, stream, spec, prompt = draw
    obs = Observation(client, route, stream, spec, prompt, clock.now())
    body = request_body(plan, route, stream, spec, PROMPTS[prompt])
    try:
        if stream:
            await _send_streamed(http, body, obs, clock)
        else:
            await _send_whole(http, body, obs)
    except httpx.TimeoutException as exc:
        obs.failure = ("timeout", type(exc).__name__, str(exc))
    except httpx.TransportError as exc:
        when = "after the headers" if obs.status else "before any response"
        events = f" and {obs.content.events} events" if obs.status else ""
        obs.failure = ("dropped", f"{type(exc).__name__} {when}", f"{exc or '(no message)'} ({when}{events})")
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a 200 that does not read
        obs.failure = ("http_error", f"{obs.status}:unreadable", f"{type(exc).__name__}: {exc}")
    obs.end = clock.now()
    return obs


async def _send_whole(http: httpx.AsyncClient, body: dict[str, Any], obs: Observation) -> None:
    response = await http.post(PATHS[obs.route], json=body)
    _note_headers(response, obs)
    if response.status_code == 200:
        obs.content = read_whole(obs.route, response.json())
    else:
        obs.error_code, obs.error_text = error_code(response.content)


async def _send_streamed(http: httpx.AsyncClient, body: dict[str, Any], obs: Observation, clock: Clock) -> None:
    async with http.stream("POST", PATHS[obs.route], json=body) as response:
        _note_headers(response, obs)
        if response.status_code != 200:
            obs.error_code, obs.error_text = error_code(await response.aread())
            return
        event: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if read_event(obs.route, event, line[5:].strip(), obs.content) and obs.ttft is None:
                    obs.ttft = clock.now() - obs.start
                event = None


def _note_headers(response: httpx.Response, obs: Observation) -> None:
    obs.status = response.status_code
    obs.receipt = response.headers.get(RECEIPT_HEADER)


def http_client(url: str, config: SoakConfig, connections: int = 1) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=url, headers=headers, timeout=httpx.Timeout(config.request_timeout, connect=30.0),
        # idle connections dropped before the server drops them (docs/deployment.md, "Idle connections")
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                            keepalive_expiry=KEEPALIVE_S),
    )  # fmt: skip


async def client_loop(index: int, url: str, plan: Plan, clock: Clock, until: float, out: list[Observation]) -> None:
    rng = random.Random(plan.config.seed * 1000 + index)
    async with http_client(url, plan.config) as http:
        while clock.now() < until:
            out.append(await send(http, plan, clock, index, plan.draw(rng)))


async def clients(groups: Sequence[tuple[str, Sequence[str], Plan, Sequence[int]]], clock: Clock, until: float
                  ) -> dict[str, list[Observation]]:  # fmt: skip
    """A client process's job (``processes.in_processes``): the clients of each group (its key, the servers, its
    plan, its client indices; client i on server i mod n) until ``until``; each group's observations."""
    out: dict[str, list[Observation]] = {key: [] for key, *_ in groups}
    await asyncio.gather(*(client_loop(i, urls[i % len(urls)], plan, clock, until, out[key])
                           for key, urls, plan, indices in groups for i in indices))  # fmt: skip
    return out
