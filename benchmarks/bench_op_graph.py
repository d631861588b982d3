"""What the steering op costs inside a CUDA graph, without vLLM: a decoder-shaped chain of matmuls per layer
(Qwen3-4B sizes by default, so each layer streams its ~200 MB of weights through the L2 cache as a real decode step
does) with ``torch.ops.hotwire.steer_`` after every layer, captured in one CUDA graph and replayed.

Variants, all in one process and measured round-robin: ``vanilla`` (no op), ``noop_kernel`` (an empty Triton
kernel per layer: the price of a graph node alone), ``idle`` (the op, no token steered: what one graph set costs
when nothing is steered), and every token steered at 1, 8 or all layers, with ``layer_on`` naming exactly the
steered layers (the default) or switched on everywhere (``_all_on``: the cost when a live config elsewhere
switches on layers this batch does not steer). ``_pdl`` variants launch the kernel as a programmatic dependent
launch (hotwire's default on compute capability 9.0+, ``HOTWIRE_PDL``); the others launch it plainly. Reports ms
per replay and the difference to ``vanilla`` per step and per hooked layer.

``--compiled`` swaps the bare matmul chain for layers shaped like vLLM's compiled decoder layer (see
``CompiledDecoder``) and adds ``torch_*`` variants: the same steering as torch ops (``HOTWIRE_IMPL=inductor``),
which Inductor may fuse into the next layer's norm kernel. It also reports how many kernels Inductor generated.

An experiment rides along (``steered_1layer_l2pin``): the same op graph captured on a stream whose access-policy
window marks ``token_cfg`` and ``layer_on`` (one allocation) as persisting in the L2 cache, so that the weights
streaming through L2 between two layers need not evict them and the op's one round of loads may hit L2 instead
of memory. hotwire does not do this; the variant measures whether it would pay. Where the driver refuses, the
variant is left out and ``meta.l2pin`` says why. Its 1 MiB L2 set-aside then stays for the rest of the run, for
every variant alike, and persisting lines are reset after each of its timings.

    python benchmarks/bench_op_graph.py [--tokens 1,8,64,256] [--compiled] [--out result.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from hotwire_core import ops

SHAPES = {
    # hidden, intermediate, q+kv projection width, attention output width, layers
    "qwen3-4b": (2560, 9728, 6144, 4096, 36),
    "qwen3-8b": (4096, 12288, 6144, 4096, 36),
}


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()


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
        # token_cfg and layer_on share one allocation, so that one L2 access-policy window covers both.
        self.routing = torch.zeros(4096 + n, device="cuda", dtype=torch.int32)
        self.token_cfg, self.layer_on = self.routing[:4096], self.routing[4096:]
        self.cfg_slot = torch.zeros(3, n, k, device="cuda", dtype=torch.int32)
        self.cfg_scale = torch.zeros(3, n, k, device="cuda", dtype=torch.float32)
        self.cfg_rel = torch.zeros(3, n, k, device="cuda", dtype=torch.float32)

    def step(self, x: torch.Tensor, hook: str) -> torch.Tensor:
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(self.layers):
            x = x + (x @ w_qkv)[:, : self.attn_out] @ w_o
            hidden = (x @ w_up)[:, : self.inter] @ w_down
            self.hook(hook, hidden, layer)
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

    def hook(self, hook: str, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Apply the variant's steering to ``hidden`` (in place, or returned for ``torch``)."""
        args = (self.token_cfg, self.layer_on, self.cfg_slot, self.cfg_scale, self.cfg_rel, self.bank, self.inv_norm, layer)
        if hook in ("op", "op_l2pin", "op_pdl"):
            torch.ops.hotwire.steer_(hidden, None, *args)
        elif hook in ("empty", "empty_pdl"):
            _empty_kernel[(hidden.shape[0],)](hidden, PDL=hook == "empty_pdl", launch_pdl=hook == "empty_pdl")
        elif hook == "torch":
            return ops.steer_torch(hidden, None, *args, use_norm=False)
        return hidden


def _rms_norm(x32: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM 0.25.1's native RMSNorm (``RMSNorm.forward_static``) on a float32 input."""
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + 1e-6)).to(torch.bfloat16) * weight


class CompiledDecoder(Decoder):
    """The same weights in a step shaped like vLLM's compiled decoder layer (fused residual-add + RMSNorm in torch
    ops, SiLU-and-mul, the hook on the MLP output), compiled by Inductor. Unlike vLLM, which compiles one graph
    with a dynamic token count, each token count gets its own static-shape compile here (an imitation, not
    vLLM's code). ``torch`` (``ops.steer_torch``, i.e. ``HOTWIRE_IMPL=inductor``) can fuse into the next layer's
    norm."""

    def __init__(self, shape: str, slots: int, k: int):
        super().__init__(shape, slots, k)
        self.norms = torch.ones(self.n_layers, 2, self.hidden, device="cuda", dtype=torch.bfloat16)
        self.compiled: dict[str, object] = {}
        self.kernels: dict[str, dict] = {}

    def eager_step(self, x: torch.Tensor, hook: str) -> torch.Tensor:
        hidden, residual = x, torch.zeros_like(x)
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(self.layers):
            x32 = hidden.float() + residual.float()
            residual = x32.to(torch.bfloat16)
            attn = (_rms_norm(x32, self.norms[layer, 0]) @ w_qkv)[:, : self.attn_out] @ w_o
            x32 = attn.float() + residual.float()
            residual = x32.to(torch.bfloat16)
            gate_up = _rms_norm(x32, self.norms[layer, 1]) @ w_up
            hidden = (torch.nn.functional.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]) @ w_down
            hidden = self.hook(hook, hidden, layer)
        return _rms_norm(hidden.float() + residual.float(), self.norms[0, 0])

    def step(self, x: torch.Tensor, hook: str) -> torch.Tensor:
        # One compile per token count (static shapes), shared by op and op_pdl: the op reads ops.PDL per launch.
        key = ("op" if hook == "op_pdl" else hook, x.shape[0])
        if key not in self.compiled:
            from torch._inductor.utils import run_and_get_code

            # Every compile here is of the same lambda: lift Dynamo's per-code-object limit (8) over them.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            fn = torch.compile(lambda t, _hook=key[0]: self.eager_step(t, _hook), fullgraph=True, dynamic=False)
            _, code = run_and_get_code(fn, x)
            text = "\n".join(code)
            self.kernels[f"{key[0]}@{key[1]}"] = {
                "triton_kernels": text.count("@triton.jit"),
                "extern_mm": text.count("extern_kernels.mm"),
                # text matches: 2 per hooked layer in benchmarks/results/2026-11-30_h200x2_9e8170e
                "hotwire_op_mentions": text.count("hotwire.steer_"),
            }
            self.compiled[key] = fn
        return self.compiled[key](x)



class _AccessPolicyWindow(ctypes.Structure):
    """CUDA driver API ``CUaccessPolicyWindow``."""

    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class _LaunchAttributeValue(ctypes.Union):
    """CUDA driver API ``CUlaunchAttributeValue`` (64 bytes), as ``cuStreamSetAttribute`` takes it."""

    _fields_ = [("access_policy_window", _AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_CU_ACCESS_PROPERTY_NORMAL, _CU_ACCESS_PROPERTY_PERSISTING = 0, 2


class L2Pin:
    """Persisting L2 lines through the CUDA driver API (``libcuda``, always present where CUDA runs)."""

    def __init__(self) -> None:
        self.driver = ctypes.CDLL("libcuda.so.1")

    def _check(self, what: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned CUresult {status}")

    def pin(self, stream: torch.cuda.Stream, tensor: torch.Tensor) -> None:
        """Reserve 1 MiB of L2 for persisting lines and mark ``tensor`` persisting for kernels launched on (or
        captured from) ``stream``; RuntimeError with the driver's code when refused."""
        limit = ctypes.c_size_t(1 << 20)
        self._check("cuCtxSetLimit", self.driver.cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE), limit))
        value = _LaunchAttributeValue()
        value.access_policy_window = _AccessPolicyWindow(
            tensor.data_ptr(), tensor.numel() * tensor.element_size(), 1.0,
            _CU_ACCESS_PROPERTY_PERSISTING, _CU_ACCESS_PROPERTY_NORMAL,
        )
        attribute = ctypes.c_int(_CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW)
        status = self.driver.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), attribute, ctypes.byref(value))
        self._check("cuStreamSetAttribute", status)

    def reset(self) -> None:
        """Turn every persisting line back to normal, so that the pinned variant leaves nothing behind for the
        variants measured after it."""
        torch.cuda.synchronize()
        self._check("cuCtxResetPersistingL2Cache", self.driver.cuCtxResetPersistingL2Cache())


def capture(
    decoder: Decoder, tokens: int, hook: str, l2: L2Pin | None = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.randn(tokens, decoder.hidden, device="cuda", dtype=torch.bfloat16) * 0.1
    ops.PDL = hook == "op_pdl"  # read by the op at every launch: during warm-up and capture here
    for _ in range(2):  # compiles the Triton kernels and warms cuBLAS before capture
        decoder.step(x, hook)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    if hook == "op_l2pin":
        assert l2 is not None
        l2.pin(stream, decoder.routing)  # captured kernel nodes take the stream's access-policy window
    with torch.cuda.graph(graph, stream=stream):
        decoder.step(x, hook)
    ops.PDL = False
    return graph, x


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def variants_for(n: int, compiled: bool) -> dict[str, tuple[str, list[int], list[int]]]:
    """name -> (graph hook, steered layers, layers switched on)."""
    middle, every, one = list(range(n // 2 - 4, n // 2 + 4)), list(range(n)), [n // 2]
    if compiled:
        return {
            "vanilla": ("none", [], []),
            "idle": ("op", [], []),
            "steered_1layer": ("op", one, one),
            "steered_1layer_pdl": ("op_pdl", one, one),
            "torch_idle": ("torch", [], []),
            "torch_steered_1layer": ("torch", one, one),
            "torch_steered_all": ("torch", every, every),
        }
    return {
        "vanilla": ("none", [], []),
        "noop_kernel": ("empty", [], []),
        "noop_kernel_pdl": ("empty_pdl", [], []),
        "idle": ("op", [], []),
        "idle_pdl": ("op_pdl", [], []),
        "steered_1layer": ("op", one, one),
        "steered_1layer_pdl": ("op_pdl", one, one),
        "steered_1layer_all_on": ("op", one, every),
        "steered_8layers": ("op", middle, middle),
        "steered_all": ("op", every, every),
        "steered_1layer_l2pin": ("op_l2pin", one, one),
    }


def run(
    shape: str, tokens_list: list[int], reps: int, replays: int, slots: int, k: int, compiled: bool
) -> tuple[dict, str, dict]:
    """Results per token count, what became of the L2 experiment ("measured" or why not), and (compiled mode)
    the kernels Inductor generated per hook and token count."""
    decoder = (CompiledDecoder if compiled else Decoder)(shape, slots, k)
    n = decoder.n_layers
    variants = variants_for(n, compiled)
    results: dict = {}
    l2: L2Pin | None = None
    l2_note = "measured" if "steered_1layer_l2pin" in variants else "not in this mode"
    for tokens in tokens_list:
        hooks = sorted({hook for hook, _, _ in variants.values()} - {"op_l2pin"})
        graphs = {hook: capture(decoder, tokens, hook) for hook in hooks}
        if "steered_1layer_l2pin" in variants:
            try:
                l2 = l2 or L2Pin()
                graphs["op_l2pin"] = capture(decoder, tokens, "op_l2pin", l2)
                l2.reset()
            except (OSError, RuntimeError) as exc:
                l2_note = f"left out: {type(exc).__name__}: {exc}"
                del variants["steered_1layer_l2pin"]
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
                if hook == "op_l2pin":
                    l2.reset()
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
    return results, l2_note, getattr(decoder, "kernels", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--tokens", default="1,8,64,256", help="batch sizes (tokens per decode step)")
    parser.add_argument("--reps", type=int, default=7, help="round-robin repetitions (median reported)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per timing")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--max-stack", type=int, default=4)
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM-shaped layers compiled by Inductor; adds the torch formulation (HOTWIRE_IMPL=inductor)")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_op_graph needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    began = time.time()
    results, l2_note, kernels = run(args.shape, tokens, args.reps, args.replays, args.slots, args.max_stack, args.compiled)
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
        "compiled": args.compiled,
        "l2pin": l2_note,
        "kernels": kernels,
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
