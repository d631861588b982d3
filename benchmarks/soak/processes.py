"""The soak's client processes: one asyncio process saturates before a vLLM API server does, so the clients (and a
tenant flood) run in spawned processes, each telling how much of a core it used (near 1: the clients, not the
server, may have been the limit)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["CLIENTS_PER_PROCESS", "Job", "in_processes", "process_count"]

CLIENTS_PER_PROCESS = 64  # streaming clients per process: below a third of a core in the GPU soaks

Job = tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]  # a module-level async function and its arguments


def process_count(clients: int, asked: int = 0) -> int:
    """``asked`` processes where given (> 0), else one per :data:`CLIENTS_PER_PROCESS` clients."""
    return asked if asked > 0 else max(1, -(-clients // CLIENTS_PER_PROCESS))


def _run(job: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> tuple[Any, float]:
    cpu, wall = time.process_time(), time.monotonic()
    result = asyncio.run(job(*args))
    return result, (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-9)


async def in_processes(jobs: Sequence[Job]) -> list[tuple[Any, float]]:
    """Each job in a spawned process of its own, all at once: per job, its result and the share of a core its
    process used meanwhile. A job's exception is raised here."""
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        pending = [pool.apply_async(_run, job) for job in jobs]
        return list(await asyncio.gather(*(asyncio.to_thread(p.get) for p in pending)))
