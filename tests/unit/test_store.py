"""hotwire_core.store: the durable vector store and the HOTWIRE_VECTORS preload directory."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from hotwire_core import store as store_mod
from hotwire_core.registry import DTYPES, VectorRegistry
from hotwire_core.store import StoredVector, VectorStore, load_preload_dir, tensor_to_stored

N_LAYERS, HIDDEN = 4, 8


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def vec(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def restore(stored: StoredVector, registry: VectorRegistry | None = None):
    registry = registry or VectorRegistry(N_LAYERS, HIDDEN)
    return registry.register(
        stored.vector_id, stored.data, stored.dtype, stored.shape, stored.layers, False,
        version=stored.version, created_at=stored.created_at,
    )


CASES = [
    ("agnostic", (HIDDEN,), None),
    ("per_layer", (N_LAYERS, HIDDEN), None),
    ("named", (2, HIDDEN), [3, 1]),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name,shape,layers", CASES)
def test_save_load_round_trip(tmp_path, dtype, name, shape, layers):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    t = vec(*shape, seed=len(name), dtype=DTYPES[dtype])
    r.register(name, raw(t), dtype, list(shape), layers, False)
    v = r.register(name, raw(t * 2), dtype, list(shape), layers, True)  # version 2
    v.created_at = 1234.25
    st = VectorStore(tmp_path / "s")
    st.save(v)
    (loaded,) = st.load()
    assert loaded.vector_id == name and loaded.dtype == dtype
    assert loaded.version == 2 and loaded.created_at == 1234.25
    assert loaded.shape == list(shape)
    w = restore(loaded)
    assert w.version == 2 and w.sha256 == v.sha256
    assert w.layers == v.layers and w.shape == v.shape
    assert w.rows.dtype == DTYPES[dtype] and torch.equal(w.rows, v.rows)
    for layer in range(N_LAYERS):
        a, b = v.row(layer), w.row(layer)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_several_vectors_and_overwrite(tmp_path):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    for vid in ("b", "a", "c"):
        st.save(r.register(vid, raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    st.save(r.register("a", raw(vec(HIDDEN, seed=9)), "float32", [HIDDEN], None, True))
    loaded = {s.vector_id: s for s in st.load()}
    assert set(loaded) == {"a", "b", "c"}
    assert loaded["a"].version == 2 and loaded["a"].data == raw(vec(HIDDEN, seed=9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors", "versions.json"]


def test_save_leaves_no_tmp_files(tmp_path):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    for i in range(5):
        st.save(r.register("v", raw(vec(HIDDEN, seed=i)), "float32", [HIDDEN], None, True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.safetensors", "versions.json"]
    assert st.last_versions() == {"v": 5}


def test_failed_save_keeps_old_file_and_no_tmp(tmp_path, monkeypatch):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    st.save(r.register("v", raw(vec(HIDDEN, seed=1)), "float32", [HIDDEN], None, False))
    v2 = r.register("v", raw(vec(HIDDEN, seed=2)), "float32", [HIDDEN], None, True)

    def broken(path, data):
        with open(path, "wb") as f:
            f.write(data[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod.Path, "write_bytes", broken)
    with pytest.raises(OSError):
        st.save(v2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.safetensors", "versions.json"]
    (loaded,) = st.load()
    assert loaded.version == 1 and loaded.data == raw(vec(HIDDEN, seed=1))
    assert st.last_versions() == {"v": 2}  # recorded before the file: version 2 is never handed out again


def test_delete(tmp_path):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    st.save(r.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    st.save(r.register("b", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    st.delete("a")
    st.delete("never-there")  # no error
    assert [s.vector_id for s in st.load()] == ["b"]


def test_a_tenants_vectors_are_files_beside_the_shared_ones(tmp_path):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    for vector_id in ("calm", "acme/calm", "beta/calm"):
        st.save(r.register(vector_id, raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "acme~calm.safetensors", "beta~calm.safetensors", "calm.safetensors"]
    assert sorted(s.vector_id for s in st.load()) == ["acme/calm", "beta/calm", "calm"]
    st.delete("acme/calm")
    assert sorted(s.vector_id for s in st.load()) == ["beta/calm", "calm"]


def test_corrupt_files_skipped(tmp_path, caplog):
    r = VectorRegistry(N_LAYERS, HIDDEN)
    st = VectorStore(tmp_path)
    st.save(r.register("good", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    save_file({"other": torch.zeros(3)}, str(tmp_path / "notrows.safetensors"))  # valid file, wrong content
    save_file({"rows": torch.zeros(1, HIDDEN)}, str(tmp_path / "nometa.safetensors"))  # no metadata
    (tmp_path / "ignored.txt").write_text("x")
    with caplog.at_level("ERROR"):
        loaded = st.load()
    assert [s.vector_id for s in loaded] == ["good"]
    assert sum("skipping unreadable stored vector" in m for m in caplog.messages) == 3


def test_store_creates_root(tmp_path):
    root = tmp_path / "a" / "b"
    VectorStore(root)
    assert root.is_dir()
    assert VectorStore(root).load() == []


def test_tensor_to_stored():
    t = vec(2, HIDDEN, dtype=torch.bfloat16)
    s = tensor_to_stored("x", t, [0, 1])
    assert (s.vector_id, s.dtype, s.shape, s.layers, s.version) == ("x", "bfloat16", [2, HIDDEN], [0, 1], None)
    assert s.data == raw(t)
    s64 = tensor_to_stored("y", torch.ones(HIDDEN, dtype=torch.float64))
    assert s64.dtype == "float32" and s64.data == raw(torch.ones(HIDDEN))
    nc = vec(HIDDEN, 2).t()  # non-contiguous input
    assert tensor_to_stored("z", nc).data == raw(nc.contiguous())


# -- preload directory ---------------------------------------------------------------------------------------


def test_preload_safetensors_and_pt(tmp_path):
    a = vec(HIDDEN, seed=1)
    b = vec(N_LAYERS, HIDDEN, seed=2, dtype=torch.bfloat16)
    c = vec(HIDDEN, seed=3, dtype=torch.float16)
    save_file({"anything": a}, str(tmp_path / "alpha.safetensors"))
    torch.save(b, tmp_path / "beta.pt")
    torch.save(c, tmp_path / "gamma.pt")
    (tmp_path / "readme.md").write_text("ignored")
    out = {s.vector_id: s for s in load_preload_dir(tmp_path)}
    assert set(out) == {"alpha", "beta", "gamma"}
    assert out["alpha"].dtype == "float32" and out["alpha"].shape == [HIDDEN] and out["alpha"].data == raw(a)
    assert out["beta"].dtype == "bfloat16" and out["beta"].shape == [N_LAYERS, HIDDEN] and out["beta"].data == raw(b)
    assert out["gamma"].dtype == "float16" and out["gamma"].data == raw(c)
    assert all(s.version is None and s.layers is None for s in out.values())
    v = restore(out["beta"])
    assert v.layers == tuple(range(N_LAYERS)) and torch.equal(v.rows, b)


def test_preload_bad_files_skipped(tmp_path):
    save_file({"x": torch.zeros(HIDDEN), "y": torch.zeros(HIDDEN)}, str(tmp_path / "two.safetensors"))
    torch.save({"t": torch.zeros(HIDDEN)}, tmp_path / "dict.pt")  # loads under weights_only, not a tensor
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    torch.save(torch.ones(HIDDEN), tmp_path / "ok.pt")
    assert [s.vector_id for s in load_preload_dir(tmp_path)] == ["ok"]


class _Exploit:
    """Unpickling this (without weights_only) would create ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch.save", "pickle", "tensor_in_list"])
def test_preload_pt_never_unpickles_code(tmp_path, writer):
    marker = tmp_path.parent / f"{tmp_path.name}-PWNED"
    pre = tmp_path / "pre"
    pre.mkdir()
    payload = _Exploit(marker)
    path = pre / "evil.pt"
    if writer == "torch.save":
        torch.save(payload, path)
    elif writer == "pickle":
        path.write_bytes(pickle.dumps(payload))
    else:
        torch.save([torch.zeros(HIDDEN), payload], path)
    torch.save(torch.ones(HIDDEN), pre / "fine.pt")
    # sanity: the payload really is dangerous when unpickled without weights_only
    if writer == "pickle":
        probe = tmp_path / "probe"
        pickle.loads(pickle.dumps(_Exploit(probe))).close()
        assert probe.exists()
    out = load_preload_dir(pre)
    assert [s.vector_id for s in out] == ["fine"]
    assert not marker.exists()


def test_preload_files_sharing_an_id_load_only_the_first(tmp_path, caplog):
    """a.pt beside a.safetensors: the first (in name order) is loaded, the other refused with a log line, so a
    restart does not make a new version from each in turn."""
    save_file({"t": vec(HIDDEN, seed=1)}, str(tmp_path / "a.safetensors"))
    torch.save(vec(HIDDEN, seed=2), tmp_path / "a.pt")
    out = load_preload_dir(tmp_path)
    assert [s.vector_id for s in out] == ["a"] and out[0].data == raw(vec(HIDDEN, seed=2))  # a.pt sorts first
    assert "has the id 'a'" in caplog.text


def test_missing_preload_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="HOTWIRE_VECTORS=.* is not a directory"):
        load_preload_dir(tmp_path / "nope")


def test_last_versions_survive_delete_and_ignore_a_corrupt_file(tmp_path, caplog):
    store = VectorStore(tmp_path)
    assert store.last_versions() == {}
    registry = VectorRegistry(N_LAYERS, HIDDEN)
    for version in (3, 2):  # never goes down
        store.save(registry.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN], None, True, version=version))
    store.delete("a")
    assert store.last_versions() == {"a": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["versions.json"]
    (tmp_path / "versions.json").write_text("[not a map")
    with pytest.raises(store_mod.HistoryLost, match="versions.json is unreadable"):
        store.last_versions()


def test_versions_another_engine_core_wrote_are_read_again(tmp_path):
    """Each data-parallel engine core has its own store object on one folder: one that kept versions.json parsed
    from its own last write still sees what the other wrote since, and a version it gave out stays."""
    first, second = VectorStore(tmp_path), VectorStore(tmp_path)
    registry = VectorRegistry(N_LAYERS, HIDDEN)
    first.save(registry.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    assert first.last_versions() == second.last_versions() == {"a": 1}
    second.note_versions({"b": 4})
    assert first.last_versions() == {"a": 1, "b": 4}
    first.note_versions({"a": 2})
    assert second.last_versions() == {"a": 2, "b": 4}
    mine = first.last_versions()
    mine["a"] = 0  # a copy: the kept parse does not change
    assert first.last_versions()["a"] == 2


def _engine_start(root) -> VectorRegistry:
    """What an engine core does at start: the store restored into a new registry."""
    from hotwire_core.vectors import restore as restore_store

    registry = VectorRegistry(N_LAYERS, HIDDEN)
    restore_store(registry, VectorStore(root), None)
    return registry


def _register(root, registry: VectorRegistry, vector_id: str, seed: int) -> int:
    """A registration as the controller makes it: stored first, then current."""
    vector = registry.prepare(vector_id, raw(vec(HIDDEN, seed=seed)), "float32", [HIDDEN], None, True)
    VectorStore(root).save(vector)
    registry.add(vector)
    return vector.version


def _damage(path) -> None:
    path.write_text('{"a": 3, "gone')  # torn


def _lose(path) -> None:
    path.unlink()


def _roll_back(path, older: str) -> None:
    path.write_text(older)  # an older copy put back: readable, behind the files


@pytest.mark.parametrize("loss", ["damaged", "missing", "older copy"])
def test_a_lost_version_history_never_reuses_a_version(tmp_path, caplog, loss):
    """Whatever happened to versions.json, no version number is given out twice: the store sets the damaged file
    aside and every id's versions go on above a floor (the time in ms) that it keeps from then on."""
    registry = _engine_start(tmp_path)
    _register(tmp_path, registry, "a", 1)
    older = (tmp_path / "versions.json").read_text()  # {"a": 1}
    assert [_register(tmp_path, registry, "a", seed) for seed in (2, 3)] == [2, 3]
    assert _register(tmp_path, registry, "gone", 4) == 1
    VectorStore(tmp_path).delete("gone")  # gone@1 was handed out, and its file is no more
    {"damaged": _damage, "missing": _lose, "older copy": lambda p: _roll_back(p, older)}[loss](tmp_path / "versions.json")

    restarted = _engine_start(tmp_path)
    assert restarted.current("a").version == 3  # the live vector is served as it was
    assert "versions of deleted vectors are lost" in caplog.text
    floor = VectorStore(tmp_path).last_versions()["*"]
    assert floor > 1_700_000_000_000
    assert _register(tmp_path, restarted, "gone", 5) == floor + 1  # not 1 again
    assert _register(tmp_path, restarted, "a", 6) == floor + 1
    if loss != "missing":
        assert len(list(tmp_path.glob("versions.json.damaged-*"))) == 1
    caplog.clear()
    again = _engine_start(tmp_path)  # the floor is kept: nothing lost this time, nothing recovered
    assert "lost" not in caplog.text
    assert _register(tmp_path, again, "new", 7) == floor + 1 and _register(tmp_path, again, "a", 8) == floor + 2


def test_versions_json_forgets_the_oldest_deleted_ids_and_no_version_is_reused(tmp_path, monkeypatch):
    """versions.json keeps every stored id and the last HISTORY_KEPT ids deleted; the older ones only raise the
    floor, so after a restart no id, forgotten or not, gets a version it had."""
    monkeypatch.setattr(store_mod, "HISTORY_KEPT", 8)
    registry = _engine_start(tmp_path)
    assert _register(tmp_path, registry, "live", 0) == 1  # the oldest entry, never forgotten: it has a file
    handed = {}
    for i in range(30):
        vid = f"flood-{i}"
        for seed in range(i % 3 + 1):
            handed[vid] = _register(tmp_path, registry, vid, seed)
        VectorStore(tmp_path).delete(vid)
        registry.unregister(vid)
    versions = VectorStore(tmp_path).last_versions()
    assert len(versions) <= 8 + 2 and versions["live"] == 1 and versions["*"] >= 3
    assert list(versions)[-1] == "flood-29"  # in the order of the last registrations
    restarted = _engine_start(tmp_path)
    floor = VectorStore(tmp_path).last_versions()["*"]
    assert restarted.current("live").version == 1 and _register(tmp_path, restarted, "live", 9) == floor + 1
    for vid, version in handed.items():
        assert _register(tmp_path, restarted, vid, 9) > version
    assert _register(tmp_path, restarted, "new", 9) == floor + 1


def test_a_store_of_many_vectors_never_forgets_the_one_it_saves(tmp_path, monkeypatch, caplog):
    """With more stored ids than a pass keeps, the id being saved (its file comes after versions.json) stays in
    versions.json: a restart finds nothing lost."""
    monkeypatch.setattr(store_mod, "HISTORY_KEPT", 8)
    store, registry = VectorStore(tmp_path), VectorRegistry(N_LAYERS, HIDDEN)
    for i in range(12):  # more stored ids than the 6 a pass keeps
        store.save(registry.register(f"live{i}", raw(vec(HIDDEN, seed=i)), "float32", [HIDDEN], None, False))
        assert f"live{i}" in store.last_versions()
    restarted = _engine_start(tmp_path)
    assert "lost" not in caplog.text and [restarted.current(f"live{i}").version for i in range(12)] == [1] * 12


def test_store_writes_reach_the_disk_before_they_count(tmp_path, monkeypatch):
    """The file and its folder are synced before save returns: a power loss cannot leave an empty versions.json."""
    synced = []
    real = store_mod.os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    registry = VectorRegistry(N_LAYERS, HIDDEN)
    VectorStore(tmp_path).save(registry.register("v", raw(vec(HIDDEN)), "float32", [HIDDEN], None, False))
    assert len(synced) == 4  # versions.json and the vector's file, each with its folder
