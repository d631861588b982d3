"""Graph variants (``ops.GATE`` + ``vllm_glue``): which graph set vLLM's own wrapper and V2 manager replay.

CUDA graphs cannot be captured on the CPU, so these drive the real ``CUDAGraphWrapper.__call__`` (runtime mode
NONE, which runs the wrapped callable and captures nothing) and the real ``CudaGraphManager.run_fullgraph`` with
stand-in graphs; the glue is applied to test subclasses, so vLLM's classes stay untouched for other tests. On
the GPU the same paths capture and replay for real (``tests/integration`` under ``benchmarks/gpu_checks.sh``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.compilation import cuda_graph  # noqa: E402
from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.forward_context import BatchDescriptor, set_forward_context  # noqa: E402
from vllm.v1.worker.gpu import cudagraph_utils  # noqa: E402

from hotwire_core.vllm_glue import graphs, patching, runners, workers  # noqa: E402
from hotwire_core.ops import ALL, GATE, IDLE, READ, STEER  # noqa: E402


@pytest.fixture(autouse=True)
def split_gate():
    GATE.configure(True, read=False, capture=False)
    GATE.kinds = ALL
    yield
    GATE.configure(False, read=False, capture=False)
    GATE.kinds = ALL


class Wrapper(cuda_graph.CUDAGraphWrapper):
    """vLLM's wrapper without its constructor (which needs a CUDA graph pool); it joins vLLM's set of wrappers."""

    clear_graphs = cuda_graph.CUDAGraphWrapper.clear_graphs

    def __init__(self):
        self.runnable = lambda: "ran"
        self.runtime_mode = CUDAGraphMode.FULL
        self.concrete_cudagraph_entries = {}
        cuda_graph.CUDAGraphWrapper._all_instances.add(self)


graphs.patch_cuda_graph_wrapper(SimpleNamespace(CUDAGraphWrapper=Wrapper))

CONFIG = VllmConfig()
DESC, OTHER = BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True), BatchDescriptor(num_tokens=16)


def entry(name: str) -> SimpleNamespace:
    return SimpleNamespace(cudagraph=name)


NAMES = {IDLE: "idle graph", ALL: "steered graph", STEER: "steer graph", READ: "read graph",
         STEER | READ: "steer+read graph"}


def captured(kinds: int) -> Wrapper:
    """A wrapper with DESC captured in every variant (ALL last, as hotwire's capture hook does)."""
    w = Wrapper()
    for variant in GATE.variants[:-1]:
        with graphs.capturing(variant):
            w.concrete_cudagraph_entries[DESC] = entry(NAMES[variant])
    w.concrete_cudagraph_entries[DESC] = entry("steered graph")
    GATE.kinds = kinds
    return w


def graph(w: Wrapper, desc: BatchDescriptor = DESC) -> str:
    """The graph vLLM's ``__call__`` would replay for ``desc``: it looks in ``concrete_cudagraph_entries``."""
    return w.concrete_cudagraph_entries[desc].cudagraph


def test_the_gate_puts_each_wrappers_set_in_place_when_it_moves():
    w = captured(ALL)
    assert graph(w) == "steered graph"
    GATE.kinds = IDLE
    assert graph(w) == "idle graph"
    GATE.kinds = ALL
    assert graph(w) == "steered graph"


def test_with_read_and_capture_compiled_in_each_variant_replays_its_own_graphs():
    """Steering alone, reading alone and both get graphs without the ops they do not need; capturing gets ALL's."""
    GATE.configure(True, read=True, capture=True)
    w = captured(ALL)
    for needed, replayed in ((STEER, "steer graph"), (READ, "read graph"), (STEER | READ, "steer+read graph"),
                             (IDLE, "idle graph"), (ALL, "steered graph"), (STEER | 4, "steered graph")):
        GATE.kinds = GATE.covering(needed)
        assert graph(w) == replayed, needed


def test_a_replay_runs_vllms_own_call_unwrapped():
    """Graph replays pay no hotwire hook: the set is swapped when the gate moves, not looked up per call."""
    assert not getattr(cuda_graph.CUDAGraphWrapper.__call__, "_hotwire", False)


def test_closed_gate_falls_back_to_a_steered_only_graph_never_the_reverse():
    w = captured(ALL)
    w.concrete_cudagraph_entries[OTHER] = entry("steered graph, captured outside hotwire's capture hook")
    GATE.kinds = IDLE
    assert graph(w, OTHER).startswith("steered graph")  # a steered graph serves an unsteered step
    assert graph(w) == "idle graph"
    GATE.kinds = ALL
    w._hotwire_sets.own[IDLE][BatchDescriptor(num_tokens=32)] = entry("idle graph only")
    assert BatchDescriptor(num_tokens=32) not in w.concrete_cudagraph_entries  # never an idle graph when steering


def test_capturing_closed_fills_the_bare_idle_set_even_if_the_gate_was_closed_already():
    """V2's dummy steps close the gate before capture. A wrapper then serves unsteered steps from its idle set
    completed with steered-only graphs; what a capture adds must still land in the bare idle set."""
    w = captured(ALL)
    w.concrete_cudagraph_entries[OTHER] = entry("steered graph only")
    GATE.kinds = IDLE
    new = BatchDescriptor(num_tokens=32)
    with graphs.capturing(IDLE):
        w.concrete_cudagraph_entries[new] = entry("new idle graph")
    w.concrete_cudagraph_entries[new] = entry("new steered graph")
    assert graph(w, new) == "new steered graph"
    GATE.kinds = IDLE
    assert graph(w, new) == "new idle graph" and graph(w, OTHER) == "steered graph only"


def test_gate_not_split_leaves_the_wrapper_alone():
    GATE.split = False
    w = Wrapper()
    steered = w.concrete_cudagraph_entries
    steering = SimpleNamespace(step_kinds=lambda scheduled: IDLE)
    graphs.set_gate(steering, SimpleNamespace(num_scheduled_tokens={"plain": 1}))
    assert w.concrete_cudagraph_entries is steered and "_hotwire_sets" not in w.__dict__


def test_a_replaced_entries_dict_starts_both_sets_over():
    """vLLM drops a wrapper's graphs by assigning a new dict (elastic EP): the idle set must go too."""
    w = captured(ALL)
    fresh = w.concrete_cudagraph_entries = {}
    GATE.kinds = IDLE
    assert w.concrete_cudagraph_entries == {} and w._hotwire_sets.full is fresh
    GATE.kinds = ALL
    assert w.concrete_cudagraph_entries is fresh


def test_clear_graphs_clears_every_set():
    w = captured(IDLE)
    w.clear_graphs()
    assert w._hotwire_sets.own[IDLE] == {} and w._hotwire_sets.full == {} and w.concrete_cudagraph_entries == {}
    with graphs.capturing(IDLE):  # captured again, with the same batch shapes
        w.concrete_cudagraph_entries[DESC] = entry("new idle graph")
    w.concrete_cudagraph_entries[DESC] = entry("new steered graph")
    GATE.kinds = IDLE
    assert graph(w) == "new idle graph"


def counts() -> dict:
    return graphs.graph_set_counts(runner=None)


def test_graph_set_counts():
    before = counts()
    w = captured(ALL)
    w.concrete_cudagraph_entries[OTHER] = entry("steered only")
    Wrapper().concrete_cudagraph_entries[DESC] = entry("no idle variant: not counted")
    after = counts()
    assert after["holders"] - before["holders"] == 1 and after["serving_idle"] == 0
    added = {name: n - before["graphs"].get(name, 0) for name, n in after["graphs"].items()}
    assert added == {"idle": 1, "all": 2}
    assert (after["variants"], after["kinds"]) == (["idle", "all"], "all")
    GATE.kinds = IDLE
    closed = counts()
    assert closed["serving_idle"] == closed["holders"] >= 1
    del w


def test_a_wrapper_made_during_a_closed_capture_keeps_its_idle_graphs_apart():
    """After elastic EP resets vLLM's compiled graphs, vLLM compiles (and makes new wrappers) inside the first,
    closed, capture pass: what such a wrapper captures there is idle and must not become its steered set."""
    with graphs.capturing(IDLE):
        w = Wrapper()
        w.concrete_cudagraph_entries[DESC] = entry("idle graph")
    assert w.concrete_cudagraph_entries == {}  # the steered pass finds nothing and captures its own
    w.concrete_cudagraph_entries[DESC] = entry("steered graph")
    GATE.kinds = IDLE
    assert graph(w) == "idle graph"


def test_a_failed_switch_leaves_the_gate_as_it_was():
    w = captured(ALL)
    switch = GATE.on_change

    def failing(kinds):
        raise RuntimeError("switch failed")

    GATE.on_change = failing
    try:
        with pytest.raises(RuntimeError):
            GATE.kinds = IDLE
    finally:
        GATE.on_change = switch
    assert GATE.kinds == ALL and graph(w) == "steered graph"
    GATE.kinds = IDLE  # the next move goes through
    assert graph(w) == "idle graph"


class Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class Manager(cudagraph_utils.CudaGraphManager):
    """vLLM's V2 manager without its constructor; run_fullgraph is vLLM's, capture records the gate."""

    run_fullgraph = cudagraph_utils.CudaGraphManager.run_fullgraph

    def __init__(self):
        self.graphs = {}
        self.gates_seen: list[int] = []

    def capture(self, desc):
        self.gates_seen.append(GATE.kinds)
        self.graphs[desc] = Graph()
        return {desc: "attention state"}


class ModelManager(Manager):
    """Stands for ``ModelCudaGraphManager`` (the target model's graphs); ``Manager`` for a speculator's."""

    def capture(self, desc):
        return super().capture(desc)


graphs.patch_v2_cudagraphs(SimpleNamespace(CudaGraphManager=Manager, ModelCudaGraphManager=ModelManager))
FULL = cudagraph_utils.BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8)


def test_v2_captures_every_variant_then_all_and_replays_by_gate():
    GATE.configure(True, read=True, capture=False)
    m = ModelManager()
    assert m.capture(FULL) == {FULL: "attention state"}
    assert m.gates_seen == [IDLE, STEER, READ, ALL] and GATE.kinds == ALL
    idle, steer, steered = (m._hotwire_variant_graphs[IDLE][FULL], m._hotwire_variant_graphs[STEER][FULL],
                            m.graphs[FULL])
    assert len({id(idle), id(steer), id(steered)}) == 3
    m.run_fullgraph(FULL)
    assert (idle.replays, steer.replays, steered.replays) == (0, 0, 1)
    GATE.kinds = IDLE
    m.run_fullgraph(FULL)
    GATE.kinds = STEER
    m.run_fullgraph(FULL)
    assert (idle.replays, steer.replays, steered.replays) == (1, 1, 1)
    assert m.graphs[FULL] is steered  # ALL's set is back in place after another variant's replay


@pytest.mark.parametrize("split", [False, True], ids=["not-split", "speculator"])
def test_v2_captures_once_without_split_and_for_speculators(split):
    """A speculator's drafter has no hotwire op: its manager captures once and always replays that graph."""
    GATE.split = split
    m = ModelManager() if not split else Manager()
    m.capture(FULL)
    assert m.gates_seen == [ALL] and not hasattr(m, "_hotwire_variant_graphs")
    GATE.kinds = IDLE
    m.run_fullgraph(FULL)
    assert m.graphs[FULL].replays == 1


@pytest.mark.skipif(not hasattr(cudagraph_utils, "_extrapolate_full_graph_memory"),
                    reason="this vLLM's V2 runner does not profile CUDA-graph memory (0.29+ does)")
@pytest.mark.parametrize("split", [True, False], ids=["split", "not-split"])
def test_v2_graph_memory_profile_counts_every_graph_set(split):
    """vLLM 0.29+ sizes the KV cache after estimating V2's FULL-graph memory from the largest graphs' captures:
    the first capture's cost plus the second's for every further graph. hotwire's capture samples every variant,
    so there are that many times as many graphs to count (here two: idle and ALL)."""
    module = SimpleNamespace(CudaGraphManager=Manager, ModelCudaGraphManager=ModelManager,
                             _extrapolate_full_graph_memory=cudagraph_utils._extrapolate_full_graph_memory)
    graphs.patch_v2_cudagraphs(module)
    GATE.split = split
    mib = 1 << 20
    samples = [300 * mib, 2 * mib, 1 * mib, 2 * mib]  # idle set's two largest graphs, then the steered set's
    graphs_per_set = 35
    expected = 300 * mib + ((2 * graphs_per_set if split else graphs_per_set) - 1) * 2 * mib
    assert module._extrapolate_full_graph_memory(samples, graphs_per_set) == expected


def test_v1_capture_hook_runs_every_variant_then_all():
    seen = []
    capture = graphs.capture_variants(lambda runner, desc: seen.append((desc, GATE.kinds)) or "done")
    assert capture(None, "d") == "done" and seen == [("d", IDLE), ("d", ALL)] and GATE.kinds == ALL
    GATE.configure(True, read=False, capture=True)
    seen.clear()
    capture(None, "d")
    assert seen == [("d", IDLE), ("d", STEER), ("d", ALL)]
    GATE.split = False
    seen.clear()
    capture(None, "d")
    assert seen == [("d", ALL)]


def test_gate_follows_the_scheduled_requests():
    """The runners' wrappers close the gate for a step with no steered request and open it otherwise."""
    import torch

    from hotwire_core.contract import BINDING_KEY
    from hotwire_core.runtime import WorkerSteering
    from hotwire_core.settings import Settings

    steering = WorkerSteering({}, 4, 8, torch.float32, torch.device("cpu"), 32, 3, Settings(6, 2, "op", None, None))
    steered = SimpleNamespace(req_id="s", prompt_token_ids=[1, 2, 3],
                              sampling_params=SimpleNamespace(extra_args={BINDING_KEY: {"p": [], "d": [(1, 1, 1.0, 0.0)]}}))
    steering.on_step(runners.step_of(SimpleNamespace(scheduled_new_reqs=[steered]), set()))
    graphs.set_gate(steering, SimpleNamespace(num_scheduled_tokens={"plain": 1}))
    assert GATE.kinds == IDLE
    graphs.set_gate(steering, SimpleNamespace(num_scheduled_tokens={"plain": 1, "s": 1}))
    assert GATE.kinds == ALL  # steering alone: the full set, when nothing else is compiled in
    graphs.set_gate(steering, SimpleNamespace(num_scheduled_tokens={}))  # frees finished requests only
    assert GATE.kinds == ALL
    GATE.split = False  # one graph set: the gate stays open whatever runs
    graphs.set_gate(steering, SimpleNamespace(num_scheduled_tokens={"plain": 1}))
    assert GATE.kinds == ALL


@pytest.mark.parametrize(
    "device,hip,capability,enabled,expected",
    [
        ("cpu", None, None, True, False),
        ("cuda", None, (9, 0), True, True),
        ("cuda", None, (10, 0), True, True),
        ("cuda", None, (8, 9), True, False),  # Ada and older have no programmatic dependent launch
        ("cuda", "6.4", (9, 4), True, False),  # ROCm calls its GPUs "cuda" too (MI300: 9.4)
        ("cuda", None, (9, 0), False, False),  # HOTWIRE_PDL=0
    ],
)
def test_pdl_only_on_nvidia_hopper_and_later(monkeypatch, device, hip, capability, enabled, expected):
    import torch

    from hotwire_core.settings import Settings

    monkeypatch.setattr(patching, "_SETTINGS", Settings(8, 4, "op", None, None, pdl=enabled))
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
    assert workers.pdl_possible(torch.device(device)) is expected


def test_log_lines_go_out_as_vllms_do():
    """In a fresh process whose vLLM loads its plugins (hotwire among them): hotwire's INFO lines print with
    vLLM's format and level (by Python's defaults they would be dropped)."""
    import os
    import subprocess
    import sys

    # vLLM 0.32+ sets its handler up when a process starts serving (configure_logging), which may come after the
    # plugins loaded; before 0.32 importing vllm.logger did.
    code = ("import logging, vllm.logger; from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "\nif hasattr(vllm.logger, 'configure_logging'):\n"
            "    from vllm.config.logging import LoggingConfig; vllm.logger.configure_logging(LoggingConfig())\n"
            "logging.getLogger('hotwire_core.runtime').info('hotwire: probe line'); "
            "logging.getLogger('hotwire_api.metrics').debug('hotwire: debug line')")
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    # importing vLLM and loading the plugins can take minutes on a loaded two-core machine
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr
    printed = [line for line in (out.stdout + out.stderr).splitlines() if "hotwire:" in line]
    assert len(printed) == 1 and "INFO" in printed[0] and printed[0].endswith("hotwire: probe line"), printed
