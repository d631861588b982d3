"""What the steering op costs inside a CUDA graph, without vLLM: a decoder-shaped chain of matmuls per layer
(Qwen3-4B sizes by default, so each layer streams its ~200 MB of weights through the L2 cache as a real decode step
does) with ``torch.ops.hotwire.steer_`` after every layer, captured in one CUDA graph and replayed.

Variants, all in one process and measured round-robin: ``vanilla`` (no op), ``noop_kernel`` (an empty Triton
kernel per layer: the price of a graph node alone), ``idle`` (the op, no token steered: what one graph set costs
when nothing is steered), and every token steered at 1, 8 or all layers, with ``layer_on`` naming exactly the
steered layers (the default) or switched on everywhere (``_all_on``: the cost when a live config elsewhere
switches on layers this batch does not steer). Reports ms per replay and the difference to ``vanilla`` per step
and per hooked layer.

    python benchmarks/bench_op_graph.py [--tokens 1,8,64,256] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import triton
import triton.language as tl

import hotwire_core.ops  # noqa: F401  registers torch.ops.hotwire.steer_

SHAPES = {
    # hidden, intermediate, q+kv projection width, attention output width, layers
    "qwen3-4b": (2560, 9728, 6144, 4096, 36),
    "qwen3-8b": (4096, 12288, 6144, 4096, 36),
}


@triton.jit
def _empty_kernel(x_ptr):
    pass


class Decoder:
    """Random bf16 weights and the hotwire buffers; ``step`` is one decode step of ``tokens`` tokens."""

    def __init__(self, shape: str, slots: int, k: int):
        self.hidden, self.inter, self.qkv, self.attn_out, self.n_layers = SHAPES[shape]
        h, n = self.hidden, self.n_layers
        g = torch.Generator(device="cuda").manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

        self.layers = [
            (weight(h, self.qkv), weight(self.attn_out, h), weight(h, 2 * self.inter), weight(self.inter, h))
            for _ in range(n)
        ]
        self.bank = torch.randn(slots + 1, h, device="cuda", dtype=torch.bfloat16, generator=g)
        self.bank[0] = 0
        self.inv_norm = 1 / self.bank.float().norm(dim=1).clamp(min=1e-6)
        self.token_cfg = torch.zeros(4096, device="cuda", dtype=torch.int32)
        self.layer_on = torch.zeros(n, device="cuda", dtype=torch.int32)
        self.cfg_slot = torch.zeros(3, n, k, device="cuda", dtype=torch.int32)
        self.cfg_scale = torch.zeros(3, n, k, device="cuda", dtype=torch.float32)
        self.cfg_rel = torch.zeros(3, n, k, device="cuda", dtype=torch.float32)

    def step(self, x: torch.Tensor, hook: str) -> torch.Tensor:
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(self.layers):
            x = x + (x @ w_qkv)[:, : self.attn_out] @ w_o
            hidden = (x @ w_up)[:, : self.inter] @ w_down
            if hook == "op":
                torch.ops.hotwire.steer_(
                    hidden, None, self.token_cfg, self.layer_on, self.cfg_slot, self.cfg_scale, self.cfg_rel,
                    self.bank, self.inv_norm, layer,
                )
            elif hook == "empty":
                _empty_kernel[(x.shape[0],)](hidden)
            x = x + hidden
        return x

    def configure(self, steered: list[int], layer_on: list[int]) -> None:
        """Config 1 adds bank row 1 at ``steered`` layers; every token uses config 1 (none when empty)."""
        self.cfg_slot.zero_()
        self.cfg_scale.zero_()
        self.layer_on.zero_()
        for layer in steered:
            self.cfg_slot[1, layer, 0] = 1
            self.cfg_scale[1, layer, 0] = 0.5
        for layer in layer_on:
            self.layer_on[layer] = 1
        self.token_cfg.fill_(1 if steered else 0)


def capture(decoder: Decoder, tokens: int, hook: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.randn(tokens, decoder.hidden, device="cuda", dtype=torch.bfloat16) * 0.1
    for _ in range(2):  # compiles the Triton kernels and warms cuBLAS before capture
        decoder.step(x, hook)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.step(x, hook)
    return graph, x


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def run(shape: str, tokens_list: list[int], reps: int, replays: int, slots: int, k: int) -> dict:
    decoder = Decoder(shape, slots, k)
    n = decoder.n_layers
    middle = list(range(n // 2 - 4, n // 2 + 4))
    # name -> (graph hook, steered layers, layers switched on)
    variants = {
        "vanilla": ("none", [], []),
        "noop_kernel": ("empty", [], []),
        "idle": ("op", [], []),
        "steered_1layer": ("op", [n // 2], [n // 2]),
        "steered_1layer_all_on": ("op", [n // 2], list(range(n))),
        "steered_8layers": ("op", middle, middle),
        "steered_all": ("op", list(range(n)), list(range(n))),
    }
    results: dict = {}
    for tokens in tokens_list:
        graphs = {hook: capture(decoder, tokens, hook) for hook in ("none", "empty", "op")}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(reps):
            names = list(variants)
            names = names[rep % len(names):] + names[: rep % len(names)]  # rotate the order per repetition
            for name in names:
                hook, steered, on = variants[name]
                decoder.configure(steered, on)
                graph = graphs[hook][0]
                graph.replay()  # settle after the reconfiguration
                samples[name].append(time_replays(graph, replays))
        base = statistics.median(samples["vanilla"])
        rows = {}
        for name, values in samples.items():
            med = statistics.median(values)
            rows[name] = {
                "ms": round(med, 5),
                "min_ms": round(min(values), 5),
                "max_ms": round(max(values), 5),
                "delta_us": round((med - base) * 1000, 2),
                "delta_pct": round((med / base - 1) * 100, 3),
                "delta_us_per_layer": round((med - base) * 1000 / n, 3),
            }
        results[str(tokens)] = rows
        del graphs
        torch.cuda.synchronize()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--tokens", default="1,8,64,256", help="batch sizes (tokens per decode step)")
    parser.add_argument("--reps", type=int, default=7, help="round-robin repetitions (median reported)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per timing")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--max-stack", type=int, default=4)
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_op_graph needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    began = time.time()
    results = run(args.shape, tokens, args.reps, args.replays, args.slots, args.max_stack)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began)),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": args.shape,
        "reps": args.reps,
        "replays": args.replays,
        "slots": args.slots,
        "max_stack": args.max_stack,
        "seconds": round(time.time() - began, 1),
    }
    print(json.dumps(meta))
    for tokens, rows in results.items():
        print(f"\ntokens={tokens}: vanilla {rows['vanilla']['ms']:.4f} ms/step")
        print(f"{'variant':24} {'ms':>9} {'min..max':>19} {'Δ µs':>8} {'Δ %':>8} {'µs/layer':>9}")
        for name, r in rows.items():
            spread = f"{r['min_ms']:.4f}..{r['max_ms']:.4f}"
            print(f"{name:24} {r['ms']:9.4f} {spread:>19} {r['delta_us']:8.2f} {r['delta_pct']:8.3f} {r['delta_us_per_layer']:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
