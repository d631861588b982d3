"""hotwire_api.engine with several engine cores (data parallelism): which calls gather every engine core's
answer and how the answers are merged. The real thing runs in tests/integration/test_data_parallel.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hotwire_api.engine import HotwireEngine, merge_stats, merge_vector_lists
from hotwire_api.errors import HotwireError
from hotwire_core import contract


def stats(capacity: int, used: int, rows: list[dict], refused: dict[str, int], steered: int) -> dict[str, Any]:
    return {
        "ok": True, "capacity": capacity, "used": used, "pinned": len(rows), "free": capacity - used, "evictions": 1,
        "refused": refused, "steered_requests": steered, "vectors": 2, "rows": rows,
        "model": {"steerable": True, "n_layers": 4, "hidden_size": 8},
    }


def row(slot: int, vector_id: str) -> dict[str, Any]:
    return {"slot": slot, "id": vector_id, "version": 1, "layer": 2, "refcount": 1, "last_use": 5.0}


def test_merge_stats_sums_counters_and_tags_rows_with_their_engine() -> None:
    a = stats(8, 2, [row(1, "x"), row(2, "y")], {"slots_exhausted": 1}, 3)
    b = stats(8, 1, [row(1, "x")], {"slots_exhausted": 2, "unknown_vector": 1}, 4)
    merged = merge_stats([a, b])
    assert (merged["capacity"], merged["used"], merged["free"], merged["pinned"], merged["evictions"]) == (16, 3, 13, 3, 2)
    assert merged["steered_requests"] == 7 and merged["refused"] == {"slots_exhausted": 3, "unknown_vector": 1}
    assert [(r["engine"], r["slot"], r["id"]) for r in merged["rows"]] == [(0, 1, "x"), (0, 2, "y"), (1, 1, "x")]
    assert merged["vectors"] == 2 and merged["engines"] == 2 and merged["model"] == a["model"]
    assert merge_stats([a]) is a  # one engine core: its answer as it is


def test_merge_vector_lists_counts_users_on_every_engine() -> None:
    first = {"vectors": [{"id": "x", "version": 2, "in_flight": 1}, {"id": "y", "version": 1, "in_flight": 0}]}
    second = {"vectors": [{"id": "x", "version": 2, "in_flight": 3}, {"id": "y", "version": 4, "in_flight": 2}]}
    assert merge_vector_lists([first, second]) == [  # counted by id: users of any version still use the id
        {"id": "x", "version": 2, "in_flight": 4}, {"id": "y", "version": 1, "in_flight": 2}
    ]


class TwoEngines:
    """A stand-in engine client with two engine cores: ``collective_rpc`` answers as vLLM's DP client does
    (the first engine core's answer); ``per_engine`` asks the engine cores a slice selects."""

    def __init__(self, answers: dict[str, list[dict]]):
        self.answers = answers
        self.calls: list[tuple[str, str]] = []
        self.args: list[tuple] = []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None) -> list:
        self.calls.append(("first", method))
        return [self.answers[method][0]]

    async def per_engine(self, method: str, args: tuple, which: slice, failures: bool = False) -> list[Any]:
        names = {(None, 1): "first alone", (1, None): "the others", (None, None): "each"}
        self.calls.append((names[which.start, which.stop], method))
        self.args.append(args)
        answers: list[Any] = []
        for answer in self.answers[method][which]:
            if isinstance(answer, Exception) and not failures:
                raise answer
            answers.append(answer if isinstance(answer, Exception) else [answer])
        return answers


def test_engine_gathers_every_engine_core_where_it_matters() -> None:
    client = TwoEngines({
        contract.UNREGISTER: [{"ok": True, "in_flight": 0, "version": 4}, {"ok": True, "in_flight": 2, "version": 4}],
        contract.STATS: [stats(8, 1, [row(1, "x")], {}, 1), stats(8, 1, [row(3, "x")], {}, 2)],
        contract.CHECK: [{"ok": True, "receipt": "x@1:L2x1", "spec": "pinned"}, {"ok": True, "receipt": "never asked"}],
        contract.REFUSALS: [{"ok": True, "refusals": {}}, {"ok": True, "refusals": {"t": {
            "ok": False, "status": 410, "code": "version_gone", "error": "gone", "field": "hotwire[0].version"}}}],
    })
    engine = HotwireEngine(client, client.per_engine)
    assert asyncio.run(engine.unregister("x")) == 2  # in use on the second engine core: DELETE answers 202
    assert client.args[-1] == ("x", 4)  # the others delete the version the first one deleted
    merged = asyncio.run(engine.stats())
    assert (merged.engines, merged.capacity, merged.steered_requests) == (2, 16, 3)
    assert [(r.engine, r.slot) for r in merged.rows] == [(0, 1), (1, 3)]
    assert asyncio.run(engine.check("{}")) == ("x@1:L2x1", "pinned")
    refused = asyncio.run(engine.refusals(["t"]))["t"]  # kept by whichever engine core refused the request
    assert (refused.status, refused.code, refused.field) == (410, "version_gone", "hotwire[0].version")
    # Deciding asks the first engine core alone: vLLM's own collective_rpc would wait for every one of them.
    assert client.calls == [("first alone", contract.UNREGISTER), ("the others", contract.UNREGISTER),
                            ("each", contract.STATS), ("first alone", contract.CHECK), ("each", contract.REFUSALS)]


def test_refusals_come_from_the_engine_cores_that_answer() -> None:
    """An engine core that fails cannot hold a refusal the others would lose: the lookup uses the others'
    answers, and fails only when no engine core answers."""
    kept = {"ok": True, "refusals": {"t": {"ok": False, "status": 400, "code": "too_strong", "error": "strong"}}}
    dead = ConnectionError("engine core 0 died")
    for answers in ([dead, kept], [kept, {"ok": False, "status": 500, "code": "internal", "error": "broke"}]):
        client = TwoEngines({contract.REFUSALS: answers})
        assert asyncio.run(HotwireEngine(client, client.per_engine).refusals(["t"]))["t"].code == "too_strong"
    client = TwoEngines({contract.REFUSALS: [dead, dead]})
    with pytest.raises(HotwireError) as info:
        asyncio.run(HotwireEngine(client, client.per_engine).refusals(["t"]))
    assert info.value.code == "engine_unavailable"
    client = TwoEngines({contract.STATS: [stats(8, 1, [], {}, 1), dead]})
    with pytest.raises(HotwireError):  # elsewhere every engine core's answer counts
        asyncio.run(HotwireEngine(client, client.per_engine).stats())


def test_registration_the_engine_cores_disagree_on_is_an_error() -> None:
    def answer(version: int, sha256: str = "ab") -> dict:
        meta = {"id": "x", "version": version, "sha256": sha256, "dtype": "float32", "shape": [8], "layers": None,
                "norms": {"*": 1.0}, "created_at": 1.0}
        return {"ok": True, "created": True, "vector": meta}

    from hotwire_api.codec import VectorPayload

    payload = VectorPayload(data=b"\0" * 32, dtype="float32", shape=(8,), layers=None)
    agreeing = TwoEngines({contract.REGISTER: [answer(3), answer(3)]})
    created, meta = asyncio.run(HotwireEngine(agreeing, agreeing.per_engine).register("x", payload, False))
    # the first engine core numbers the version; the others are told it
    assert created and meta.version == 3
    assert agreeing.calls == [("first alone", contract.REGISTER), ("the others", contract.REGISTER)]
    assert agreeing.args[1][-1] == 3 and len(agreeing.args[0]) == len(agreeing.args[1]) - 1
    drifted = TwoEngines({contract.REGISTER: [answer(3), answer(3, "cd")]})
    with pytest.raises(HotwireError) as err:
        asyncio.run(HotwireEngine(drifted, drifted.per_engine).register("x", payload, False))
    assert (err.value.status, err.value.code) == (500, "engines_disagree") and "x'@3" in err.value.message


def _registration_refused(answer: dict, source: str) -> HotwireError:
    """The error ``register`` raises when both engine cores give ``answer`` for a payload sent as ``source``."""
    from hotwire_api.codec import VectorPayload

    client = TwoEngines({contract.REGISTER: [answer, answer]})
    payload = VectorPayload(data=b"\0" * 32, dtype="float32", shape=(8,), layers=None, source=source)
    with pytest.raises(HotwireError) as err:
        asyncio.run(HotwireEngine(client, client.per_engine).register("x", payload, False))
    return err.value


def test_a_refusal_of_the_values_names_the_field_they_were_sent_in() -> None:
    """The engine checks the values (out_of_range) and names "data"; a multipart upload sent them as "file"."""
    refusal = {"ok": False, "status": 400, "code": "out_of_range", "error": "the vector holds 1e+05", "field": "data"}
    for source in ("file", "data", "layers"):
        err = _registration_refused(refusal, source)
        assert (err.code, err.field) == ("out_of_range", source)
    # a file (or per-layer lists) carried the shape and dtype too: a vector made for another model names the file
    wrong_width = {"ok": False, "status": 400, "code": "bad_shape", "error": "does not fit", "field": "shape"}
    for source, named in (("file", "file"), ("layers", "layers"), ("data", "shape")):
        assert _registration_refused(wrong_width, source).field == named
    other = {"ok": False, "status": 409, "code": "exists", "error": "taken", "field": "id"}
    assert _registration_refused(other, "file").field == "id"


def test_a_refusal_from_any_engine_core_is_raised() -> None:
    client = TwoEngines({contract.UNREGISTER: [
        {"ok": True, "in_flight": 0, "version": 1},
        {"ok": False, "status": 404, "code": "unknown_vector", "error": "unknown steering vector 'x'", "field": "id"},
    ]})
    with pytest.raises(HotwireError) as err:
        asyncio.run(HotwireEngine(client, client.per_engine).unregister("x"))
    assert (err.value.status, err.value.code) == (404, "unknown_vector")


def test_without_data_parallelism_every_call_is_one_collective_rpc() -> None:
    client = TwoEngines({contract.UNREGISTER: [{"ok": True, "in_flight": 1, "version": 1}, {"ok": True, "in_flight": 5}]})
    assert asyncio.run(HotwireEngine(client).unregister("x")) == 1
    assert client.calls == [("first", contract.UNREGISTER)]


def test_the_catalog_pins_only_what_every_engine_core_has() -> None:
    """A registration reaches the first engine core first: the catalog copy takes the oldest current version of an
    id (the first core retains it) and leaves out an id another core lacks, and looks again on its next refresh."""
    from hotwire_api.catalog import Catalog

    model = {"steerable": True, "reason": "", "n_layers": 4, "hidden_size": 8, "dtype": "float32", "max_stack": 4,
             "norm": False, "layers": "0-3"}

    def meta(vector_id: str, version: int) -> dict:
        return {"id": vector_id, "version": version, "sha256": f"{vector_id}{version}", "layers": None,
                "norms": {"*": 1.0}}

    def catalog(*vectors: dict) -> dict:
        return {"ok": True, "generation": 7, "model": model, "capacity": 16, "max_rows": 16, "vectors": list(vectors)}

    client = TwoEngines({contract.CATALOG: [catalog(meta("a", 2), meta("new", 1)), catalog(meta("a", 1))]})
    copy = Catalog()
    asyncio.run(copy.refresh(HotwireEngine(client, client.per_engine)))
    assert copy.lookup("a").version == 1 and copy.lookup("new") is None
    assert copy.generation == -1  # behind: the next refresh asks in full
    client.answers[contract.CATALOG][1] = catalog(meta("a", 2), meta("new", 1))
    asyncio.run(copy.refresh(HotwireEngine(client, client.per_engine), not_before=float("inf")))
    assert copy.lookup("a").version == 2 and copy.lookup("new").version == 1 and copy.generation == 7


class OneEngine:
    """An engine client whose engine core is a real ``SteeringController`` (its RPC answers as vLLM's would)."""

    def __init__(self, controller: Any):
        self.controller = controller
        self.answered: list[dict] = []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None) -> list:
        answer = self.controller.answer(contract.engine_method(method), args, kwargs or {})
        self.answered.append(answer)
        return [answer]


def test_the_api_servers_copy_follows_the_engine_by_what_changed(monkeypatch) -> None:
    """After the first, full answer the engine sends only the ids changed since the copy's generation (replaced,
    deleted, re-registered), and the copy equals the engine's whole catalog after each; a copy further behind than
    the engine's log of changes gets the catalog whole."""
    import numpy as np

    from hotwire_api.catalog import Catalog
    from hotwire_core import registry as registry_mod
    from hotwire_core.admission import ModelInfo
    from hotwire_core.controller import SteeringController
    from hotwire_core.settings import Settings
    from hotwire_core.vllm_glue.requests import VLLM_REQUESTS

    monkeypatch.setattr(registry_mod, "CHANGES_KEPT", 4)
    hidden = 8
    controller = SteeringController(ModelInfo(True, "", 2, hidden, "float32", frozenset({0, 1})),
                                    Settings(8, 2, "op", None, None), "org/model", VLLM_REQUESTS)
    rng = np.random.default_rng(0)

    def register(vector_id: str, replace: bool = False) -> None:
        data = rng.standard_normal(hidden, dtype=np.float32).tobytes()
        assert controller.register(vector_id, data, "float32", [hidden], None, replace)["ok"]

    def engine_view() -> dict[str, int]:
        return {m["id"]: m["version"] for m in controller.catalog()["vectors"]}

    client, copy = OneEngine(controller), Catalog()
    engine = HotwireEngine(client)

    def refreshed() -> dict:
        asyncio.run(copy.refresh(engine, not_before=float("inf")))
        assert {i: v.version for i, v in copy.vectors.items()} == engine_view()
        assert copy.generation == controller.registry.generation
        return client.answered[-1]

    for vector_id in ("a", "b", "c"):
        register(vector_id)
    assert "since" not in refreshed()  # the first answer is whole
    register("a", replace=True)
    controller.unregister("b")
    answer = refreshed()
    assert answer["since"] >= 0 and [m["id"] for m in answer["vectors"]] == ["a"] and answer["removed"] == ["b"]
    controller.unregister("c")
    register("c")
    answer = refreshed()
    assert [(m["id"], m["version"]) for m in answer["vectors"]] == [("c", 2)] and answer["removed"] == []
    for k in range(5):  # more changes than the log keeps
        register(f"n{k}")
    answer = refreshed()
    assert "since" not in answer and len(answer["vectors"]) == 7


def test_a_catalog_delta_that_lost_its_base_is_asked_for_whole() -> None:
    """Two fetches under way at once: the one answered last finds the copy moved by the other, so its delta (what
    changed after the generation it sent) has no base; it asks for the whole catalog instead of merging."""
    from hotwire_api.catalog import Catalog

    model = {"steerable": True, "reason": "", "n_layers": 4, "hidden_size": 8, "dtype": "float32", "max_stack": 4,
             "norm": False, "layers": "0-3"}
    meta = {"id": "b", "version": 1, "sha256": "b1", "layers": None, "norms": {"*": 1.0}}
    whole = {"ok": True, "generation": 9, "model": model, "capacity": 16, "max_rows": 16,
             "vectors": [meta, {**meta, "id": "c", "sha256": "c1"}]}

    class Engine:
        asked: list[int] = []

        async def catalog(self, generation: int) -> dict:
            self.asked.append(generation)
            if generation == -1:
                return whole
            copy.generation = 8  # (another fetch applied its answer while this one was on its way)
            return {**whole, "generation": 9, "since": 5, "vectors": [meta], "removed": []}

        async def other_catalogs(self) -> list:
            return []

    copy = Catalog()
    copy.generation = 5
    asyncio.run(copy._fetch(Engine()))
    assert Engine.asked == [5, -1] and sorted(copy.vectors) == ["b", "c"] and copy.generation == 9
