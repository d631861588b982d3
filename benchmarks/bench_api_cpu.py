"""The API server's CPU per plain request: plugin-free vLLM against hotwire, side by side, below saturation.

Both ``vllm serve`` of ``bench_throughput.servers`` start (the tiny Qwen3, float32); each round sends every server
the same requests (``--concurrency`` at a time over ``/v1/completions``: non-streamed 1-token completions, then
streamed ``--max-tokens`` ones), the servers' order alternating per round, and reads the API server's (the main
process's) CPU time and the engine's steps (vLLM's ``/metrics``) around each batch. What hotwire's API-server code
costs a request that asks nothing of it, apart from how a saturated server shares its core (``bench_throughput.py``).
A streamed request's CPU follows the engine's steps per request (each step's outputs are one message to the API
server), which the engine's batching sets, not the plugin: the two are reported side by side.

    python -m benchmarks.bench_api_cpu --rounds 3 --out api_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_throughput import engine_counts, model_facts, servers
from benchmarks.server_processes import cpu_s


async def send(url: str, model: str, count: int, concurrency: int, max_tokens: int, stream: bool,
               steer: str | None = None) -> None:
    """``count`` completions, ``concurrency`` at a time, steered by the spec ``steer`` where given; each must answer
    200 (streamed: to ``[DONE]``)."""
    gate = asyncio.Semaphore(concurrency)
    body = {"model": model, "prompt": "The quick brown fox jumps over", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    if steer is not None:
        body["vllm_xargs"] = {"hotwire": steer}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def one() -> None:
            async with gate:
                if not stream:
                    answer = await http.post("/v1/completions", json=body)
                    if answer.status_code != 200:
                        raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")
                    return
                async with http.stream("POST", "/v1/completions", json=body) as answer:
                    lines = [line async for line in answer.aiter_lines()]
                if answer.status_code != 200 or "data: [DONE]" not in lines:
                    raise RuntimeError(f"HTTP {answer.status_code}, stream without [DONE]")

        await asyncio.gather(*(one() for _ in range(count)))


def cpu_ms_per_request(pid: int, url: str, model: str, count: int, concurrency: int, max_tokens: int,
                       stream: bool) -> tuple[float, float | None]:
    """The API server's CPU milliseconds per request over ``count`` requests (after a short warm-up), and the
    engine's steps per request meanwhile (each step's outputs are one message to the API server)."""
    asyncio.run(send(url, model, 2 * concurrency, concurrency, max_tokens, stream))
    before, counts = cpu_s(pid), engine_counts(url)
    asyncio.run(send(url, model, count, concurrency, max_tokens, stream))
    spent_s, counts_after = cpu_s(pid) - before, engine_counts(url)
    steps = None if counts is None or counts_after is None else (counts_after["steps"] - counts["steps"]) / count
    return spent_s * 1000 / count, steps


def at_equal_steps(rows: list[dict]) -> dict[str, float] | None:
    """Least squares over ``rows`` (one kind of request, both servers): CPU per request = base + per_step * engine
    steps per request + hotwire * [the hotwire server]. ``hotwire`` (with its standard error) is what the plugin
    costs a request at the same batching, which the raw medians mix with how each server's engine happened to batch.
    None with fewer than four rows that have steps."""
    import numpy as np

    rows = [row for row in rows if row.get("engine_steps_per_request") is not None]
    if len(rows) < 4:
        return None
    x = np.array([[1.0, row["engine_steps_per_request"], row["server"] == "hotwire"] for row in rows])
    y = np.array([row["api_cpu_ms_per_request"] for row in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    variance = float(residual @ residual) / (len(rows) - 3)
    se = np.sqrt(np.diag(variance * np.linalg.pinv(x.T @ x)))
    return {"base_ms": float(coef[0]), "per_step_ms": float(coef[1]), "hotwire_ms": float(coef[2]),
            "hotwire_se_ms": float(se[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--short", type=int, default=400, help="non-streamed 1-token requests per round and server")
    parser.add_argument("--streamed", type=int, default=150, help="streamed requests per round and server")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of a streamed request")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("api_cpu.json"))
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hotwire-api-cpu-"))
    from hotwire_core.tiny_model import build_model

    model = build_model(workdir / "tiny", "tiny", weights=True)
    kinds = {"short": (args.short, 1, False), "streamed": (args.streamed, args.max_tokens, True)}
    rows = []
    with servers(model, ["--dtype", "float32", "--max-model-len", "4096"], workdir, 16) as started:
        name = model_facts(started["hotwire"][0])[0]
        for kind, (count, max_tokens, stream) in kinds.items():
            for r in range(args.rounds):
                for server in ("vanilla", "hotwire") if r % 2 == 0 else ("hotwire", "vanilla"):
                    url, pid = started[server]
                    start = time.monotonic()
                    ms, steps = cpu_ms_per_request(pid, url, name, count, args.concurrency, max_tokens, stream)
                    rows.append({"kind": kind, "round": r, "server": server, "api_cpu_ms_per_request": ms,
                                 "engine_steps_per_request": steps, "requests": count,
                                 "wall_s": time.monotonic() - start})
                    print(f"api_cpu: {kind:8s} round {r} {server:8s} {ms:.3f} ms per request, "
                          f"{steps or float('nan'):.2f} engine steps per request", flush=True)
    medians = {f"{kind}/{server}": statistics.median(row["api_cpu_ms_per_request"] for row in rows
                                                     if row["kind"] == kind and row["server"] == server)
               for kind in kinds for server in ("vanilla", "hotwire")}
    steps = {key: statistics.median(s) if (s := [row["engine_steps_per_request"] for row in rows
                                                    if f"{row['kind']}/{row['server']}" == key
                                                    and row["engine_steps_per_request"] is not None]) else None
             for key in medians}
    fits = {kind: at_equal_steps([row for row in rows if row["kind"] == kind]) for kind in kinds}
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "medians": medians, "engine_steps_per_request_medians": steps,
                                    "at_equal_steps": fits}, indent=1))
    for key, ms in medians.items():
        print(f"api_cpu: median {key}: {ms:.3f} ms per request, {steps[key] or float('nan'):.2f} engine steps "
              "per request", flush=True)
    for kind, fit in fits.items():
        if fit is not None:
            print(f"api_cpu: {kind}: at equal engine steps hotwire adds {fit['hotwire_ms']:+.3f} ms per request "
                  f"(standard error {fit['hotwire_se_ms']:.3f}); each step per request costs {fit['per_step_ms']:.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
