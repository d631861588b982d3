"""Idle graph variants (see ``ops.Gate``): every CUDA graph is captured twice, gate closed (idle: the op is a no-op
no request steers) and open (steered), and a step replays the set the gate names. V1 and piecewise graphs live in
``CUDAGraphWrapper`` (``vllm.compilation.cuda_graph``), V2's FULL graphs in its ``CudaGraphManager``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..ops import GATE
from .patching import wrap

__all__ = ["capture_both_variants", "gate_closed", "graph_set_counts", "patch_cuda_graph_wrapper",
           "patch_v2_cudagraphs", "set_gate"]

_V2_IDLE_GRAPHS = "_hotwire_idle_graphs"  # the V2 model manager's attribute holding its idle FULL graphs


def set_gate(steering: Any, scheduler_output: Any) -> None:
    # A step that schedules nothing (it only frees finished requests) runs no forward: the gate stays put, so
    # that the graph sets are not swapped out and back around it.
    if GATE.split and scheduler_output.num_scheduled_tokens:
        GATE.open = steering.steers_any(scheduler_output.num_scheduled_tokens)


@contextmanager
def gate_closed() -> Iterator[None]:
    GATE.open = False
    if GRAPH_SETS is not None:
        # Even if a dummy step closed the gate already: captures must land in the bare idle dicts, not in the
        # sets that serve unsteered steps (those may be completed with steered graphs).
        GRAPH_SETS.put_in_place(False, capturing=True)
    try:
        yield
    finally:
        GATE.open = True


def capture_both_variants(original: Callable) -> Callable:
    """Capture (and warm up) the idle variant first, then the steered one: until the steered variant exists,
    a closed gate must find no graph to fall back on (see ``_GraphSets``)."""

    def capture(self, *args, **kwargs):
        if GATE.split:
            with gate_closed():
                original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return capture


class _WrapperSets:
    """One wrapper's two graph sets: ``steered`` (vLLM's own entries dict) and ``idle``, plus the dict it serves
    unsteered steps from: the idle set completed with graphs captured only steered."""

    __slots__ = ("steered", "idle", "serving_idle", "_sizes")

    def __init__(self, steered: dict):
        self.steered, self.idle = steered, {}
        self.serving_idle: dict = self.idle
        self._sizes: tuple[int, int] | None = None

    def holds(self, entries: dict) -> bool:
        return entries is self.steered or entries is self.idle or entries is self.serving_idle

    def for_idle_steps(self) -> dict:
        sizes = (len(self.steered), len(self.idle))
        if sizes != self._sizes:  # graphs are captured at startup only; ``clear`` resets this
            missing = self.steered.keys() - self.idle.keys()
            self.serving_idle = {**self.idle, **{d: self.steered[d] for d in missing}} if missing else self.idle
            self._sizes = sizes
        return self.serving_idle

    def clear(self) -> None:
        for entries in (self.steered, self.idle, self.serving_idle):
            entries.clear()
        self._sizes = None


class _GraphSets:
    """The two graph sets of every ``CUDAGraphWrapper`` (the V1 FULL graph, every piecewise graph) in this
    process. When the gate moves, each wrapper gets the set the gate names as its ``concrete_cudagraph_entries``,
    so a graph replay costs hotwire nothing.

    Unsteered steps may replay a graph captured only steered (e.g. a drafter's, captured outside hotwire's
    capture hook): steered graphs serve unsteered steps correctly, the reverse never happens. While capturing
    with the gate closed, a wrapper gets its bare idle dict, so that new graphs land there."""

    def __init__(self, wrapper_class: type):
        self._instances = wrapper_class._all_instances  # vLLM's WeakSet of every wrapper in this process

    @staticmethod
    def sets_of(wrapper: Any) -> _WrapperSets:
        own = wrapper.__dict__
        current, sets = own["concrete_cudagraph_entries"], own.get("_hotwire_sets")
        if sets is None or not sets.holds(current):
            # First sight, or vLLM put in a new dict to drop its graphs (elastic EP): both sets start over.
            sets = own["_hotwire_sets"] = _WrapperSets(current)
        return sets

    def put_in_place(self, gate_open: bool, capturing: bool = False) -> None:
        for wrapper in list(self._instances):
            sets = self.sets_of(wrapper)
            if gate_open:
                wrapper.concrete_cudagraph_entries = sets.steered
            else:
                wrapper.concrete_cudagraph_entries = sets.idle if capturing else sets.for_idle_steps()

    def count_into(self, counts: dict[str, int]) -> None:
        """Add the wrappers holding idle graphs to ``counts`` (see ``hotwire_graph_sets``)."""
        for wrapper in list(self._instances):
            sets = wrapper.__dict__.get("_hotwire_sets")
            if sets is None or not sets.idle:
                continue
            counts["holders"] += 1
            counts["serving_idle"] += wrapper.concrete_cudagraph_entries is not sets.steered
            counts["idle_graphs"] += sum(e.cudagraph is not None for e in sets.idle.values())
            counts["steered_graphs"] += sum(e.cudagraph is not None for e in sets.steered.values())


GRAPH_SETS: _GraphSets | None = None


def patch_cuda_graph_wrapper(module: Any) -> None:
    global GRAPH_SETS
    GRAPH_SETS = _GraphSets(module.CUDAGraphWrapper)
    GATE.on_change = GRAPH_SETS.put_in_place

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if not GATE.open:
                # Made while the gate is closed (vLLM compiles inside a capture pass after elastic EP resets its
                # compiled graphs): what it captures now is idle, and must not become its steered set.
                self.concrete_cudagraph_entries = _GraphSets.sets_of(self).idle

        return __init__

    def make_clear(original):
        def clear_graphs(self):
            original(self)
            if "_hotwire_sets" in self.__dict__:
                self._hotwire_sets.clear()

        return clear_graphs

    wrap(module.CUDAGraphWrapper, "__init__", make_init)
    wrap(module.CUDAGraphWrapper, "clear_graphs", make_clear)


def patch_v2_cudagraphs(module: Any) -> None:
    """V2 keeps FULL graphs in ``CudaGraphManager.graphs``: the model's manager (not the speculators', whose
    drafter has no hotwire op) gets a second dict for the idle variant, in place while the gate is closed."""

    @contextmanager
    def idle_graphs(manager: Any) -> Iterator[None]:
        steered, manager.graphs = manager.graphs, manager.__dict__.setdefault(_V2_IDLE_GRAPHS, {})
        try:
            yield
        finally:
            manager.graphs = steered

    def make_capture(original):
        def capture(self, *args, **kwargs):
            if GATE.open:
                return original(self, *args, **kwargs)
            with idle_graphs(self):
                return original(self, *args, **kwargs)

        return capture_both_variants(capture)

    def make_run(original):
        def run_fullgraph(self, desc):
            if GATE.open or desc not in getattr(self, _V2_IDLE_GRAPHS, {}):
                return original(self, desc)
            with idle_graphs(self):
                return original(self, desc)

        return run_fullgraph

    def make_release(original):
        def release_graphs(self):
            original(self)
            self.__dict__.pop(_V2_IDLE_GRAPHS, None)

        return release_graphs

    def make_extrapolate(original):
        def _extrapolate_full_graph_memory(mem_samples, total_graphs):
            # The profiling capture samples the largest FULL graphs of both variants (idle first), and vLLM takes
            # the second sample as every further graph's cost: with two sets there are twice as many graphs.
            return original(mem_samples, 2 * total_graphs if GATE.split else total_graphs)

        return _extrapolate_full_graph_memory

    wrap(module.ModelCudaGraphManager, "capture", make_capture)
    wrap(module.CudaGraphManager, "run_fullgraph", make_run)
    if "release_graphs" in vars(module.CudaGraphManager):  # 0.32+: elastic EP drops the graphs to capture anew
        wrap(module.CudaGraphManager, "release_graphs", make_release)
    if hasattr(module, "_extrapolate_full_graph_memory"):  # 0.29+: graph memory is profiled before the KV cache is sized
        wrap(module, "_extrapolate_full_graph_memory", make_extrapolate)



def graph_set_counts(runner: Any) -> dict:
    """Which CUDA graph set this rank has in place now, for verify and the GPU tests: ``holders`` (every
    ``CUDAGraphWrapper`` and V2 FULL-graph manager holding idle graphs), how many of them serve their idle set
    (``serving_idle``), and the graphs in each set."""
    counts = dict.fromkeys(("holders", "serving_idle", "idle_graphs", "steered_graphs"), 0)
    if GRAPH_SETS is not None:
        GRAPH_SETS.count_into(counts)
    manager = getattr(runner, "cudagraph_manager", None)  # V2's FULL graphs (V1 has none)
    idle_full = getattr(manager, _V2_IDLE_GRAPHS, None)
    if idle_full:  # run_fullgraph replays them whenever the gate is closed
        counts["holders"] += 1
        counts["serving_idle"] += not GATE.open
        counts["idle_graphs"] += len(idle_full)
        counts["steered_graphs"] += len(manager.graphs)
    return {"split": GATE.split, "gate_open": GATE.open, **counts}
