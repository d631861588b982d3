"""Decode cost of hotwire against plain vLLM, one GPU, one run.

Each configuration runs in its own process (its own engine): ``vanilla`` (no plugin loaded at all:
``VLLM_PLUGINS=""``), ``op`` (hotwire, opaque Triton op) and ``inductor`` (hotwire, torch ops fused by
Inductor). For every batch size and steering mode, the decode time per token of a request is
``(t(1 + N tokens) - t(1 token)) / N`` for one ``generate`` call over the batch: the step time a request sees,
not total throughput. TTFT is ``t(1 token)``. Medians of ``--reps`` runs, with min and max.

    python benchmarks/bench_decode.py --shape qwen3-4b --batches 1,8,64,256 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "idle": "hotwire loaded, no request steered",
    "steered": "every request steered: one vector at one middle layer",
    "steered_all_layers": "every request steered: one vector at every layer",
    "stacked": "every request steered: 4 entries on the same layer",
    "distinct": "every request its own vector (up to 256 distinct), one middle layer",
}


def _spec(mode: str, n_layers: int, i: int) -> str | None:
    mid = n_layers // 2
    if mode == "idle":
        return None
    if mode == "steered":
        return json.dumps({"id": "v0", "layer": mid, "scale": 2.0})
    if mode == "steered_all_layers":
        return json.dumps({"id": "v0", "layer": list(range(n_layers)), "scale": 0.5})
    if mode == "stacked":
        return json.dumps([{"id": f"v{k}", "layer": mid, "scale": 0.5} for k in range(4)])
    if mode == "distinct":
        return json.dumps({"id": f"v{i % 256}", "layer": mid, "scale": 2.0})
    raise ValueError(mode)


def _time_generate(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        args.model, load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=max(args.batches),
        gpu_memory_utilization=0.85, seed=0,
    )
    hf = llm.llm_engine.model_config.hf_config
    n_layers, hidden = hf.num_hidden_layers, hf.hidden_size
    modes = ["idle"] if args.config == "vanilla" else args.modes
    if args.config != "vanilla":
        from hotwire_core.offline import register_vector

        g = torch.Generator().manual_seed(0)
        n_vectors = 256 if "distinct" in modes else 4
        for k in range(n_vectors):
            register_vector(llm, f"v{k}", torch.randn(hidden, generator=g) * 0.01)
    rng = torch.Generator().manual_seed(1)
    for batch in args.batches:
        for mode in modes:
            def params(n: int) -> list:
                out = []
                for i in range(batch):
                    spec = _spec(mode, n_layers, i)
                    out.append(SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                                              extra_args={"hotwire": spec} if spec else None))
                return out

            def prompts() -> list:
                return [{"prompt_token_ids": torch.randint(0, min(hf.vocab_size, 30000), (args.prompt_len,), generator=rng).tolist()}
                        for _ in range(batch)]

            _time_generate(llm, prompts(), params(8))  # warm-up: first sight of these batch shapes
            ttft, decode = [], []
            for _ in range(args.reps):
                t1 = _time_generate(llm, prompts(), params(1))
                tn = _time_generate(llm, prompts(), params(1 + args.decode_tokens))
                ttft.append(t1 * 1e3)
                decode.append((tn - t1) / args.decode_tokens * 1e3)
            row = {"config": args.config, "mode": mode, "batch": batch, "decode_ms": decode, "ttft_ms": ttft}
            print("RESULT " + json.dumps(row), flush=True)


def _summary(rows: list[dict]) -> str:
    base = {r["batch"]: statistics.median(r["decode_ms"]) for r in rows if r["config"] == "vanilla"}
    lines = ["| config | mode | batch | decode ms/token (median, min-max) | vs vanilla | TTFT ms (median) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        med = statistics.median(r["decode_ms"])
        rel = f"{(med / base[r['batch']] - 1) * 100:+.2f}%" if r["batch"] in base else "n/a"
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['batch']} | {med:.3f} ({min(r['decode_ms']):.3f}-{max(r['decode_ms']):.3f})"
            f" | {rel} | {statistics.median(r['ttft_ms']):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-4b", help="a shape from hotwire_core.tiny_model.SHAPES")
    parser.add_argument("--configs", default="vanilla,op,inductor")
    parser.add_argument("--modes", default="idle,steered", help=",".join(MODES))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--worker", dest="config", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = args.modes.split(",")
    if args.config:
        return worker(args)

    from hotwire_core.tiny_model import build_model

    model = build_model(Path(tempfile.gettempdir()) / f"hotwire-bench-{args.shape}", args.shape, weights=False)
    rows: list[dict] = []
    for config in args.configs.split(","):
        env = dict(os.environ)
        if config == "vanilla":
            env["VLLM_PLUGINS"] = ""
        else:
            env.pop("VLLM_PLUGINS", None)
            env["HOTWIRE_IMPL"] = config
        cmd = [sys.executable, __file__, "--worker", config, "--model", str(model), "--batches",
               ",".join(map(str, args.batches)), "--modes", ",".join(args.modes), "--reps", str(args.reps),
               "--decode-tokens", str(args.decode_tokens), "--prompt-len", str(args.prompt_len)]
        start = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        print(f"{config}: {len(got)} results in {time.time() - start:.0f} s (exit {proc.returncode})", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
        rows += got
        if args.out:
            _write(args, rows)
    print(_summary(rows))


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    import torch
    import vllm

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "shape": args.shape,
        "command": " ".join(sys.argv),
        "method": "decode ms/token = (t(1+N) - t(1)) / N per generate() over the batch; medians of reps",
        "modes": {m: MODES[m] for m in args.modes},
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": _summary(rows)}, indent=1))


if __name__ == "__main__":
    main()
