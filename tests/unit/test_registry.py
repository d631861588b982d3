"""hotwire_core.registry: decoding registered bytes, versions, retirement and references."""

from __future__ import annotations

import pytest
import torch

from hotwire_core import contract
from hotwire_core import version_history
from hotwire_core.admission import row_key
from hotwire_core.registry import DTYPES, RegistryError, VectorRegistry, content_sha256, decode_vector

N_LAYERS, HIDDEN = 4, 8


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def vec(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def reg(r: VectorRegistry, vid="v", t=None, dtype="float32", layers=None, replace=False):
    t = vec(HIDDEN) if t is None else t
    return r.register(vid, raw(t), dtype, list(t.shape), layers, replace)


def reg_error(fn, *args, **kwargs) -> RegistryError:
    with pytest.raises(RegistryError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.fixture
def r() -> VectorRegistry:
    return VectorRegistry(N_LAYERS, HIDDEN)


# -- shapes --------------------------------------------------------------------------------------------------


def test_layer_agnostic_vector(r):
    t = vec(HIDDEN)
    v = reg(r, t=t)
    assert v.layers is None and v.shape == (HIDDEN,) and v.rows.shape == (1, HIDDEN)
    for layer in range(N_LAYERS):
        assert torch.equal(v.row(layer), t)
        assert row_key(v, layer).layer == -1
    assert v.row(99) is not None  # a [hidden] vector serves any layer; the controller checks the range
    assert list(v.norms()) == ["*"]
    assert v.norms()["*"] == pytest.approx(float(t.norm()))


def test_row_per_layer(r):
    t = vec(N_LAYERS, HIDDEN)
    v = reg(r, t=t)
    assert v.layers == tuple(range(N_LAYERS)) and v.shape == (N_LAYERS, HIDDEN)
    for layer in range(N_LAYERS):
        assert torch.equal(v.row(layer), t[layer])
        assert row_key(v, layer).layer == layer
    assert v.row(N_LAYERS) is None
    assert set(v.norms()) == {"0", "1", "2", "3"}
    assert v.norms()["2"] == pytest.approx(float(t[2].norm()))


def test_named_layers_unsorted_rows_follow(r):
    t = vec(3, HIDDEN)
    v = reg(r, t=t, layers=[3, 0, 2])
    assert v.layers == (0, 2, 3)
    assert torch.equal(v.row(3), t[0])
    assert torch.equal(v.row(0), t[1])
    assert torch.equal(v.row(2), t[2])
    assert v.row(1) is None
    assert v.meta()["layers"] == [0, 2, 3]
    assert v.norms()["3"] == pytest.approx(float(t[0].norm()))


def test_meta_shape(r):
    v = reg(r, "abc", t=vec(2, HIDDEN), layers=[1, 2])
    meta = v.meta()
    assert set(meta) == set(contract.VectorMeta.__annotations__)  # the shape both processes read
    assert meta["id"] == "abc" and meta["version"] == 1 and meta["dtype"] == "float32"
    assert meta["shape"] == [2, HIDDEN] and meta["in_flight"] == 0 and len(meta["sha256"]) == 64


@pytest.mark.parametrize(
    "shape,layers,code,field",
    [
        ([HIDDEN + 1], None, "bad_shape", "shape"),
        ([N_LAYERS, HIDDEN + 1], None, "bad_shape", "shape"),
        ([2, 2, HIDDEN], None, "bad_shape", "shape"),
        ([N_LAYERS - 1, HIDDEN], None, "bad_shape", "shape"),  # 2-D without layers needs n_layers rows
        ([0, HIDDEN], None, "bad_shape", "shape"),
        ([2, HIDDEN], [1], "bad_layers", "layers"),
        ([2, HIDDEN], [1, 1], "bad_layers", "layers"),
        ([2, HIDDEN], [1, N_LAYERS], "layer_out_of_range", "layers"),
        ([2, HIDDEN], [-1, 0], "layer_out_of_range", "layers"),
        ([2, HIDDEN], [True, 0], "layer_out_of_range", "layers"),
        ([HIDDEN], [0], "bad_layers", "layers"),
    ],
)
def test_shape_errors(r, shape, layers, code, field):
    n = 1
    for d in shape:
        n *= d
    err = reg_error(r.register, "v", b"\0" * (4 * n), "float32", shape, layers, False)
    assert (err.status, err.code, err.field) == (400, code, field)
    assert r.current("v") is None


@pytest.mark.parametrize("shape", ["8", [8.0], [-8], None])
def test_shape_not_int_list(r, shape):
    err = reg_error(r.register, "v", b"\0" * 32, "float32", shape if shape is not None else [], None, False)
    assert err.code == "bad_shape"


def test_wrong_byte_length(r):
    for data in (b"\0" * (4 * HIDDEN - 1), b"\0" * (4 * HIDDEN + 4), b""):
        err = reg_error(r.register, "v", data, "float32", [HIDDEN], None, False)
        assert (err.status, err.code, err.field) == (400, "bad_data", "data")
    # right length for fp16 is wrong for fp32
    err = reg_error(r.register, "v", b"\0" * (2 * HIDDEN), "float32", [HIDDEN], None, False)
    assert err.code == "bad_data"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_not_finite(r, bad, dtype):
    t = vec(HIDDEN)
    t[3] = bad
    t = t.to(DTYPES[dtype])
    err = reg_error(r.register, "v", raw(t), dtype, [HIDDEN], None, False)
    assert (err.status, err.code, err.field) == (400, "not_finite", "data")


@pytest.mark.parametrize(
    "model_dtype, largest, dtype",
    [("float16", 65504.0, "float32"), ("bfloat16", 3.3895e38, "float32"), ("float32", 3.4028e38, "float32")],
)
def test_values_the_models_dtype_cannot_hold_are_refused(model_dtype, largest, dtype):
    """The bank holds rows in the model's dtype: 1e5 is inf in a float16 bank, and scale 0 makes it NaN."""
    r = VectorRegistry(N_LAYERS, HIDDEN, model_dtype)
    t = torch.zeros(HIDDEN)
    t[1] = -largest * 0.999
    assert reg(r, "fits", t, dtype).row_norm(0) == pytest.approx(largest * 0.999, rel=1e-6)
    if model_dtype != "float32":  # float32's own range is all a float32 vector can hold
        t[1] = largest * 1.001
        err = reg_error(reg, r, "over", t, dtype)
        assert (err.status, err.code, err.field) == (400, "out_of_range", "data")
        assert model_dtype in err.message and "scale" in err.message


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp32", "", None])
def test_bad_dtype(r, dtype):
    err = reg_error(r.register, "v", b"\0" * 32, dtype, [HIDDEN], None, False)
    assert (err.status, err.code, err.field) == (400, "bad_dtype", "dtype")


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "a/b/c", None, 3])
def test_bad_id(r, bad):
    err = reg_error(r.register, bad, raw(vec(HIDDEN)), "float32", [HIDDEN], None, False)
    assert (err.status, err.code, err.field) == (400, "bad_id", "id")


def test_id_with_trailing_newline_rejected(r):
    err = reg_error(r.register, "abc\n", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False)
    assert err.code == "bad_id"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_round_trip(r, dtype):
    t = vec(2, HIDDEN, seed=3, dtype=DTYPES[dtype])
    v = reg(r, t=t, dtype=dtype, layers=[1, 3])
    assert v.rows.dtype == DTYPES[dtype] and v.dtype == dtype
    assert torch.equal(v.rows, t)  # bit-exact: no cast on the way in
    assert raw(v.rows) == raw(t)


def test_decode_vector_copies_input():
    data = bytearray(raw(vec(HIDDEN)))  # a mutable buffer: the rows must not alias it
    rows, _, _ = decode_vector(data, "float32", [HIDDEN], None, N_LAYERS, HIDDEN)
    before = rows.clone()
    data[:4] = b"\0\0\0\0"
    assert torch.equal(rows, before)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_refused_in_every_dtype(dtype, bad):
    t = vec(N_LAYERS, HIDDEN).to(DTYPES[dtype])
    t[2, 5] = bad
    with pytest.raises(RegistryError) as err:
        decode_vector(raw(t), dtype, [N_LAYERS, HIDDEN], None, N_LAYERS, HIDDEN)
    assert err.value.code == "not_finite"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_row_norms_match_torch_and_follow_layer_order(dtype):
    t = (vec(3, HIDDEN) * torch.tensor([[1.0], [2.0], [3.0]])).to(DTYPES[dtype])
    rows, layers, norms = decode_vector(raw(t), dtype, [3, HIDDEN], [3, 0, 2], N_LAYERS, HIDDEN)
    assert layers == (0, 2, 3)
    assert torch.equal(rows, t[[1, 2, 0]])
    expected = t[[1, 2, 0]].double().norm(dim=-1).tolist()
    assert norms == pytest.approx(expected, rel=1e-6)


# -- versions ------------------------------------------------------------------------------------------------


def test_conflict_without_replace(r):
    v1 = reg(r, t=vec(HIDDEN, seed=1))
    err = reg_error(reg, r, t=vec(HIDDEN, seed=2))
    assert (err.status, err.code, err.field) == (409, "exists", "id")
    assert r.current("v") is v1 and v1.version == 1 and not v1.retired


def test_replace_increments_version_and_retires(r):
    v1 = reg(r, t=vec(HIDDEN, seed=1))
    v2 = reg(r, t=vec(HIDDEN, seed=2), replace=True)
    v3 = reg(r, t=vec(HIDDEN, seed=2), replace=True)  # same content still makes a version
    assert (v1.version, v2.version, v3.version) == (1, 2, 3)
    assert v1.retired and v2.retired and not v3.retired
    assert r.current("v") is v3
    assert r.vectors() == [v3]


def test_replace_on_new_id_is_version_1(r):
    assert reg(r, "new", replace=True).version == 1


def test_versions_never_reused_after_unregister(r):
    assert reg(r).version == 1
    assert r.unregister("v").version == 1
    assert r.current("v") is None and r.vectors() == []
    assert reg(r).version == 2
    r.unregister("v")
    assert reg(r).version == 3


def test_versions_are_per_id(r):
    reg(r, "a")
    reg(r, "a", replace=True)
    assert reg(r, "b").version == 1


def test_unregister_unknown(r):
    err = reg_error(r.unregister, "nope")
    assert (err.status, err.code, err.field) == (404, "unknown_vector", "id")
    reg(r)
    r.unregister("v")
    assert reg_error(r.unregister, "v").status == 404


def test_restore_with_explicit_version(r):
    v = r.register("v", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False, version=7, created_at=123.5)
    assert v.version == 7 and v.created_at == 123.5
    assert reg(r, replace=True).version == 8


def test_to_result():
    err = RegistryError(409, "exists", "msg", "id")
    assert err.to_result() == {"ok": False, "status": 409, "code": "exists", "error": "msg", "field": "id"}
    assert "field" not in RegistryError(400, "c", "m").to_result()


# -- references ----------------------------------------------------------------------------------------------


def test_release_of_current_version_never_drops(r):
    v = reg(r)
    r.acquire(v)
    r.acquire(v)
    assert r.in_flight("v") == 2 and v.meta()["in_flight"] == 2
    assert r.release(v) is False
    assert r.release(v) is False
    assert v.refs == 0 and r.current("v") is v


def test_retired_version_kept_while_referenced(r):
    v1 = reg(r, t=vec(HIDDEN, seed=1))
    r.acquire(v1)
    r.acquire(v1)
    v2 = reg(r, t=vec(HIDDEN, seed=2), replace=True)
    r.acquire(v2)
    assert v1.retired and r.current("v") is v2
    assert r.in_flight("v") == 3
    assert r.release(v1) is False
    assert r.in_flight("v") == 2
    assert r.release(v1) is True  # the last reference on a retired version: gone now
    assert r.in_flight("v") == 1
    assert r.release(v2) is False
    assert r.in_flight("v") == 0


def test_in_flight_counts_every_live_version_of_each_id(r):
    """The listing's counts: current and retired versions of each id summed, ids apart, deleted ids included,
    and kept as requests take and give back their references (a version retired while held keeps its count)."""
    a1 = reg(r, "a", t=vec(HIDDEN, seed=1))
    r.acquire(a1)
    a2 = reg(r, "a", t=vec(HIDDEN, seed=2), replace=True)
    r.acquire(a2)
    r.acquire(a2)
    b = reg(r, "b", t=vec(HIDDEN, seed=3))
    r.acquire(b)
    r.unregister("b")
    reg(r, "c", t=vec(HIDDEN, seed=4))
    assert {i: r.in_flight(i) for i in ("a", "b", "c", "unknown")} == {"a": 3, "b": 1, "c": 0, "unknown": 0}
    r.acquire(a1)  # a retired version taken again (a request that names it)
    reg(r, "a", t=vec(HIDDEN, seed=5), replace=True)  # a2 retired while held twice
    assert r.in_flight("a") == 4
    for vector in (a1, a1, a2, a2, b):
        r.release(vector)
    assert r.in_flight("a") == r.in_flight("b") == 0 and r._held_retired == {}


def test_unregister_with_refs_counts_in_flight(r):
    v = reg(r)
    r.acquire(v)
    gone = r.unregister("v")
    assert gone is v and v.retired
    assert r.current("v") is None
    assert r.in_flight("v") == 1
    v2 = reg(r)
    r.acquire(v2)
    assert v2.version == 2 and r.in_flight("v") == 2
    assert r.release(v) is True
    assert r.in_flight("v") == 1


def test_retired_without_refs_counts_no_users(r):
    reg(r, t=vec(HIDDEN, seed=1))
    reg(r, t=vec(HIDDEN, seed=2), replace=True)
    assert r.in_flight("v") == 0
    assert r.in_flight("other") == 0


def test_retired_versions_stay_usable_by_version_for_the_retention(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("hotwire_core.registry.time.monotonic", lambda: clock[0])
    r = VectorRegistry(N_LAYERS, HIDDEN, retain_s=60)
    v1 = reg(r, t=vec(HIDDEN, seed=1))
    v2 = reg(r, t=vec(HIDDEN, seed=2), replace=True)
    assert r.lookup("v") is v2 and r.lookup("v", 2) is v2 and r.lookup("v", 1) is v1 and r.lookup("v", 3) is None
    r.unregister("v")
    assert r.lookup("v") is None and r.lookup("v", 2) is v2
    clock[0] += 59
    assert r.lookup("v", 1) is v1
    r.acquire(v1)  # held by a request past its retention: kept until released
    clock[0] += 2
    assert r.lookup("v", 1) is v1 and r.lookup("v", 2) is None
    assert r.release(v1) is True
    assert r.lookup("v", 1) is None and [v.version for v in r.retained()] == []


def test_a_change_prunes_the_retired_versions_past_their_retention_behind_a_held_one(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("hotwire_core.registry.time.monotonic", lambda: clock[0])
    r = VectorRegistry(N_LAYERS, HIDDEN, retain_s=60)
    versions = []
    for seed in range(6):  # v@1..v@5 retired 10 s apart, v@6 current
        versions.append(reg(r, t=vec(HIDDEN, seed=seed), replace=True))
        clock[0] += 10
    r.acquire(versions[0])  # the oldest, held by a running request
    clock[0] = 1000.0 + 30 + 61  # the retention of v@1..v@3 is over, v@4's and v@5's not
    reg(r, "other")  # a change prunes
    assert sorted(v.version for v in r.retained()) == [1, 4, 5]
    assert r.release(versions[0]) is True and sorted(v.version for v in r.retained()) == [4, 5]


def test_versions_from_another_numbering_never_go_back(r):
    late = r.prepare("v", raw(vec(HIDDEN, seed=1)), "float32", [HIDDEN], None, False, version=3)
    assert r.add(late) is True
    early = r.prepare("v", raw(vec(HIDDEN, seed=2)), "float32", [HIDDEN], None, False, version=2)
    assert r.supersedes(early) is False and r.add(early) is False
    assert r.current("v") is late and r.lookup("v", 2) is early
    assert r.unregister("v", version=2) is None and r.current("v") is late  # a deletion of an older version
    assert r.unregister("v", version=3) is late and r.current("v") is None
    stale = r.prepare("v", raw(vec(HIDDEN, seed=3)), "float32", [HIDDEN], None, False, version=3)
    assert r.add(stale) is False and r.current("v") is None
    assert reg(r).version == 4  # numbering goes on past every version seen


def test_the_history_of_deleted_ids_stays_bounded_and_no_version_is_reused(monkeypatch):
    """A tenant registering and deleting ever new ids: the registry remembers the last versions of the last
    HISTORY_KEPT ids without a current version; older ones only raise the floor every id's next version goes on
    above (versions grow, not one by one)."""
    monkeypatch.setattr(version_history, "HISTORY_KEPT", 8)
    r = VectorRegistry(N_LAYERS, HIDDEN)
    reg(r, "live")
    reg(r, "live", replace=True)  # live@2, registered before every other id
    handed = {}
    for i in range(40):
        vid = f"flood-{i}"
        for _ in range(i % 3 + 1):  # versions 1 to 3
            handed[vid] = reg(r, vid, replace=True).version
        r.unregister(vid)
    assert len(r.history._last) <= 1 + 8 and len(r.history._deleted) <= 8
    # the highest version of a forgotten id; ids registered after a pass start above it, so it climbs
    assert 3 <= r.history.floor < max(handed.values())
    floor = r.history.floor
    assert r.current("live").version == 2 and reg(r, "live", replace=True).version == floor + 1
    for vid, version in handed.items():  # forgotten or not, an id's next version is above every one it had
        assert reg(r, vid).version > version
        r.unregister(vid)
    floor = r.history.floor
    assert reg(r, "new").version == floor + 1


def test_an_id_noted_again_is_forgotten_last(monkeypatch):
    """The history forgets the ids longest unused: one registered again moves to the end and keeps its own last
    version through the passes after."""
    monkeypatch.setattr(version_history, "HISTORY_KEPT", 8)
    r = VectorRegistry(N_LAYERS, HIDDEN)
    for version in (1, 2, 3):
        reg(r, "old", t=vec(HIDDEN, seed=version), replace=True)
    r.unregister("old")
    for i in range(20):
        reg(r, f"x{i}")
        r.unregister(f"x{i}")
        if i % 5 == 0:
            r.unregister("old", version=3)  # noted again: moved to the end
    assert r.history._last["old"] == 3


def test_a_restored_history_forgets_no_stored_id():
    """At engine start the store's history comes in before its vectors are current: nothing is forgotten then,
    so the floor does not rise past the live ids' versions."""
    r = VectorRegistry(N_LAYERS, HIDDEN)
    live = {f"live{i}": 20 + i for i in range(version_history.HISTORY_KEPT + 10)}
    r.history.restore(live, 0)
    assert r.history.floor == 0 and reg(r, "new").version == 1


def test_generation_counts_changes_of_current_versions(r):
    g = r.generation
    reg(r)
    reg(r, t=vec(HIDDEN, seed=5), replace=True)
    r.unregister("v")
    assert r.generation == g + 3


def test_in_flight_is_per_id(r):
    a, b = reg(r, "a"), reg(r, "b")
    r.acquire(a)
    r.acquire(b)
    r.acquire(b)
    assert r.in_flight("a") == 1 and r.in_flight("b") == 2


# -- sha256 --------------------------------------------------------------------------------------------------


def test_sha256_stable_and_content_sensitive():
    r1, r2 = VectorRegistry(N_LAYERS, HIDDEN), VectorRegistry(N_LAYERS, HIDDEN)
    t = vec(HIDDEN, seed=5)
    a = reg(r1, "a", t=t)
    b = reg(r2, "b", t=t.clone())
    assert a.sha256 == b.sha256  # same content, any id, any registry
    assert reg(r1, "a", t=t, replace=True).sha256 == a.sha256
    t2 = t.clone()
    t2[0] += 1e-3
    assert reg(r1, "c", t=t2).sha256 != a.sha256
    assert reg(r1, "d", t=t.half(), dtype="float16").sha256 != a.sha256  # dtype is part of the content
    assert reg(r1, "e", t=t.unsqueeze(0), layers=[0]).sha256 != a.sha256  # so are the layers
    assert reg(r1, "f", t=t.unsqueeze(0), layers=[1]).sha256 != reg(r1, "g", t=t.unsqueeze(0), layers=[0]).sha256


def test_sha256_same_for_equivalent_layer_orders(r):
    t = vec(2, HIDDEN)
    a = reg(r, "a", t=t, layers=[0, 2])
    b = reg(r, "b", t=t.flip(0).contiguous(), layers=[2, 0])
    assert a.sha256 == b.sha256
    assert a.sha256 == content_sha256(a.rows, "float32", (0, 2))
