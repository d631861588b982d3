"""hotwire_core.controller: admission, bindings, cache salts, refusals, RPC surface and restore.

Uses real ``vllm.v1.request.Request`` objects with vLLM's own block hasher."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from vllm.utils.hashing import sha256

from hotwire_api.catalog import CatalogVector, rules_of
from hotwire_core import sessions as sessions_mod
from hotwire_core.admission import DEFAULT_STRENGTH_LIMIT, STRENGTH_LIMITS, ModelInfo, Refusal, resolve
from hotwire_core.contract import BINDING_KEY, READOUT_ARGS_KEY, USER_SALT_ATTR, SteerItem
from hotwire_core.bindings import BankWrite
from hotwire_core.controller import SteeringController, WaitForRows
from hotwire_core.spec import SALT_PREFIX
from hotwire_core.settings import Settings
from hotwire_core.vllm_glue.requests import VLLM_REQUESTS

N_LAYERS, HIDDEN, BLOCK = 4, 8, 16
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    init_none_hash(sha256)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def vec(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def model(steerable=True, layers=None) -> ModelInfo:
    return ModelInfo(
        steerable, "" if steerable else "no decoder layer", N_LAYERS, HIDDEN, "float32",
        frozenset(range(N_LAYERS) if layers is None else layers),
    )


def ctrl(slots=8, max_stack=2, store=None, preload=None, steerable=True, layers=None, name="org/model") -> SteeringController:
    return SteeringController(model(steerable, layers), Settings(slots, max_stack, "op", store, preload), name, VLLM_REQUESTS)


def ctrl_env(monkeypatch, **env: str) -> SteeringController:
    """A controller with its settings read from ``env`` (and defaults), as the engine core reads them."""
    for name in ("HOTWIRE_SLOTS", "HOTWIRE_MAX_ROWS", "HOTWIRE_MAX_WAIT_S", "HOTWIRE_VECTORS", "HOTWIRE_LAYERS",
                 "HOTWIRE_TENANT_ROWS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"HOTWIRE_STORE": "off", **env}.items():
        monkeypatch.setenv(name, value)
    return SteeringController(model(), Settings.from_env(), "org/model", VLLM_REQUESTS)


def register(c: SteeringController, vid: str, t: torch.Tensor, layers=None, replace=False) -> dict:
    out = c.register(vid, raw(t), "float32", list(t.shape), layers, replace)
    assert out["ok"], out
    return out


def request(rid="r", spec=None, salt=None, extra=None, prompt=PROMPT) -> Request:
    extra_args = dict(extra or {})
    if spec is not None:
        extra_args["hotwire"] = spec if isinstance(spec, str) else json.dumps(spec)
    sp = SamplingParams(max_tokens=8, extra_args=extra_args or None)
    return Request(rid, list(prompt), sp, None, cache_salt=salt, block_hasher=get_request_block_hasher(BLOCK, sha256))


def admit(c, rid="r", spec=None, **kw):
    req = request(rid, spec, **kw)
    return c.admit(req), req


def refusal(c, spec, rid="bad") -> Refusal:
    with pytest.raises(Refusal) as info:
        c.admit(request(rid, spec))
    return info.value


def state(c: SteeringController):
    """Everything admission may change, for no-side-effect checks."""
    s = c.stats()
    return (
        {k: v for k, v in s.items()},
        {vid: (v.version, v.refs) for vid, v in c.registry._current.items()},
        dict(c.registry._retired),
        dict(c.bindings),
        list(c.bindings._writes),
    )


@pytest.fixture
def c() -> SteeringController:
    c = ctrl()
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))  # a row per layer
    register(c, "g", vec(HIDDEN, seed=2))  # layer-agnostic
    register(c, "part", vec(2, HIDDEN, seed=3), layers=[2, 0])  # rows for layers 0 and 2 only
    return c


# -- unsteered -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [None, {}, {"other": 1}])
def test_unsteered_admit_is_none(c, extra):
    req = request(extra=extra)
    hashes = list(req.block_hashes)
    sp = req.sampling_params
    assert c.admit(req) is None
    assert req.cache_salt is None
    assert req.block_hashes == hashes and len(hashes) == 2
    assert req.sampling_params is sp
    assert c.take_writes() == [] and dict(c.bindings) == {}
    assert c.stats()["steered_requests"] == 0 and c.stats()["pinned"] == 0


def test_unsteered_keeps_user_salt(c):
    req = request(salt="user")
    c.admit(req)
    assert req.cache_salt == "user"


def test_pooling_request_without_sampling_params(c):
    class R:  # a request without sampling params (pooling): nothing to steer
        request_id = "pool"
        sampling_params = None
        cache_salt = None

    assert c.admit(R()) is None


# -- steered admission ---------------------------------------------------------------------------------------


def test_binding_config_phases_and_norm(c):
    spec = [
        {"id": "a", "layer": [2, 1], "scale": 3.0},
        {"id": "g", "layer": 1, "scale": 0.5, "norm": True, "decode_only": True},
        {"id": "part", "layer": 0, "scale": -1.5, "prefill_only": True},
    ]
    binding, req = admit(c, "r1", spec)
    slots = {(r["id"], r["layer"]): r["slot"] for r in c.stats()["rows"]}
    assert set(slots) == {("a", 1), ("a", 2), ("g", -1), ("part", 0)}
    assert len(set(slots.values())) == 4 and 0 not in slots.values()
    a1, a2, g, p0 = slots["a", 1], slots["a", 2], slots["g", -1], slots["part", 0]
    assert binding.config == {
        "p": [SteerItem(1, a1, 3.0, 0.0), SteerItem(2, a2, 3.0, 0.0), SteerItem(0, p0, -1.5, 0.0)],
        "d": [SteerItem(1, a1, 3.0, 0.0), SteerItem(2, a2, 3.0, 0.0), SteerItem(1, g, 0.0, 0.5)],
    }
    assert req.sampling_params.extra_args[BINDING_KEY] == binding.config
    assert req.sampling_params.extra_args["hotwire"] == json.dumps(spec)  # the spec itself stays
    assert binding.receipt == "a@1:L1+2x3;g@1:L1x0.5,norm,decode_only;part@1:L0x-1.5,prefill_only"
    assert [v.vector_id for v in binding.vectors] == ["a", "g", "part"]
    assert dict(c.bindings) == {"r1": binding}
    s = c.stats()
    assert (s["used"], s["pinned"], s["free"], s["steered_requests"]) == (4, 4, 4, 1)
    assert c.registry.current("a").refs == 1


def test_bank_writes_queued_once(c):
    assert not c.step_payload_pending
    binding, _ = admit(c, "r1", [{"id": "a", "layer": [0, 3], "scale": 1}, {"id": "g", "layer": [1, 2], "scale": 2}])
    assert c.step_payload_pending
    writes = c.take_writes()
    assert c.take_writes() == [] and not c.step_payload_pending
    assert all(isinstance(w, BankWrite) for w in writes)
    slots = {(r["id"], r["layer"]): r["slot"] for r in c.stats()["rows"]}
    by_slot = {w.slot: w for w in writes}
    assert len(writes) == 3 and set(by_slot) == set(slots.values())  # g is one row for both layers
    a, g = c.registry.current("a"), c.registry.current("g")
    for (vid, layer), slot in slots.items():
        expect = (a.rows[layer] if vid == "a" else g.rows[0]).float()
        w = by_slot[slot]
        assert w.row.dtype == torch.float32 and torch.equal(w.row, expect)
        assert w.inv_norm == pytest.approx(1.0 / float(expect.norm()))
    # g is used at layers 1 and 2 through the same slot
    assert [item[1] for item in binding.config["p"] if item[0] in (1, 2)] == [slots["g", -1]] * 2
    # a second request on the same rows loads nothing
    admit(c, "r2", [{"id": "g", "layer": 0, "scale": 9}])
    assert c.take_writes() == []
    assert {r["id"]: r["refcount"] for r in c.stats()["rows"] if r["id"] == "g"} == {"g": 2}


def test_zero_vector_inv_norm_is_finite(c):
    register(c, "zero", torch.zeros(HIDDEN))
    admit(c, "r", {"id": "zero", "layer": 0, "scale": 1, "norm": True})
    (w,) = c.take_writes()
    assert torch.isfinite(torch.tensor(w.inv_norm)) and torch.count_nonzero(w.row) == 0


def test_caller_sampling_params_not_mutated(c):
    sp = SamplingParams(max_tokens=8, extra_args={"hotwire": '{"id":"a","layer":1,"scale":2}', "keep": [1]})
    before = copy.deepcopy(sp.extra_args)
    req = Request("r", list(PROMPT), sp, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    c.admit(req)
    assert sp.extra_args == before and BINDING_KEY not in sp.extra_args
    assert req.sampling_params is not sp
    assert BINDING_KEY in req.sampling_params.extra_args
    assert req.sampling_params.extra_args["keep"] == [1]
    assert req.sampling_params.max_tokens == 8


def test_cache_salt_and_block_hashes(c):
    plain = request("p")
    binding, req = admit(c, "s", {"id": "a", "layer": 1, "scale": 2})
    assert req.cache_salt.startswith(SALT_PREFIX) and len(req.cache_salt) == len(SALT_PREFIX) + 64
    assert len(req.block_hashes) == len(plain.block_hashes) == 2
    assert req.block_hashes[0] != plain.block_hashes[0]
    assert req.block_hashes[1] != plain.block_hashes[1]  # chained
    # the recomputed hashes are exactly what vLLM computes for a request carrying that salt
    ref = Request("x", list(PROMPT), SamplingParams(max_tokens=8), None, cache_salt=req.cache_salt,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    assert req.block_hashes == ref.block_hashes


def test_cache_salt_same_for_same_steering(c):
    _, r1 = admit(c, "r1", {"id": "a", "layer": 1, "scale": 2})
    _, r2 = admit(c, "r2", '{"scale": 2.0, "layer": [1], "id": "a", "norm": false}')
    assert r1.cache_salt == r2.cache_salt and r1.block_hashes == r2.block_hashes


@pytest.mark.parametrize(
    "other",
    [
        {"id": "a", "layer": 1, "scale": 2.5},
        {"id": "a", "layer": 2, "scale": 2},
        {"id": "a", "layer": [1, 2], "scale": 2},
        {"id": "a", "layer": 1, "scale": 2, "norm": True},
        {"id": "a", "layer": 1, "scale": 2, "decode_only": True},
        {"id": "a", "layer": 1, "scale": 2, "prefill_only": True},
        {"id": "g", "layer": 1, "scale": 2},
        [{"id": "a", "layer": 1, "scale": 2}, {"id": "g", "layer": 3, "scale": 1}],
    ],
)
def test_cache_salt_differs_per_spec(c, other):
    _, r1 = admit(c, "r1", {"id": "a", "layer": 1, "scale": 2})
    _, r2 = admit(c, "r2", other)
    assert r1.cache_salt != r2.cache_salt
    assert r1.block_hashes[0] != r2.block_hashes[0]


@pytest.mark.parametrize("flag", ["decode_only", "prefill_only"])
def test_phase_restricted_salt_depends_on_the_prompt_length(c, flag):
    """A token's KV under a decode_only/prefill_only entry depends on whether it was prompt or output, so such
    requests share KV only with requests of the same prompt length; other specs do not care."""
    phased = {"id": "a", "layer": 1, "scale": 2, flag: True}
    plain_spec = {"id": "a", "layer": 1, "scale": 2}
    _, short = admit(c, "s", phased)
    _, same = admit(c, "s2", phased)
    _, longer = admit(c, "l", phased, prompt=PROMPT + [7, 8, 9])
    assert short.cache_salt == same.cache_salt != longer.cache_salt
    assert short.block_hashes[0] != longer.block_hashes[0]  # the same first block, not shared
    _, a = admit(c, "p1", plain_spec)
    _, b = admit(c, "p2", plain_spec, prompt=PROMPT + [7, 8, 9])
    assert a.cache_salt == b.cache_salt and a.block_hashes[0] == b.block_hashes[0]
    # the input thread's presalt agrees with admission
    assert c.cache_salt_for(json.dumps(phased), None, len(PROMPT) + 3) == longer.cache_salt


def test_cache_salt_follows_vector_content(c):
    spec = {"id": "g", "layer": 1, "scale": 2}
    _, r1 = admit(c, "r1", spec)
    register(c, "g", vec(HIDDEN, seed=99), replace=True)
    _, r2 = admit(c, "r2", spec)
    assert r1.cache_salt != r2.cache_salt
    # same content under a new version: the KV is the same, so the salt may be shared
    register(c, "g", vec(HIDDEN, seed=99), replace=True)
    _, r3 = admit(c, "r3", spec)
    assert r3.cache_salt == r2.cache_salt


def test_cache_salt_combines_user_salt(c):
    spec = {"id": "a", "layer": 1, "scale": 2}
    _, none = admit(c, "r0", spec)
    _, u1 = admit(c, "r1", spec, salt="tenant-1")
    _, u1b = admit(c, "r1b", spec, salt="tenant-1")
    _, u2 = admit(c, "r2", spec, salt="tenant-2")
    assert len({none.cache_salt, u1.cache_salt, u2.cache_salt, "tenant-1", "tenant-2"}) == 5
    assert u1.cache_salt == u1b.cache_salt
    plain_u1 = request("p", salt="tenant-1")
    assert u1.block_hashes[0] != plain_u1.block_hashes[0]


def test_user_salt_cannot_collide_with_steered_salt(c):
    _, steered = admit(c, "s", {"id": "a", "layer": 1, "scale": 2})
    forged = request("f", salt=steered.cache_salt)
    with pytest.raises(Refusal) as exc:
        c.admit(forged)
    assert exc.value.code == "reserved_salt" and exc.value.field == "cache_salt"


def presalted(c, rid, spec, salt=None) -> Request:
    """A request built as hotwire's ``preprocess_add_request`` hook builds it: salted before vLLM hashes it."""
    spec_json = json.dumps(spec)
    presalt = c.cache_salt_for(spec_json, salt, len(PROMPT))
    assert presalt is not None
    req = request(rid, spec_json, salt=presalt)
    setattr(req, USER_SALT_ATTR, salt)
    return req


@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_presalted_request_keeps_its_block_hashes(c, salt):
    spec = {"id": "a", "layer": 1, "scale": 2}
    _, ref = admit(c, "ref", spec, salt=salt)  # salted by admission, blocks hashed again
    req = presalted(c, "r", spec, salt)
    hashed, hasher = [], req._block_hasher
    req._block_hasher = lambda r: hashed.append(r) or hasher(r)
    c.admit(req)
    assert hashed == [] and req.cache_salt == ref.cache_salt and req.block_hashes == ref.block_hashes


def test_presalted_request_is_hashed_again_when_the_vector_changed_meanwhile(c):
    spec = {"id": "a", "layer": 1, "scale": 2}
    req = presalted(c, "r", spec)
    old = list(req.block_hashes)
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=9), replace=True)  # between the input thread and admission
    c.admit(req)
    _, ref = admit(c, "ref", spec)
    assert req.cache_salt == ref.cache_salt and req.block_hashes == ref.block_hashes != old


def test_cache_salt_for_requests_admission_would_refuse_is_none(c):
    assert c.cache_salt_for('{"id": "nope", "layer": 1, "scale": 1}', None, 40) is None  # unknown vector
    assert c.cache_salt_for("{not json", None, 40) is None
    forged = c.cache_salt_for('{"id": "a", "layer": 1, "scale": 1}', None, 40)
    assert c.cache_salt_for('{"id": "a", "layer": 1, "scale": 1}', forged, 40) is None  # a reserved user salt
    req = request("f", salt=forged)  # and admission refuses it, as before
    setattr(req, USER_SALT_ATTR, forged)
    with pytest.raises(Refusal, match="cache_salt may not start"):
        c.admit(req)


def test_same_vector_twice_shares_rows_and_refs(c):
    binding, _ = admit(c, "r", [{"id": "a", "layer": 1, "scale": 1}, {"id": "a", "layer": 1, "scale": 2}])
    assert len(c.take_writes()) == 1
    slot = c.stats()["rows"][0]["slot"]
    assert binding.config["p"] == [SteerItem(1, slot, 1.0, 0.0), SteerItem(1, slot, 2.0, 0.0)]
    assert c.registry.current("a").refs == 1 and binding.vectors == [c.registry.current("a")]
    c.release("r")
    assert c.registry.current("a").refs == 0 and c.stats()["pinned"] == 0


# -- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,code,field",
    [
        ('{"id": "a",', "bad_spec", "hotwire"),
        ([{"id": "a", "layer": 1, "scale": "x"}], "bad_spec", "hotwire[0].scale"),
        ([{"id": "a", "layer": 1, "scale": 1}, {"id": "a", "layer": 1}], "bad_spec", "hotwire[1].scale"),
        ([{"id": "a", "layer": 1, "scale": 1}, {"id": "nope", "layer": 1, "scale": 1}], "unknown_vector", "hotwire[1].id"),
        ({"id": "a", "layer": N_LAYERS, "scale": 1}, "layer_out_of_range", "hotwire.layer".replace(".", "[0].")),
        ([{"id": "g", "layer": 0, "scale": 1}, {"id": "g", "layer": [0, 9], "scale": 1}], "layer_out_of_range", "hotwire[1].layer"),
        ({"id": "part", "layer": 1, "scale": 1}, "no_row_for_layer", "hotwire[0].layer"),
        ([{"id": "a", "layer": 1, "scale": s} for s in (1, 2, 3)], "too_many_entries", "hotwire"),
        ([{"id": "a", "layer": [0, 1], "scale": 1}, {"id": "g", "layer": 1, "scale": 1}, {"id": "part", "layer": [0, 2], "scale": 1},
          {"id": "g", "layer": [1, 3], "scale": 1, "decode_only": True}], "too_many_entries", "hotwire"),
    ],
)
def test_refusals_400(c, spec, code, field):
    before = state(c)
    err = refusal(c, spec)
    assert (err.status, err.code, err.field) == (400, code, field)
    assert c.stats()["refused"] == {code: 1}
    after = state(c)
    assert {k: v for k, v in after[0].items() if k != "refused"} == {k: v for k, v in before[0].items() if k != "refused"}
    assert after[1:] == before[1:]
    res = err.to_result()
    assert res["ok"] is False and res["status"] == 400 and res["code"] == code and res["field"] == field


def test_stack_limit_is_per_phase(c):
    # max_stack=2: two decode-only + two prefill-only entries on layer 1 fit (2 per phase) ...
    spec = [
        {"id": "a", "layer": 1, "scale": 1, "decode_only": True},
        {"id": "g", "layer": 1, "scale": 1, "decode_only": True},
        {"id": "a", "layer": 1, "scale": 2, "prefill_only": True},
        {"id": "g", "layer": 1, "scale": 2, "prefill_only": True},
    ]
    binding, _ = admit(c, "ok", spec)
    assert len(binding.config["p"]) == 2 and len(binding.config["d"]) == 2
    # ... one more entry for every phase does not
    err = refusal(c, spec + [{"id": "a", "layer": 1, "scale": 3}])
    assert err.code == "too_many_entries" and "HOTWIRE_MAX_STACK=2" in err.message


def test_steering_strong_enough_to_overflow_the_model_is_refused(c):
    g_norm = c.registry.current("g").row_norm(1)
    fits = 0.99 * DEFAULT_STRENGTH_LIMIT.added_norm / g_norm
    admit(c, "ok", {"id": "g", "layer": 1, "scale": -fits})
    c.release("ok")
    for spec, culprit in (
        ({"id": "g", "layer": [1, 2], "scale": fits}, 0),  # summed over layers
        ([{"id": "g", "layer": 1, "scale": fits / 20}, {"id": "g", "layer": 2, "scale": fits}], 1),  # and over entries
        ({"id": "g", "layer": 1, "scale": 3e38}, 0),
        ([{"id": "g", "layer": 0, "scale": 1.0, "norm": True},  # 11**4 > 1e3
          {"id": "g", "layer": list(range(N_LAYERS)), "scale": 10.0, "norm": True}], 1),
    ):
        before = state(c)
        err = refusal(c, spec)
        assert (err.status, err.code, err.field) == (400, "too_strong", f"hotwire[{culprit}].scale"), spec
        assert "float32 model" in err.message and f"hotwire[{culprit}] weighs most" in err.message
        assert " tokens (" not in err.message  # no phase named when every entry steers every token
        assert state(c)[1:] == before[1:]
    # per phase: the strongest prefill-only and decode-only entries never apply to the same token
    admit(c, "phases", [{"id": "g", "layer": 1, "scale": fits, "prefill_only": True},
                        {"id": "g", "layer": 2, "scale": fits, "decode_only": True}])
    err = refusal(c, [{"id": "g", "layer": 1, "scale": 1.0}, {"id": "g", "layer": 2, "scale": 3e38, "decode_only": True}])
    assert "on generated tokens" in err.message and err.field == "hotwire[1].scale"
    admit(c, "norm", {"id": "g", "layer": [0, 1, 2], "scale": 9.0, "norm": True})  # 10**3: at the limit
    assert c.check(json.dumps({"id": "g", "layer": [1, 2], "scale": fits}))["code"] == "too_strong"


def test_strength_growth_beyond_a_float_is_reported_as_a_power_of_e():
    deep = ModelInfo(True, "", 16, HIDDEN, "float32", frozenset(range(16)))
    c = SteeringController(deep, Settings(8, 2, "op", None, None), "org/model", VLLM_REQUESTS)
    register(c, "g", vec(HIDDEN))
    err = refusal(c, {"id": "g", "layer": list(range(16)), "scale": 3e38, "norm": True})
    assert err.code == "too_strong" and "e^1418-fold" in err.message  # 16 * ln(1 + 3e38): exp() would overflow


def fp16_controller() -> SteeringController:
    fp16 = ModelInfo(True, "", N_LAYERS, HIDDEN, "float16", frozenset(range(N_LAYERS)))
    c = SteeringController(fp16, Settings(8, 2, "op", None, None), "org/model", VLLM_REQUESTS)
    register(c, "g", vec(HIDDEN))
    return c


def test_float16_models_have_a_lower_strength_limit():
    c = fp16_controller()
    g_norm = c.registry.current("g").row_norm(0)
    limit = STRENGTH_LIMITS["float16"]
    admit(c, "ok", {"id": "g", "layer": 0, "scale": 0.99 * limit.added_norm / g_norm})
    err = refusal(c, {"id": "g", "layer": 0, "scale": 1.01 * limit.added_norm / g_norm})
    assert err.code == "too_strong" and "float16 model" in err.message


def test_norm_relative_entries_multiply_what_earlier_layers_added():
    """A token's norm goes n -> g n + A layer by layer: a norm-relative entry scales up absolute steering added at
    an earlier layer, not at a later one (found by review: each limit alone let 8 x (n + 4096) through on float16)."""
    c = fp16_controller()
    limit = STRENGTH_LIMITS["float16"]
    strong = 0.9 * limit.added_norm / c.registry.current("g").row_norm(0)
    grow = limit.norm_growth - 1
    admit(c, "later", [{"id": "g", "layer": 0, "scale": grow, "norm": True}, {"id": "g", "layer": 1, "scale": strong}])
    c.release("later")
    err = refusal(c, [{"id": "g", "layer": 0, "scale": strong}, {"id": "g", "layer": 1, "scale": grow, "norm": True}])
    assert err.code == "too_strong" and err.field == "hotwire[0].scale"
    assert "multiplied by the growth of norm-relative entries at later layers" in err.message


def test_stacked_norm_relative_entries_share_one_norm_read():
    """The kernel reads a layer's norm once for all its entries: growth 1 + sum |scale|, not a product."""
    c = fp16_controller()
    half = (STRENGTH_LIMITS["float16"].norm_growth - 1) / 2
    admit(c, "at-limit", [{"id": "g", "layer": 0, "scale": half, "norm": True}, {"id": "g", "layer": 0, "scale": -half, "norm": True}])
    c.release("at-limit")
    err = refusal(c, [{"id": "g", "layer": 0, "scale": half, "norm": True}, {"id": "g", "layer": 0, "scale": half + 0.1, "norm": True}])
    assert err.code == "too_strong" and err.field == "hotwire[1].scale"


def test_layer_without_hook_refused():
    c = ctrl(layers={0, 1, 3})  # e.g. layer 2 has no hook on any rank
    register(c, "g", vec(HIDDEN))
    err = refusal(c, {"id": "g", "layer": 2, "scale": 1})
    assert (err.status, err.code, err.field) == (400, "layer_out_of_range", "hotwire[0].layer")
    assert "this server steers layers 0-1,3" in err.message and "HOTWIRE_LAYERS" not in err.message
    assert admit(c, "ok", {"id": "g", "layer": 3, "scale": 1})[0] is not None
    assert c.stats()["model"]["layers"] == "0-1,3"


def test_layer_outside_hotwire_layers_names_the_setting():
    settings = Settings(8, 2, "op", None, None, layers=frozenset({1, 2}))
    c = SteeringController(model(layers={1, 2}), settings, "org/model", VLLM_REQUESTS)
    register(c, "g", vec(HIDDEN))
    err = refusal(c, {"id": "g", "layer": [1, 3], "scale": 1})
    assert (err.code, err.field) == ("layer_out_of_range", "hotwire[0].layer")
    assert err.message == f"layer 3 cannot be steered: this server steers layers 1-2 (HOTWIRE_LAYERS; the model has 0-{N_LAYERS - 1})"


def test_model_not_steerable():
    c = ctrl(steerable=False)
    register(c, "g", vec(HIDDEN))
    err = refusal(c, {"id": "g", "layer": 0, "scale": 1})
    assert (err.status, err.code) == (503, "model_not_steerable")
    assert "no decoder layer" in err.message
    err = refusal(c, "not even json")  # 503 comes before spec parsing
    assert err.status == 503
    assert c.stats()["refused"] == {"model_not_steerable": 2}
    assert c.stats()["model"]["steerable"] is False
    # unsteered requests are still fine
    assert c.admit(request("plain")) is None


def test_slots_exhausted():
    c = ctrl(slots=2)
    register(c, "a", vec(N_LAYERS, HIDDEN))
    admit(c, "r1", {"id": "a", "layer": [0, 1], "scale": 1})
    c.take_writes()
    before = state(c)
    err = refusal(c, {"id": "a", "layer": [1, 2], "scale": 1}, rid="r2")
    assert (err.status, err.code) == (429, "slots_exhausted")
    assert "HOTWIRE_SLOTS" in err.message
    assert c.stats()["refused"] == {}  # the engine defers such requests (see test_deferred_*): not a refusal
    after = state(c)
    assert after[1:] == before[1:]  # no refs, no bindings, no writes
    assert {k: v for k, v in after[0].items() if k != "refused"} == {k: v for k, v in before[0].items() if k != "refused"}
    # a request that needs only resident rows still fits
    admit(c, "r3", {"id": "a", "layer": 1, "scale": 5})
    c.release("r1")
    c.release("r3")
    binding, _ = admit(c, "r2", {"id": "a", "layer": [1, 2], "scale": 1})
    assert binding is not None and c.stats()["evictions"] == 1


def test_refused_counts_accumulate(c):
    for _ in range(3):
        refusal(c, {"id": "nope", "layer": 0, "scale": 1})
    refusal(c, "[]")
    assert c.stats()["refused"] == {"unknown_vector": 3, "bad_spec": 1}


def test_admit_over_count_refuses_cleanly():
    c = ctrl(slots=2)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    register(c, "c", vec(HIDDEN, seed=3))
    admit(c, "r1", {"id": "a", "layer": 0, "scale": 1})
    c.release("r1")  # a: resident, unpinned
    admit(c, "r2", {"id": "c", "layer": 0, "scale": 1})  # c: pinned
    spec = [{"id": "a", "layer": 0, "scale": 1}, {"id": "b", "layer": 0, "scale": 1}]
    checked = c.check(json.dumps(spec))
    err = refusal(c, spec)  # a is its own row, not an evictable one: b has nowhere to go
    assert err.status == 429 and c.stats()["pinned"] == 1
    assert checked["ok"] is False and checked["status"] == 429


def test_more_rows_than_capacity_is_400_in_check_and_admit():
    c = ctrl(slots=1)
    register(c, "a", vec(N_LAYERS, HIDDEN))
    spec = {"id": "a", "layer": [0, 1], "scale": 1}
    assert c.check(json.dumps(spec))["code"] == "too_many_rows"
    err = refusal(c, spec)
    assert (err.status, err.code) == (400, "too_many_rows")
    assert c.stats()["refused"] == {"too_many_rows": 1}


def test_a_spec_over_the_row_cap_is_400_in_check_admit_and_the_api_servers_rules(monkeypatch):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="8", HOTWIRE_MAX_ROWS="3")
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "g", vec(HIDDEN, seed=2))  # one row for every layer it steers
    over = [{"id": "a", "layer": [0, 1, 2], "scale": 1}, {"id": "g", "layer": [0, 3], "scale": 1}]  # 4 rows
    before = state(c)
    err = refusal(c, over)
    assert (err.status, err.code, err.field) == (400, "too_many_rows", "hotwire")
    for text in ("needs 4 bank rows", "at most 3 of the 8", "HOTWIRE_MAX_ROWS=3", "steer fewer layers or vectors"):
        assert text in err.message
    assert c.stats()["refused"] == {"too_many_rows": 1} and state(c)[1:] == before[1:]
    assert c.check(json.dumps(over)) == c.check(json.dumps(over), False) == err.to_result()  # hotwire_check
    # The API server decides from the catalog the engine hands it, alike.
    catalog = c.catalog()
    assert catalog["max_rows"] == 3 and rules_of(catalog) == c.rules
    vectors = {v.vector_id: v for v in map(CatalogVector.from_meta, catalog["vectors"])}
    with pytest.raises(Refusal) as api:
        resolve(json.dumps(over), lambda vector_id, version: vectors.get(vector_id), rules_of(catalog))
    assert api.value.to_result() == err.to_result()
    assert admit(c, "fits", [{"id": "a", "layer": [0, 1], "scale": 1}, {"id": "g", "layer": [0, 1, 2, 3], "scale": 1}])[0]


def test_by_default_one_request_may_pin_a_quarter_of_the_bank_or_a_row_per_steerable_layer(monkeypatch):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="8")  # a quarter is 2 rows, the model has 4 layers
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "b", vec(N_LAYERS, HIDDEN, seed=2))
    assert admit(c, "every-layer", {"id": "a", "layer": [0, 1, 2, 3], "scale": 1})[0] is not None
    err = refusal(c, [{"id": "a", "layer": [0, 1, 2, 3], "scale": 1}, {"id": "b", "layer": 0, "scale": 1}])
    assert err.code == "too_many_rows" and "HOTWIRE_MAX_ROWS=4" in err.message and c.rules.max_rows == 4


class Clock:
    """``time`` for ``hotwire_core.deferral``: its ``monotonic`` reads ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("hotwire_core.deferral.time", clock, raising=False)
    return clock


def waiting(c: SteeringController, rid: str, spec, ticket: str | None = None) -> Request:
    """A request the engine glue defers, as ``EngineCore.add_request`` does."""
    req = request(rid, spec, extra={"hotwire_ticket": ticket} if ticket else None)
    with pytest.raises(WaitForRows) as info:
        c.admit(req)
    c.defer(req, info.value.resolved)
    return req


def refusals_reported(c: SteeringController) -> list[tuple[Request, Refusal]]:
    """What the engine glue's ``on_refused`` gets; the refusal is kept for the request's ticket, as there."""
    reported: list[tuple[Request, Refusal]] = []
    c.on_refused = lambda req, exc: (c.note_refusal(req, exc), reported.append((req, exc)))
    return reported


def test_a_request_that_waits_past_hotwire_max_wait_s_is_refused_with_503_slots_busy(monkeypatch, clock):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="3", HOTWIRE_MAX_WAIT_S="5")
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "b", vec(N_LAYERS, HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": [0, 1, 2], "scale": 1})  # the whole bank
    reported = refusals_reported(c)
    first = waiting(c, "first", {"id": "b", "layer": [0, 1], "scale": 1}, ticket="T1")
    clock.now += 2
    second = waiting(c, "second", {"id": "b", "layer": [2], "scale": 1})
    clock.now += 2.9
    assert c.admit_deferred() == [] and reported == [] and list(c.deferred) == ["first", "second"]
    clock.now += 0.1  # first has waited 5 s, second 3 s
    assert c.admit_deferred() == [] and list(c.deferred) == ["second"]
    ((req, exc),) = reported
    assert req is first and (exc.status, exc.code) == (503, "slots_busy")
    for text in ("waited 5.0 s", "HOTWIRE_MAX_WAIT_S=5", "needs 2 more bank rows and only 0 can be freed",
                 "3 of the 3 rows are pinned by 1 running steered request(s), the largest holding 3",
                 "Retry later", "raise HOTWIRE_SLOTS", "lower HOTWIRE_MAX_ROWS"):  # fmt: skip
        assert text in exc.message, exc.message
    assert c.refusals(["T1"])["refusals"]["T1"] == exc.to_result()  # what its API server answers with
    assert c.stats()["refused"] == {"slots_busy": 1} and c.registry.current("b").refs == 1  # second's hold
    clock.now += 2
    assert c.admit_deferred() == [] and [r for r, _ in reported] == [first, second] and not c.deferred
    assert c.stats()["refused"] == {"slots_busy": 2} and c.registry.current("b").refs == 0
    assert c.stats()["pinned"] == 3 and "hog" in c.bindings  # the holder runs on


def test_a_refused_request_lets_the_next_one_in_and_one_that_fits_is_never_refused(monkeypatch, clock):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="3", HOTWIRE_MAX_WAIT_S="5")
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "b", vec(N_LAYERS, HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": [0, 1], "scale": 1})
    reported = refusals_reported(c)
    big = waiting(c, "big", {"id": "b", "layer": [0, 1, 2], "scale": 1})
    small = waiting(c, "small", {"id": "b", "layer": 0, "scale": 1})  # fits, but comes after big
    clock.now += 5
    assert c.admit_deferred() == [small] and [r for r, _ in reported] == [big]
    late = waiting(c, "late", {"id": "a", "layer": 2, "scale": 1})
    clock.now += 60  # e.g. a paused engine, which does not step
    c.release("hog")
    assert c.admit_deferred() == [late] and len(reported) == 1  # its rows are free now: served, not refused


def test_hotwire_max_wait_s_0_refuses_a_request_that_cannot_pin_its_rows_at_once(monkeypatch, clock):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="1", HOTWIRE_MAX_WAIT_S="0")
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": 0, "scale": 1})
    reported = refusals_reported(c)
    waiting(c, "w", {"id": "b", "layer": 0, "scale": 1})
    assert c.admit_deferred() == [] and not c.deferred
    assert reported[0][1].code == "slots_busy" and "waited 0.0 s" in reported[0][1].message


def test_a_request_waiting_behind_a_preempted_one_is_told_so_when_it_gives_up(monkeypatch, clock):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="2", HOTWIRE_MAX_WAIT_S="5")
    for vid, seed in (("a", 1), ("b", 2), ("c", 3)):
        register(c, vid, vec(N_LAYERS, HIDDEN, seed=seed))
    _, r1 = admit(c, "r1", {"id": "a", "layer": [0, 1], "scale": 1})
    c.suspend("r1")
    admit(c, "r2", {"id": "b", "layer": 0, "scale": 1})
    assert c.resume(r1) is False
    reported = refusals_reported(c)
    waiting(c, "w", {"id": "c", "layer": 0, "scale": 1})  # one row would be free: it waits behind r1
    clock.now += 5
    assert c.admit_deferred() == []
    assert "preempted steered requests are waiting to pin their rows again" in reported[0][1].message


def test_deferred_requests_are_admitted_in_order_when_rows_free():
    c = ctrl(slots=2)
    register(c, "a", vec(N_LAYERS, HIDDEN))
    admit(c, "holder", {"id": "a", "layer": [0, 1], "scale": 1})
    waiting = [request(f"w{i}", {"id": "a", "layer": [2, 3], "scale": 1}) for i in range(2)]
    for r in waiting:
        with pytest.raises(Refusal):
            c.admit(r)
        c.defer(r)
    assert c.admit_deferred() == [] and c.stats()["deferred"] == 2
    c.release("holder")
    assert c.admit_deferred() == waiting  # both fit: they share rows (a@1 layers 2 and 3)
    assert c.stats()["deferred"] == 0 and c.stats()["deferrals"] == 2 and c.stats()["pinned"] == 2


def test_deferred_request_keeps_the_version_it_resolved_when_the_vector_is_deleted():
    c = ctrl(slots=2)
    register(c, "a", vec(N_LAYERS, HIDDEN))
    register(c, "b", vec(HIDDEN))
    admit(c, "holder", {"id": "a", "layer": [0, 1], "scale": 1})
    late = request("late", {"id": "b", "layer": 0, "scale": 1})
    with pytest.raises(Refusal):
        c.admit(late)
    c.defer(late)
    assert c.list()["vectors"][1]["in_flight"] == 1  # the deferred request holds b@1
    c.unregister("b")
    register(c, "b", vec(HIDDEN, seed=9))  # b@2, registered while late waits
    c.release("holder")
    assert c.admit_deferred() == [late]
    assert c.bindings["late"].receipt == "b@1:L0x1"
    c.release("late")
    assert all(v["in_flight"] == 0 for v in c.list()["vectors"])


def test_a_pinned_version_is_applied_while_retained():
    c = ctrl()
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "a", vec(HIDDEN, seed=2), replace=True)
    binding, _ = admit(c, "old", {"id": "a", "layer": 0, "scale": 1, "version": 1})
    assert binding.receipt == "a@1:L0x1"
    assert admit(c, "new", {"id": "a", "layer": 0, "scale": 1})[0].receipt == "a@2:L0x1"
    c.unregister("a")
    assert admit(c, "after-delete", {"id": "a", "layer": 0, "scale": 1, "version": 2})[0].receipt == "a@2:L0x1"
    assert refusal(c, {"id": "a", "layer": 0, "scale": 1}).code == "unknown_vector"
    assert refusal(c, {"id": "a", "layer": 0, "scale": 1, "version": 7}).code == "unknown_vector"


def test_a_pinned_version_past_its_retention_is_refused_not_replaced():
    c = SteeringController(model(True, None), Settings(8, 2, "op", None, None, retain_s=0), "org/model", VLLM_REQUESTS)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "a", vec(HIDDEN, seed=2), replace=True)
    gone = refusal(c, {"id": "a", "layer": 0, "scale": 1, "version": 1})
    assert (gone.status, gone.code, gone.field) == (410, "version_gone", "hotwire[0].version")


def test_a_version_the_fleet_retired_is_held_for_what_is_left_of_its_retention(monkeypatch):
    clock = {"wall": 10_000.0, "mono": 500.0}
    monkeypatch.setattr("hotwire_core.vector_changes.time.time", lambda: clock["wall"])
    monkeypatch.setattr("hotwire_core.vector_changes.time.monotonic", lambda: clock["mono"])
    monkeypatch.setattr("hotwire_core.registry.time.monotonic", lambda: clock["mono"])
    c = ctrl()  # HOTWIRE_RETAIN_S 60
    register(c, "a", vec(HIDDEN, seed=2))  # this replica heard of version 1 only after it
    old = vec(HIDDEN, seed=1)
    args = ("a", raw(old), "float32", [HIDDEN], None, False)
    out = c.register(*args, 7, clock["wall"] - 45)  # retired by the fleet 45 s ago
    assert out["ok"] and out["vector"]["version"] == 7
    assert [v["version"] for v in c.list()["vectors"]] == [1]  # held as retired, never current
    assert admit(c, "pinned", {"id": "a", "layer": 0, "scale": 1, "version": 7})[0].receipt == "a@7:L0x1"
    c.release("pinned")
    clock["mono"] += 14.9
    assert c.registry.lookup("a", 7) is not None
    clock["mono"] += 0.2  # 60 s after the fleet retired it, not 60 s after this replica heard of it
    assert c.registry.lookup("a", 7) is None
    assert refusal(c, {"id": "a", "layer": 0, "scale": 1, "version": 7}).code == "version_gone"
    late = c.register("a", raw(vec(HIDDEN, seed=3)), "float32", [HIDDEN], None, False, 8, clock["wall"] - 61)
    assert (late["ok"], late["status"], late["code"]) == (False, 410, "version_gone")
    assert c.registry.lookup("a", 8) is None
    # newer than the current version, yet retired elsewhere: still not current here
    assert c.register("a", raw(vec(HIDDEN, seed=4)), "float32", [HIDDEN], None, False, 9, clock["wall"])["ok"]
    assert [v["version"] for v in c.list()["vectors"]] == [1] and c.registry.lookup("a", 9) is not None
    bad = c.register(*args, None, clock["wall"])
    assert (bad["ok"], bad["status"], bad["field"]) == (False, 400, "version")


def test_export_gives_back_what_register_took(c):
    t = vec(2, HIDDEN, seed=5)
    meta = register(c, "x", t, layers=[3, 1])["vector"]
    out = c.export("x", 1)
    assert out["ok"] and out["vector"]["sha256"] == meta["sha256"]
    again = ctrl()
    v = out["vector"]
    back = again.register("x", out["data"], v["dtype"], v["shape"], v["layers"], False, 1)
    assert back["ok"] and back["vector"]["sha256"] == meta["sha256"]
    register(c, "x", vec(HIDDEN, seed=6), replace=True)
    assert c.export("x", 1)["ok"]  # retained versions too
    assert c.export("x", None)["vector"]["version"] == 2  # None: the current one, looked up in the same call
    for missing in (c.export("x", 5), c.export("nope", None)):
        assert (missing["ok"], missing["status"], missing["code"]) == (False, 404, "unknown_vector")


def test_pinned_and_unpinned_specs_of_the_same_contents_share_a_cache_salt():
    c = ctrl()
    register(c, "a", vec(HIDDEN, seed=1))
    _, plain = admit(c, "x", {"id": "a", "layer": 0, "scale": 1})
    _, pinned = admit(c, "y", {"id": "a", "layer": 0, "scale": 1, "version": 1})
    assert plain.cache_salt == pinned.cache_salt


def test_versions_numbered_by_another_engine_core_agree_whatever_the_order():
    first, late = ctrl(), ctrl()
    register(first, "a", vec(HIDDEN, seed=1))
    register(first, "a", vec(HIDDEN, seed=2), replace=True)
    for version, seed in ((2, 2), (1, 1)):  # the second engine core hears of version 2 first
        t = vec(HIDDEN, seed=seed)
        assert late.register("a", raw(t), "float32", [HIDDEN], None, False, version)["ok"]
    assert [v["version"] for v in late.list()["vectors"]] == [2]
    assert late.list()["vectors"][0]["sha256"] == first.list()["vectors"][0]["sha256"]
    assert admit(late, "r", {"id": "a", "layer": 0, "scale": 1, "version": 1})[0].receipt == "a@1:L0x1"
    # a deletion of version 2 heard before a registration of version 3, and one of version 1 after version 2
    assert late.unregister("a", 1)["ok"] and late.list()["vectors"][0]["version"] == 2
    assert late.unregister("a", 2)["ok"] and late.list()["vectors"] == []
    assert late.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False, 2)["ok"]
    assert late.list()["vectors"] == []


def test_catalog_is_the_registry_for_api_servers():
    c = ctrl()
    first = c.catalog()
    assert first["ok"] and first["vectors"] == [] and first["capacity"] == 8 and first["model"]["n_layers"] == N_LAYERS
    assert c.catalog(first["generation"]) == {"ok": True, "generation": first["generation"], "unchanged": True}
    register(c, "a", vec(HIDDEN))
    changed = c.catalog(first["generation"])
    assert changed["generation"] > first["generation"]
    assert [(v["id"], v["version"]) for v in changed["vectors"]] == [("a", 1)]


def test_refusals_of_ticketed_requests_are_kept_for_their_api_server():
    c = ctrl()
    ticketed = request("t", {"id": "nope", "layer": 0, "scale": 1}, extra={"hotwire_ticket": "T1"})
    with pytest.raises(Refusal) as info:
        c.admit(ticketed)
    c.note_refusal(ticketed, info.value)
    c.note_refusal(request("u", {"id": "nope", "layer": 0, "scale": 1}), info.value)  # no ticket: nothing kept
    found = c.refusals(["T1", "T2"])["refusals"]
    assert list(found) == ["T1"] and found["T1"]["code"] == "unknown_vector"
    assert c.refusals(["T1"])["refusals"] == {}  # handed out once


def test_aborted_deferred_requests_are_dropped():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN))
    register(c, "b", vec(HIDDEN, seed=5))
    admit(c, "holder", {"id": "a", "layer": 0, "scale": 1})
    for rid in ("x", "y", "z"):
        r = request(rid, {"id": "b", "layer": 0, "scale": 1})
        with pytest.raises(Refusal):
            c.admit(r)
        c.defer(r)
    c.drop_deferred("x")
    c.drop_deferred(["y"])
    assert list(c.deferred) == ["z"]
    c.drop_deferred(None)
    assert not c.deferred


def test_huge_int_scale_is_refusal(c):
    spec = '{"id": "a", "layer": 1, "scale": %s}' % ("9" * 400)
    assert c.check(spec)["status"] == 400
    assert refusal(c, spec).code == "bad_spec"


# -- release / re-register / unregister ----------------------------------------------------------------------


def test_release_unpins(c):
    admit(c, "r1", {"id": "a", "layer": [0, 1], "scale": 1})
    admit(c, "r2", {"id": "a", "layer": 1, "scale": 1})
    assert c.stats()["pinned"] == 2
    c.release("r1")
    rows = {r["layer"]: r["refcount"] for r in c.stats()["rows"]}
    assert rows == {0: 0, 1: 1} and c.stats()["pinned"] == 1
    assert "r1" not in c.bindings and c.registry.current("a").refs == 1
    c.release("r1")  # twice: no-op
    c.release("never-admitted")
    assert c.registry.current("a").refs == 1
    c.release("r2")
    assert c.stats()["pinned"] == 0 and c.stats()["used"] == 2  # rows stay cached
    assert c.registry.current("a").refs == 0


def test_reregister_under_inflight_request(c):
    spec = {"id": "a", "layer": 1, "scale": 2}
    b1, _ = admit(c, "r1", spec)
    old_slot = b1.config["p"][0][1]
    c.take_writes()
    new = vec(N_LAYERS, HIDDEN, seed=50)
    out = register(c, "a", new, replace=True)
    assert out["created"] is False and out["vector"]["version"] == 2
    assert b1.vectors[0].version == 1 and b1.vectors[0].retired
    b2, _ = admit(c, "r2", spec)
    assert b2.vectors[0].version == 2 and b2.receipt == "a@2:L1x2"
    new_slot = b2.config["p"][0][1]
    assert new_slot != old_slot
    (w,) = c.take_writes()
    assert w.slot == new_slot and torch.equal(w.row, new[1])
    assert {m["id"]: m["in_flight"] for m in c.list()["vectors"]}["a"] == 2
    assert {(r["version"], r["refcount"]) for r in c.stats()["rows"]} == {(1, 1), (2, 1)}
    c.release("r1")  # last user of version 1: its rows go
    assert {(r["version"], r["refcount"]) for r in c.stats()["rows"]} == {(2, 1)}
    assert c.registry.in_flight("a") == 1
    c.release("r2")
    assert {(r["version"], r["refcount"]) for r in c.stats()["rows"]} == {(2, 0)}


def test_replace_drops_unreferenced_old_rows(c):
    admit(c, "r1", {"id": "a", "layer": 1, "scale": 2})
    c.release("r1")
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=7), replace=True)
    assert [r for r in c.stats()["rows"] if r["id"] == "a"] == []


def test_unregister_returns_in_flight(c):
    admit(c, "r1", {"id": "a", "layer": 1, "scale": 2})
    admit(c, "r2", {"id": "a", "layer": 1, "scale": 3})
    assert c.unregister("a") == {"ok": True, "in_flight": 2, "version": 1}
    assert [v["id"] for v in c.list()["vectors"]] == ["g", "part"]
    err = refusal(c, {"id": "a", "layer": 1, "scale": 2})
    assert err.code == "unknown_vector"
    c.release("r1")
    assert [r["id"] for r in c.stats()["rows"]] == ["a"]
    c.release("r2")
    assert c.stats()["rows"] == [] and c.stats()["used"] == 0
    out = register(c, "a", vec(HIDDEN))
    assert out["created"] is True and out["vector"]["version"] == 2


def test_unregister_idle_drops_rows_now(c):
    admit(c, "r1", {"id": "g", "layer": 1, "scale": 2})
    c.release("r1")
    assert c.stats()["used"] == 1
    assert c.unregister("g") == {"ok": True, "in_flight": 0, "version": 1}
    assert c.stats()["used"] == 0 and c.stats()["free"] == 8


def test_unregister_unknown(c):
    out = c.unregister("nope")
    assert out == {"ok": False, "status": 404, "code": "unknown_vector", "error": "unknown steering vector 'nope'", "field": "id"}


def test_register_results(c):
    out = c.register("new", raw(vec(HIDDEN)), "float32", [HIDDEN])
    assert out["ok"] and out["created"] is True and out["vector"]["id"] == "new"
    assert set(out["vector"]) == {"id", "version", "sha256", "dtype", "shape", "layers", "norms", "in_flight", "created_at",
                                  "tenant"}
    dup = c.register("new", raw(vec(HIDDEN)), "float32", [HIDDEN])
    assert (dup["ok"], dup["status"], dup["code"]) == (False, 409, "exists")
    bad = c.register("x", b"\0" * 3, "float32", [HIDDEN])
    assert (bad["status"], bad["code"], bad["field"]) == (400, "bad_data", "data")
    assert c.register("y", bytearray(raw(vec(HIDDEN))), "float32", (HIDDEN,))["ok"]  # msgpack may give these


def test_list_in_flight_across_versions(c):
    admit(c, "r1", {"id": "a", "layer": 1, "scale": 2})
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=5), replace=True)
    admit(c, "r2", {"id": "a", "layer": 1, "scale": 2})
    admit(c, "r3", {"id": "a", "layer": 2, "scale": 2})
    metas = {m["id"]: m for m in c.list()["vectors"]}
    assert metas["a"]["version"] == 2 and metas["a"]["in_flight"] == 3
    assert metas["g"]["in_flight"] == 0



def test_list_of_a_tenant_holds_its_namespace_alone(c):
    for vector_id in ("acme/a", "acme/b", "beta/a"):
        register(c, vector_id, vec(N_LAYERS, HIDDEN, seed=7))
    assert sorted(m["id"] for m in c.list("acme")["vectors"]) == ["acme/a", "acme/b"]
    assert [m["id"] for m in c.list("beta")["vectors"]] == ["beta/a"]
    shared = sorted(m["id"] for m in c.list()["vectors"] if "/" not in m["id"])
    assert len(shared) >= 1 and sorted(m["id"] for m in c.list("")["vectors"]) == shared  # the shared namespace
    assert len(c.list()["vectors"]) == len(shared) + 3 and c.list("gamma")["vectors"] == []


# -- check ---------------------------------------------------------------------------------------------------


def test_check_ok_without_side_effects(c):
    spec = json.dumps([{"id": "a", "layer": [1, 2], "scale": 3}, {"id": "g", "layer": 0, "scale": 1, "norm": True}])
    before = state(c)
    out = c.check(spec)
    assert out == {"ok": True, "receipt": "a@1:L1+2x3;g@1:L0x1,norm", "new_rows": 3, "spec": (
        '[{"id":"a","layer":[1,2],"scale":3.0,"version":1},{"id":"g","layer":[0],"norm":true,"scale":1.0,"version":1}]')}
    assert state(c) == before
    b, _ = admit(c, "r", spec)
    assert b.receipt == out["receipt"]
    assert c.check(spec)["new_rows"] == 0


@pytest.mark.parametrize(
    "spec,code,field",
    [
        ("{", "bad_spec", "hotwire"),
        ('{"id": "nope", "layer": 0, "scale": 1}', "unknown_vector", "hotwire[0].id"),
        ('{"id": "a", "layer": 9, "scale": 1}', "layer_out_of_range", "hotwire[0].layer"),
        ('{"id": "part", "layer": 3, "scale": 1}', "no_row_for_layer", "hotwire[0].layer"),
    ],
)
def test_check_400(c, spec, code, field):
    before = state(c)
    out = c.check(spec)
    assert (out["ok"], out["status"], out["code"], out["field"]) == (False, 400, code, field)
    assert out["error"]
    assert state(c) == before and c.stats()["refused"] == {}


def test_check_429_and_503():
    c = ctrl(slots=1)
    register(c, "a", vec(N_LAYERS, HIDDEN))
    admit(c, "r", {"id": "a", "layer": 0, "scale": 1})
    before = state(c)
    out = c.check('{"id": "a", "layer": 1, "scale": 1}')
    assert (out["ok"], out["status"], out["code"]) == (False, 429, "slots_exhausted")
    assert "field" not in out
    assert c.check('{"id": "a", "layer": 0, "scale": 7}') == {
        "ok": True, "receipt": "a@1:L0x7", "new_rows": 0, "spec": '[{"id":"a","layer":[0],"scale":7.0,"version":1}]'}
    assert state(c) == before
    d = ctrl(steerable=False)
    out = d.check('{"id": "a", "layer": 0, "scale": 1}')
    assert (out["ok"], out["status"], out["code"]) == (False, 503, "model_not_steerable")
    assert d.stats()["refused"] == {}


# -- stats ---------------------------------------------------------------------------------------------------


def test_stats_shape(c):
    admit(c, "r", {"id": "a", "layer": [0, 1], "scale": 1})
    refusal(c, {"id": "zz", "layer": 0, "scale": 1})
    s = c.stats()
    assert set(s) == {"ok", "capacity", "used", "pinned", "free", "evictions", "refused", "steered_requests",
                      "vectors", "rows", "model", "deferred", "deferrals", "suspended", "resumptions", "capturing",
                      "tenant_rows", "tenant_shares"}
    assert s["capturing"] == 0 and s["tenant_rows"] == 4 and s["tenant_shares"] == {}  # half the bank of 8
    assert s["ok"] is True
    assert (s["capacity"], s["used"], s["pinned"], s["free"], s["evictions"]) == (8, 2, 2, 6, 0)
    assert s["refused"] == {"unknown_vector": 1}
    assert s["steered_requests"] == 1 and s["vectors"] == 3
    for row in s["rows"]:
        assert set(row) == {"slot", "id", "version", "layer", "refcount", "last_use"}
    assert sorted((r["id"], r["version"], r["layer"], r["refcount"]) for r in s["rows"]) == [("a", 1, 0, 1), ("a", 1, 1, 1)]
    assert [r["slot"] for r in s["rows"]] == [1, 2]
    # the documented model keys (the code also reports "dtype", which docs/architecture.md does not list)
    assert {"steerable", "reason", "n_layers", "hidden_size", "max_stack"} <= set(s["model"])
    assert (s["model"]["steerable"], s["model"]["n_layers"], s["model"]["hidden_size"], s["model"]["max_stack"]) == (
        True, N_LAYERS, HIDDEN, 2)
    json.dumps(s)  # msgpack/JSON-native


def test_take_writes_one_write_per_slot():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    admit(c, "r1", {"id": "a", "layer": 0, "scale": 1})
    c.release("r1")  # aborted before it was ever scheduled
    admit(c, "r2", {"id": "b", "layer": 0, "scale": 1})
    writes = c.take_writes()
    assert len(writes) == 1  # one write for the slot, and it is the last one queued: b, which r2 reads
    assert torch.equal(writes[0].row, c.registry.current("b").rows[0])


# -- store and preload ---------------------------------------------------------------------------------------


def test_store_restores_vectors(tmp_path):
    c1 = ctrl(store=str(tmp_path))
    register(c1, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c1, "a", vec(N_LAYERS, HIDDEN, seed=2), replace=True)
    register(c1, "g", vec(HIDDEN, seed=3))
    register(c1, "part", vec(2, HIDDEN, seed=4), layers=[3, 1])
    register(c1, "gone", vec(HIDDEN))
    c1.unregister("gone")
    before = {m["id"]: m for m in c1.list()["vectors"]}
    files = ["a.safetensors", "g.safetensors", "part.safetensors", "versions.json"]
    assert sorted(p.name for p in c1.store.root.iterdir()) == files
    assert c1.store.root == Settings(8, 2, "op", str(tmp_path), None).store_dir("org/model")

    c2 = ctrl(store=str(tmp_path))
    after = {m["id"]: m for m in c2.list()["vectors"]}
    assert after == before  # same versions, sha256, layers, norms, created_at
    for vid in after:
        assert torch.equal(c2.registry.current(vid).rows, c1.registry.current(vid).rows)
    assert register(c2, "a", vec(HIDDEN), replace=True)["vector"]["version"] == 3
    # A deleted id registered again after a restart does not reuse its old version number.
    register(c2, "gone", vec(HIDDEN, seed=9))
    c2.unregister("gone")
    c2.unregister("a")
    c3 = ctrl(store=str(tmp_path))
    assert register(c3, "gone", vec(HIDDEN))["vector"]["version"] == 3
    assert register(c3, "a", vec(HIDDEN))["vector"]["version"] == 4
    # another model has its own store
    assert ctrl(store=str(tmp_path), name="other/model").list()["vectors"] == []
    # "off" disables it
    assert ctrl(store="off").store is None


def test_a_store_whose_versions_json_is_gone_never_reuses_a_version(tmp_path):
    """Without versions.json the store cannot know what deleted ids had (test_store.py covers each kind of loss):
    the engine serves what the files hold and numbers on above a floor it keeps."""
    c1 = ctrl(store=str(tmp_path))
    register(c1, "a", vec(HIDDEN, seed=1))
    register(c1, "a", vec(HIDDEN, seed=2), replace=True)  # a@2
    register(c1, "gone", vec(HIDDEN, seed=3))
    c1.unregister("gone")
    (c1.store.root / "versions.json").unlink()
    c2 = ctrl(store=str(tmp_path))  # restores a@2 and starts versions above a floor
    assert c2.registry.current("a").version == 2
    c2.unregister("a")
    c3 = ctrl(store=str(tmp_path))
    floor = c3.store.last_versions()["*"]
    assert register(c3, "a", vec(HIDDEN))["vector"]["version"] == floor + 1
    assert register(c3, "gone", vec(HIDDEN, seed=4))["vector"]["version"] == floor + 1


def test_bank_writes_carry_a_compact_copy_of_the_row():
    import pickle

    c = ctrl(slots=8)
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    c.admit(request("r", {"id": "a", "layer": 1, "scale": 1.0}))
    (write,) = c.take_writes()
    assert torch.equal(write.row, c.registry.current("a").rows[1])
    assert write.row.untyped_storage().nbytes() == HIDDEN * 4  # not the whole [N_LAYERS, HIDDEN] vector
    assert len(pickle.dumps(write.row)) < len(pickle.dumps(c.registry.current("a").rows))


def test_preload_dir(tmp_path):
    store, pre = tmp_path / "store", tmp_path / "pre"
    pre.mkdir()
    c1 = ctrl(store=str(store))
    register(c1, "a", vec(HIDDEN, seed=1))
    register(c1, "a", vec(HIDDEN, seed=2), replace=True)  # a@2 in the store
    register(c1, "same", vec(HIDDEN, seed=3))  # same@1 in the store, and the same content in a file below
    save_file({"t": vec(HIDDEN, seed=10)}, str(pre / "a.safetensors"))  # differs from the stored a
    save_file({"t": vec(HIDDEN, seed=3)}, str(pre / "same.safetensors"))
    save_file({"t": vec(N_LAYERS, HIDDEN, seed=11)}, str(pre / "p1.safetensors"))
    torch.save(vec(HIDDEN, seed=12).half(), pre / "p2.pt")
    torch.save(vec(HIDDEN + 1), pre / "wrongsize.pt")  # refused by the registry, logged, skipped

    c2 = ctrl(store=str(store), preload=str(pre))
    metas = {m["id"]: m for m in c2.list()["vectors"]}
    assert set(metas) == {"a", "same", "p1", "p2"}
    # a file that differs from the stored vector of its id wins, as a new version; an unchanged one changes nothing
    assert metas["a"]["version"] == 3 and torch.equal(c2.registry.current("a").rows[0], vec(HIDDEN, seed=10))
    assert metas["same"]["version"] == 1
    assert metas["p1"]["version"] == 1 and metas["p1"]["layers"] == list(range(N_LAYERS))
    assert metas["p2"]["dtype"] == "float16"
    assert torch.equal(c2.registry.current("p1").rows, vec(N_LAYERS, HIDDEN, seed=11))
    # preloaded vectors are written to the store, so a start without the folder reads them from there
    assert (c2.store.root / "p1.safetensors").exists() and (c2.store.root / "p2.safetensors").exists()
    c3 = ctrl(store=str(store))
    assert {m["id"]: m["version"] for m in c3.list()["vectors"]} == {"a": 3, "same": 1, "p1": 1, "p2": 1}
    # with the folder again and nothing edited: the same versions (no new version per restart)
    c4 = ctrl(store=str(store), preload=str(pre))
    assert {m["id"]: m["version"] for m in c4.list()["vectors"]} == {"a": 3, "same": 1, "p1": 1, "p2": 1}
    # a vector deleted over the API comes back from its file at the next start, as a new version
    c4.unregister("p1")
    c5 = ctrl(store=str(store), preload=str(pre))
    assert {m["id"]: m["version"] for m in c5.list()["vectors"]}["p1"] == 2


def test_store_write_failure_registers_nothing(tmp_path, monkeypatch):
    """A store that cannot be written: a 500 store_failed that says what to do, and nothing changes, neither in
    memory nor on disk (the old version stays current and stored; a retry is not a 409)."""
    from pathlib import Path

    c = ctrl(store=str(tmp_path))
    register(c, "a", vec(HIDDEN, seed=1))

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    for replace in (True, False):
        out = c.register("new" if not replace else "a", raw(vec(HIDDEN, seed=2)), "float32", [HIDDEN], None, replace)
        assert out["ok"] is False and out["status"] == 500 and out["code"] == "store_failed"
        assert "No space left on device" in out["error"] and "HOTWIRE_STORE" in out["error"]
    assert {m["id"]: m["version"] for m in c.list()["vectors"]} == {"a": 1}
    assert torch.equal(c.registry.current("a").rows[0], vec(HIDDEN, seed=1))
    monkeypatch.undo()
    assert register(c, "new", vec(HIDDEN, seed=2))["created"] is True  # not a 409: the failed try left nothing
    assert register(c, "a", vec(HIDDEN, seed=2), replace=True)["vector"]["version"] == 2  # no one saw the failed 2
    assert {s.vector_id: s.version for s in c.store.load()} == {"a": 2, "new": 1}


def test_store_delete_failure_unregisters_nothing(tmp_path, monkeypatch):
    from pathlib import Path

    c = ctrl(store=str(tmp_path))
    register(c, "a", vec(HIDDEN, seed=1))

    def locked(path, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", locked)
    out = c.unregister("a")
    assert out["ok"] is False and out["code"] == "store_failed" and "Permission denied" in out["error"]
    assert [m["id"] for m in c.list()["vectors"]] == ["a"]
    assert c.unregister("nope")["code"] == "unknown_vector"  # a 404 still, whatever the store


def test_preload_with_a_store_it_cannot_write_still_serves(tmp_path, monkeypatch):
    from pathlib import Path

    pre = tmp_path / "pre"
    pre.mkdir()
    torch.save(vec(HIDDEN, seed=1), pre / "v.pt")

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    c = ctrl(store=str(tmp_path / "store"), preload=str(pre))
    assert [m["id"] for m in c.list()["vectors"]] == ["v"]


def test_rpc_answers_are_dicts_whatever_fails(monkeypatch):
    """``answer`` is what the engine core's collective_rpc returns for hotwire_*: never an exception."""
    c = ctrl()
    assert c.answer("check", ("[" * 100_000,), {})["code"] == "bad_spec"
    monkeypatch.setattr(c.registry, "vectors", lambda tenant=None: 1 / 0)
    out = c.answer("list", (), {})
    assert out == {"ok": False, "status": 500, "code": "internal",
                   "error": "hotwire_list failed in the engine (ZeroDivisionError: division by zero); its log has the traceback"}  # fmt: skip
    assert c.answer("admit", (None,), {})["code"] == "unknown_method"  # only the RPC surface is reachable


def test_preload_without_store(tmp_path):
    torch.save(vec(HIDDEN, seed=1), tmp_path / "v.pt")
    c = ctrl(store=None, preload=str(tmp_path))
    assert [m["id"] for m in c.list()["vectors"]] == ["v"]
    assert admit(c, "r", {"id": "v", "layer": 0, "scale": 1})[0] is not None


# -- preemption ------------------------------------------------------------------------------------------------


def test_preempted_request_unpins_and_resumes_in_place():
    c = ctrl(slots=2)
    register(c, "a", vec(HIDDEN, seed=1))
    b1, r1 = admit(c, "r1", {"id": "a", "layer": 0, "scale": 2})
    c.take_writes()
    c.suspend("r1")
    c.suspend("r1")  # twice: no-op
    s = c.stats()
    assert (s["pinned"], s["used"], s["suspended"]) == (0, 1, 1)
    assert c.registry.current("a").refs == 1  # the version stays referenced
    assert c.resume(r1) is True
    assert c.take_writes() == [] and c.take_rebinds() == {}  # its row was still cached: nothing to reload
    s = c.stats()
    assert (s["pinned"], s["suspended"], s["resumptions"]) == (1, 0, 1)
    assert c.resume(r1) is True and c.stats()["resumptions"] == 1  # not suspended: nothing to do
    c.release("r1")
    assert c.stats()["pinned"] == 0 and c.registry.current("a").refs == 0


def test_resumed_request_gets_its_rows_back_in_other_slots():
    """While r1 is preempted its row is evicted; resuming reloads that version's row and rebinds r1."""
    c = ctrl(slots=2)
    a = vec(HIDDEN, seed=1)
    for vid, seed in (("a", 1), ("b", 2), ("c", 3)):
        register(c, vid, a if vid == "a" else vec(HIDDEN, seed=seed))
    b1, r1 = admit(c, "r1", {"id": "a", "layer": 0, "scale": 2})
    (slot_a,) = {item[1] for item in b1.config["d"]}
    c.suspend("r1")
    admit(c, "r2", {"id": "b", "layer": 0, "scale": 1})
    admit(c, "r3", {"id": "c", "layer": 0, "scale": 1})  # evicts a's unpinned row
    register(c, "a", vec(HIDDEN, seed=9), replace=True)  # r1 keeps version 1
    c.take_writes()
    assert c.resume(r1) is False  # both rows pinned by r2 and r3: r1 waits, nothing changed
    assert c.stats()["suspended"] == 1 and c.take_writes() == [] and c.take_rebinds() == {}
    c.release("r2")
    assert c.resume(r1) is True
    (w,) = c.take_writes()
    assert torch.equal(w.row, a) and w.slot != slot_a  # version 1's values, in b's old slot
    assert c.step_payload_pending  # the rebind still has to go out
    rebinds = c.take_rebinds()
    assert rebinds == {"r1": {"p": [SteerItem(0, w.slot, 2.0, 0.0)], "d": [SteerItem(0, w.slot, 2.0, 0.0)]}}
    assert r1.sampling_params.extra_args[BINDING_KEY] == rebinds["r1"]
    assert c.take_rebinds() == {}


def test_release_of_a_suspended_request_unpins_nothing_twice():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    admit(c, "r1", {"id": "a", "layer": 0, "scale": 2})
    c.suspend("r1")
    _, r2 = admit(c, "r2", {"id": "a", "layer": 0, "scale": 1})  # shares the row, pins it
    c.release("r1")
    s = c.stats()
    assert (s["pinned"], s["suspended"]) == (1, 0) and s["rows"][0]["refcount"] == 1
    assert c.registry.current("a").refs == 1
    c.release("r2")
    assert c.stats()["pinned"] == 0


def test_a_preempted_request_waiting_for_rows_is_not_starved_by_new_ones():
    c = ctrl(slots=2)
    for vid, seed in (("a", 1), ("b", 2), ("c", 3)):
        register(c, vid, vec(N_LAYERS, HIDDEN, seed=seed))
    _, r1 = admit(c, "r1", {"id": "a", "layer": [0, 1], "scale": 1})  # needs both rows
    c.suspend("r1")
    admit(c, "r2", {"id": "b", "layer": 0, "scale": 1})
    assert c.resume(r1) is False
    # A one-row request would fit in the free row, but would keep r1 waiting: it waits behind r1 instead.
    exc = refusal(c, {"id": "c", "layer": 0, "scale": 1}, rid="r3")
    assert exc.code == "slots_exhausted" and exc.status == 429
    assert c.check(json.dumps({"id": "c", "layer": 0, "scale": 1}))["status"] == 429
    assert c.stats()["refused"] == {}  # waiting, not refused
    c.release("r2")
    assert c.resume(r1) is True
    admit(c, "r3", {"id": "a", "layer": 0, "scale": 2})  # rows pinned by r1 are shared: fits now
    assert c.check(json.dumps({"id": "a", "layer": 1, "scale": 1}))["ok"] is True


def test_releasing_a_preempted_request_that_waits_lets_others_in():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    _, r1 = admit(c, "r1", {"id": "a", "layer": 0, "scale": 1})
    c.suspend("r1")
    admit(c, "r2", {"id": "b", "layer": 0, "scale": 1})
    assert c.resume(r1) is False
    c.release("r1")  # aborted while it waited
    c.release("r2")
    admit(c, "r3", {"id": "a", "layer": 0, "scale": 1})


def session_chunk(rid, spec=None, resumable=True, prompt=PROMPT, extra=None) -> Request:
    """A streaming-input chunk (or, not resumable, the session's end marker) as vLLM's input processor builds it."""
    req = request(rid, spec, prompt=prompt, extra=extra)
    req.resumable = resumable
    return req


def test_a_streaming_chunk_keeps_its_sessions_binding():
    """The next chunk of a session (same id, vLLM holds the session) pins and releases nothing: the chunk before
    may still be running on those rows. The session keeps its versions even if the vector is re-registered."""
    c = ctrl(slots=4)
    register(c, "a", vec(HIDDEN, seed=1))
    spec = {"id": "a", "layer": 0, "scale": 1}
    binding, session = admit(c, "s", spec)
    register(c, "a", vec(HIDDEN, seed=2), replace=True)  # a@2; the session keeps a@1
    before = state(c)
    c.admit_update(session_chunk("s", '{"scale": 1.0, "layer": [0], "id": "a"}'), session)  # same steering
    c.admit_update(session_chunk("s", {"id": "other", "layer": 3, "scale": 9}, resumable=False), session)  # end marker
    assert state(c) == before and c.bindings["s"] is binding
    # vLLM gives the session the chunk's params: the binding goes back into them
    session.sampling_params = session_chunk("s", spec).sampling_params
    c.keep_binding(session)
    assert session.sampling_params.extra_args[BINDING_KEY] == binding.config
    c.release("s")
    assert c.stats()["pinned"] == 0 and c.registry.in_flight("a") == 0


@pytest.mark.parametrize(
    "first,chunk",
    [
        ({"id": "a", "layer": 0, "scale": 1}, {"id": "a", "layer": 0, "scale": 2}),
        ({"id": "a", "layer": 0, "scale": 1}, None),
        (None, {"id": "a", "layer": 0, "scale": 1}),
        ({"id": "a", "layer": 0, "scale": 1}, "{not json"),
    ],
    ids=["other-scale", "steered-then-plain", "plain-then-steered", "unreadable"],
)
def test_a_streaming_chunk_that_changes_the_steering_is_refused(first, chunk):
    """A session's KV is salted for its first chunk's steering: a chunk steered otherwise is a 400 that changes
    nothing (the engine glue then ends the session, which releases its binding)."""
    c = ctrl(slots=4)
    register(c, "a", vec(HIDDEN, seed=1))
    _, session = admit(c, "s", first)
    before = state(c)
    with pytest.raises(Refusal) as info:
        c.admit_update(session_chunk("s", chunk), session)
    assert (info.value.status, info.value.code, info.value.field) == (400, "steering_changed", "hotwire")
    assert c.refused["steering_changed"] == 1
    assert state(c)[1:] == before[1:]


def test_a_chunk_for_a_session_still_waiting_for_rows_ends_it():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": 0, "scale": 1})
    first = session_chunk("s", {"id": "b", "layer": 0, "scale": 1})
    with pytest.raises(Refusal):
        c.admit(first)
    c.defer(first)
    with pytest.raises(Refusal) as info:
        c.admit_update(session_chunk("s", {"id": "b", "layer": 0, "scale": 1}), None)
    assert info.value.status == 429 and "start the session again" in info.value.message
    assert not c.deferred and c.admit_deferred() == []


def test_ended_sessions_are_remembered_until_their_end_marker_and_bounded(monkeypatch):
    c = ctrl()
    c.note_ended_session("s")
    assert c.session_ended("s", final=False) is True  # more input: still ended
    assert c.session_ended("s", final=True) is True and c.session_ended("s", final=True) is False
    monkeypatch.setattr(sessions_mod, "ENDED_SESSIONS_KEPT", 3)
    for i in range(5):
        c.note_ended_session(f"s{i}")
    assert [c.session_ended(f"s{i}", final=True) for i in range(5)] == [False, False, True, True, True]


def test_drop_deferred_returns_what_it_dropped():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    admit(c, "hog", {"id": "a", "layer": 0, "scale": 1})
    register(c, "b", vec(HIDDEN, seed=2))
    waiting = [request(f"w{i}", {"id": "b", "layer": 0, "scale": 1}) for i in range(3)]
    for r in waiting:
        c.defer(r)
    assert c.drop_deferred("w1") == [waiting[1]] and c.drop_deferred(["w9"]) == []
    assert c.drop_deferred(None) == [waiting[0], waiting[2]] and not c.deferred


def _engine_with_hotwires_hooks():
    """vLLM's own ``EngineCore`` request methods, with hotwire's hooks, on an engine with only what they read; the
    request ids its block hasher hashed, and the requests it passed to the scheduler."""
    from types import SimpleNamespace

    from vllm.v1.engine import core as vllm_core

    from hotwire_core.vllm_glue import engine_core

    names = ("_initialize_kv_caches", "add_request", "preprocess_add_request", "collective_rpc")
    Core = type("Core", (), {n: vllm_core.EngineCore.__dict__[n] for n in names})
    engine_core.patch_engine_core(SimpleNamespace(EngineCore=Core, EngineCoreProc=vllm_core.EngineCoreProc,
                                                  RequestStatus=vllm_core.RequestStatus))
    hashed, added = [], []
    hasher = get_request_block_hasher(BLOCK, sha256)
    engine = Core.__new__(Core)
    engine.mm_receiver_cache = None
    engine.vllm_config = SimpleNamespace(watermark_config=None)  # 0.34+ reads these two
    engine.prefix_hash_config = None
    engine.request_block_hasher = lambda r: hashed.append(r.request_id) or hasher(r)
    engine.hotwire = ctrl()
    engine.scheduler = SimpleNamespace(requests={}, add_request=added.append)
    register(engine.hotwire, "a", vec(N_LAYERS, HIDDEN, seed=1))
    return engine, hashed, added


def test_the_engine_hooks_salt_a_steered_prompt_before_vllm_hashes_it_once():
    """vLLM's own ``EngineCore.preprocess_add_request`` (input thread) and ``add_request``, with hotwire's hooks:
    the steered prompt's blocks are hashed once, with the steered salt, and admission keeps those hashes."""
    from vllm.v1.engine import EngineCoreRequest

    engine, hashed, added = _engine_with_hotwires_hooks()
    c = engine.hotwire
    spec = json.dumps({"id": "a", "layer": 1, "scale": 2})
    core_request = EngineCoreRequest("s", list(PROMPT), None, SamplingParams(max_tokens=8, extra_args={"hotwire": spec}),
                                     None, 0.0, None, "tenant", None)  # fmt: skip
    req, _ = engine.preprocess_add_request(core_request)
    assert req.cache_salt.startswith(SALT_PREFIX) and getattr(req, USER_SALT_ATTR) == "tenant"
    hashes = list(req.block_hashes)
    engine.add_request(req)
    assert added == [req] and hashed == ["s"] and req.block_hashes == hashes and "s" in c.bindings
    _, ref = admit(c, "ref", json.loads(spec), salt="tenant")  # salted by admission alone: the same salt
    assert ref.cache_salt == req.cache_salt


def test_block_hashes_a_frontend_computed_are_not_kept_for_a_steered_prompt():
    """vLLM 0.34+ keeps the prompt block hashes a frontend sends (``EngineCoreRequest.block_hashes``, from vLLM's Rust
    frontend) instead of hashing: they carry the user's salt, not the steered one. A steered prompt is hashed in
    the engine all the same; a plain prompt keeps the frontend's hashes, as without hotwire."""
    from vllm.v1.engine import EngineCoreRequest

    if "block_hashes" not in EngineCoreRequest.__struct_fields__:
        pytest.skip("this vLLM takes no block hashes from a frontend (0.34+ does)")
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import PrefixHashConfig

    engine, _, added = _engine_with_hotwires_hooks()
    engine.prefix_hash_config = PrefixHashConfig("sha256", BLOCK, kv_cache_utils.NONE_HASH)
    plain = SamplingParams(max_tokens=8)
    frontend = list(Request("f", list(PROMPT), plain, None, cache_salt="tenant",
                            block_hasher=get_request_block_hasher(BLOCK, sha256)).block_hashes)
    assert len(frontend) == 2

    def core_request(rid: str, params: SamplingParams) -> EngineCoreRequest:
        return EngineCoreRequest(rid, list(PROMPT), None, params, None, 0.0, None, "tenant", None,
                                 block_hashes=list(frontend))  # fmt: skip

    spec = json.dumps({"id": "a", "layer": 1, "scale": 2})
    steered, _ = engine.preprocess_add_request(core_request("s", SamplingParams(max_tokens=8, extra_args={"hotwire": spec})))
    assert len(steered.block_hashes) == 2 and not set(steered.block_hashes) & set(frontend)
    _, ref = admit(engine.hotwire, "ref", json.loads(spec), salt="tenant")  # hashed with the steered salt
    assert steered.block_hashes == ref.block_hashes
    engine.add_request(steered)
    assert added == [steered] and steered.block_hashes == ref.block_hashes  # admission found them right
    same, _ = engine.preprocess_add_request(core_request("p", plain))
    assert same.block_hashes == frontend


def test_a_session_whose_first_chunk_waited_for_rows_keeps_its_steering_for_later_chunks():
    """The first chunk waited (its spec is pinned to the versions it resolved); a later chunk with the same spec,
    unpinned, asks for the same steering."""
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": 0, "scale": 1})
    spec = {"id": "b", "layer": 0, "scale": 1}
    first = session_chunk("s", spec)
    with pytest.raises(Refusal):
        c.admit(first)
    c.defer(first)
    c.release("hog")
    assert c.admit_deferred() == [first]
    c.admit_update(session_chunk("s", spec), first)  # no steering_changed
    with pytest.raises(Refusal) as info:
        c.admit_update(session_chunk("s", {**spec, "version": 2}), first)  # another version is other steering
    assert info.value.code == "steering_changed"


def test_newcomers_wait_behind_a_deferred_request():
    """Rows that free up go to the request waiting longest: a newcomer waits behind it, whether it would pin an
    unpinned resident row or only share rows pinned already (test_a_stream_of_requests_sharing_pinned_rows_*)."""
    c = ctrl(slots=2)
    for vid, seed in (("a", 1), ("b", 2), ("c", 3)):
        register(c, vid, vec(N_LAYERS, HIDDEN, seed=seed))
    admit(c, "warm", {"id": "a", "layer": 0, "scale": 1})
    c.release("warm")  # a@L0 resident, unpinned
    admit(c, "holder", {"id": "b", "layer": 0, "scale": 1})
    big = request("big", {"id": "c", "layer": [0, 1], "scale": 1})
    with pytest.raises(Refusal):
        c.admit(big)
    c.defer(big)
    for newcomer in ({"id": "a", "layer": 0, "scale": 1}, {"id": "b", "layer": 0, "scale": 2}):
        with pytest.raises(WaitForRows) as info:  # a@L0: the row big needs once holder is done; b@L0: pinned
            c.admit(request("late", newcomer))
        assert "waits behind them" in info.value.message
        assert c.check(json.dumps(newcomer))["code"] == "slots_exhausted"  # check_steering: it would wait
    c.release("holder")
    assert c.admit_deferred() == [big]


def test_a_stream_of_requests_sharing_pinned_rows_cannot_starve_an_earlier_one():
    """Requests that only share a row pinned already take no row, but keep it pinned: admitted ahead of a waiting
    request, each one overlapping the last would keep that row from ever freeing up for it."""
    c = ctrl(slots=2)
    register(c, "b", vec(HIDDEN, seed=2))
    register(c, "c", vec(N_LAYERS, HIDDEN, seed=3))
    admit(c, "s0", {"id": "b", "layer": 0, "scale": 1})
    big = request("big", {"id": "c", "layer": [0, 1], "scale": 1})  # needs both rows
    with pytest.raises(WaitForRows):
        c.admit(big)
    c.defer(big)
    for i in range(1, 4):  # s{i} arrives while s{i-1} runs, then s{i-1} finishes
        sharer = request(f"s{i}", {"id": "b", "layer": 0, "scale": 1})
        try:
            c.admit(sharer)
        except WaitForRows as exc:
            c.defer(sharer, exc.resolved)
        c.release(f"s{i - 1}")
        if c.admit_deferred()[:1] == [big]:
            break
    else:
        pytest.fail("requests sharing a pinned row kept an earlier request waiting for ever")
    assert i == 1 and list(c.deferred) == ["s1"]
    c.release("big")
    assert [r.request_id for r in c.admit_deferred()] == ["s1"]


def test_check_without_slots_never_says_wait():
    c = ctrl(slots=1)
    register(c, "a", vec(HIDDEN, seed=1))
    register(c, "b", vec(HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": 0, "scale": 1})
    spec = '{"id": "b", "layer": 0, "scale": 1, "version": 1}'
    assert c.check(spec)["code"] == "slots_exhausted"
    assert c.check(spec, False) == {"ok": True, "receipt": "b@1:L0x1", "new_rows": 0,
                                    "spec": '[{"id":"b","layer":[0],"scale":1.0,"version":1}]'}


def test_a_failure_after_pinning_leaks_nothing(c, monkeypatch):
    """Anything that raises once ``admit`` pinned rows (here vLLM hashing the blocks again) releases them and the
    versions before the refusal leaves: the request never runs, so nothing else would."""
    req = request("r", {"id": "a", "layer": [0, 1], "scale": 1})

    def broken() -> None:
        raise RuntimeError("hashing failed")

    monkeypatch.setattr(req, "update_block_hashes", broken)
    with pytest.raises(RuntimeError, match="hashing failed"):
        c.admit(req)
    assert "r" not in c.bindings and c.stats()["pinned"] == 0 and c.stats()["steered_requests"] == 0
    assert all(v["in_flight"] == 0 for v in c.list()["vectors"])
    admit(c, "r2", {"id": "a", "layer": [0, 1], "scale": 1})  # its rows stay loaded, unpinned: reused
    assert c.stats()["pinned"] == 2


def test_deferring_reuses_what_admit_resolved(monkeypatch):
    c = ctrl(slots=2)
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "g", vec(HIDDEN, seed=2))
    admit(c, "hog", {"id": "a", "layer": [0, 1], "scale": 1})
    with pytest.raises(WaitForRows) as info:
        c.admit(request("late", {"id": "g", "layer": 0, "scale": 1}))
    late = request("late", {"id": "g", "layer": 0, "scale": 1})
    monkeypatch.setattr(c, "_resolve", lambda spec: pytest.fail("resolved again"))
    c.defer(late, info.value.resolved)
    assert list(c.deferred) == ["late"] and '"version"' in late.sampling_params.extra_args["hotwire"]


# -- readout ---------------------------------------------------------------------------------------------------


def reader(readout_probes=2, slots=8, **model_fields) -> SteeringController:
    info = dataclasses.replace(model(), readout_probes=readout_probes, **model_fields)
    c = SteeringController(info, Settings(slots, 2, "op", None, None), "org/model", VLLM_REQUESTS)
    register(c, "a", vec(N_LAYERS, HIDDEN, seed=1))
    register(c, "g", vec(HIDDEN, seed=2))
    return c


def test_a_readout_pins_its_probe_rows_and_gives_the_workers_its_probes():
    c = reader()
    readout = {"probes": [{"id": "a", "layer": 1, "bias": 0.5}, {"id": "g", "layer": 3}], "tokens": "generated"}
    binding, req = admit(c, "r1", extra={"hotwire_readout": json.dumps(readout)})
    assert [item.layer for item in binding.config["r"]] == [1, 3]
    assert len({item.slot for item in binding.config["r"]}) == 2 and all(item.slot for item in binding.config["r"])
    assert binding.config["p"] == binding.config["d"] == []  # reads, does not steer
    args = req.sampling_params.extra_args[READOUT_ARGS_KEY]
    assert args["tag"] == "r1" and args["tokens"] == "generated"
    assert [(p["name"], p["layer"], p["bias"]) for p in args["probes"]] == [("a@1:L1", 1, 0.5), ("g@1:L3", 3, 0.0)]
    assert args["probes"][1]["norm"] == pytest.approx(float(vec(HIDDEN, seed=2).norm()), rel=1e-6)
    assert c.stats()["pinned"] == 2 and req.cache_salt is None  # generated tokens only: the prefix cache stays
    c.release("r1")
    assert c.stats()["pinned"] == 0


def test_a_prompt_readout_gets_a_cache_salt_of_its_own_and_steers_beside_it():
    c = reader()
    readout = json.dumps({"probes": [{"id": "a", "layer": 2}], "tokens": "all", "tag": "mine"})
    spec = {"id": "a", "layer": 2, "scale": 1.0}
    first, req1 = admit(c, "r1", spec=spec, extra={"hotwire_readout": readout})
    second, req2 = admit(c, "r2", spec=spec, extra={"hotwire_readout": readout})
    assert req1.cache_salt.startswith("hotwire:readout:") and req1.cache_salt != req2.cache_salt
    assert first.config["r"][0].slot == first.config["p"][0].slot  # the steering row doubles as the probe's
    assert req1.sampling_params.extra_args[READOUT_ARGS_KEY]["tag"] == "mine"
    assert c.stats()["pinned"] == 1


@pytest.mark.parametrize("readout, code, field", [
    ({"probes": [{"id": "nope", "layer": 1}]}, "unknown_vector", "hotwire_readout.probes[0].id"),
    ({"probes": [{"id": "a", "layer": N_LAYERS}]}, "layer_out_of_range", "hotwire_readout.probes[0].layer"),
    ({"probes": [{"id": "a", "layer": 1}] * 3}, "bad_readout", "hotwire_readout.probes"),
    ({"probes": [{"id": "a", "layer": 1, "version": 7}]}, "version_gone", "hotwire_readout.probes[0].version"),
])
def test_a_readout_admission_cannot_serve_is_refused_without_side_effects(readout, code, field):
    c = reader()
    before = state(c)
    with pytest.raises(Refusal) as info:
        c.admit(request("bad", extra={"hotwire_readout": json.dumps(readout)}))
    assert (info.value.code, info.value.field) == (code, field)
    assert state(c)[1:] == before[1:]


def test_probes_and_conditions_only_read_the_layers_hotwire_readout_layers_names():
    c = reader(readout_layers=frozenset({1}), gates=("token", "latch"))
    admit(c, "ok", extra={"hotwire_readout": json.dumps({"probes": [{"id": "a", "layer": 1}]})})
    gated = {"id": "a", "layer": 3, "scale": 1.0, "when": {"id": "a", "layer": 2, "above": 0}}
    for name, spec, extra, field in [
        ("probe", None, {"hotwire_readout": json.dumps({"probes": [{"id": "a", "layer": 2}]})},
         "hotwire_readout.probes[0].layer"),
        ("gate", gated, {}, "hotwire[0].when.layer"),
    ]:
        with pytest.raises(Refusal) as info:
            c.admit(request(name, spec=spec, extra=extra))
        assert (info.value.status, info.value.code, info.value.field) == (400, "layer_out_of_range", field)
        assert "reads layers 1 (HOTWIRE_READOUT_LAYERS)" in info.value.message
    admit(c, "steered", {"id": "a", "layer": 2, "scale": 1.0})  # steering there is not restricted
    assert c.rules.model.to_json(2)["readout_layers"] == "1"


def test_a_streaming_input_session_cannot_be_read():
    """Its prompt grows chunk by chunk: its first chunk with a readout is refused, and so is a later chunk's."""
    c = reader()
    readout = json.dumps({"probes": [{"id": "a", "layer": 1}], "tokens": "all"})
    first = session_chunk("s", extra={"hotwire_readout": readout})
    with pytest.raises(Refusal) as info:
        c.admit(first)
    assert (info.value.status, info.value.code, info.value.field) == (400, "readout_unsupported", "hotwire_readout")
    binding, session = admit(c, "t", {"id": "a", "layer": 0, "scale": 1.0})
    session.resumable = True
    with pytest.raises(Refusal) as info:
        c.admit_update(session_chunk("t", {"id": "a", "layer": 0, "scale": 1.0},
                                     extra={"hotwire_readout": readout}), session)
    assert info.value.code == "readout_unsupported"
    assert c.stats()["refused"] == {"readout_unsupported": 2}
    c.admit_update(session_chunk("t", {"id": "a", "layer": 0, "scale": 1.0}, resumable=False,
                                 extra={"hotwire_readout": readout}), session)  # the end marker: vLLM ends it


def test_readout_on_a_server_without_the_readout_op_is_refused_503():
    c = reader(readout_probes=0)
    with pytest.raises(Refusal) as info:
        c.admit(request("r", extra={"hotwire_readout": '{"probes": [{"id": "a", "layer": 1}]}'}))
    assert (info.value.status, info.value.code) == (503, "readout_off")


@pytest.mark.parametrize("key", [BINDING_KEY, READOUT_ARGS_KEY])
def test_a_client_cannot_send_what_only_admission_sets(c, key):
    """A forged binding would make the workers steer with whatever bank rows it names."""
    forged = {BINDING_KEY: {"p": [[1, 1, 100.0, 0.0]], "d": []}, READOUT_ARGS_KEY: {"tag": "t", "tokens": "all", "probes": []}}
    with pytest.raises(Refusal) as info:
        c.admit(request("f", extra={key: forged[key]}))
    assert (info.value.code, info.value.field) == ("reserved_field", key)
    with pytest.raises(Refusal):
        c.admit(request("g", spec={"id": "a", "layer": 1, "scale": 1.0}, extra={key: forged[key]}))


# ---- tenants' share of the bank (HOTWIRE_TENANT_ROWS) ----------------------------------------------------------


def test_a_tenant_flooding_distinct_vectors_never_makes_another_tenants_requests_wait(monkeypatch, clock):
    """A tenant's vectors pin at most HOTWIRE_TENANT_ROWS rows; its requests past that wait in its own lane, while
    another tenant's and shared requests are admitted at once, and the oldest of its own goes first."""
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="16", HOTWIRE_TENANT_ROWS="4", HOTWIRE_MAX_WAIT_S="5")
    assert c.slots.tenant_rows == 4
    for k in range(6):
        register(c, f"flood/v{k}", vec(N_LAYERS, HIDDEN, seed=k))
    register(c, "calm/c", vec(N_LAYERS, HIDDEN, seed=10))
    register(c, "s", vec(N_LAYERS, HIDDEN, seed=11))
    reported = refusals_reported(c)
    for k in range(2):  # two rows each: the tenant's share is full
        admit(c, f"f{k}", {"id": f"flood/v{k}", "layer": [0, 1], "scale": 1})
    assert c.slots.pinned_by("flood") == 4
    assert "HOTWIRE_TENANT_ROWS" in c.check(json.dumps({"id": "flood/v2", "layer": 0, "scale": 1}))["error"]
    f2 = waiting(c, "f2", {"id": "flood/v2", "layer": [0, 1], "scale": 1})
    f3 = waiting(c, "f3", {"id": "flood/v3", "layer": 0, "scale": 1})  # one row would fit: it waits behind f2
    assert list(c.deferred) == ["f2", "f3"]
    # the bank has 12 free rows: the other tenant and the shared vectors are not held up by the flood's lane
    admit(c, "calm", {"id": "calm/c", "layer": [0, 1, 2, 3], "scale": 1})
    admit(c, "shared", {"id": "s", "layer": [0, 1], "scale": 1})
    assert c.slots.pinned_by("calm") == 4 and c.slots.pinned_by("") == 2
    c.release("f0")
    assert c.admit_deferred() == [f2] and list(c.deferred) == ["f3"]  # the oldest of the lane first
    clock.now += 5
    assert c.admit_deferred() == [] and not c.deferred
    ((req, exc),) = reported
    assert req is f3 and (exc.status, exc.code) == (429, "quota_exceeded")
    for text in ("waited 5.0 s", "tenant 'flood'", "4 of the 4 bank rows", "HOTWIRE_TENANT_ROWS"):
        assert text in exc.message, exc.message
    for rid in ("f1", "f2", "calm", "shared"):
        c.release(rid)
    assert c.slots.pinned_by("flood") == c.slots.pinned_by("calm") == c.stats()["pinned"] == 0


def test_a_tenants_share_is_never_below_what_one_request_may_pin(monkeypatch):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="16", HOTWIRE_TENANT_ROWS="1")
    assert c.slots.tenant_rows == c.rules.max_rows == 4  # a request that fits the bank fits its tenant's share
    assert ctrl_env(monkeypatch, HOTWIRE_SLOTS="16").slots.tenant_rows == 8  # by default, half the bank


def test_a_preempted_request_waiting_for_its_tenants_share_holds_up_only_its_tenant(monkeypatch):
    c = ctrl_env(monkeypatch, HOTWIRE_SLOTS="16", HOTWIRE_TENANT_ROWS="4")
    for vid, seed in (("acme/x", 1), ("acme/y", 2), ("beta/z", 3), ("s", 4)):
        register(c, vid, vec(N_LAYERS, HIDDEN, seed=seed))
    _, a1 = admit(c, "a1", {"id": "acme/x", "layer": [0, 1, 2, 3], "scale": 1})
    c.suspend("a1")
    admit(c, "a2", {"id": "acme/y", "layer": [0, 1, 2, 3], "scale": 1})  # acme's share, while a1 is preempted
    assert c.resume(a1) is False  # 12 rows free, but not for acme
    admit(c, "b", {"id": "beta/z", "layer": [0, 1], "scale": 1})  # other tenants and shared vectors go on
    admit(c, "s", {"id": "s", "layer": 0, "scale": 1})
    assert refusal(c, {"id": "acme/y", "layer": 0, "scale": 2}, rid="a3").code == "slots_exhausted"  # behind a1
    c.release("a2")
    assert c.resume(a1) is True


def test_a_request_waiting_for_the_bank_holds_up_every_tenant():
    """One that waits for bank rows (not its tenant's share) keeps first come, first served across tenants: the
    others' newcomers cannot keep it waiting for ever."""
    c = ctrl(slots=8)  # each tenant's share: 4
    for vid, seed in (("acme/x", 1), ("beta/y", 2), ("beta/z", 3), ("s", 4)):
        register(c, vid, vec(N_LAYERS, HIDDEN, seed=seed))
    admit(c, "b1", {"id": "beta/y", "layer": [0, 1, 2, 3], "scale": 1})
    admit(c, "s1", {"id": "s", "layer": [0, 1, 2], "scale": 1})  # 1 row left
    big = request("big", {"id": "acme/x", "layer": [0, 1, 2, 3], "scale": 1})
    with pytest.raises(WaitForRows) as info:
        c.admit(big)
    assert "only 1 of 8 can be freed" in info.value.message  # the bank, not acme's share
    c.defer(big, info.value.resolved)
    with pytest.raises(WaitForRows) as info:  # fits the free row, but would keep big waiting
        c.admit(request("late", {"id": "s", "layer": 3, "scale": 1}))
    assert "waits behind them" in info.value.message
    c.release("b1")
    assert c.admit_deferred() == [big]
