"""Readout's pure parts: the spec, the op (its CPU kernel, and its Triton kernel in Triton's interpreter), the worker's
per-step bookkeeping, and the result a reader gets. The engine end to end: tests/integration/test_readout.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from hotwire_core.contract import SteerItem
from hotwire_core.readout_op import read_torch
from hotwire_core.readout_results import ReadoutLost, readout_of
from hotwire_core.readout_spec import parse_readout
from hotwire_core.spec import SpecError
from triton_interpreter import check_in_interpreter

N_LAYERS, H, MAX_TOKENS, K = 4, 24, 16, 3


# -- the spec ---------------------------------------------------------------------------------------------------


def test_a_readout_parses_from_json_with_defaults():
    spec = parse_readout('{"probes": [{"id": "joy", "layer": 2}, {"id": "r", "layer": 0, "bias": -1}]}', 4)
    assert [(p.vector_id, p.layer, p.bias) for p in spec.probes] == [("joy", 2, 0.0), ("r", 0, -1.0)]
    assert spec.tokens == "generated" and not spec.reads_prompt and spec.tag is None
    assert parse_readout({"probes": {"id": "joy", "layer": 1}, "tokens": "all"}, 4).reads_prompt
    assert parse_readout(spec.to_json(), 4) == spec


@pytest.mark.parametrize("value, field", [
    ("{", "hotwire_readout"),
    ([], "hotwire_readout"),
    ({"probes": []}, "hotwire_readout.probes"),
    ({"probes": [{"id": "a", "layer": 1}] * 5}, "hotwire_readout.probes"),
    ({"probes": [{"id": "a", "layer": True}]}, "hotwire_readout.probes[0].layer"),
    ({"probes": [{"id": "a", "layer": [1, 2]}]}, "hotwire_readout.probes[0].layer"),
    ({"probes": [{"id": "../a", "layer": 1}]}, "hotwire_readout.probes[0].id"),
    ({"probes": [{"id": "a", "layer": 1, "bias": float("nan")}]}, "hotwire_readout.probes[0].bias"),
    ({"probes": [{"id": "a", "layer": 1, "scale": 2}]}, "hotwire_readout.probes[0].scale"),
    ({"probes": [{"id": "a", "layer": 1}], "tokens": "every"}, "hotwire_readout.tokens"),
    ({"probes": [{"id": "a", "layer": 1}], "when": 1}, "hotwire_readout.when"),
])
def test_a_bad_readout_names_its_field(value, field):
    with pytest.raises(SpecError) as info:
        parse_readout(value, 4)
    assert info.value.field == field


# -- the op -----------------------------------------------------------------------------------------------------


def _tables(g):
    bank = torch.randn(5, H, generator=g)
    bank[0] = 0  # slot 0: the bank's all-zero row
    read_slot = torch.zeros(3, N_LAYERS, K, dtype=torch.int32)
    read_slot[1, 1, 0], read_slot[1, 2, 1] = 3, 4  # row 1: probe 0 at layer 1, probe 1 at layer 2
    read_slot[2, 1, 0], read_slot[2, 1, 2] = 2, 3
    return bank, read_slot


def test_the_cpu_kernel_writes_the_read_tokens_only():
    from hotwire_core import readout_op
    from hotwire_core.ops import ALL, CAPTURE, GATE, IDLE, STEER

    g = torch.Generator().manual_seed(0)
    bank, read_slot = _tables(g)
    out = torch.full((N_LAYERS, MAX_TOKENS, K + 1), -7.0)
    saved = readout_op._OUT
    readout_op.set_output(out)
    try:
        x, r = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
        rows = torch.zeros(MAX_TOKENS, dtype=torch.int32)
        rows[:4] = torch.tensor([0, 1, 2, 0], dtype=torch.int32)
        torch.ops.hotwire.read_(x, r, rows, read_slot, bank, 1)
        torch.ops.hotwire.read_(x, r, rows, read_slot, bank, 3)  # no row has a probe at layer 3: nothing written
        stream = x + r
        torch.testing.assert_close(out[1, 1, 0], stream[1] @ bank[3])
        torch.testing.assert_close(out[1, 2, 2], stream[2] @ bank[3])
        torch.testing.assert_close(out[1, 2, 0], stream[2] @ bank[2])
        torch.testing.assert_close(out[1, 1, K], stream[1].norm())
        assert out[1, 1, 1] == 0  # probe 1 of row 1 reads layer 2, not 1
        assert (out[1, [0, 3]] == -7).all() and (out[[0, 2, 3]] == -7).all()  # unread tokens and layers untouched
        for kinds in (IDLE, STEER | CAPTURE):  # a gate without READ: nothing
            GATE.kinds = kinds
            torch.ops.hotwire.read_(x * 2, r, rows, read_slot, bank, 1)
            torch.testing.assert_close(out[1, 1, K], stream[1].norm())
    finally:
        GATE.kinds = ALL
        readout_op.set_output(saved)


def check_triton_against_torch(device: str, pdl: bool = False) -> None:
    """``read_triton_`` writes what ``read_torch`` computes for read tokens and leaves the others: with and without a
    partner, bf16 and float32 streams, a hidden size spanning several blocks, and K not a power of two. ``pdl``:
    launched as a programmatic dependent launch (CUDA, compute capability 9.0+)."""
    from hotwire_core import triton_readout

    g = torch.Generator().manual_seed(1)
    for dtype, with_other, block in ((torch.float32, True, None), (torch.bfloat16, False, 8), (torch.bfloat16, True, 8)):
        saved = triton_readout.MAX_BLOCK_H
        if block is not None:
            triton_readout.MAX_BLOCK_H = block
        try:
            bank, read_slot = _tables(g)
            bank = bank.to(dtype)
            n = 5
            target = torch.randn(n, H, generator=g).to(dtype)
            other = torch.randn(n, H, generator=g).to(dtype) if with_other else None
            rows = torch.zeros(MAX_TOKENS, dtype=torch.int32)
            rows[:n] = torch.tensor([1, 0, 2, 1, 0], dtype=torch.int32)
            want = torch.full((N_LAYERS, MAX_TOKENS, K + 1), -7.0)
            picked = rows[:n].nonzero().squeeze(1)
            want[1, picked] = read_torch(target[picked], None if other is None else other[picked], rows[picked],
                                         read_slot, bank, 1)
            ones = [0, 3]  # row 1 reads layer 2, row 2 does not
            want[2, ones] = read_torch(target[ones], None if other is None else other[ones], rows[ones], read_slot,
                                       bank, 2)
            got = torch.full((N_LAYERS, MAX_TOKENS, K + 1), -7.0, device=device)
            for layer in (1, 2):
                triton_readout.read_triton_(target.to(device), None if other is None else other.to(device),
                                            rows.to(device), read_slot.to(device), bank.to(device), got, layer,
                                            pdl=pdl)
            torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
        finally:
            triton_readout.MAX_BLOCK_H = saved


def test_triton_kernel_in_interpreter() -> None:
    check_in_interpreter(__file__, 'check_triton_against_torch("cpu")')


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_triton_kernel_compiled_on_a_gpu(pdl: bool) -> None:
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    check_triton_against_torch("cuda", pdl=pdl)


# -- the worker -------------------------------------------------------------------------------------------------


class _HostUploader:
    to_device = staticmethod(lambda t: t)
    copy_ = staticmethod(lambda dst, src: dst.copy_(src))


def _args(tag, tokens, layers=(1, 2)):
    probes = [{"name": f"p{k}@1:L{layer}", "layer": layer, "bias": 0.0, "norm": 1.0} for k, layer in enumerate(layers)]
    return {"tag": tag, "tokens": tokens, "probes": probes}


def _worker():
    from hotwire_core.readout_worker import WorkerReadout

    return WorkerReadout([0, 1, 2, 3], N_LAYERS, torch.device("cpu"), MAX_TOKENS, K, 4, _HostUploader())


def _forward(worker, positions_values):
    """What the op would write for the step's read tokens: value = 100 * row + position (dot), position (norm)."""
    for t in range(MAX_TOKENS):
        row = int(worker.token_read[t])
        if row:
            worker.out[:, t, :K] = 100 * row + positions_values[t]
            worker.out[:, t, K] = positions_values[t]


def test_the_worker_reads_the_asked_positions_across_chunks_and_keeps_the_latest():
    w = _worker()
    items = [SteerItem(1, 3, 0.0, 0.0), SteerItem(2, 4, 0.0, 0.0)]
    w.on_step([], [("a", 5, _args("ta", "all"), items), ("b", 5, _args("tb", "generated"), items)], {})
    assert w.read_slot[1, 1, 0] == 3 and w.read_slot[1, 2, 1] == 4
    # step 1: a's prompt positions 0-2 and b's 0-4 (b reads from position 4 on: the last prompt token)
    w.fill(["a", "b", "plain"], np.array([3, 5, 2]), np.array([0, 0, 0]), 10)
    assert w.token_read[:10].tolist() == [1, 1, 1, 0, 0, 0, 0, 2, 0, 0]
    _forward(w, [0, 1, 2, 0, 0, 0, 0, 4, 0, 0] + [0] * 6)
    # step 2: a's positions 3-4, b's 5; a position read again (3) keeps the latest value
    w.fill(["a", "b"], np.array([2, 1]), np.array([3, 5]), 3)
    _forward(w, [3, 4, 5] + [0] * 13)
    w.fill(["a"], np.array([1]), np.array([3]), 1)  # a recomputes position 3 (preempted)
    _forward(w, [3.5] + [0] * 15)
    w.on_step(["a", "b"], [], {})
    a = w.take(["ta"])["readouts"]["ta"]
    positions = np.frombuffer(a["positions"], np.int32)
    values = np.frombuffer(a["values"], np.float32).reshape(len(positions), 2, 2)
    assert positions.tolist() == [0, 1, 2, 3, 4]
    assert values[:, 0, 0].tolist() == [100, 101, 102, 103.5, 104] and values[:, 1, 1].tolist() == [0, 1, 2, 3.5, 4]
    b = w.take(["tb"])["readouts"]["tb"]
    assert np.frombuffer(b["positions"], np.int32).tolist() == [4, 5]
    assert w.take(["ta", "tb"])["readouts"] == {}  # each handed out once
    assert not w.clean  # token_read still holds the last step's rows
    w.fill(["plain"], np.array([1]), np.array([9]), 1)
    assert w.clean and not w.token_read.any() and sorted(w._free) == [1, 2, 3, 4]


def test_a_live_request_is_handed_out_when_asked_before_the_worker_hears_it_finished():
    w = _worker()
    w.on_step([], [("a", 2, _args("ta", "generated", (1,)), [SteerItem(1, 3, 0.0, 0.0)])], {})
    w.fill(["a"], np.array([2]), np.array([0]), 2)
    _forward(w, [0, 1] + [0] * 14)
    got = w.take(["ta"])["readouts"]["ta"]  # the last forward's values are flushed by the take itself
    assert np.frombuffer(got["positions"], np.int32).tolist() == [1]
    w.on_step(["a"], [], {})  # the finish arrives: nothing is kept for the tag again
    assert w.take(["ta"])["readouts"] == {} and not w.live


class _Event:
    """A device event as the worker uses it (``query``, ``synchronize``): a CPU has none, so copies arrive here only
    when the test says so, or when the worker waits for them."""

    def __init__(self):
        self.done = self.waited = self.blocked = False

    def query(self):
        return self.done

    def synchronize(self):
        self.blocked = self.blocked or not self.done  # a wait on the device, not on what has arrived
        self.waited = self.done = True


def _prefill_and_decode_with_events(monkeypatch):
    """Readers ``a`` and ``b`` (tags ``ta``, ``tb``) after a prefill and a decode step, with stand-in device events:
    the prefill's copy under way, the decode step's values not yet copied."""
    from hotwire_core import readout_worker

    events = []
    monkeypatch.setattr(readout_worker, "_record_event", lambda cuda: events.append(_Event()) or events[-1])
    w = _worker()
    items = [SteerItem(1, 3, 0.0, 0.0)]
    w.on_step([], [("a", 2, _args("ta", "generated", (1,)), items), ("b", 2, _args("tb", "generated", (1,)), items)], {})
    w.fill(["a", "b"], np.array([2, 2]), np.array([0, 0]), 4)
    _forward(w, [0, 1, 0, 1] + [0] * 12)
    w.fill(["a", "b"], np.array([1, 1]), np.array([2, 2]), 2)  # issues the prefill's copy: under way
    _forward(w, [2, 2] + [0] * 14)
    return w, events


def test_a_finished_reader_retires_without_waiting_for_copies_under_way(monkeypatch):
    """A step in which a reader finishes does not wait for the device: the reader keeps its row until the copies
    holding its values arrive (a later fill sees them), and only then is its readout kept; a take of a retiring
    reader waits for its copies alone."""
    w, events = _prefill_and_decode_with_events(monkeypatch)
    w.on_step(["a", "b"], [], {})  # issues the decode step's copy and retires both: no wait
    assert len(events) == 2 and not any(e.waited for e in events)
    assert not w.live and w.done.take(["ta", "tb"]) == {} and len(w._free) == 2 and not w.clean
    events[0].done = True
    w.fill(["plain"], np.array([1]), np.array([5]), 1)  # the first copy arrived; both readers' values span two
    assert w.done.kept == {} and len(w._free) == 2
    got = w.take(["ta"])["readouts"]["ta"]  # waits for the second copy, which holds a's last value
    assert events[1].waited and np.frombuffer(got["positions"], np.int32).tolist() == [1, 2]
    assert np.frombuffer(got["values"], np.float32).reshape(2, 1, 2)[:, 0, 0].tolist() == [101, 102]
    assert "tb" in w.done.kept and len(w._free) == 4  # b's copies arrived too: kept for its take, rows free
    w.fill(["plain"], np.array([1]), np.array([6]), 1)
    assert w.clean


def test_a_take_that_may_not_wait_says_pending_until_the_copies_arrive(monkeypatch):
    """``take(wait=False)``, as the API server asks under load: a reader whose last values are still on their way
    from the device (finished, or finished without the workers knowing yet) is handed out only once they arrived,
    and the take waits for no event meanwhile."""
    w, events = _prefill_and_decode_with_events(monkeypatch)
    w.on_step(["a"], [], {})  # a retires; b finished too, but the workers hear of it a step later
    for tag in ("ta", "tb"):
        assert w.take([tag], wait=False) == {"ok": True, "readouts": {}, "pending": True}
    assert len(events) == 2 and not any(e.waited for e in events)
    events[0].done = events[1].done = True
    got = {tag: w.take([tag], wait=False)["readouts"][tag] for tag in ("ta", "tb")}
    assert not any(e.blocked for e in events)
    for tag in ("ta", "tb"):
        assert np.frombuffer(got[tag]["positions"], np.int32).tolist() == [1, 2]
    assert w.take(["ta", "tb"], wait=False) == {"ok": True, "readouts": {}}  # handed out once


def test_a_reader_handed_out_early_is_not_waited_for_when_it_retires(monkeypatch):
    """A live reader handed out (the worker had not heard it finished) and then retired with a copy under way: a
    later take of its tag (a retry for another rank's values) has nothing to hand out and waits for no copy."""
    w, events = _prefill_and_decode_with_events(monkeypatch)
    assert w.take(["ta"], wait=False)["pending"]  # issues the decode step's copy
    for event in events:
        event.done = True
    assert "ta" in w.take(["ta"], wait=False)["readouts"]  # early: a is still live
    w.fill(["a"], np.array([1]), np.array([3]), 1)  # the engine ran a one more step
    _forward(w, [3] + [0] * 15)
    w.on_step(["a"], [], {})  # retires a, its last copy under way
    assert not events[-1].done
    assert w.take(["ta"], wait=False) == {"ok": True, "readouts": {}} and not any(e.blocked for e in events)


def test_a_new_reader_waits_for_retiring_rows_only_when_none_is_free(monkeypatch):
    from hotwire_core import readout_worker

    events = []
    monkeypatch.setattr(readout_worker, "_record_event", lambda cuda: events.append(_Event()) or events[-1])
    w = _worker()  # 4 rows
    items = [SteerItem(1, 3, 0.0, 0.0)]
    ids = ["a", "b", "c", "d"]
    w.on_step([], [(r, 2, _args(f"t{r}", "generated", (1,)), items) for r in ids], {})
    w.fill(ids, np.array([2] * 4), np.array([0] * 4), 8)
    _forward(w, [0, 1] * 4 + [0] * 8)
    w.on_step(ids, [("e", 2, _args("te", "generated", (1,)), items)], {})  # every row retiring: e waits for them
    assert events[0].waited and "e" in w.live and sorted(w.done.kept) == ["ta", "tb", "tc", "td"]


def test_a_rebind_rewrites_the_probe_rows():
    w = _worker()
    w.on_step([], [("a", 2, _args("ta", "all", (1,)), [SteerItem(1, 3, 0.0, 0.0)])], {})
    w.on_step([], [], {"a": {"p": [], "d": [], "r": [SteerItem(1, 7, 0.0, 0.0)]}})
    assert w.read_slot[1, 1, 0] == 7


# -- the result -------------------------------------------------------------------------------------------------


def _answer(tag, prompt_len, positions, values, held, tokens="all", layers=(1, 2)):
    args = _args(tag, tokens, layers)
    args["probes"][0]["bias"], args["probes"][0]["norm"] = 0.5, 2.0
    return {"ok": True, "readouts": {tag: {
        "args": args, "prompt_len": prompt_len, "held": held, "positions": np.array(positions, np.int32).tobytes(),
        "values": np.array(values, np.float32).tobytes()}}}


def test_the_result_splits_prompt_and_generated_and_merges_ranks():
    positions = [0, 1, 2, 3]
    rank0 = [[[1, 2], [np.nan, np.nan]], [[2, 2], [np.nan, np.nan]], [[3, 2], [np.nan, np.nan]], [[4, 0], [np.nan, np.nan]]]
    rank1 = [[[np.nan, np.nan], [5, 1]], [[np.nan, np.nan], [6, 1]], [[np.nan, np.nan], [7, 1]], [[np.nan, np.nan], [8, 1]]]
    answers = [_answer("t", 2, positions, rank0, [0]), _answer("t", 2, positions, rank1, [1])]
    got = readout_of(answers, "t", n_generated=3)
    first, second = got["probes"]
    assert first["probe"] == "p0@1:L1" and first["bias"] == 0.5
    assert first["prompt"] == {"score": [1.5, 2.5], "cosine": [0.25, 0.5]}
    assert first["generated"] == {"score": [2.5, 3.5, 4.5], "cosine": [0.5, 0.75, 0.0]}  # norm 0: cosine 0
    assert second["generated"]["score"] == [6.0, 7.0, 8.0]


def test_a_missing_position_is_an_error_not_a_short_answer():
    answers = [_answer("t", 2, [0, 1], [[[1, 1], [1, 1]], [[1, 1], [1, 1]]], [0, 1])]
    with pytest.raises(ReadoutLost, match="no value for position 2"):
        readout_of(answers, "t", n_generated=2)
    with pytest.raises(ReadoutLost, match="no worker returned it"):
        readout_of(answers, "other", n_generated=1)
    lost = {"ok": True, "readouts": {"t": {"error": "all 4 readout rows of this worker are in use"}}}
    with pytest.raises(ReadoutLost, match="rows of this worker"):
        readout_of([lost], "t", n_generated=1)


def test_a_peek_hands_out_settled_generated_positions_and_leaves_them_in_place():
    """``peek``: a stream's values so far, from a generated token on, only where vLLM counts the position computed
    for good (a speculative step's drafts wait for the next step); the final take still has every value."""
    w = _worker()
    w.on_step([], [("a", 3, _args("ta", "generated", (1,)), [SteerItem(1, 3, 0.0, 0.0)])], {})
    w.fill(["a"], np.array([3]), np.array([0]), 3)  # prefill: position 2 (the last prompt token) is read
    _forward(w, [0, 1, 2] + [0] * 13)
    assert w.peek({"ta": 0})["readouts"]["ta"]["positions"] == b""  # nothing settled yet
    w.fill(["a"], np.array([3]), np.array([3]), 3)  # a decode step with 2 drafts: positions 3-5
    _forward(w, [3, 4, 5] + [0] * 13)
    peeked = w.peek({"ta": 0})["readouts"]["ta"]
    assert np.frombuffer(peeked["positions"], np.int32).tolist() == [2]  # 3-5 are not settled until the next step
    w.fill(["a"], np.array([2]), np.array([5]), 2)  # 2 of the 3 accepted: 5 is computed again
    _forward(w, [5.5, 6] + [0] * 14)
    peeked = w.peek({"ta": 1})["readouts"]["ta"]
    assert np.frombuffer(peeked["positions"], np.int32).tolist() == [3, 4]
    assert np.frombuffer(peeked["values"], np.float32).reshape(2, 1, 2)[:, 0, 0].tolist() == [103, 104]
    assert w.peek({"other": 0})["readouts"] == {}
    w.on_step(["a"], [], {})
    whole = w.take(["ta"])["readouts"]["ta"]
    assert np.frombuffer(whole["positions"], np.int32).tolist() == [2, 3, 4, 5, 6]
    assert np.frombuffer(whole["values"], np.float32).reshape(5, 1, 2)[3, 0, 0] == 105.5  # the latest value


def test_positions_from_the_device_replace_counts_that_assume_every_draft_was_accepted():
    """Asynchronous scheduling with speculation: the host's count for the step after a verification assumes all its
    drafts were accepted (6 here, where 2 of 3 were: 5), vLLM's device positions are right. The values, what a peek
    counts as settled and a gate's positions follow the device's."""
    from hotwire_core.readout_worker import WorkerReadout

    w = WorkerReadout([0, 1, 2, 3], N_LAYERS, torch.device("cpu"), MAX_TOKENS, K, 4, _HostUploader(), gates=True)
    args = {**_args("ta", "generated", (1,)), "gate": {"probe": 0, "below": False, "latch": True, "cosine": False,
                                                        "prompt": False, "threshold": 0.0}}  # fmt: skip
    w.on_step([], [("a", 3, args, [SteerItem(1, 3, 0.0, 0.0)])], {})
    w.fill(["a"], np.array([3]), np.array([0]), 3, torch.arange(3))  # prefill: exact counts
    _forward(w, [0, 1, 2] + [0] * 13)
    w.fill(["a"], np.array([3]), np.array([3]), 3, torch.arange(3, 6))  # the last sampled token and 2 drafts
    _forward(w, [3, 4, 5] + [0] * 13)
    w.fill(["a"], np.array([2]), np.array([6]), 2, torch.tensor([5, 6]))  # the host counts 6, the device knows 5
    assert w.gates["token_pos"][:2].tolist() == [5, 6]
    _forward(w, [5.5, 6] + [0] * 14)
    peeked = w.peek({"ta": 0})["readouts"]["ta"]
    assert np.frombuffer(peeked["positions"], np.int32).tolist() == [2, 3, 4]  # 5 and 6: this step's, not settled
    w.fill(["a"], np.array([1]), np.array([7]), 1, torch.tensor([7]))
    w.on_step(["a"], [], {})
    whole = w.take(["ta"])["readouts"]["ta"]
    assert np.frombuffer(whole["positions"], np.int32).tolist() == [2, 3, 4, 5, 6, 7]
    assert np.frombuffer(whole["values"], np.float32).reshape(6, 1, 2)[3, 0, 0] == 105.5  # the latest value


def test_a_stream_gets_the_generated_values_every_rank_holds_without_a_gap():
    from hotwire_core.readout_results import generated_so_far

    def part(positions, held, base):
        """One rank's answer: probes it holds read ``base + position`` at norm 1, the others NaN."""
        values = [[[base + p, 1] if k in held else [np.nan, np.nan] for k in (0, 1)] for p in positions]
        return _answer("t", 3, positions, values, held, tokens="generated")

    # prompt length 3: generated token 1 is position 3; rank 0 holds probe 0 up to position 5, rank 1 probe 1 up to 4
    answers = [part([3, 4, 5], [0], 100), part([3, 4], [1], 200)]
    got = generated_so_far(answers, "t", 1)
    assert [p["generated"]["score"] for p in got] == [[103.5, 104.5], [203.0, 204.0]]  # probe 0's bias: 0.5
    assert got[0]["generated"]["cosine"] == [103 / 2, 104 / 2]  # norm 1 x probe norm 2
    assert generated_so_far([part([4, 5], [0, 1], 0)], "t", 1) is None  # token 1 (position 3) not yet there
    assert generated_so_far(answers, "other", 0) is None


def test_a_streamed_readout_sends_what_arrived_since_the_last_chunk_once():
    from hotwire_api.readout_stream import StreamedReadout

    stream = StreamedReadout()
    assert stream.pop() is None
    stream.arrived = [(0, [{"probe": "p", "generated": {"score": [1.0], "cosine": [0.1]}}]),
                      (1, [{"probe": "p", "generated": {"score": [2.0, 3.0], "cosine": [0.2, 0.3]}}])]
    assert stream.pop() == {"from": 0, "probes": [{"probe": "p", "generated": {"score": [1.0, 2.0, 3.0],
                                                                               "cosine": [0.1, 0.2, 0.3]}}]}
    assert stream.pop() is None
