"""Host time of moving hotwire's gate (``ops.GATE``): every CUDA graph wrapper gets the graph set the gate names.

A step with no steered request replays the idle graphs (captured without hotwire's op), any other step the
steered ones. ``vllm_glue.graphs._GraphSets`` puts the right set in place when the gate opens or closes, not on every
graph replay, so a server pays this only when its batch goes from steered to unsteered or back. This times one
move on vLLM's own ``CUDAGraphWrapper`` class (instances made without CUDA: its constructor needs a graph pool),
each with both sets filled as hotwire's capture fills them.

    python benchmarks/bench_gate_switch.py --wrappers 38 --entries 51   # V1, 36 layers: 37 piecewise + 1 FULL
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import timeit
from types import SimpleNamespace

from vllm.compilation import cuda_graph
from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor

from hotwire_core.vllm_glue import graphs
from hotwire_core.ops import ALL, GATE, IDLE


def captured_wrappers(n_wrappers: int, n_entries: int) -> list[cuda_graph.CUDAGraphWrapper]:
    """``n_wrappers`` wrappers with ``n_entries`` batch shapes captured idle, then steered."""
    graphs.patch_cuda_graph_wrapper(cuda_graph)
    GATE.split = True
    wrappers = []
    for _ in range(n_wrappers):
        w = object.__new__(cuda_graph.CUDAGraphWrapper)
        w.runtime_mode, w.concrete_cudagraph_entries = CUDAGraphMode.PIECEWISE, {}
        cuda_graph.CUDAGraphWrapper._all_instances.add(w)
        wrappers.append(w)
    descs = [BatchDescriptor(num_tokens=8 * (i + 1)) for i in range(n_entries)]
    for variant in ("idle", "steered"):
        with graphs.capturing(IDLE) if variant == "idle" else contextlib.nullcontext():
            for w in wrappers:
                for desc in descs:
                    w.concrete_cudagraph_entries[desc] = SimpleNamespace(cudagraph=variant)
    return wrappers


def per_move_us(number: int) -> float:
    def close_and_open() -> None:
        GATE.kinds = IDLE
        GATE.kinds = ALL

    return statistics.median(timeit.repeat(close_and_open, number=number, repeat=5)) / number / 2 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrappers", default="38,74", help="comma-separated wrapper counts")
    parser.add_argument("--entries", type=int, default=51, help="batch shapes captured per wrapper")
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| wrappers | batch shapes each | µs per gate move |\n|---|---|---|")
    for n in (int(x) for x in args.wrappers.split(",")):
        wrappers = captured_wrappers(n, args.entries)
        assert {w.concrete_cudagraph_entries[next(iter(w.concrete_cudagraph_entries))].cudagraph for w in wrappers} == {"steered"}
        print(f"| {n} | {args.entries} | {per_move_us(args.number):.1f} |")
        for w in wrappers:
            cuda_graph.CUDAGraphWrapper._all_instances.discard(w)


if __name__ == "__main__":
    main()
