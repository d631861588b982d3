"""The host benchmarks' set-ups do what their modes say (``bench_host_step``, ``bench_admission``,
``bench_gate_switch``)."""

from __future__ import annotations

import pytest

from benchmark_module import load

bench_host_step = load("bench_host_step")
bench_admission = load("bench_admission")
bench_gate_switch = load("bench_gate_switch")


@pytest.mark.parametrize("mode", bench_host_step.MODES)
def test_host_step_modes_do_what_they_say(mode):
    step = bench_host_step.decode_step(4, mode, "tiny")  # a warm-up step ran already
    w = step.worker
    before = set(w._line_of)
    for _ in range(6):
        step()
    steered, rows = set(w._line_of), len(w.config_rows)
    assert len(steered) == (0 if mode == "idle" else 4)
    assert (steered == before) == (mode in ("idle", "steered"))  # churn: requests finish and join every step
    assert rows == {"idle": 0, "steered": 1, "churn": 1, "churn-distinct": 4}[mode]  # one config row per config
    # steered tokens: every decoding request's one token; churn's newcomer is in its prompt (steered decode-only)
    assert int(w.buffers["token_cfg"].ne(0).sum()) == {"idle": 0, "steered": 4, "churn": 3, "churn-distinct": 3}[mode]


def test_admission_modes_hash_as_named(monkeypatch):
    c = bench_admission.controller("tiny")
    hashed = []
    original = bench_admission.Request.update_block_hashes
    monkeypatch.setattr(bench_admission.Request, "update_block_hashes", lambda self: hashed.append(1) or original(self))
    counts = {}
    for mode in ("plain", "salted late", "presalted"):
        hashed.clear()
        assert bench_admission.per_request_us(c, 32, mode, 1) > 0
        counts[mode] = len(hashed) / 5  # per request: timeit.repeat ran 5 times
    assert counts == {"plain": 1, "salted late": 2, "presalted": 1}


def test_gate_switch_moves_every_wrapper_between_its_two_sets():
    from hotwire_core.ops import ALL, GATE, IDLE

    wrappers = bench_gate_switch.captured_wrappers(3, 2)
    try:
        def variants() -> set:
            return {entry.cudagraph for w in wrappers for entry in w.concrete_cudagraph_entries.values()}

        assert variants() == {"steered"}
        GATE.kinds = IDLE
        assert variants() == {"idle"}
        assert bench_gate_switch.per_move_us(10) > 0 and variants() == {"steered"}
    finally:
        for w in wrappers:
            bench_gate_switch.cuda_graph.CUDAGraphWrapper._all_instances.discard(w)
        GATE.split, GATE.kinds = False, ALL
