"""Probe-gated steering's pure parts: the condition in a spec, the ops deciding and applying it (the CPU kernels, and
the Triton kernels in Triton's interpreter) against a reference written out by hand, the receipt, and admission.
The engine end to end: tests/integration/test_gates.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotwire_core import readout_op
from hotwire_core.gates import gate_of, holds
from hotwire_core.ops import GATE_BELOW, GATE_COSINE, GATE_LATCH, NEVER
from hotwire_core.spec import SpecError, canonical_spec, parse_spec
from triton_interpreter import check_in_interpreter

# -- the spec ---------------------------------------------------------------------------------------------------


def test_a_condition_parses_and_round_trips():
    entries = parse_spec('[{"id": "joy", "layer": [3, 5], "scale": 2, "decode_only": true, '
                         '"when": {"id": "tox", "layer": 1, "above": 0.25, "latch": true, "tokens": "prompt"}}, '
                         '{"id": "calm", "layer": 4, "scale": 1}]')
    when = entries[0].when
    assert (when.vector_id, when.layer, when.threshold, when.below, when.latch, when.tokens) == ("tox", 1, 0.25, False,
                                                                                                  True, "prompt")
    assert entries[1].when is None
    assert parse_spec(canonical_spec(entries)) == entries
    pinned = entries[0].pinned(3, 7)
    assert (pinned.version, pinned.when.version) == (3, 7) and pinned.steering() == entries[0]
    assert pinned.when.describe() == "tox@7:L1>0.25,latch,prompt"
    cos = parse_spec({"id": "a", "layer": 2, "scale": 1, "when": {"id": "t", "layer": 0, "below": -0.1, "cosine": True}})
    assert cos[0].when.below and cos[0].when.cosine and cos[0].when.threshold == float(np.float32(-0.1))


@pytest.mark.parametrize("when, field", [
    ({"id": "t", "layer": 3, "above": 1}, "hotwire.when.layer"),  # not below the steered layer
    ({"id": "t", "layer": 1}, "hotwire.when"),  # no threshold
    ({"id": "t", "layer": 1, "above": 1, "below": 0}, "hotwire.when"),
    ({"id": "t", "layer": 1, "above": float("inf")}, "hotwire.when.above"),
    ({"id": "t", "layer": 1, "above": 1, "tokens": "generated"}, "hotwire.when.tokens"),
    ({"id": "t", "layer": 1, "above": 1, "latch": 1}, "hotwire.when.latch"),
    ({"id": "t", "layer": 1, "above": 1, "scale": 2}, "hotwire.when.scale"),
    ({"id": "../t", "layer": 1, "above": 1}, "hotwire.when.id"),
    ("tox", "hotwire.when"),
])
def test_a_bad_condition_names_its_field(when, field):
    with pytest.raises(SpecError) as info:
        parse_spec({"id": "a", "layer": [3], "scale": 1.0, "when": when})
    assert info.value.field == field


def test_the_gated_entries_of_a_request_share_one_condition():
    when = {"id": "t", "layer": 1, "above": 1}
    parse_spec([{"id": "a", "layer": 3, "scale": 1, "when": when}, {"id": "b", "layer": 4, "scale": 1, "when": when}])
    with pytest.raises(SpecError) as info:
        parse_spec([{"id": "a", "layer": 3, "scale": 1, "when": when},
                    {"id": "b", "layer": 4, "scale": 1, "when": {**when, "above": 2}}])
    assert info.value.field == "hotwire[1].when"


# -- the ops: a batch of three requests through read_ at the condition's layer, then steer_ above it ------------

H, K_READ, K_STEER, N_LAYERS, MAX_TOKENS = 24, 2, 2, 4, 16
COND_LAYER, STEER_LAYER = 1, 3


def make_case(seed: int = 0):
    """Three requests in one step: A gated per token (probe 1 above 0), B latched (probe 1 below 0.2, cosine), both
    also carrying an ungated entry for B; C plain. Returns the op arguments and the reference, computed here with
    numpy from the same float32 values."""
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(5, H, generator=g)
    bank[0] = 0
    inv_norm = 1 / bank.norm(dim=1).clamp_min(1e-30)
    inv_norm[0] = 0
    # token layout: A at positions 4..8 (5 tokens), B at 10..15 (6 tokens, prompt length 12), C 2 tokens
    rows = [1] * 5 + [2] * 6 + [0] * 2
    positions = list(range(4, 9)) + list(range(10, 16)) + [0, 1]
    n = len(rows)
    token_read = torch.zeros(MAX_TOKENS, dtype=torch.int32)
    token_read[:n] = torch.tensor(rows, dtype=torch.int32)
    token_pos = torch.zeros(MAX_TOKENS, dtype=torch.int32)
    token_pos[:n] = torch.tensor(positions, dtype=torch.int32)
    token_hit = torch.full((MAX_TOKENS,), 7, dtype=torch.int32)  # stale values the ops must overwrite
    read_slot = torch.zeros(3, N_LAYERS, K_READ, dtype=torch.int32)
    read_slot[1, COND_LAYER, 1] = read_slot[2, COND_LAYER, 1] = 3  # both read probe 3 (as their probe 1)
    read_slot[1, COND_LAYER, 0] = 4
    gate_row = torch.full((3, 8), -1, dtype=torch.int32)
    gate_row[1, :5] = torch.tensor([COND_LAYER, 1, 0, NEVER, 9])
    gate_row[2, :5] = torch.tensor([COND_LAYER, 1, GATE_BELOW | GATE_LATCH | GATE_COSINE, NEVER, 12])
    gate_f = torch.zeros(3, 4)
    gate_f[1, :3] = torch.tensor([0.0, 0.5, float(inv_norm[3])])
    gate_f[2, :3] = torch.tensor([0.2, 0.0, float(inv_norm[3])])
    # steering: config 1 (A): slot 1 gated; config 2 (B): slot 1 gated, slot 2 not; C: config 0
    token_cfg = torch.zeros(MAX_TOKENS, dtype=torch.int32)
    token_cfg[:n] = torch.tensor([1] * 5 + [2] * 6 + [0] * 2, dtype=torch.int32)
    layer_on = torch.zeros(N_LAYERS, dtype=torch.int32)
    layer_on[STEER_LAYER] = 1
    cfg_slot = torch.zeros(3, N_LAYERS, K_STEER, dtype=torch.int32)
    cfg_scale = torch.zeros(3, N_LAYERS, K_STEER)
    cfg_gate = torch.zeros(3, N_LAYERS, K_STEER, dtype=torch.int32)
    cfg_slot[1, STEER_LAYER, 0], cfg_scale[1, STEER_LAYER, 0], cfg_gate[1, STEER_LAYER, 0] = 1, 3.0, 1
    cfg_slot[2, STEER_LAYER, 0], cfg_scale[2, STEER_LAYER, 0], cfg_gate[2, STEER_LAYER, 0] = 1, -2.0, 1
    cfg_slot[2, STEER_LAYER, 1], cfg_scale[2, STEER_LAYER, 1] = 2, 0.5
    cfg_rel = torch.zeros_like(cfg_scale)
    stream = torch.randn(n, H, generator=g)
    stream[0], stream[1] = bank[3], -bank[3]  # A: a token that holds and one that does not (dot +-|p|^2, bias 0.5)
    stream[5], stream[6] = 2 * bank[3], -bank[3]  # B: cosine 1 (not below 0.2), then -1: the latch fires at 11
    tensors = dict(bank=bank, inv_norm=inv_norm, token_read=token_read, token_pos=token_pos, token_hit=token_hit,
                   read_slot=read_slot, gate_row=gate_row, gate_f=gate_f, token_cfg=token_cfg, layer_on=layer_on,
                   cfg_slot=cfg_slot, cfg_scale=cfg_scale, cfg_rel=cfg_rel, cfg_gate=cfg_gate)

    # The reference: the condition per token in float32, then the steering it lets through.
    s = stream.numpy().astype(np.float32)
    p = bank[3].numpy().astype(np.float32)
    dots = np.array([np.float32(np.dot(s[t], p)) for t in range(n)], np.float32)
    norms = np.sqrt(np.sum(s * s, axis=1), dtype=np.float32)
    held_a = dots[:5] + np.float32(0.5) > 0
    cos_b = np.where(norms[5:11] > 0, dots[5:11] * np.float32(inv_norm[3]) / norms[5:11], 0).astype(np.float32)
    held_b = cos_b < np.float32(0.2)
    first_b = min((positions[5 + i] for i in range(6) if held_b[i]), default=NEVER)
    want = s.copy()
    for t in range(5):
        if held_a[t]:
            want[t] += 3.0 * bank[1].numpy()
    for i in range(6):
        t = 5 + i
        want[t] += 0.5 * bank[2].numpy()
        if positions[t] >= first_b:
            want[t] += -2.0 * bank[1].numpy()
    reference = dict(held_a=held_a, held_b=held_b, first_b=first_b, steered=want)
    return stream, tensors, reference


def run_ops(stream, t, device: str, triton: bool, pdl: bool = False):
    """read_ at the condition's layer, then steer_ at the steered one (``pdl``: each launched as a programmatic
    dependent of the kernel before it); returns (steered stream, hit, first, out)."""
    t = {k: v.to(device) for k, v in t.items()}
    stream = stream.to(device)
    out = torch.zeros(N_LAYERS, MAX_TOKENS, K_READ + 1, device=device)
    gates_read = (t["token_pos"], t["token_hit"], t["gate_row"], t["gate_f"])
    gates_steer = (t["cfg_gate"], t["token_read"], t["token_pos"], t["token_hit"], t["gate_row"])
    steer_args = (t["token_cfg"], t["layer_on"], t["cfg_slot"], t["cfg_scale"], t["cfg_rel"], t["bank"], t["inv_norm"],
                  STEER_LAYER)
    if triton:
        from hotwire_core.triton_readout import read_triton_
        from hotwire_core.triton_steer import steer_triton_

        read_triton_(stream, None, t["token_read"], t["read_slot"], t["bank"], out, COND_LAYER, *gates_read, pdl=pdl)
        steer_triton_(stream, None, *steer_args, *gates_steer, pdl=pdl)
    else:
        saved = readout_op._OUT
        readout_op.set_output(out)
        try:
            torch.ops.hotwire.read_(stream, None, t["token_read"], t["read_slot"], t["bank"], COND_LAYER, *gates_read)
            torch.ops.hotwire.steer_(stream, None, *steer_args, *gates_steer)
        finally:
            readout_op.set_output(saved)
    return stream.cpu(), t["token_hit"].cpu(), t["gate_row"][:, 3].cpu(), out.cpu()


def check_ops(device: str, triton: bool, pdl: bool = False) -> None:
    stream, tensors, ref = make_case()
    plain_before = stream[11:13].clone()
    steered, hit, first, out = run_ops(stream.clone(), tensors, device, triton, pdl)
    assert ref["held_a"].any() and not ref["held_a"].all(), "the case must let some tokens through and stop others"
    assert ref["first_b"] == 11, "the latch must fire inside the step, after its first token"
    assert hit[:5].tolist() == ref["held_a"].astype(int).tolist()
    assert hit[5:11].tolist() == ref["held_b"].astype(int).tolist()
    assert int(first[2]) == ref["first_b"] and int(first[1]) == NEVER  # A is not latched: its first stays
    torch.testing.assert_close(steered[:11], torch.from_numpy(ref["steered"][:11]), atol=1e-5, rtol=1e-5)
    for t in np.flatnonzero(~ref["held_a"]):  # gated off at every entry: the row keeps its bits
        assert torch.equal(steered[t], stream[t])
    assert torch.equal(steered[11:13], plain_before)  # the plain request
    torch.testing.assert_close(out[COND_LAYER, :11, 1], torch.from_numpy(np.float32([
        np.dot(stream[t].numpy(), tensors["bank"][3].numpy()) for t in range(11)])), atol=1e-5, rtol=1e-5)


def test_the_cpu_kernels_gate_as_the_reference():
    check_ops("cpu", triton=False)


def test_an_ungated_server_calls_the_ops_as_before():
    """Without gate tensors the ops take their old arguments and a steered token is steered."""
    stream, t, _ = make_case()
    steer_args = (t["token_cfg"], t["layer_on"], t["cfg_slot"], t["cfg_scale"], t["cfg_rel"], t["bank"], t["inv_norm"],
                  STEER_LAYER)
    x = stream.clone()
    torch.ops.hotwire.steer_(x, None, *steer_args)
    torch.testing.assert_close(x[0], stream[0] + 3.0 * t["bank"][1])


def test_the_triton_kernels_gate_as_the_reference_in_the_interpreter():
    check_in_interpreter(__file__, 'check_ops("cpu", triton=True)')


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_the_triton_kernels_gate_as_the_reference_on_a_gpu(pdl: bool):
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    check_ops("cuda", triton=True, pdl=pdl)


# -- the receipt ------------------------------------------------------------------------------------------------


def test_the_receipt_names_the_first_position_that_held():
    gate = {"probe": 0, "threshold": 1.0, "below": False, "cosine": False, "latch": True, "prompt": False}
    positions = np.arange(6, dtype=np.int32)
    dots = np.array([0.1, 0.2, 1.5, 0.3, 2.0, 0.0], np.float32)
    norms = np.ones(6, np.float32)
    got = gate_of(gate, "t@1:L1", positions, dots, norms, 0.0, 1.0, prompt_len=4)
    assert got == {"condition": "t@1:L1", "fired": True, "position": 2, "positions_held": 2, "prompt_tokens": 4,
                   "latch": True}
    assert gate_of({**gate, "prompt": True}, "t", positions, dots - 1.0, norms, 0.0, 1.0, 4)["fired"] is False
    assert gate_of({**gate, "prompt": True}, "t", positions, dots, norms, 0.0, 1.0, 2)["positions_held"] == 0
    below = holds({**gate, "below": True, "cosine": True}, dots, np.float32([1, 1, 1, 1, 1, 0]), 0.0, 2.0)
    assert below.tolist() == [True, True, True, True, False, True]  # cosine = dot / (2 * norm) < 1; 0 for a zero norm


# -- admission in the engine core (test_controller's helpers) --------------------------------------------------


@pytest.fixture(scope="module")
def _none_hash():
    from vllm.utils.hashing import sha256  # vLLM's block hasher needs its NONE_HASH
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _gated(when=None, **entry):
    return {"id": "a", "layer": 3, "scale": 2.0, "when": {"id": "g", "layer": 1, "above": 0.5, **(when or {})}, **entry}


def test_admission_reads_the_condition_last_on_every_token_and_marks_the_gated_items(_none_hash):
    import dataclasses
    import json

    from test_controller import admit, reader

    from hotwire_core.contract import READOUT_ARGS_KEY

    c = reader(readout_probes=2)
    c.rules = dataclasses.replace(c.rules, model=dataclasses.replace(c.rules.model, gates=("token", "latch")))
    spec = [_gated({"latch": True, "cosine": True}), {"id": "a", "layer": 2, "scale": 1.0}]
    readout = json.dumps({"probes": [{"id": "a", "layer": 2}], "tokens": "generated"})
    binding, req = admit(c, "r1", spec=spec, extra={"hotwire_readout": readout})
    args = req.sampling_params.extra_args[READOUT_ARGS_KEY]
    assert args["tokens"] == "all" and [p["name"] for p in args["probes"]] == ["a@1:L2", "g@1:L1"]
    assert args["gate"] == {"probe": 1, "threshold": 0.5, "below": False, "cosine": True, "latch": True,
                            "prompt": False}
    assert [(i.layer, i.gated) for i in binding.config["d"]] == [(3, 1), (2, 0)]
    assert req.cache_salt.startswith("hotwire:readout:")  # every prompt token is computed
    assert binding.receipt == "a@1:L3x2,when=g@1:L1cos>0.5,latch;a@1:L2x1"
    _, alone = admit(c, "r2", spec=_gated())  # no readout of its own: one is made for the condition
    assert [p["name"] for p in alone.sampling_params.extra_args[READOUT_ARGS_KEY]["probes"]] == ["g@1:L1"]


@pytest.mark.parametrize("gates, when, status, code", [
    ((), {}, 400, "gate_unsupported"),  # pipeline parallelism
    (("token",), {"latch": True}, 400, "gate_unsupported"),  # speculative decoding
    (("token", "latch"), {"id": "nope"}, 400, "unknown_vector"),
    (("token", "latch"), {"version": 9}, 410, "version_gone"),
])
def test_a_gate_admission_cannot_serve_is_refused(gates, when, status, code, _none_hash):
    import dataclasses

    from test_controller import reader, request

    from hotwire_core.admission import Refusal

    c = reader(readout_probes=2)
    c.rules = dataclasses.replace(c.rules, model=dataclasses.replace(c.rules.model, gates=gates))
    with pytest.raises(Refusal) as info:
        c.admit(request("bad", spec=_gated(when)))
    assert (info.value.status, info.value.code) == (status, code)
    assert info.value.field.startswith("hotwire[0].when")
    off = reader(readout_probes=0)
    with pytest.raises(Refusal) as info:
        off.admit(request("off", spec=_gated()))
    assert (info.value.status, info.value.code) == (503, "readout_off")


def test_verify_check_g_passes_only_when_the_gates_do_what_their_receipts_say():
    from hotwire_core.verify.checks import Result, check_gates

    steered, plain = Result([5, 6], [-0.5, -1.0], 0), Result([7, 8], [-0.25, -2.0], 0)
    receipts = [{"positions_held": 9}, {"positions_held": 0}]
    assert check_gates([steered, plain], receipts, steered, plain, 9, 1e-6).passed
    assert not check_gates([plain, plain], receipts, steered, plain, 9, 1e-6).passed  # the open gate did not steer
    assert not check_gates([steered, steered], receipts, steered, plain, 9, 1e-6).passed  # the shut gate steered
    assert not check_gates([steered, plain], [{"positions_held": 8}, receipts[1]], steered, plain, 9, 1e-6).passed
    assert not check_gates([steered, plain], receipts, plain, plain, 9, 1e-6).passed  # steering moved nothing


def test_a_decided_condition_is_the_one_its_pinned_spec_carries(_none_hash):
    """The API server keeps a decided spec's condition (``admission._decide``) instead of parsing the pinned spec
    again: the two must be one condition, the probe's version pinned."""
    import dataclasses
    import json

    from test_controller import reader

    from hotwire_core.admission import pinned_spec
    from hotwire_core.gates import condition_of
    from hotwire_core.spec import parse_spec

    c = reader(readout_probes=2)
    c.rules = dataclasses.replace(c.rules, model=dataclasses.replace(c.rules.model, gates=("token", "latch")))
    resolved = c._resolve(json.dumps([_gated({"latch": True, "cosine": True}), {"id": "a", "layer": 2, "scale": 1.0}]))
    kept = condition_of(resolved)
    assert kept is not None and kept.version is not None
    assert kept == next(e.when for e in parse_spec(pinned_spec(resolved)) if e.when is not None)
