"""hotwire_core.runtime.WorkerSteering on a CPU device: bank writes, config rows, per-step token_cfg fill."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hotwire_core.admission import ModelInfo
from hotwire_core.contract import BINDING_KEY, CAPTURE_KEY, READOUT_ARGS_KEY, SteerItem
from hotwire_core.bindings import BankWrite
from hotwire_core.controller import SteeringController
from hotwire_core.ops import CAPTURE, GATE, IDLE, READ, STEER
from hotwire_core.runtime import CONFIG_ROWS_PER_BATCH_SLOT, WorkerSteering
from hotwire_core.settings import Settings
from hotwire_core.steer_hook import select_layers
from hotwire_core.vllm_glue.layers import wrap_layer_class
from hotwire_core.vllm_glue.requests import VLLM_REQUESTS
from hotwire_core.vllm_glue.runners import step_of

N_LAYERS, HIDDEN, MAX_TOKENS, MAX_REQS, SLOTS, STACK = 4, 8, 32, 3, 6, 2
ROWS = 2 * CONFIG_ROWS_PER_BATCH_SLOT * MAX_REQS  # config rows a worker can hand out (row 0 aside)


def ws(dtype=torch.float32, max_reqs=MAX_REQS) -> WorkerSteering:
    return WorkerSteering({}, N_LAYERS, HIDDEN, dtype, torch.device("cpu"), MAX_TOKENS, max_reqs,
                          Settings(SLOTS, STACK, "op", None, None))


def new_req(req_id, prompt_len, config=None, extra=None, prompt_token_ids="auto", **kw):
    extra_args = dict(extra or {})
    if config is not None:
        extra_args[BINDING_KEY] = config
    ids = list(range(prompt_len)) if prompt_token_ids == "auto" else prompt_token_ids
    return SimpleNamespace(req_id=req_id, prompt_token_ids=ids,
                           sampling_params=SimpleNamespace(extra_args=extra_args or None), **kw)


def step(w, new=(), removed=(), writes=None, rebinds=None):
    out = SimpleNamespace(scheduled_new_reqs=list(new))
    if writes is not None:
        out.hotwire_writes = writes
    if rebinds is not None:
        out.hotwire_rebinds = rebinds
    w.on_step(step_of(out, set(removed)))


def steered(w) -> set[str]:
    return set(w._line_of)


def distinct_cfg(i: int) -> dict:
    """A config of its own for request ``i`` (requests with equal configs share rows)."""
    return {"p": [[1, 3, float(i + 1), 0.0]], "d": [[0, 5, -float(i + 1), 0.0]]}


def fill(w, req_ids, scheduled, computed):
    w.fill(list(req_ids), np.array(scheduled, dtype=np.int32), np.array(computed, dtype=np.int32), sum(scheduled))
    return w.buffers["token_cfg"].tolist()


CFG = {"p": [[1, 3, 2.0, 0.0], [1, 4, 0.0, 0.5], [3, 3, -1.0, 0.0]], "d": [[0, 5, 1.5, 0.0]]}


# -- construction --------------------------------------------------------------------------------------------


def test_buffers_and_info():
    w = ws()
    b = w.buffers
    assert b["bank"].shape == (SLOTS + 1, HIDDEN) and b["bank"].dtype == torch.float32
    assert b["inv_norm"].shape == (SLOTS + 1,)
    assert b["token_cfg"].shape == (MAX_TOKENS,) and b["token_cfg"].dtype == torch.int32
    assert b["layer_on"].shape == (N_LAYERS,) and b["layer_on"].dtype == torch.int32
    for name in ("cfg_slot", "cfg_scale", "cfg_rel"):
        assert b[name].shape == (ROWS + 1, N_LAYERS, STACK)
    assert all(int(t.count_nonzero()) == 0 for t in b.values())
    info = w.info()
    assert info["steerable"] is False and info["layers"] == [] and info["reason"]
    assert (info["n_layers"], info["hidden_size"], info["dtype"]) == (N_LAYERS, HIDDEN, "float32")


def test_select_layers():
    found = {i: torch.nn.Identity() for i in range(4)}
    assert select_layers(found, 4, None) is found
    assert sorted(select_layers(found, 4, frozenset({1, 2}))) == [1, 2]
    # a pipeline rank holding layers 2-3 hooks only its share of HOTWIRE_LAYERS, possibly none
    assert select_layers({2: found[2], 3: found[3]}, 4, frozenset({0, 1})) == {}
    with pytest.raises(ValueError, match="HOTWIRE_LAYERS=3-4 names layer 4, but the model has 4 decoder layers"):
        select_layers(found, 4, frozenset({3, 4}))


def test_rank_without_hooked_layers_is_still_steerable():
    w = WorkerSteering({}, N_LAYERS, HIDDEN, torch.float32, torch.device("cpu"), MAX_TOKENS, MAX_REQS,
                       Settings(SLOTS, STACK, "op", None, None), steerable=True)
    info = w.info()
    assert info["steerable"] is True and info["layers"] == [] and not info["reason"]


def test_dbo_micro_batching_makes_the_model_unsteerable_with_its_reason():
    """Micro-batches run on slices of the batch, whose tokens would read token_cfg from its start: such a server
    starts, says why it cannot steer, and refuses steered requests (503) instead of steering the wrong tokens."""
    from hotwire_core.vllm_glue.workers import unsupported_setup as _unsupported_setup

    def config(ubatching: bool) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(use_ubatching=ubatching))

    assert _unsupported_setup(config(False)) is None
    reason = _unsupported_setup(config(True))
    assert "--enable-dbo" in reason
    w = WorkerSteering({}, N_LAYERS, HIDDEN, torch.float32, torch.device("cpu"), MAX_TOKENS, MAX_REQS,
                       Settings(SLOTS, STACK, "op", None, None), steerable=False, reason=reason)
    assert w.info()["steerable"] is False and w.info()["reason"] == reason


@pytest.mark.parametrize(
    "config, says",
    [
        ({"parallel_config": {"use_ubatching": False, "prefill_context_parallel_size": 2}}, "prefill context parallel"),
        ({"speculative_config": {"enable_adaptive_verification": True}}, "adaptive draft verification"),
        ({"cache_config": {"kv_sharing_fast_prefill": True}}, "KV-sharing fast prefill"),
    ],
)
def test_features_steering_would_be_wrong_under_make_the_model_unsteerable(config: dict, says: str):
    """Each is refused with its reason; a release whose config lacks the field (older vLLM) counts it as off."""
    from hotwire_core.vllm_glue.workers import unsupported_setup

    parts = {"parallel_config": {"use_ubatching": False}, "speculative_config": None, **config}
    vllm_config = SimpleNamespace(**{k: v if v is None else SimpleNamespace(**v) for k, v in parts.items()})
    reason = unsupported_setup(vllm_config)
    assert reason is not None and says in reason and ";" not in reason
    assert unsupported_setup(SimpleNamespace(parallel_config=SimpleNamespace(use_ubatching=False))) is None


# -- bank writes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bank_writes(dtype):
    w = ws(dtype)
    r3, r5 = torch.randn(HIDDEN), torch.randn(HIDDEN)
    step(w, writes=[BankWrite(3, r3, 0.25), BankWrite(5, r5, 2.0)])
    bank = w.buffers["bank"]
    assert bank.dtype == dtype
    assert torch.equal(bank[3], r3.to(dtype)) and torch.equal(bank[5], r5.to(dtype))
    for other in (0, 1, 2, 4, 6):
        assert int(bank[other].count_nonzero()) == 0
    assert w.buffers["inv_norm"].tolist() == [0, 0, 0, 0.25, 0, 2.0, 0]
    # a later write replaces a row in place (same storage: graphs read by address)
    ptr = bank.data_ptr()
    step(w, writes=[BankWrite(3, r5, 0.5)])
    assert torch.equal(w.buffers["bank"][3], r5.to(dtype)) and w.buffers["bank"].data_ptr() == ptr
    assert w.buffers["inv_norm"][3].item() == 0.5


def test_no_writes_attribute_or_empty():
    w = ws()
    step(w)  # no hotwire_writes attribute
    step(w, writes=[])
    assert int(w.buffers["bank"].count_nonzero()) == 0


# -- config rows ---------------------------------------------------------------------------------------------


def test_config_rows_per_phase_layer_and_stack():
    w = ws()
    step(w, new=[new_req("A", 6, CFG)])
    prow, drow, plen = w.request_rows("A")
    assert plen == 6 and prow != drow and 0 not in (prow, drow)
    slot, scale, rel = (w.buffers[n] for n in ("cfg_slot", "cfg_scale", "cfg_rel"))
    exp_slot = torch.zeros(N_LAYERS, STACK, dtype=torch.int32)
    exp_scale = torch.zeros(N_LAYERS, STACK)
    exp_rel = torch.zeros(N_LAYERS, STACK)
    exp_slot[1, 0], exp_scale[1, 0] = 3, 2.0
    exp_slot[1, 1], exp_rel[1, 1] = 4, 0.5  # second entry on layer 1 -> stack index 1
    exp_slot[3, 0], exp_scale[3, 0] = 3, -1.0
    assert torch.equal(slot[prow], exp_slot) and torch.equal(scale[prow], exp_scale) and torch.equal(rel[prow], exp_rel)
    exp_slot = torch.zeros(N_LAYERS, STACK, dtype=torch.int32)
    exp_scale = torch.zeros(N_LAYERS, STACK)
    exp_slot[0, 0], exp_scale[0, 0] = 5, 1.5
    assert torch.equal(slot[drow], exp_slot) and torch.equal(scale[drow], exp_scale)
    assert int(rel[drow].count_nonzero()) == 0
    # row 0 ("no steer") and unused rows stay zero
    used = {prow, drow}
    for row in range(ROWS + 1):
        if row not in used:
            assert int(slot[row].count_nonzero()) == 0 and int(scale[row].count_nonzero()) == 0


def test_single_phase_configs_use_row_zero():
    w = ws()
    step(w, new=[new_req("D", 4, {"p": [], "d": [[2, 1, 1.0, 0.0]]}), new_req("P", 4, {"p": [[2, 1, 1.0, 0.0]]})])
    assert w.request_rows("D")[0] == 0 and w.request_rows("D")[1] != 0
    assert w.request_rows("P")[0] != 0 and w.request_rows("P")[1] == 0
    assert w.request_rows("P")[0] == w.request_rows("D")[1] and len(w.config_rows) == 1  # the same config: one row
    row = w.request_rows("P")[0]
    # prompt tokens of P and generated ones of D are steered, the other phase of each is not
    assert fill(w, ["D", "P"], [4, 4], [0, 0]) == [0] * 4 + [row] * 4 + [0] * (MAX_TOKENS - 8)
    assert fill(w, ["D", "P"], [1, 1], [4, 4]) == [row, 0] + [0] * (MAX_TOKENS - 2)
    assert fill(w, ["D", "P"], [2, 2], [3, 3]) == [0, row, row, 0] + [0] * (MAX_TOKENS - 4)  # across the boundary


def test_layer_on_follows_the_live_configs():
    """A layer is switched on while some live config row steers it, in either phase, and off once none does."""
    w = ws()
    on = lambda: w.buffers["layer_on"].tolist()  # noqa: E731
    assert on() == [0, 0, 0, 0]
    step(w, new=[new_req("A", 6, CFG)])  # prefill rows at layers 1 and 3, decode rows at layer 0
    assert on() == [1, 1, 0, 1]
    step(w, new=[new_req("B", 2, {"d": [[2, 1, 1.0, 0.0], [3, 1, 1.0, 0.0]]}), new_req("plain", 2)])
    assert on() == [1, 1, 1, 1]
    step(w, removed=["A"])
    assert on() == [0, 0, 1, 1]  # layer 3 stays on: B still steers it
    step(w, new=[new_req("B", 2, {"d": [[1, 1, 1.0, 0.0]]})])  # re-added with another config (V2 after preemption)
    assert on() == [0, 1, 0, 0]
    step(w, removed=["B", "plain"])
    assert on() == [0, 0, 0, 0] and len(w.config_rows) == 0 and not w.config_rows.layer_users.any()


def test_request_sent_again_without_steering_is_unsteered():
    """A streaming-input update re-sends a request; without a binding it must lose its old rows, not keep them."""
    w = ws()
    step(w, new=[new_req("S", 3, CFG)])
    assert fill(w, ["S"], [3], [0])[:3] != [0, 0, 0] and w.buffers["layer_on"].tolist() == [1, 1, 0, 1]
    assert len(w.config_rows) == 2
    step(w, new=[new_req("S", 5)])
    assert "S" not in steered(w) and len(w.config_rows) == 0
    assert fill(w, ["S"], [5], [0])[:5] == [0] * 5 and w.buffers["layer_on"].tolist() == [0, 0, 0, 0]


def test_config_rows_hold_preempted_requests_beside_a_full_batch_and_say_when_they_run_out():
    """V1 keeps a preempted request's rows: a full batch of steered requests plus as many preempted ones fit;
    past that the worker stops with a message instead of an IndexError."""
    w = ws()
    n = CONFIG_ROWS_PER_BATCH_SLOT * MAX_REQS
    step(w, new=[new_req(f"r{i}", 3, distinct_cfg(i)) for i in range(n)])
    assert len(w.config_rows) == ROWS
    step(w, new=[new_req("same-as-r0", 3, distinct_cfg(0))])  # a live config needs no row of its own
    with pytest.raises(RuntimeError, match="steering config rows hold configs of running or preempted"):
        step(w, new=[new_req("one-more", 3, distinct_cfg(n))])


def test_unsteered_new_requests_ignored():
    w = ws()
    reqs = [
        new_req("none", 4),  # extra_args None
        new_req("other", 4, extra={"hotwire": "{}", "x": 1}),  # spec without binding (never admitted)
        SimpleNamespace(req_id="pool", prompt_token_ids=[1, 2], sampling_params=None),
    ]
    step(w, new=reqs)
    assert steered(w) == set()
    assert int(w.buffers["cfg_slot"].count_nonzero()) == 0


def test_controller_to_worker():
    """The binding and writes a real controller produces land where the config table points."""
    import json

    c = SteeringController(
        ModelInfo(True, "", N_LAYERS, HIDDEN, "float32", frozenset(range(N_LAYERS))),
        Settings(SLOTS, STACK, "op", None, None), "m", VLLM_REQUESTS,
    )
    t = torch.randn(N_LAYERS, HIDDEN)
    g = torch.randn(HIDDEN)
    c.register("a", t.view(torch.uint8).numpy().tobytes(), "float32", [N_LAYERS, HIDDEN])
    c.register("g", g.view(torch.uint8).numpy().tobytes(), "float32", [HIDDEN])
    spec = [{"id": "a", "layer": [1, 2], "scale": 3.0}, {"id": "g", "layer": 1, "scale": 0.5, "norm": True, "decode_only": True}]
    sp = SimpleNamespace(extra_args={"hotwire": json.dumps(spec)})
    req = SimpleNamespace(request_id="R", prompt_token_ids=[1, 2, 3], sampling_params=sp, cache_salt=None,
                          block_hashes=[], update_block_hashes=lambda: None)
    c.admit(req)
    w = ws()
    step(w, new=[SimpleNamespace(req_id="R", prompt_token_ids=[1, 2, 3], sampling_params=req.sampling_params)],
         writes=c.take_writes())
    prow, drow, plen = w.request_rows("R")
    b = w.buffers
    # decode row, layer 1: a's row with scale 3 and g's row as a norm-relative entry
    s_a1, s_g = int(b["cfg_slot"][drow, 1, 0]), int(b["cfg_slot"][drow, 1, 1])
    assert torch.equal(b["bank"][s_a1], t[1]) and torch.equal(b["bank"][s_g], g)
    assert b["cfg_scale"][drow, 1].tolist() == [3.0, 0.0] and b["cfg_rel"][drow, 1].tolist() == [0.0, 0.5]
    assert b["inv_norm"][s_g].item() == pytest.approx(1 / float(g.norm()))
    s_a2 = int(b["cfg_slot"][prow, 2, 0])
    assert torch.equal(b["bank"][s_a2], t[2]) and b["cfg_scale"][prow, 2, 0].item() == 3.0
    assert b["cfg_slot"][prow, 1].tolist() == [s_a1, 0]  # g is decode-only


# -- fill ----------------------------------------------------------------------------------------------------


def test_fill_phases_straddle_unsteered_and_padding():
    w = ws()
    step(w, new=[new_req("A", 5, CFG), new_req("B", 9), new_req("C", 4, CFG)])
    pa, da, _ = w.request_rows("A")
    pc, dc, _ = w.request_rows("C")
    # A: positions 3..6 with prompt 5 -> 3,4 prefill, 5,6 decode; B unsteered; C decoding at 10, 11
    cfg = fill(w, ["A", "B", "C"], [4, 3, 2], [3, 0, 10])
    assert cfg[:9] == [pa, pa, da, da, 0, 0, 0, dc, dc]
    assert cfg[9:] == [0] * (MAX_TOKENS - 9)  # padding beyond the batch
    # a pure prefill chunk and the exact boundary
    cfg = fill(w, ["C", "A"], [4, 1], [0, 5])
    assert cfg[:5] == [pc, pc, pc, pc, da]
    assert cfg[5:] == [0] * (MAX_TOKENS - 5)  # the old tail (previous step's 9 tokens) is cleared
    cfg = fill(w, ["A"], [5], [0])
    assert cfg[:5] == [pa] * 5 and cfg[5:] == [0] * (MAX_TOKENS - 5)


def test_fill_steers_verification_tokens_as_decode_tokens():
    """Speculative decoding schedules a decoding request 1 + k tokens (its last sampled token and k drafts), all
    past its prompt: each gets the decode row (decode_only steers them all, prefill_only none), also when a step
    of one token per request (no drafts proposed) came between."""
    w = ws()
    step(w, new=[new_req("D", 4, {"p": [], "d": [[2, 1, 1.0, 0.0]]}), new_req("P", 4, {"p": [[2, 2, 1.0, 0.0]]}),
                 new_req("W", 6, CFG)])  # fmt: skip
    d, (pw, dw, _) = w.request_rows("D")[1], w.request_rows("W")
    # D and P verify 3 drafts each, W runs its prompt's last chunk
    assert fill(w, ["D", "P", "W"], [4, 4, 3], [4, 9, 3])[:11] == [d] * 4 + [0] * 4 + [pw] * 3
    assert fill(w, ["D", "P", "W"], [1, 1, 1], [8, 13, 6])[:3] == [d, 0, dw]  # no drafts this step
    assert fill(w, ["D", "P", "W"], [1, 1, 1], [9, 14, 7])[:3] == [d, 0, dw]  # the steady path
    assert fill(w, ["D", "P", "W"], [2, 4, 4], [10, 15, 8])[:10] == [d] * 2 + [0] * 4 + [dw] * 4


def test_fill_matches_a_per_token_reference_on_random_batches():
    """Token by token: position < prompt length -> prefill row, else decode row; unsteered and padding 0.
    Random batches mix decode tokens, prefill chunks and chunks that run past the prompt."""
    rng = np.random.default_rng(0)
    w = ws(max_reqs=8)
    ids = [f"r{i}" for i in range(8)]
    for i, r in enumerate(ids[:6]):  # r6, r7 unsteered
        step(w, new=[new_req(r, int(rng.integers(1, 6)), distinct_cfg(i))])
    for _ in range(200):
        batch = list(rng.permutation(ids)[: rng.integers(0, 9)])
        scheduled = [int(rng.choice([1, 1, 1, rng.integers(1, 4)])) for _ in batch]  # at most 24 < MAX_TOKENS
        computed = [int(rng.integers(0, 9)) for _ in batch]
        expected = []
        for r, n, c in zip(batch, scheduled, computed):
            prow, drow, plen = w.request_rows(r) or (0, 0, 0)
            expected += [prow if c + j < plen else drow for j in range(n)]
        assert fill(w, batch, scheduled, computed) == expected + [0] * (MAX_TOKENS - len(expected))


def test_fill_order_follows_req_ids_not_arrival():
    w = ws()
    step(w, new=[new_req("A", 2, CFG), new_req("C", 2, CFG)])
    da, dc = w.request_rows("A")[1], w.request_rows("C")[1]
    assert fill(w, ["C", "X", "A"], [1, 2, 1], [5, 5, 5])[:4] == [dc, 0, 0, da]


def test_clean_step_after_steered_clears_once_then_never_copies():
    w = ws()
    step(w, new=[new_req("A", 3, CFG), new_req("B", 3)])
    pa = w.request_rows("A")[0]
    cfg = fill(w, ["A", "B"], [3, 3], [0, 0])
    assert cfg[:6] == [pa, pa, pa, 0, 0, 0]
    # A is still active but not scheduled this step: the region is cleared once
    cfg = fill(w, ["B"], [1], [3])
    assert cfg == [0] * MAX_TOKENS
    # poison the device buffer: a following clean step must not copy anything
    w.buffers["token_cfg"][0] = 77
    w.buffers["token_cfg"][MAX_TOKENS - 1] = 78
    fill(w, ["B"], [1], [4])
    fill(w, ["B"], [20], [5])
    assert w.buffers["token_cfg"][0].item() == 77 and w.buffers["token_cfg"][-1].item() == 78


def test_clean_step_after_request_removed():
    w = ws()
    step(w, new=[new_req("A", 3, CFG)])
    fill(w, ["A"], [8], [0])
    step(w, removed={"A"})
    assert steered(w) == set()
    assert not w.clean  # no steered request, but the device still holds A's configs
    assert fill(w, ["B"], [2], [0]) == [0] * MAX_TOKENS  # the 8 old tokens cleared even though only 2 run
    assert w.clean
    w.buffers["token_cfg"][3] = 9
    fill(w, ["B"], [2], [2])
    fill(w, [], [], [])
    assert w.buffers["token_cfg"][3].item() == 9


def test_clear_with_empty_batch():
    w = ws()
    step(w, new=[new_req("A", 3, CFG)])
    fill(w, ["A"], [4], [0])
    assert fill(w, [], [], []) == [0] * MAX_TOKENS
    w.buffers["token_cfg"][0] = 5
    fill(w, [], [], [])
    assert w.buffers["token_cfg"][0].item() == 5


def test_never_steered_worker_never_copies():
    w = ws()
    step(w, new=[new_req("B", 3)])
    w.buffers["token_cfg"][:] = 3
    fill(w, ["B"], [3], [0])
    assert w.buffers["token_cfg"].tolist() == [3] * MAX_TOKENS


def test_token_cfg_keeps_its_storage():
    w = ws()
    ptr = w.buffers["token_cfg"].data_ptr()
    step(w, new=[new_req("A", 3, CFG)])
    fill(w, ["A"], [3], [0])
    fill(w, [], [], [])
    assert w.buffers["token_cfg"].data_ptr() == ptr


# -- request lifecycle ---------------------------------------------------------------------------------------


def test_removed_requests_free_rows_for_reuse():
    w = ws(max_reqs=1)  # config rows 1..4: two steered requests
    step(w, new=[new_req("A", 3, distinct_cfg(0)), new_req("B", 3, distinct_cfg(1))])
    assert len(w.config_rows) == ROWS // MAX_REQS
    rows_a = set(w.request_rows("A")[:2])
    step(w, new=[new_req("C", 3, distinct_cfg(2))], removed={"A"})
    assert set(w.request_rows("C")[:2]) == rows_a
    assert steered(w) == {"B", "C"}
    for i in range(20):  # churn never leaks rows (nor request lines)
        step(w, new=[new_req(f"N{i}", 3, distinct_cfg(3 + i))], removed={"C" if i == 0 else f"N{i - 1}"})
    assert len(w.config_rows) == ROWS // MAX_REQS and len(steered(w)) == 2 and len(w._lines) == 8
    step(w, removed={"B", "N19", "unknown"})
    assert len(w.config_rows) == 0 and steered(w) == set()


def test_removing_single_phase_request_does_not_free_row_zero():
    w = ws(max_reqs=1)
    step(w, new=[new_req("D", 3, {"d": [[0, 1, 1.0, 0.0]]})])
    step(w, removed={"D"})
    assert len(w.config_rows) == 0 and sorted(w.config_rows._free) == [1, 2, 3, 4]  # row 0 never handed out


def test_readded_request_starts_clean():
    w = ws(max_reqs=1)
    step(w, new=[new_req("A", 3, CFG)])
    step(w, new=[new_req("A", 7, {"p": [[2, 2, 4.0, 0.0]], "d": [[2, 2, 4.0, 0.0]]})])  # preempted + resumed (V2)
    prow, drow, plen = w.request_rows("A")
    assert plen == 7 and len(w.config_rows) == 1  # its old rows freed; the new phases share one config
    assert w.buffers["cfg_slot"][prow].tolist() == [[0, 0], [0, 0], [2, 0], [0, 0]]


def test_removed_before_added_in_same_step():
    w = ws(max_reqs=1)  # 4 config rows: two requests with configs of their own
    step(w, new=[new_req("A", 3, distinct_cfg(0)), new_req("X", 3, distinct_cfg(1))])
    step(w, new=[new_req("B", 3, distinct_cfg(2))], removed={"A"})  # only works if removal happens first
    assert steered(w) == {"B", "X"}


def test_equal_configs_share_rows_and_write_nothing_more():
    """Admitting a request whose config is live uses its rows as they are on the device; the rows go when
    their last user does, and a config admitted again afterwards is written afresh."""
    w = ws()
    step(w, new=[new_req("A", 3, CFG)])
    pa, da, _ = w.request_rows("A")
    w.buffers["cfg_scale"][da, 0, 0] = 99.0  # a second write of A's config would overwrite this
    step(w, new=[new_req("B", 5, {"p": [list(x) for x in CFG["p"]], "d": [tuple(x) for x in CFG["d"]]})])
    assert w.request_rows("B") == (pa, da, 5) and len(w.config_rows) == 2
    assert w.buffers["cfg_scale"][da, 0, 0].item() == 99.0
    assert fill(w, ["A", "B"], [1, 1], [3, 4])[:2] == [da, pa]
    step(w, removed={"A"})
    assert len(w.config_rows) == 2 and w.buffers["layer_on"].tolist() == [1, 1, 0, 1]  # B still uses them
    step(w, removed={"B"})
    assert len(w.config_rows) == 0 and w.buffers["layer_on"].tolist() == [0, 0, 0, 0]
    step(w, new=[new_req("C", 3, CFG)])
    assert w.buffers["cfg_scale"][w.request_rows("C")[1], 0, 0].item() == 1.5


def test_stale_config_of_removed_request_not_used():
    w = ws()
    step(w, new=[new_req("A", 3, CFG)])
    step(w, removed={"A"})
    cfg = fill(w, ["A"], [2], [0])  # a runner that still lists A must not steer it
    assert cfg == [0] * MAX_TOKENS


def test_prompt_embeds_request_prompt_length():
    w = ws()
    step(w, new=[new_req("E", 0, CFG, prompt_token_ids=None, prompt_embeds=torch.zeros(5, HIDDEN))])
    prow, drow, plen = w.request_rows("E")
    assert plen == 5
    assert fill(w, ["E"], [6], [0])[:6] == [prow] * 5 + [drow]


class LlamaDecoderLayer(torch.nn.Module):
    """Stands in for a vLLM decoder layer: returns (hidden, residual) with the contract's argument names."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states * 2, residual


@pytest.mark.parametrize("fusion,norm_setting,target,norm", [
    (False, False, "hidden", False),
    (False, True, "hidden", True),
    (True, False, "residual", True),
])
def test_steering_target_follows_allreduce_rms_fusion(fusion, norm_setting, target, norm):
    layer = LlamaDecoderLayer()
    wrap_layer_class(LlamaDecoderLayer)
    w = WorkerSteering({0: layer}, 1, HIDDEN, torch.float32, torch.device("cpu"), MAX_TOKENS, MAX_REQS,
                       Settings(SLOTS, STACK, "op", None, None, norm=norm_setting), allreduce_rms_fusion=fusion)
    assert (w.target, w.norm) == (target, norm)
    # A steered token moves the tensor the target names and leaves the other one alone.
    w.buffers["bank"][1] = 1.0
    w.buffers["cfg_slot"][1, 0, 0] = 1
    w.buffers["cfg_scale"][1, 0, 0] = 3.0
    w.buffers["token_cfg"][0] = 1
    w.buffers["layer_on"][0] = 1
    hidden, residual = torch.ones(2, HIDDEN), torch.zeros(2, HIDDEN)
    out_hidden, out_residual = layer(None, hidden, residual)
    steered, untouched = (out_hidden, out_residual) if target == "hidden" else (out_residual, out_hidden)
    base = {"hidden": 2.0, "residual": 0.0}
    assert torch.equal(steered[0], torch.full((HIDDEN,), base[target] + 3.0))
    assert torch.equal(steered[1], torch.full((HIDDEN,), base[target]))
    other = "residual" if target == "hidden" else "hidden"
    assert torch.equal(untouched, torch.full((2, HIDDEN), base[other]))


def test_bank_writes_of_mixed_dtypes_are_cast_to_the_model_dtype():
    w = ws(torch.bfloat16)
    r16, r32 = torch.randn(HIDDEN).half(), torch.randn(HIDDEN)
    step(w, writes=[BankWrite(1, r16, 1.0), BankWrite(2, r32, 1.0)])
    assert torch.equal(w.buffers["bank"][1], r16.to(torch.bfloat16))
    assert torch.equal(w.buffers["bank"][2], r32.to(torch.bfloat16))


def test_steady_decode_is_not_recomputed_until_the_batch_changes(monkeypatch):
    w = ws()
    step(w, new=[new_req("A", 3, CFG), new_req("B", 2)])
    pa, da = w.request_rows("A")[:2]
    assert fill(w, ["A", "B"], [1, 1], [2, 2])[:2] == [pa, 0]  # A's last prompt token: not steady yet
    assert w._steady_rows is None
    assert fill(w, ["A", "B"], [1, 1], [3, 3])[:2] == [da, 0]  # both decoding: steady from here on
    calls = []
    monkeypatch.setattr(np, "where", lambda *a: calls.append(a))  # any recomputation would call it
    w.buffers["token_cfg"][0] = 77  # and an upload would overwrite this
    for pos in range(4, 8):
        fill(w, ["A", "B"], [1, 1], [pos, pos])
    assert calls == [] and w.buffers["token_cfg"][0].item() == 77
    monkeypatch.undo()
    # A new batchmate, or a prefill chunk, leaves the steady path.
    step(w, new=[new_req("C", 4, CFG)])
    pc = w.request_rows("C")[0]
    assert fill(w, ["A", "B", "C"], [1, 1, 1], [8, 8, 0])[:3] == [da, 0, pc]
    assert w._steady_rows is None


def test_preemption_disarms_the_steady_decode_shortcut():
    """V1 keeps a preempted request's rows; resumed alone in the same batch slot, it recomputes its prompt
    (here one token per step): the prefill config must come back."""
    w = ws()
    step(w, new=[new_req("A", 3, CFG)])
    pa, da = w.request_rows("A")[:2]
    assert fill(w, ["A"], [1], [5])[0] == da and w._steady_rows is not None
    out = SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids={"A"})
    w.on_step(step_of(out, set()))
    assert fill(w, ["A"], [1], [0])[0] == pa


def test_step_kinds_names_steps_with_a_steered_request():
    """A step needs STEER iff a scheduled request has a prefill or a decode config."""
    w = ws()
    assert w.step_kinds({"a": 1}) == IDLE
    step(w, new=[new_req("plain", 3), new_req("s", 3, {"p": [], "d": [(1, 1, 1.0, 0.0)]}),
                 new_req("none", 3, {"p": [], "d": []})])
    assert w.step_kinds({"plain": 1, "none": 1}) == IDLE
    assert w.step_kinds({}) == IDLE
    assert w.step_kinds({"plain": 1, "s": 1}) == STEER
    many = {f"r{i}": 1 for i in range(10)}
    assert w.step_kinds(many) == IDLE  # fewer active than scheduled: the other loop
    assert w.step_kinds({**many, "s": 1}) == STEER
    step(w, removed=["s"])
    assert w.step_kinds({"plain": 1, "s": 1}) == IDLE


def test_rebind_moves_a_kept_request_to_its_new_slots():
    """V1 keeps a preempted request; when it resumes with rows in other slots, its config rows follow."""
    w = ws()
    step(w, new=[new_req("A", 3, {"p": [(1, 2, 1.5, 0.0)], "d": [(1, 2, 1.5, 0.0)]}), new_req("B", 3)])
    prompt_len = w.request_rows("A")[2]
    moved = {"p": [(1, 5, 1.5, 0.0)], "d": [(1, 5, 1.5, 0.0)]}
    step(w, rebinds={"A": moved, "gone": moved})  # a request this worker does not hold is ignored
    assert steered(w) == {"A"} and w.request_rows("A")[2] == prompt_len  # B is plain: never tracked
    for row in w.request_rows("A")[:2]:
        assert w.buffers["cfg_slot"][row, 1, 0].item() == 5
        assert w.buffers["cfg_scale"][row, 1, 0].item() == 1.5
    assert fill(w, ["A"], [1], [3])[0] == w.request_rows("A")[1]


def test_rebind_of_a_request_readded_in_the_same_step_uses_the_new_request():
    """V2 re-adds a resumed request as new; its new data already carries the moved config."""
    w = ws()
    moved = {"p": [], "d": [(2, 4, 1.0, 0.0)]}
    step(w, new=[new_req("A", 3, moved)], rebinds={"A": {"p": [], "d": [(2, 6, 1.0, 0.0)]}})
    row = w.request_rows("A")[1]
    assert w.buffers["cfg_slot"][row, 2, 0].item() == 4
    assert len(w.config_rows) == 1  # one config row taken, not two


def _worker_info(steerable: bool, layers: list[int], reason: str = "", slots: int = SLOTS, stack: int = STACK) -> dict:
    return {"steerable": steerable, "reason": reason, "layers": layers, "n_layers": 4, "hidden_size": 8,
            "dtype": "float32", "norm": False, "slots": slots, "max_stack": stack}


def test_model_info_over_ranks(monkeypatch):
    from hotwire_core.vllm_glue import engine_core, patching

    monkeypatch.setattr(patching, "_SETTINGS", Settings(SLOTS, STACK, "op", None, None))
    # pipeline ranks: the union of their hooked layers; a rank HOTWIRE_LAYERS left without hooks is fine
    info = engine_core.model_info([_worker_info(True, [1]), _worker_info(True, [])])
    assert info.steerable and info.layers == frozenset({1}) and not info.reason
    info = engine_core.model_info([_worker_info(False, [], "no decoder layer"), _worker_info(True, [3])])
    assert not info.steerable and info.reason == "no decoder layer"
    # every rank has layers but HOTWIRE_LAYERS names none of them: say so instead of an empty reason
    monkeypatch.setattr(patching, "_SETTINGS", Settings(SLOTS, STACK, "op", None, None, layers=frozenset({2})))
    info = engine_core.model_info([_worker_info(True, []), _worker_info(True, [])])
    assert not info.steerable and info.reason == "HOTWIRE_LAYERS=2 selects no layer hotwire can hook"


def test_workers_with_another_bank_size_turn_steering_off(monkeypatch):
    """Each process reads its own environment: a worker whose bank or stack differs from the engine core's would
    read rows and configs the core never wrote, so the model is reported unsteerable, naming the variable."""
    from hotwire_core.vllm_glue import engine_core, patching

    monkeypatch.setattr(patching, "_SETTINGS", Settings(SLOTS, STACK, "op", None, None))
    assert engine_core.model_info([_worker_info(True, [1]), _worker_info(True, [2])]).steerable
    info = engine_core.model_info([_worker_info(True, [1]), _worker_info(True, [2], slots=SLOTS * 2)])
    assert not info.steerable
    assert info.reason.startswith(f"HOTWIRE_SLOTS is {SLOTS} in the engine core but {SLOTS * 2} in its workers")
    info = engine_core.model_info([_worker_info(True, [1], stack=STACK + 1)])
    assert not info.steerable and info.reason.startswith(f"HOTWIRE_MAX_STACK is {STACK} in the engine core")


def test_step_kinds_name_each_op_a_step_needs_and_the_gate_picks_the_cheapest_variant_covering_them():
    """Steering, reading (a readout or a gate) and capturing are separate bits, so a steered step replays graphs
    without the read and capture ops where those are compiled in (``ops.graph_variants``)."""
    layer = LlamaDecoderLayer()
    wrap_layer_class(LlamaDecoderLayer)
    w = WorkerSteering({0: layer}, 1, HIDDEN, torch.float32, torch.device("cpu"), MAX_TOKENS, MAX_REQS,
                       Settings(SLOTS, STACK, "op", None, None, readout=True, capture=True))
    probe = {"name": "p@1:L0", "layer": 0, "bias": 0.0, "norm": 1.0}
    reading = {"p": [], "d": [], "r": [SteerItem(0, 3, 0.0, 0.0)]}
    step(w, new=[new_req("s", 3, {"p": [], "d": [(0, 1, 1.0, 0.0)]}),
                 new_req("r", 3, reading, extra={READOUT_ARGS_KEY: {"tag": "t", "tokens": "all", "probes": [probe]}}),
                 new_req("c", 3, extra={CAPTURE_KEY: {"tag": "c", "layers": [0], "position": "last"}})])
    assert w.step_kinds({"s": 1}) == STEER
    assert w.step_kinds({"r": 1}) == READ
    assert w.step_kinds({"c": 1}) == CAPTURE
    assert w.step_kinds({"s": 1, "r": 1, "c": 1, "plain": 1}) == STEER | READ | CAPTURE
    try:
        GATE.configure(True, read=True, capture=True)
        picks = {kinds: GATE.covering(kinds) for kinds in range(8)}
        assert picks == {IDLE: IDLE, STEER: STEER, READ: READ, STEER | READ: STEER | READ,
                         CAPTURE: 7, STEER | CAPTURE: 7, READ | CAPTURE: 7, 7: 7}
        GATE.configure(True, read=False, capture=True)
        assert [GATE.covering(kinds) for kinds in (IDLE, STEER, CAPTURE)] == [IDLE, STEER, 7]
        GATE.configure(True, read=False, capture=False)
        assert [GATE.covering(kinds) for kinds in (IDLE, STEER)] == [IDLE, 7]  # steering alone is the full set
    finally:
        GATE.configure(False, read=False, capture=False)


@pytest.mark.parametrize("capture", [False, True])
def test_the_readout_op_runs_only_at_the_layers_hotwire_readout_layers_names(capture):
    """Each layer the read op runs at costs a launch in every reading step: HOTWIRE_READOUT_LAYERS leaves it out of
    the others (capture, where compiled in, still runs at every hooked layer)."""
    layers = {0: LlamaDecoderLayer(), 1: LlamaDecoderLayer()}
    wrap_layer_class(LlamaDecoderLayer)
    w = WorkerSteering(layers, 2, HIDDEN, torch.float32, torch.device("cpu"), MAX_TOKENS, MAX_REQS,
                       Settings(SLOTS, STACK, "op", None, None, readout=True, capture=capture,
                                readout_layers=frozenset({1, 5})))
    readers = {index: layer.hotwire_steer.reader for index, layer in layers.items()}
    assert w.info()["readout_layers"] == [1] and readers[1].readout and readers[1].gates
    assert (readers[0] is not None) is capture and (readers[0] is None or not readers[0].readout)
    assert w.readout.layers == {1}
