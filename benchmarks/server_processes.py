"""A ``vllm serve``'s processes from outside: its engine core found from the API server's pid, and how much of a
core each used over a window (near 1: that process, not the clients, was the limit)."""

from __future__ import annotations

import time

import psutil

__all__ = ["CpuWindow", "cpu_s", "engine_core_pid"]


def engine_core_pid(api_server_pid: int) -> int | None:
    """The engine core process a ``vllm serve`` runs (with one GPU, its model runner too): the API server's child
    titled ``VLLM::EngineCore`` (vLLM names it when setproctitle is installed), else its busiest spawned child."""
    children = [c for c in psutil.Process(api_server_pid).children(recursive=True)
                if "resource_tracker" not in " ".join(c.cmdline())]  # fmt: skip
    titled = [c for c in children if "EngineCore" in " ".join(c.cmdline())]
    found = titled or sorted(children, key=lambda c: -sum(c.cpu_times()[:2]))
    return found[0].pid if found else None


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class CpuWindow:
    """The share of a core the API server ``api_server_pid`` and its engine core used from construction to
    :meth:`shares`."""

    def __init__(self, api_server_pid: int):
        engine = engine_core_pid(api_server_pid)
        self._pids = {"api_server": api_server_pid, **({"engine_core": engine} if engine else {})}
        self._start = time.monotonic(), {name: cpu_s(pid) for name, pid in self._pids.items()}

    def shares(self) -> dict[str, float]:
        began, used = self._start
        wall = max(time.monotonic() - began, 1e-9)
        return {name: round((cpu_s(pid) - used[name]) / wall, 3) for name, pid in self._pids.items()}
