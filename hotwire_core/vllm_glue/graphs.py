"""Graph variants (see ``ops.Gate``): every CUDA graph is captured once for each of ``GATE.variants`` (idle: no
hotwire op; steering alone; ...; ``ALL``), and a step replays the set of the variant the gate names. V1 and
piecewise graphs live in ``CUDAGraphWrapper`` (``vllm.compilation.cuda_graph``), V2's FULL graphs in its
``CudaGraphManager``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..ops import ALL, GATE, IDLE, kinds_name
from .patching import wrap

__all__ = ["capture_variants", "capturing", "graph_set_counts", "patch_cuda_graph_wrapper", "patch_v2_cudagraphs",
           "set_gate"]

_V2_VARIANT_GRAPHS = "_hotwire_variant_graphs"  # the V2 model manager's attribute: variant -> its FULL graphs


def set_gate(steering: Any, scheduler_output: Any) -> None:
    # A step that schedules nothing (it only frees finished requests) runs no forward: the gate stays put, so
    # that the graph sets are not swapped out and back around it.
    if GATE.split and scheduler_output.num_scheduled_tokens:
        GATE.kinds = GATE.covering(steering.step_kinds(scheduler_output.num_scheduled_tokens))


@contextmanager
def capturing(variant: int) -> Iterator[None]:
    GATE.kinds = variant
    if GRAPH_SETS is not None:
        # Even if the gate named this variant already (a dummy step closes it): captures must land in the
        # variant's bare dicts, not in the sets that serve its steps (those may be completed with ALL's graphs).
        GRAPH_SETS.put_in_place(variant, capturing=True)
    try:
        yield
    finally:
        GATE.kinds = ALL


def capture_variants(original: Callable) -> Callable:
    """Capture (and warm up) every variant but ``ALL`` first, then ``ALL``: until ``ALL``'s graph exists, a step
    of another variant must find no graph to fall back on (see ``_GraphSets``)."""

    def capture(self, *args, **kwargs):
        if GATE.split:
            for variant in GATE.variants[:-1]:
                with capturing(variant):
                    original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return capture


class _WrapperSets:
    """One wrapper's graph sets: ``full`` (vLLM's own entries dict: ``ALL``), ``own`` (each other variant's
    graphs), and the dicts steps of a variant are served from: its own completed with graphs captured only for
    ``ALL``."""

    __slots__ = ("full", "own", "serving", "_sizes")

    def __init__(self, full: dict):
        self.full = full
        self.own: dict[int, dict] = {}
        self.serving: dict[int, dict] = {}
        self._sizes: dict[int, tuple[int, int]] = {}

    def holds(self, entries: dict) -> bool:
        return entries is self.full or any(entries is d for d in (*self.own.values(), *self.serving.values()))

    def captured(self, variant: int) -> dict:
        return self.full if variant == ALL else self.own.setdefault(variant, {})

    def for_steps(self, variant: int) -> dict:
        if variant == ALL:
            return self.full
        own = self.captured(variant)
        sizes = (len(self.full), len(own))
        if sizes != self._sizes.get(variant):  # graphs are captured at startup only; ``clear`` resets this
            missing = self.full.keys() - own.keys()
            self.serving[variant] = {**own, **{d: self.full[d] for d in missing}} if missing else own
            self._sizes[variant] = sizes
        return self.serving[variant]

    def clear(self) -> None:
        for entries in (self.full, *self.own.values(), *self.serving.values()):
            entries.clear()
        self._sizes.clear()


class _GraphSets:
    """The graph sets of every ``CUDAGraphWrapper`` (the V1 FULL graph, every piecewise graph) in this process.
    When the gate moves, each wrapper gets the set of the variant the gate names as its
    ``concrete_cudagraph_entries``, so a graph replay costs hotwire nothing.

    A step may replay a graph captured only for ``ALL`` (e.g. a drafter's, captured outside hotwire's capture
    hook): ``ALL``'s graphs serve every step correctly, the reverse never happens. While capturing a variant, a
    wrapper gets that variant's bare dict, so that new graphs land there."""

    def __init__(self, wrapper_class: type):
        self._instances = wrapper_class._all_instances  # vLLM's WeakSet of every wrapper in this process

    @staticmethod
    def sets_of(wrapper: Any) -> _WrapperSets:
        own = wrapper.__dict__
        current, sets = own["concrete_cudagraph_entries"], own.get("_hotwire_sets")
        if sets is None or not sets.holds(current):
            # First sight, or vLLM put in a new dict to drop its graphs (elastic EP): every set starts over.
            sets = own["_hotwire_sets"] = _WrapperSets(current)
        return sets

    def put_in_place(self, variant: int, capturing: bool = False) -> None:
        for wrapper in list(self._instances):
            sets = self.sets_of(wrapper)
            wrapper.concrete_cudagraph_entries = sets.captured(variant) if capturing else sets.for_steps(variant)

    def count_into(self, counts: dict) -> None:
        """Add the wrappers holding idle graphs to ``counts`` (see ``graph_set_counts``)."""
        for wrapper in list(self._instances):
            sets = wrapper.__dict__.get("_hotwire_sets")
            if sets is None or not sets.own.get(IDLE):
                continue
            counts["holders"] += 1
            in_place = wrapper.concrete_cudagraph_entries
            counts["serving_idle"] += in_place is sets.own[IDLE] or in_place is sets.serving.get(IDLE)
            for variant, entries in ((ALL, sets.full), *sets.own.items()):
                name = kinds_name(variant)
                counts["graphs"][name] = counts["graphs"].get(name, 0) + sum(
                    e.cudagraph is not None for e in entries.values())


GRAPH_SETS: _GraphSets | None = None


def patch_cuda_graph_wrapper(module: Any) -> None:
    global GRAPH_SETS
    GRAPH_SETS = _GraphSets(module.CUDAGraphWrapper)
    GATE.on_change = GRAPH_SETS.put_in_place

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if GATE.kinds != ALL:
                # Made while another variant is captured (vLLM compiles inside the first capture pass after elastic
                # EP resets its compiled graphs): what it captures now is that variant's, and must not become ALL's.
                self.concrete_cudagraph_entries = _GraphSets.sets_of(self).captured(GATE.kinds)

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
    """V2 keeps FULL graphs in ``CudaGraphManager.graphs`` (``ALL``'s): the model's manager (not the speculators',
    whose drafter has no hotwire op) gets a dict per other variant, in place while the gate names it."""

    @contextmanager
    def variant_graphs(manager: Any, variant: int) -> Iterator[None]:
        full = manager.graphs
        manager.graphs = manager.__dict__.setdefault(_V2_VARIANT_GRAPHS, {}).setdefault(variant, {})
        try:
            yield
        finally:
            manager.graphs = full

    def make_capture(original):
        def capture(self, *args, **kwargs):
            if GATE.kinds == ALL:
                return original(self, *args, **kwargs)
            with variant_graphs(self, GATE.kinds):
                return original(self, *args, **kwargs)

        return capture_variants(capture)

    def make_run(original):
        def run_fullgraph(self, desc):
            variant = GATE.kinds
            if variant == ALL or desc not in getattr(self, _V2_VARIANT_GRAPHS, {}).get(variant, ()):
                return original(self, desc)
            with variant_graphs(self, variant):
                return original(self, desc)

        return run_fullgraph

    def make_release(original):
        def release_graphs(self):
            original(self)
            self.__dict__.pop(_V2_VARIANT_GRAPHS, None)

        return release_graphs

    def make_extrapolate(original):
        def _extrapolate_full_graph_memory(mem_samples, total_graphs):
            # The profiling capture samples the largest FULL graphs of every variant (ALL last), and vLLM takes
            # the second sample as every further graph's cost: there are that many times as many graphs.
            return original(mem_samples, len(GATE.variants) * total_graphs if GATE.split else total_graphs)

        return _extrapolate_full_graph_memory

    wrap(module.ModelCudaGraphManager, "capture", make_capture)
    wrap(module.CudaGraphManager, "run_fullgraph", make_run)
    if "release_graphs" in vars(module.CudaGraphManager):  # 0.32+: elastic EP drops the graphs to capture anew
        wrap(module.CudaGraphManager, "release_graphs", make_release)
    if hasattr(module, "_extrapolate_full_graph_memory"):  # 0.29+: graph memory is profiled before the KV cache is sized
        wrap(module, "_extrapolate_full_graph_memory", make_extrapolate)



def graph_set_counts(runner: Any) -> dict:
    """Which CUDA graph set this rank has in place now, for verify and the GPU tests: ``kinds`` (the gate's
    variant), ``holders`` (every ``CUDAGraphWrapper`` and V2 FULL-graph manager holding idle graphs), how many of
    them serve their idle set (``serving_idle``), and the graphs of each variant (``graphs``: ``ops.kinds_name`` ->
    count)."""
    counts: dict = {"holders": 0, "serving_idle": 0, "graphs": {}}
    if GRAPH_SETS is not None:
        GRAPH_SETS.count_into(counts)
    manager = getattr(runner, "cudagraph_manager", None)  # V2's FULL graphs (V1 has none)
    variants = getattr(manager, _V2_VARIANT_GRAPHS, {})
    if variants.get(IDLE):  # run_fullgraph replays the gate's variant's
        counts["holders"] += 1
        counts["serving_idle"] += GATE.kinds == IDLE
        for variant, entries in ((ALL, manager.graphs), *variants.items()):
            name = kinds_name(variant)
            counts["graphs"][name] = counts["graphs"].get(name, 0) + len(entries)
    return {"split": GATE.split, "variants": [kinds_name(v) for v in GATE.variants], "kinds": kinds_name(GATE.kinds),
            **counts}
