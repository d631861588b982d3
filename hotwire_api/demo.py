"""The whole story on one machine: start a vLLM server with hotwire, steer one request, show what changed.

    python -m hotwire_api.demo [--model PATH_OR_ID] [--port N] [--keep-running] [--cache-dir DIR]

Without ``--model`` it builds the built-in tiny model offline (once, into the cache folder) and serves it; with no
GPU it uses vLLM's CPU backend in float32. It prints the ``vllm serve`` command it runs, with the environment that
command needs, so it can be run by hand. It then registers a random vector over HTTP, sends one prompt plain and
steered (greedy, with logprobs), prints both generated texts, the logprob difference per generated token, the
``x-hotwire-receipt`` header and the slot table, and stops the server (its whole process group, also on Ctrl-C or
an error). ``--keep-running`` leaves the server up until Ctrl-C.

Exit status: 0 when steering changed the output, 1 when it did not, 2 when the demo could not run, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hotwire_api import server_process, vllm_cli
from hotwire_api.admission import RECEIPT_HEADER
from hotwire_api.client import HotwireClient
from hotwire_api.errors import HotwireError
from hotwire_api.healthcheck import logprobs_differ
from hotwire_api.models import SlotStats
from hotwire_core.cpu_env import CPU_ENV, with_cpu_env
from hotwire_core.settings import middle_layer

PROMPT = "The quick brown fox"
MAX_TOKENS = 16
VECTOR_ID = "demo"
VECTOR_SEED = 0
# The vector has standard-normal entries (norm about sqrt(hidden)): at this scale it outweighs a middle layer's
# residual stream in common models, so the change is plain to see.
SCALE = 4.0
STARTUP_TIMEOUT_S = 900.0
PROGRESS_EVERY_S = 5.0
STOP_GRACE_S = 20.0
# A server still starting up does not act on SIGTERM (it waits for its engine), and has nothing to finish.
STARTING_GRACE_S = 5.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "(Worker pid=12) INFO 11-29 18:34:17 [cpu_model_runner.py:145] Warming up..." -> "Worker: Warming up..."
_LOG_PREFIX = re.compile(r"^(?:\((\w+) pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] )?")
RULE = "=" * 78


class DemoError(Exception):
    """The demo cannot go on; the message says why."""


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its text, sampled tokens and their logprobs, and the receipt header (if any)."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    receipt: str | None


@dataclass(frozen=True)
class Outcome:
    """Whether steering changed the output, the summary lines, and the steering spec used."""

    changed: bool
    summary: list[str]
    spec: str


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
    built-in model, no vector store and no API keys (the demo talks to its own server on localhost)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "HOTWIRE_API_KEY")}
    env.update(PYTHONUNBUFFERED="1", HOTWIRE_STORE="off")
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


def random_vector(hidden: int, seed: int = VECTOR_SEED) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(hidden).astype(np.float32)


def steering_spec(layer: int) -> str:
    return json.dumps({"id": VECTOR_ID, "layer": layer, "scale": SCALE})


def request_lines(spec: str) -> list[str]:
    """What both completions ask for: the prompt, how many tokens are generated after it, and the steering."""
    return [
        f"prompt:    {PROMPT!r}",
        f"generate:  {MAX_TOKENS} tokens after the prompt, greedy (temperature 0)",
        f"steer:     vllm_xargs.hotwire = {spec}",
    ]


def complete(http: httpx.Client, url: str, model: str, spec: str | None = None) -> Completion:
    """One greedy completion of :data:`PROMPT`, steered by ``spec`` when given."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    if spec is not None:
        body["vllm_xargs"] = {"hotwire": spec}
    response = http.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise DemoError(f"POST /v1/completions: HTTP {response.status_code}: {response.text[:300]}")
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    return Completion(
        choice["text"], logprobs["tokens"], logprobs["token_logprobs"], response.headers.get(RECEIPT_HEADER.decode())
    )


def served_model(http: httpx.Client, url: str) -> str:
    return http.get(f"{url}/v1/models").json()["data"][0]["id"]


def logprob_table(plain: Completion, steered: Completion) -> str:
    """Per position: both sampled tokens, their logprobs and the difference (``*`` where the tokens differ)."""
    lines = [f"  {'#':>2}  {'plain token':<16}{'logprob':>9}   {'steered token':<16}{'logprob':>9}{'delta':>10}"]
    rows = zip(plain.tokens, plain.logprobs, steered.tokens, steered.logprobs)
    for i, (pt, plp, st, slp) in enumerate(rows):
        mark = "" if pt == st else " *"
        plain_cell, steered_cell = f"{json.dumps(pt)[:15]:<16}{plp:>9.4f}", f"{json.dumps(st)[:15]:<16}{slp:>9.4f}"
        lines.append(f"  {i:>2}  {plain_cell}   {steered_cell}{slp - plp:>+10.4f}{mark}")
    return "\n".join(lines)


def max_logprob_delta(plain: Completion, steered: Completion) -> float:
    return max((abs(a - b) for a, b in zip(plain.logprobs, steered.logprobs)), default=0.0)


def differing_positions(plain: Completion, steered: Completion) -> int:
    return sum(a != b for a, b in zip(plain.tokens, steered.tokens))


def slot_table(stats: SlotStats) -> str:
    """The bank's counters and one line per occupied row."""
    head = (
        f"  capacity {stats.capacity}, used {stats.used}, pinned {stats.pinned}, free {stats.free}, "
        f"evictions {stats.evictions}, steered requests {stats.steered_requests}, vectors {stats.vectors}"
    )
    lines = [head, f"  {'slot':>4}  {'vector':<16}{'version':>7}{'layer':>7}{'refcount':>10}{'idle s':>9}"]
    now = time.time()
    for row in stats.rows:
        layer = "any" if row.layer < 0 else str(row.layer)  # -1: a [hidden] vector's row serves every layer
        lines.append(
            f"  {row.slot:>4}  {row.id:<16}{row.version:>7}{layer:>7}{row.refcount:>10}{now - row.last_use:>9.1f}"
        )
    if not stats.rows:
        lines.append("  (no rows in use)")
    return "\n".join(lines)


def _steerable_layer_and_hidden(stats: SlotStats) -> tuple[int, int]:
    model = stats.model
    if not model.steerable:
        raise DemoError(f"the served model cannot be steered: {model.reason or 'model.steerable is false'}")
    if not model.hidden_size or not model.n_layers:
        raise DemoError(f"GET /steer/slots gave no model geometry: {model}")
    return middle_layer(model.layers, model.n_layers), model.hidden_size


def run_demo(url: str) -> Outcome:
    """Register the vector, send the prompt plain and steered, print what happened."""
    with HotwireClient(url) as client, httpx.Client(timeout=120.0) as http:
        layer, hidden = _steerable_layer_and_hidden(client.slots())
        meta = client.register(VECTOR_ID, random_vector(hidden), replace=True)
        print(f"\nregistered vector {meta.id!r} v{meta.version}: random normal (seed {VECTOR_SEED}), hidden {hidden}")
        model = served_model(http, url)
        spec = steering_spec(layer)
        plain = complete(http, url, model)
        steered = complete(http, url, model, spec)
        again = complete(http, url, model)
        stats = client.slots()

    print()
    print("\n".join(request_lines(spec)))
    print(f"\nplain text:    {plain.text!r}")
    print(f"steered text:  {steered.text!r}")
    print("\nper-token logprob difference (steered - plain; * = a different token was chosen):")
    print(logprob_table(plain, steered))
    print(f"\nreceipt header:  {RECEIPT_HEADER.decode()}: {steered.receipt}")
    print("\nslot table (GET /steer/slots):")
    print(slot_table(stats))

    changed = logprobs_differ(
        {"tokens": plain.tokens, "token_logprobs": plain.logprobs},
        {"tokens": steered.tokens, "token_logprobs": steered.logprobs},
    )
    unchanged = again.tokens == plain.tokens and again.logprobs == plain.logprobs
    summary = [
        f"model         {model}",
        f"vector        {VECTOR_ID!r}, random, hidden {hidden}; layer {layer}, scale {SCALE}",
        f"receipt       {steered.receipt}",
        f"plain         {plain.text!r}",
        f"steered       {steered.text!r}",
        f"effect        max |logprob delta| {max_logprob_delta(plain, steered):.4f}; "
        f"{differing_positions(plain, steered)}/{len(plain.tokens)} tokens differ",
        f"plain again   {'identical to the first plain run' if unchanged else 'DIFFERS from the first plain run'}",
    ]
    return Outcome(changed, summary, spec)


def print_summary(lines: list[str], result: str) -> None:
    print(f"\n{RULE}\nhotwire demo: summary\n{RULE}")
    for line in lines:
        print(line)
    print(f"RESULT        {result}\n{RULE}", flush=True)


def wait_for_ctrl_c(url: str, spec: str) -> None:
    print(f"\nthe server keeps running at {url} (Ctrl-C stops it). Try:")
    print(f"  hotwire --url {url} slots")
    print(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\")
    body = {"prompt": PROMPT, "max_tokens": 8, "vllm_xargs": {"hotwire": spec}}
    print(f"    -d '{json.dumps(body)}'")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hotwire_api.demo", description="Start a vLLM server with hotwire and steer one request."
    )
    parser.add_argument("--model", help="model to serve (path or hub id); default: the built-in tiny model")
    parser.add_argument("--port", type=int, help="server port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--keep-running", action="store_true", help="leave the server up until Ctrl-C")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="tiny model, caches and server log (default %(default)s)",
    )
    return parser


def _prepare_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from hotwire_core.tiny_model import build_model

    path = args.cache_dir / "tiny-model"
    print(f"built-in tiny model (hidden 256, 4 layers, random weights): {path}", flush=True)
    return str(build_model(path))


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _shutdown(proc: subprocess.Popen, ready: bool) -> str:
    """Stop the server; further Ctrl-C or SIGTERM cannot cut this short and leave it running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stopping the server...", flush=True)
    return server_process.stop_server(proc, STOP_GRACE_S if ready else STARTING_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = args.port or server_process.free_port()
    if not port_is_free(port):
        print(f"demo: port {port} is in use", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    url = f"http://127.0.0.1:{port}"
    log_path = args.cache_dir / "server.log"
    proc: subprocess.Popen | None = None
    ready = False
    summary: list[str] = []
    try:
        model = _prepare_model(args)
        on_gpu = has_gpu()
        command = server_command(model, port, on_gpu)
        proc = server_process.start_server(command, server_env(args.cache_dir, on_gpu, offline=not args.model), log_path)
        print(f"starting the server on the {'GPU' if on_gpu else 'CPU'} backend (the same by hand):")
        print(f"  {copyable_command(command, on_gpu, offline=not args.model)}")
        print(f"  server pid {proc.pid} (process group {proc.pid}); log: {log_path}", flush=True)
        startup_s = wait_until_ready(proc, url, log_path)
        ready = True
        print(f"server ready at {url} after {startup_s:.0f} s", flush=True)
        summary.append(f"server        {url} ({'GPU' if on_gpu else 'CPU'} backend, ready after {startup_s:.0f} s)")
        outcome = run_demo(url)
        summary += outcome.summary
        if args.keep_running:
            wait_for_ctrl_c(url, outcome.spec)
        if outcome.changed:
            status, result = 0, "PASS: steering changed the output"
        else:
            status, result = 1, "FAIL: steering left the output unchanged"
    except KeyboardInterrupt:
        status, result = 130, "INTERRUPTED"
    except Exception as exc:  # whatever went wrong, the server is stopped and the summary printed
        if not isinstance(exc, (DemoError, HotwireError, httpx.HTTPError)):
            traceback.print_exc()
        print(f"\ndemo failed: {exc}", file=sys.stderr, flush=True)
        status, result = 2, f"ERROR: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if proc is not None:
        summary.append(f"shutdown      {_shutdown(proc, ready)}")
    print_summary(summary, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
