"""The API server's Python calls per streamed request: plugin-free vLLM, hotwire plain, hotwire steered (and with
``--monitors N``, plain requests on a third server, hotwire with readout on and N monitors on all its traffic).

CPU time on a small shared machine moves by more than what hotwire's API-server code costs (``bench_api_cpu.py``);
calls do not. Both ``vllm serve`` of ``bench_throughput.servers`` start (the tiny Qwen3, float32) with
``api_calls_probe/`` leading their PYTHONPATH; for each configuration the API server's main thread counts its calls
(Python functions and built-ins) over ``--requests`` streamed completions of ``--max-tokens`` tokens sent one at a
time (so every request takes the same engine steps on both servers). Reported per configuration: calls per request,
those in hotwire's own code, and the functions whose counts differ most from the plugin-free server's. The
counts include what runs in the background meanwhile (hotwire's catalog refresh every 200 ms, vLLM's stats).

    python -m benchmarks.bench_api_calls [--monitors 4] --out api_calls.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from benchmarks.api_profile import where
from benchmarks.bench_api_cpu import send
from benchmarks.bench_throughput import add_monitors, model_facts, register_vectors, servers

PROBE = Path(__file__).parent / "api_calls_probe"
HOTWIRE_CODE = ("/hotwire_api/", "/hotwire_core/")
CONFIGS = (("vanilla", False), ("hotwire", False), ("hotwire", True))


def counted(pid: int, out: Path, run: Callable[[], None]) -> Counter:
    """The calls the process ``pid`` made while ``run()`` ran (see api_calls_probe/sitecustomize.py)."""
    (out / f"{pid}.json").unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    time.sleep(0.5)
    run()
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not (out / f"{pid}.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} wrote no call counts: is {PROBE} on its PYTHONPATH?")
        time.sleep(0.2)
    time.sleep(0.5)  # written whole (one json.dump), but give the writer its close
    return Counter({(path, name): n for path, name, n in json.loads((out / f"{pid}.json").read_text())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=25, help="functions listed per configuration")
    parser.add_argument("--monitors", type=int, default=0, help="also count plain requests on a server with this many "
                        "monitors (HOTWIRE_READOUT=1)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("api_calls.json"))
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hotwire-api-calls-"))
    out = workdir / "calls"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["HOTWIRE_API_CALLS_OUT"] = str(out)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))
    from hotwire_core.tiny_model import build_model

    model = build_model(workdir / "tiny", "tiny", weights=True)
    results: dict[str, dict] = {}
    counts: dict[str, Counter] = {}
    layer = json.loads((model / "config.json").read_text())["num_hidden_layers"] // 2
    configs = (*CONFIGS, *((("monitored", False),) if args.monitors else ()))
    with servers(model, ["--dtype", "float32", "--max-model-len", "4096"], workdir, 16, args.monitors, layer) as started:
        name, hidden, _ = model_facts(started["hotwire"][0])
        register_vectors(started["hotwire"][0], ["calls"], hidden, 0)
        if args.monitors:
            register_vectors(started["monitored"][0], ["calls"], hidden, 0)
            add_monitors(started["monitored"][0], ["calls"], args.monitors, layer)
        steer = json.dumps({"id": "calls", "layer": layer, "scale": 4.0})
        for server, steered in configs:
            url, pid = started[server]
            config = f"{server}/{'steered' if steered else 'plain'}"
            spec = steer if steered else None
            asyncio.run(send(url, name, 5, 1, args.max_tokens, True, spec))  # warm: first requests import and cache
            counts[config] = counted(pid, out, lambda: asyncio.run(send(url, name, args.requests, 1, args.max_tokens, True, spec)))
    base = counts["vanilla/plain"]
    for config, calls in counts.items():
        per = args.requests
        differing = sorted(set(calls) | set(base), key=lambda k: -abs(calls[k] - base[k]))[: args.top]
        results[config] = {
            "calls_per_request": sum(calls.values()) / per,
            "hotwire_calls_per_request": sum(n for (path, _), n in calls.items() if any(h in path for h in HOTWIRE_CODE)) / per,
            "differing_from_vanilla_plain": [{"function": f"{where(path)}:{fn}", "per_request": calls[(path, fn)] / per,
                                              "vanilla_plain": base[(path, fn)] / per} for path, fn in differing],
        }
        print(f"api_calls: {config:16s} {results[config]['calls_per_request']:9.1f} calls per request, "
              f"{results[config]['hotwire_calls_per_request']:7.1f} in hotwire's code", flush=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "configs": results}, indent=1))


if __name__ == "__main__":
    main()
