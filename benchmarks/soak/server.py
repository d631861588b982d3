"""A server of the soak's own: ``vllm serve`` with hotwire on a free port, and the tail of its log."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hotwire_core.cpu_env import with_cpu_env

SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "HOTWIRE_STORE": "off"}  # values set already win


@dataclass
class OwnServer:
    url: str
    log: Path
    pid: int  # the API server's


@contextlib.contextmanager
def own_server(model_dir: Path, slots: int, extra_args: Sequence[str], workdir: Path, built: bool,
               extra_env: dict[str, str] | None = None) -> Iterator[OwnServer]:  # fmt: skip
    """``vllm serve`` with hotwire on a free port in its own process group, with the CPU environment of
    scripts/test.sh (values already in the environment win), ``HOTWIRE_SLOTS`` and ``extra_env``; stopped on exit."""
    import torch

    from hotwire_api.server_process import free_port, start_server, stop_server, vllm_serve_command, wait_until_ready

    port = free_port()
    env = {**SERVER_ENV, **os.environ}
    if not torch.cuda.is_available():
        env = with_cpu_env(env)
    env.update(HOTWIRE_SLOTS=str(slots), PYTHONUNBUFFERED="1", **(extra_env or {}))
    defaults = ["--dtype", "float32", "--max-model-len", "4096"] if built else []
    if not torch.cuda.is_available():
        defaults.append("--enforce-eager")  # short engine starts on the CPU
    command = [*vllm_serve_command(str(model_dir)), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               *defaults, *extra_args]  # fmt: skip
    log = workdir / "server.log"
    print(f"soak: starting {' '.join(command[3:])}\nsoak: server log {log}", flush=True)
    proc = start_server(command, env, log)
    try:
        seconds = wait_until_ready(proc, f"http://127.0.0.1:{port}", 600.0)
        print(f"soak: server ready after {seconds:.0f} s", flush=True)
        yield OwnServer(f"http://127.0.0.1:{port}", log, proc.pid)
    finally:
        print(f"soak: {stop_server(proc)}", flush=True)


_ACCESS_LOG = re.compile(r'INFO: +[0-9.]+:\d+ - "')  # uvicorn's one line per request


def log_tail(log: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a server log, uvicorn's access lines left out."""
    if log is None:
        return ""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join([line for line in text.splitlines() if not _ACCESS_LOG.search(line)][-lines:])
