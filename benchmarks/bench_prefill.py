"""Time to first token of a long steered prompt against the same prompt plain, on one live ``vllm serve``.

One server (hotwire, dummy weights, graphs on, prefix caching on). Each round draws a fresh random prompt of
``--prompt-len`` token ids and sends it twice, one at a time, as a 1-token completion: plain and steered (one
[hidden] vector at the middle layer), in an order that alternates between rounds. The two never share KV (a
steered request's cache salt separates it), and no round reuses another's prompt, so both are full prefills.
TTFT is the completion's wall time seen by this process. The cost is the median over rounds of the paired
ratio steered / plain - 1 (paired: a drift of the machine hits both sides of a ratio alike).

    python benchmarks/bench_prefill.py --shape qwen3-4b --prompt-len 8192 --rounds 20 --out prefill.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from hotwire_api.server_process import ServerExited, free_port, start_server, stop_server, vllm_serve_command, wait_until_ready
from hotwire_core.cpu_env import with_cpu_env
from hotwire_core.settings import middle_layer
from hotwire_core.tiny_model import SHAPES, build_model

MODEL = "prefill-bench"


def paired_cost_pct(plain_ms: list[float], steered_ms: list[float]) -> float:
    """Median over rounds of steered / plain - 1, in percent."""
    return 100 * statistics.median(s / p - 1 for p, s in zip(plain_ms, steered_ms, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    gpu = torch.cuda.is_available()
    shape = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    model = build_model(work / "model", shape, weights=False)
    # The built folders declare 4096 positions; past them the rotary table is indexed out of bounds (a GPU run
    # with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 crashed the engine core on the first 8192-token prompt).
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], args.prompt_len + 16)
    (model / "config.json").write_text(json.dumps(config, indent=1))
    port = free_port()
    cmd = [*vllm_serve_command(str(model)), "--served-model-name", MODEL, "--load-format", "dummy",
           "--dtype", "bfloat16" if gpu else "float32", "--max-model-len", str(args.prompt_len + 16),
           "--max-num-seqs", "8", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log"]
    if gpu:
        cmd += ["--gpu-memory-utilization", "0.3"]
    env = {**os.environ, "HOTWIRE_STORE": "off", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if not gpu:
        env = with_cpu_env(env, kv_cache_gib=2)
    log = work / "server.log"
    proc = start_server(cmd, env, log)
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    try:
        try:
            print(f"server healthy after {wait_until_ready(proc, url, 900):.0f} s", flush=True)
        except ServerExited as exc:
            sys.exit(f"vllm serve: {exc}:\n{log.read_text(errors='replace')[-4000:]}")
        layer = middle_layer(None, shape.num_layers)
        vector = (rng.standard_normal(shape.hidden_size) / np.sqrt(shape.hidden_size)).astype(np.float32)
        with httpx.Client(base_url=url, timeout=600) as http:
            body = {"id": "prefill", "data": base64.b64encode(vector.tobytes()).decode(),
                    "dtype": "float32", "shape": [shape.hidden_size]}
            assert http.post("/steer/vectors", json=body).status_code == 201
            spec = json.dumps({"id": "prefill", "layer": layer, "scale": args.scale})

            def ttft_ms(prompt: list[int], steered: bool) -> float:
                request = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                if steered:
                    request["vllm_xargs"] = {"hotwire": spec}
                start = time.perf_counter()
                response = http.post("/v1/completions", json=request)
                took = (time.perf_counter() - start) * 1000
                assert response.status_code == 200, response.text
                assert ("x-hotwire-receipt" in response.headers) == steered
                return took

            vocab = min(shape.vocab_size, 500)
            ttft_ms(rng.integers(10, vocab, args.prompt_len).tolist(), False)  # warm-up: both paths once
            ttft_ms(rng.integers(10, vocab, args.prompt_len).tolist(), True)
            plain, steered = [], []
            for i in range(args.rounds):
                prompt = rng.integers(10, vocab, args.prompt_len).tolist()
                for is_steered in (False, True) if i % 2 == 0 else (True, False):
                    (steered if is_steered else plain).append(ttft_ms(prompt, is_steered))
                print(f"round {i + 1}: plain {plain[-1]:.1f} ms, steered {steered[-1]:.1f} ms", flush=True)
    finally:
        stop_server(proc)
    cost = paired_cost_pct(plain, steered)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": torch.cuda.get_device_name(0) if gpu else "cpu",
        "vllm": __import__("vllm").__version__, "shape": f"{args.shape} ({shape.num_layers} x {shape.hidden_size})",
        "command": " ".join(sys.argv), "prompt_len": args.prompt_len, "rounds": args.rounds,
        "plain_ms": plain, "steered_ms": steered, "plain_median_ms": statistics.median(plain),
        "steered_median_ms": statistics.median(steered), "steered_cost_pct": cost, "target_pct": 1.0,
    }
    print(f"TTFT {args.prompt_len} tokens: plain {result['plain_median_ms']:.1f} ms, steered "
          f"{result['steered_median_ms']:.1f} ms, paired cost {cost:+.2f}% (target <= +1%)")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
