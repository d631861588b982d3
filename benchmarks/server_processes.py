"""A ``vllm serve``'s processes from outside: its engine core found from the API server's pid, how much of a core
each used over a window (near 1: that process, not the clients, was the limit), and py-spy samples of both."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.api_profile import Recording

__all__ = ["CpuWindow", "ServerWatch", "cpu_s", "engine_core_pid", "server_pids"]


def engine_core_pid(api_server_pid: int) -> int | None:
    """The engine core process a ``vllm serve`` runs (with one GPU, its model runner too): the API server's child
    titled ``VLLM::EngineCore`` (vLLM names it when setproctitle is installed), else its busiest spawned child."""
    children = [c for c in psutil.Process(api_server_pid).children(recursive=True)
                if "resource_tracker" not in " ".join(c.cmdline())]  # fmt: skip
    titled = [c for c in children if "EngineCore" in " ".join(c.cmdline())]
    found = titled or sorted(children, key=lambda c: -sum(c.cpu_times()[:2]))
    return found[0].pid if found else None


def server_pids(api_server_pid: int) -> dict[str, int]:
    """``api_server`` and, where found, ``engine_core``: their pids."""
    engine = engine_core_pid(api_server_pid)
    return {"api_server": api_server_pid, **({"engine_core": engine} if engine else {})}


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class CpuWindow:
    """The share of a core each process of ``pids`` (by name) used from construction to :meth:`shares`."""

    def __init__(self, pids: dict[str, int]):
        self._pids = pids
        self._start = time.monotonic(), {name: cpu_s(pid) for name, pid in pids.items()}

    def shares(self) -> dict[str, float]:
        began, used = self._start
        wall = max(time.monotonic() - began, 1e-9)
        return {name: round((cpu_s(pid) - used[name]) / wall, 3) for name, pid in self._pids.items()}


class ServerWatch:
    """A soak's own server over its traffic (:meth:`start` to :meth:`finish`): how busy its API server and engine
    core were, and with ``profile_s``, py-spy's samples of both (running threads, raw stacks) for that many seconds
    from the middle of the traffic into ``<prefix>.<process>.txt``."""

    def __init__(self, api_server_pid: int, profile_s: float = 0.0, prefix: Path | None = None):
        if profile_s and prefix is None:
            raise ValueError("profiling needs a prefix for its files")
        self.pids, self.profile_s, self.prefix = server_pids(api_server_pid), profile_s, prefix
        self._window: CpuWindow | None = None
        self._timer: threading.Timer | None = None
        self._recordings: dict[str, Recording] = {}

    def start(self, duration: float) -> None:
        self._window = CpuWindow(self.pids)
        if self.profile_s:
            self._timer = threading.Timer(max(0.0, (duration - self.profile_s) / 2), self._record)
            self._timer.start()

    def _record(self) -> None:
        self._recordings = {name: Recording(pid, self.profile_s, Path(f"{self.prefix}.{name}.txt"), rate=200)
                            for name, pid in self.pids.items()}  # fmt: skip

    def finish(self) -> dict[str, Any]:
        """``busy`` (each process's share of a core) and ``profiles`` (each process's file, where recorded; a py-spy
        that failed says why instead: the soak's own result is never lost to it)."""
        busy = self._window.shares() if self._window else None
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        profiles = {}
        for name, recording in self._recordings.items():
            try:
                recording.stacks(timeout=self.profile_s + 60)
                profiles[name] = str(recording.out)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                profiles[name] = f"failed: {exc}"
        return {"busy": busy, "profiles": profiles}
