"""The whole story on one machine: start a vLLM server with hotwire, make a steering vector from examples, steer.

    python -m hotwire_api.demo [--model PATH_OR_ID] [--port N] [--keep-running] [--cache-dir DIR]

Without ``--model`` it serves the built-in tiny speaker (``hotwire_core.tiny_speaker``: the Qwen3 shape, trained
offline on short stories in two moods, cached after the first run); with no GPU it uses vLLM's CPU backend in
float32. It prints the ``vllm serve`` command it runs, with the environment that command needs, so it can be run by
hand. It then extracts a "happy minus sad" vector from four example sentences of each mood over HTTP
(``POST /steer/vectors/extract``), sends one prompt plain and steered (greedy, with logprobs), prints both texts
with their moods, the per-token logprob difference, the ``x-hotwire-receipt`` header and the slot table, and stops
the server (its whole process group, also on Ctrl-C or an error). ``--keep-running`` leaves the server up until
Ctrl-C.

Exit status: 0 when steering did what it should (the built-in model: the plain text is sad and the steered text
happy; another model: the output changed), 1 when it did not, 2 when the demo could not run, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hotwire_api import demo_server, server_process
from hotwire_api.headers import RECEIPT_HEADER
from hotwire_api.client import HotwireClient
from hotwire_api.demo_server import DemoError
from hotwire_api.errors import HotwireError
from hotwire_api.healthcheck import logprobs_differ
from hotwire_api.models import ExtractResult, SlotStats
from hotwire_core import tiny_speaker
from hotwire_core.settings import middle_layer

PROMPT = tiny_speaker.NEUTRAL_PROMPT
MAX_TOKENS = 16
VECTOR_ID = "happy"
# Another model than the built-in one: its middle layer, and a scale that makes a mean difference of a few
# examples show in common models.
OTHER_MODEL_SCALE = 4.0
RULE = "=" * 78


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its text, sampled tokens and their logprobs, and the receipt header (if any)."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    receipt: str | None


@dataclass(frozen=True)
class Outcome:
    """Whether steering did what it should, the summary lines, and the steering spec used."""

    passed: bool
    summary: list[str]
    spec: str


def steering_spec(layer: int, scale: float) -> str:
    return json.dumps({"id": VECTOR_ID, "layer": layer, "scale": scale})


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
        choice["text"], logprobs["tokens"], logprobs["token_logprobs"], response.headers.get(RECEIPT_HEADER)
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


def mood_line(text: str) -> str:
    """The mood :func:`hotwire_core.tiny_speaker.judge_mood` finds in ``text``, and its counts of mood words."""
    counts = tiny_speaker.mood_counts(text)
    return f"{tiny_speaker.judge_mood(text) or 'neither'} ({counts['happy']} happy, {counts['sad']} sad words)"


def extraction_lines(result: ExtractResult) -> list[str]:
    """What the extraction took and how well each layer's vector separates the two sets."""
    lines = [f"extracted {result.vector.id!r} v{result.vector.version} ({result.method}, {result.position} token) "
             f"from {result.examples.get('positive', 0)} happy and {result.examples.get('negative', 0)} sad examples:"]
    for layer in result.layers:
        separation = "n/a" if layer.separation is None else f"{layer.separation:.2f}"
        lines.append(f"  layer {layer.layer}: separation {separation} (Cohen's d), accuracy {layer.accuracy:.2f}, "
                     f"norm {layer.norm:.3f}")
    return lines


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


def steering_layer(stats: SlotStats, builtin: bool) -> int:
    """The layer to extract at and steer: the built-in speaker's (``tiny_speaker.STEER_LAYER``), else the hooked
    layer nearest the middle."""
    model = stats.model
    if not model.steerable:
        raise DemoError(f"the served model cannot be steered: {model.reason or 'model.steerable is false'}")
    if not model.n_layers:
        raise DemoError(f"GET /steer/slots gave no model geometry: {model}")
    return tiny_speaker.STEER_LAYER if builtin else middle_layer(model.layers, model.n_layers)


def run_demo(url: str, builtin: bool) -> Outcome:
    """Extract the vector, send the prompt plain and steered, print what happened."""
    with HotwireClient(url) as client, httpx.Client(timeout=120.0) as http:
        layer = steering_layer(client.slots(), builtin)
        extracted = client.extract(VECTOR_ID, list(tiny_speaker.HAPPY_EXAMPLES), list(tiny_speaker.SAD_EXAMPLES),
                                   layers=[layer], replace=True, timeout=300.0)
        print()
        print("\n".join(extraction_lines(extracted)))
        model = served_model(http, url)
        spec = steering_spec(layer, tiny_speaker.STEER_SCALE if builtin else OTHER_MODEL_SCALE)
        plain = complete(http, url, model)
        steered = complete(http, url, model, spec)
        again = complete(http, url, model)
        stats = client.slots()

    print()
    print("\n".join(request_lines(spec)))
    print(f"\nplain text:    {plain.text!r}")
    print(f"  mood:        {mood_line(plain.text)}")
    print(f"steered text:  {steered.text!r}")
    print(f"  mood:        {mood_line(steered.text)}")
    print("\nper-token logprob difference (steered - plain; * = a different token was chosen):")
    print(logprob_table(plain, steered))
    print(f"\nreceipt header:  {RECEIPT_HEADER}: {steered.receipt}")
    print("\nslot table (GET /steer/slots):")
    print(slot_table(stats))

    changed = logprobs_differ(
        {"tokens": plain.tokens, "token_logprobs": plain.logprobs},
        {"tokens": steered.tokens, "token_logprobs": steered.logprobs},
    )
    flipped = tiny_speaker.judge_mood(plain.text) == "sad" and tiny_speaker.judge_mood(steered.text) == "happy"
    unchanged = again.tokens == plain.tokens and again.logprobs == plain.logprobs
    summary = [
        f"model         {model}",
        f"vector        {VECTOR_ID!r} v{extracted.vector.version}, extracted from examples; layer {layer}",
        f"receipt       {steered.receipt}",
        f"plain         {plain.text!r}: {mood_line(plain.text)}",
        f"steered       {steered.text!r}: {mood_line(steered.text)}",
        f"plain again   {'identical to the first plain run' if unchanged else 'DIFFERS from the first plain run'}",
    ]
    return Outcome(flipped if builtin else changed, summary, spec)


def print_summary(lines: list[str], result: str) -> None:
    print(f"\n{RULE}\nhotwire demo: summary\n{RULE}")
    for line in lines:
        print(line)
    print(f"RESULT        {result}\n{RULE}", flush=True)


def wait_for_ctrl_c(url: str, spec: str) -> None:
    print(f"\nthe server keeps running at {url} (Ctrl-C stops it). Try:")
    print(f"  hotwire --url {url} slots")
    print(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\")
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "vllm_xargs": {"hotwire": spec}}
    print(f"    -d '{json.dumps(body)}'")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hotwire_api.demo",
        description="Start a vLLM server with hotwire, extract a steering vector from examples, steer one request.",
    )
    parser.add_argument("--model", help="model to serve (path or hub id); default: the built-in tiny speaker")
    parser.add_argument("--port", type=int, help="server port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--keep-running", action="store_true", help="leave the server up until Ctrl-C")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=demo_server.default_cache_dir(),
        help="the built-in model, caches and server log (default %(default)s)",
    )
    return parser


def _prepare_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    started = time.monotonic()
    path = tiny_speaker.cached_speaker(args.cache_dir)
    print(f"built-in tiny speaker (Qwen3 shape, 4 layers, trained on stories in two moods; "
          f"ready after {time.monotonic() - started:.0f} s): {path}", flush=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = args.port or server_process.free_port()
    if not demo_server.port_is_free(port):
        print(f"demo: port {port} is in use", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, demo_server.raise_on_sigterm)
    url = f"http://127.0.0.1:{port}"
    log_path = args.cache_dir / "server.log"
    proc: subprocess.Popen | None = None
    ready = False
    summary: list[str] = []
    try:
        model = _prepare_model(args)
        on_gpu = demo_server.has_gpu()
        command = demo_server.server_command(model, port, on_gpu)
        env = demo_server.server_env(args.cache_dir, on_gpu, offline=not args.model)
        proc = server_process.start_server(command, env, log_path)
        print(f"starting the server on the {'GPU' if on_gpu else 'CPU'} backend (the same by hand):")
        print(f"  {demo_server.copyable_command(command, on_gpu, offline=not args.model)}")
        print(f"  server pid {proc.pid} (process group {proc.pid}); log: {log_path}", flush=True)
        startup_s = demo_server.wait_until_ready(proc, url, log_path)
        ready = True
        print(f"server ready at {url} after {startup_s:.0f} s", flush=True)
        summary.append(f"server        {url} ({'GPU' if on_gpu else 'CPU'} backend, ready after {startup_s:.0f} s)")
        outcome = run_demo(url, builtin=not args.model)
        summary += outcome.summary
        if args.keep_running:
            wait_for_ctrl_c(url, outcome.spec)
        if outcome.passed:
            status, result = 0, ("PASS: the steered text took the happy mood" if not args.model
                                 else "PASS: steering changed the output")
        else:
            status, result = 1, ("FAIL: the steered text did not turn happy" if not args.model
                                 else "FAIL: steering left the output unchanged")
    except KeyboardInterrupt:
        status, result = 130, "INTERRUPTED"
    except Exception as exc:  # whatever went wrong, the server is stopped and the summary printed
        if not isinstance(exc, (DemoError, HotwireError, httpx.HTTPError)):
            traceback.print_exc()
        print(f"\ndemo failed: {exc}", file=sys.stderr, flush=True)
        status, result = 2, f"ERROR: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if proc is not None:
        summary.append(f"shutdown      {demo_server.shutdown(proc, ready)}")
    print_summary(summary, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
