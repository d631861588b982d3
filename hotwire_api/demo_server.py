"""The demo's server: the ``vllm serve`` command it starts (with the environment the CPU backend needs), its log,
waiting until it answers, and stopping it (see :mod:`hotwire_api.demo`)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
from pathlib import Path

from hotwire_api import server_process, vllm_cli
from hotwire_core.cpu_env import CPU_ENV, with_cpu_env

STARTUP_TIMEOUT_S = 900.0
PROGRESS_EVERY_S = 5.0
STOP_GRACE_S = 20.0
# A server still starting up does not act on SIGTERM (it waits for its engine), and has nothing to finish.
STARTING_GRACE_S = 5.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "(Worker pid=12) INFO 11-29 18:34:17 [cpu_model_runner.py:145] Warming up..." -> "Worker: Warming up..."
_LOG_PREFIX = re.compile(r"^(?:\((\w+) pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] )?")


class DemoError(Exception):
    """The demo cannot go on; the message says why."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotwire" / "demo"


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def server_command(model: str, port: int, on_gpu: bool) -> list[str]:
    """``vllm serve MODEL`` on localhost: the venv's ``vllm`` script where it works (vLLM's own on a GPU install,
    hotwire's after scripts/setup-cpu.sh), else ``python -m hotwire_api.vllm_cli`` (:mod:`hotwire_api.vllm_cli`)."""
    command = [*vllm_cli.command(), "serve", model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    if not on_gpu:
        command += ["--dtype", "float32", "--max-model-len", "2048"]
    return command


def copyable_command(command: list[str], on_gpu: bool, offline: bool) -> str:
    """``command`` as one shell line with the environment it needs: on a CPU vLLM's backend stops at start
    without ``VLLM_CPU_KVCACHE_SPACE``; the built-in model needs no hub (``HF_HUB_OFFLINE``)."""
    env = {} if on_gpu else dict(CPU_ENV)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command)])


def server_env(cache_dir: Path, on_gpu: bool, offline: bool) -> dict[str, str]:
    """The server's environment: CPU-backend settings without a GPU, caches under ``cache_dir``, no hub for the
    built-in model, no vector store and no API keys (the demo talks to its own server on localhost), and the
    capture op compiled in (``HOTWIRE_CAPTURE``: the demo extracts its vector from examples)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "HOTWIRE_API_KEY")}
    env.update(PYTHONUNBUFFERED="1", HOTWIRE_STORE="off", HOTWIRE_CAPTURE="1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_dir / "vllm-cache"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if not on_gpu:
        env = with_cpu_env(env)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor-cache"))
    return env


def compact_log_line(line: str) -> str:
    """A vLLM log line without its pid, level, timestamp and source location."""
    match = _LOG_PREFIX.match(line)
    rest = line[match.end():]
    return f"{match.group(1)}: {rest}" if match.group(1) else rest


def log_tail(path: Path, lines: int = 1) -> list[str]:
    """The last ``lines`` non-empty lines of the server log, without colour codes or progress-bar rewrites."""
    try:
        raw = path.read_bytes()[-16384:].decode("utf-8", "replace")
    except OSError:
        return []
    cleaned = [_ANSI.sub("", line).split("\r")[-1].strip() for line in raw.splitlines()]
    return [line for line in cleaned if line][-lines:]


def wait_until_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
    """Wait until the server answers, printing progress every few seconds; returns the seconds it took.
    Raises :class:`DemoError` when the server exits or does not come up in time."""
    next_report = [PROGRESS_EVERY_S]

    def progress(elapsed: float) -> None:
        if elapsed >= next_report[0]:
            last = compact_log_line((log_tail(log_path) or ["(no output yet)"])[0])
            print(f"  [{elapsed:4.0f} s] starting... {last[:100]}", flush=True)
            next_report[0] += PROGRESS_EVERY_S

    try:
        return server_process.wait_until_ready(proc, url, timeout_s, progress, path="/v1/models")
    except server_process.ServerExited as exc:
        tail = "\n    ".join(log_tail(log_path, 30))
        raise DemoError(f"{exc} (log: {log_path})\n    {tail}") from None


def raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def shutdown(proc: subprocess.Popen, ready: bool) -> str:
    """Stop the server; further Ctrl-C or SIGTERM cannot cut this short and leave it running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stopping the server...", flush=True)
    return server_process.stop_server(proc, STOP_GRACE_S if ready else STARTING_GRACE_S)


