"""A real ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``) in its own process group, for the
integration tests of the HTTP control plane.

The server gets the CPU environment of ``conftest.py`` plus per-server cache folders; it is ready when
``GET /health`` answers 200 and is stopped by signalling its whole process group (API server, engine core and
workers go together). On a GPU host the same float32 model is served with CUDA graphs and a fixed 1 GiB KV cache
(``benchmarks/gpu_checks.sh server`` runs the server tests beside other jobs on one GPU).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hotwire_api.server_process import (
    ServerExited,
    free_port,
    start_server,
    stop_server,
    vllm_serve_command,
    wait_until_ready,
)
from hotwire_core.verify import untimed_compilation_config

START_TIMEOUT_S = 240.0
# The tiny models' max_position_embeddings: room for streams long enough to stay in flight while a test acts on
# them. A test leaves such a stream early (which aborts it), so its length costs nothing; on a loaded two-core CI
# machine streams of 4,000 tokens (about 10 s) ended before the tests had acted (their headers came late, the test
# process stalled). A stream a test reads to its end is shorter, but three times that.
MAX_MODEL_LEN = 32768
LONG_STREAM_TOKENS = MAX_MODEL_LEN - 100  # max_tokens of a stream a test acts on and then leaves
DRAINED_STREAM_TOKENS = 12000  # max_tokens of a stream a test acts on and then reads to its end (~40 s on a CPU)
# A fixed KV cache skips vLLM's memory profiling, which miscounts when other engines share the GPU; the untimed
# compile leaves no kernel choice to timing (hotwire_core.verify.UNTIMED_INDUCTOR).
GPU_ARGS = ["--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.05",
            "--compilation-config", json.dumps(untimed_compilation_config())]


class StreamMissed(Exception):
    """A stream a test needed in flight had ended before the test could act on it."""


# For tests that act on a request while it runs: on the CPU, the test runs again (three attempts in all) when it
# fails. vLLM's CPU engine core spins on a whole core while it waits for its worker; on a two-core machine the API
# server and the test process then stalled for seconds at a time, and a several-second request could end before the
# test acted on it (plugin-free vLLM's streams too got their headers only when they ended). A real defect fails every
# attempt; on a GPU there is one attempt. pytest-rerunfailures reports each earlier attempt's failure.
retried_on_a_busy_cpu = pytest.mark.flaky(
    reruns=0 if torch.cuda.is_available() else 2, only_rerun=[AssertionError, StreamMissed, httpx.HTTPError]
)


class VllmServer:
    """One ``vllm serve`` process group. ``env`` is added to the test process's environment. ``cli``: start it
    with vLLM's ``vllm serve`` command (which may start several API servers: with ``--data-parallel-size N``
    it defaults to N) instead of the single API server of ``python -m vllm.entrypoints.openai.api_server``."""

    def __init__(
        self, model: Path, workdir: Path, env: dict[str, str], args: list[str] | None = None, cli: bool = False
    ):
        self.model = model
        self.cli = cli
        self.workdir = workdir
        self.extra_env = env
        self.args = args or []
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"server-{self.starts}.log"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def start(self, timeout: float = START_TIMEOUT_S, retried: bool = False) -> float:
        """Start the server and wait until it is healthy; returns the seconds it took. A start that failed on a
        port another process took first is made once more."""
        assert self.proc is None, "already running"
        self.starts += 1
        self.port = free_port()
        run_dir = self.workdir / f"run-{self.starts}"
        # TMPDIR stays the test run's (short) one: vLLM puts ZMQ IPC sockets there, whose paths may not exceed
        # 107 characters. The run's caches too, where it has its own (scripts/test.sh): servers start one at a
        # time, and a server that finds the kernels and model facts earlier engines of the run compiled starts
        # in less time (vLLM's own compile cache stays off, VLLM_DISABLE_COMPILE_CACHE).
        env = {
            **os.environ,
            "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(run_dir / "vllm-cache")),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(run_dir / "inductor")),
            "PYTHONUNBUFFERED": "1",
            # On a busy two-core machine the test process can stall for seconds (seen: 4 s); with uvicorn's 5 s
            # keep-alive the server may close a pooled connection just as the client reuses it.
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300",
            **self.extra_env,
        }
        if self.cli:
            entry = vllm_serve_command(str(self.model))
        else:
            entry = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd = [
            *entry,
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "8",
            "--block-size", "32",
            "--seed", "0",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *(GPU_ARGS if torch.cuda.is_available() else []),
            *self.args,
        ]  # fmt: skip
        self.proc = start_server(cmd, env, self.log_path)
        try:
            seconds = wait_until_ready(self.proc, self.url, timeout)
        except ServerExited as exc:
            self.stop()
            if "EADDRINUSE" in self.log_tail(1 << 20) and not retried:
                # vLLM picks its workers' torch.distributed port free, then binds it later: another lane's engine
                # can take it in between; a new start picks another
                return self.start(timeout, retried=True)
            raise RuntimeError(f"vllm serve: {exc}:\n{self.log_tail()}") from None
        if not torch.cuda.is_available():
            self._renice_engine_busy_loops()
        return seconds

    def _renice_engine_busy_loops(self) -> None:
        """Lower the priority of the engine core processes (nice 10, every thread), on the CPU only. While the
        busy loop waits for the worker's results it spins (``sched_yield``) on a whole core; on a two-core
        machine that starved the API server and the test process for seconds at a time (streams of plugin-free
        vLLM too got their headers only when they ended)."""
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getpgid(int(entry.name)) == self.proc.pid:
                    if (entry / "comm").read_text().startswith("VLLM::EngineCor"):
                        for thread in (entry / "task").iterdir():
                            os.setpriority(os.PRIO_PROCESS, int(thread.name), 10)
            except OSError:
                continue  # a process that exited meanwhile

    def hotwire_samples(self) -> list[tuple[str, dict[str, str], float]]:
        """hotwire's samples on ``/metrics`` as (name, labels, value), in the order vLLM serves them."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30).text
        return [(sample.name, sample.labels, sample.value) for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name.startswith("hotwire_")]  # fmt: skip

    def stop(self) -> None:
        """Stop the whole process group (API server, engine core, workers)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_server(proc)


def completion_logprobs(response: httpx.Response) -> list[float]:
    """The token logprobs of a 200 ``/v1/completions`` answer (each finite)."""
    assert response.status_code == 200, response.text
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert values and all(math.isfinite(v) for v in values)
    return values


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
