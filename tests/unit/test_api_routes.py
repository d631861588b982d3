"""The HTTP mapping of hotwire_api against an in-memory fake of the engine's ``hotwire_*`` RPC contract
(docs/architecture.md): /steer routes, auth, admission middleware, metrics, OpenAPI, client and CLI.
The real engine is exercised by the integration tests."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, generate_latest, make_asgi_app
from safetensors.numpy import save as save_numpy

from hotwire_api import cli
from hotwire_api.auth import Access
from hotwire_api.client import AsyncHotwireClient, HotwireClient
from hotwire_api.errors import HotwireError
from hotwire_api.keys import KeysFileError, Role, add_key
from hotwire_api.stats_cache import STATS
from hotwire_api.server import attach
from hotwire_api.settings import Settings
from hotwire_api.tickets import TICKETS
from hotwire_core import contract
from hotwire_core.spec import tenant_of

HIDDEN, N_LAYERS = 8, 4
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _fail(status: int, code: str, error: str, field: str | None = None) -> dict[str, Any]:
    return {"ok": False, "status": status, "code": code, "error": error, "field": field}


class FakeEngine:
    """``collective_rpc`` answering the hotwire_* contract from memory, recording every call."""

    def __init__(self) -> None:
        self.vectors: dict[str, dict[str, Any]] = {}
        self.in_flight: Counter[str] = Counter()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.steerable = True
        self.refused: Counter[str] = Counter()
        self.steered = 0
        self.generation = 0
        self.kept_refusals: dict[str, dict[str, Any]] = {}

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        self.calls.append((method, args))
        return [getattr(self, method)(*args)]

    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    def hotwire_register(
        self, vector_id: str, data: bytes, dtype: str, shape: list[int], layers: list[int] | None, replace: bool
    ) -> dict[str, Any]:
        assert isinstance(data, bytes) and isinstance(shape, list) and isinstance(replace, bool)
        assert len(data) == int(np.prod(shape)) * _ITEMSIZE[dtype]
        if shape[-1] != HIDDEN:
            return _fail(400, "hidden_size_mismatch", f"the model's hidden size is {HIDDEN}, not {shape[-1]}", "shape")
        if len(shape) == 2 and layers is None and shape[0] != N_LAYERS:
            return _fail(400, "layer_count_mismatch", f"the model has {N_LAYERS} layers, not {shape[0]}", "shape")
        if layers and max(layers) >= N_LAYERS:
            return _fail(400, "layer_out_of_range", f"layer {max(layers)} is out of range 0..{N_LAYERS - 1}", "layers")
        existing = self.vectors.get(vector_id)
        if existing is not None and not replace:
            return _fail(409, "exists", f"vector {vector_id!r} is already registered; pass replace=true", "id")
        rows = (
            np.frombuffer(data, np.float16 if dtype == "float16" else np.float32).reshape(-1, HIDDEN)
            if dtype != "bfloat16"
            else np.zeros((1, HIDDEN))
        )
        keys = layers if layers is not None else (list(range(shape[0])) if len(shape) == 2 else ["*"])
        meta = {
            "id": vector_id,
            "version": existing["version"] + 1 if existing else 1,
            "sha256": hashlib.sha256(data).hexdigest(),
            "dtype": dtype,
            "shape": shape,
            "layers": layers if layers is not None or len(shape) == 1 else list(range(shape[0])),
            "norms": {str(k): float(np.linalg.norm(r)) for k, r in zip(keys, rows, strict=False)},
            "in_flight": 0,
            "created_at": time.time(),
        }
        self.vectors[vector_id] = meta
        self.generation += 1
        return {"ok": True, "created": existing is None, "vector": meta}

    def hotwire_unregister(self, vector_id: str) -> dict[str, Any]:
        meta = self.vectors.pop(vector_id, None)
        if meta is None:
            return _fail(404, "unknown_vector", f"unknown steering vector {vector_id!r}", "id")
        self.generation += 1
        return {"ok": True, "in_flight": self.in_flight.pop(vector_id, 0), "version": meta["version"]}

    def hotwire_catalog(self, generation: int) -> dict[str, Any]:
        if generation == self.generation:
            return {"ok": True, "generation": generation, "unchanged": True}
        model = {"steerable": self.steerable, "reason": "no decoder layers" if not self.steerable else "",
                 "n_layers": N_LAYERS, "hidden_size": HIDDEN, "dtype": "float32", "max_stack": 4, "norm": False,
                 "layers": f"0-{N_LAYERS - 1}"}
        return {"ok": True, "generation": self.generation, "model": model, "capacity": 16, "max_rows": 16,
                "vectors": list(self.vectors.values())}

    def hotwire_refusals(self, tickets: list[str]) -> dict[str, Any]:
        return {"ok": True, "refusals": {t: self.kept_refusals.pop(t) for t in tickets if t in self.kept_refusals}}

    def hotwire_list(self, tenant: str | None = None) -> dict[str, Any]:
        return {"ok": True, "vectors": [{**m, "in_flight": self.in_flight[m["id"]]} for m in self.vectors.values()
                                        if tenant is None or tenant_of(m["id"]) == tenant]}

    def hotwire_stats(self) -> dict[str, Any]:
        rows = [
            {
                "slot": i + 1,
                "id": v,
                "version": m["version"],
                "layer": 0,
                "refcount": self.in_flight[v],
                "last_use": 1.0,
            }
            for i, (v, m) in enumerate(self.vectors.items())
        ]
        return {
            "ok": True,
            "capacity": 16,
            "used": len(rows),
            "pinned": sum(r["refcount"] > 0 for r in rows),
            "free": 16 - len(rows),
            "evictions": 3,
            "refused": dict(self.refused),
            "steered_requests": self.steered,
            "vectors": len(self.vectors),
            "rows": rows,
            "model": {
                "steerable": self.steerable,
                "reason": None,
                "n_layers": N_LAYERS,
                "hidden_size": HIDDEN,
                "max_stack": 4,
            },
        }

    def hotwire_check(self, spec: str, slots: bool = True) -> dict[str, Any]:
        if not self.steerable:  # like hotwire_core, check() refuses without counting: admission counts
            return _fail(503, "model_not_steerable", "this model's decoder layers cannot be steered")
        try:
            entries = json.loads(spec)
        except ValueError:
            return _fail(400, "bad_spec", "hotwire: is not valid JSON", "hotwire")
        entries = entries if isinstance(entries, list) else [entries]
        for i, entry in enumerate(entries):
            if entry["id"] not in self.vectors:
                return _fail(400, "unknown_vector", f"unknown steering vector {entry['id']!r}", f"hotwire[{i}].id")
            if entry["layer"] >= N_LAYERS:
                return _fail(
                    400, "layer_out_of_range", f"layer {entry['layer']} is out of range", f"hotwire[{i}].layer"
                )
        self.steered += 1
        first = self.vectors[entries[0]["id"]]
        return {"ok": True, "receipt": f"{first['id']}@v{first['version']}", "spec": spec, "new_rows": 1}


def _openai_app(engine: FakeEngine | None, settings: Settings) -> FastAPI:
    """A FastAPI app with stand-ins for vLLM's OpenAI routes (echoing what they received) and /metrics."""
    app = FastAPI()
    attach(app, settings)
    app.state.engine_client = engine

    async def echo(request: Request) -> JSONResponse:
        raw = await request.body()
        _to_engine(raw)
        return JSONResponse({"raw": raw.decode(), "content_length": request.headers.get("content-length")})

    async def stream(request: Request) -> StreamingResponse:
        _to_engine(await request.body())

        async def chunks():
            for i in range(3):
                yield f'data: {{"i": {i}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_api_route("/v1/chat/completions", echo, methods=["POST"])
    app.add_api_route("/v1/responses", echo, methods=["POST"])
    app.add_api_route("/v1/completions", stream, methods=["POST"])
    app.add_api_route("/v1/embeddings", echo, methods=["POST"])
    app.mount("/metrics", make_asgi_app())
    return app


def _to_engine(body: bytes) -> None:
    """What vLLM's engine client does with a request: the guard hotwire_api.mount installs sees its extra_args."""
    try:
        xargs = json.loads(body).get("vllm_xargs")
    except (ValueError, AttributeError):
        return
    TICKETS.check(xargs if isinstance(xargs, dict) else None)


@pytest.fixture(autouse=True)
def fresh_stats() -> None:
    STATS.snapshot = None
    STATS.admission_refusals = {}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> FastAPI:
    return _openai_app(engine, Settings(max_upload_bytes=4096))


@pytest.fixture
def client(app: FastAPI) -> TestClient:
    return TestClient(app)


def _vector(rows: int = 1) -> np.ndarray:
    return (
        np.arange(rows * HIDDEN, dtype=np.float32).reshape(rows, HIDDEN).squeeze(0) / 10
        if rows == 1
        else np.arange(rows * HIDDEN, dtype=np.float32).reshape(rows, HIDDEN) / 10
    )


def _upload(
    client: TestClient,
    vector_id: str,
    array: np.ndarray,
    *,
    layers: str | None = None,
    replace: bool = False,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    data = {"id": vector_id, **({"layers": layers} if layers else {})}
    return client.post(
        "/steer/vectors",
        params={"replace": "true"} if replace else None,
        data=data,
        files={"file": ("v.safetensors", save_numpy({"v": array}), "application/octet-stream")},
        headers=headers,
    )


def _error(response: httpx.Response, status: int, code: str, field: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error.get("field") == field
    return error


def _chat(vllm_xargs: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    if vllm_xargs is not None:
        body["vllm_xargs"] = vllm_xargs
    return body


def _spec(vector_id: str = "happy", layer: int = 1, scale: float = 4.0) -> str:
    return json.dumps({"id": vector_id, "layer": layer, "scale": scale})


# ---- /steer/vectors ---------------------------------------------------------------------------------------


def test_register_multipart_then_get_list_delete(client: TestClient, engine: FakeEngine) -> None:
    response = _upload(client, "happy", _vector())
    assert response.status_code == 201, response.text
    meta = response.json()
    assert (meta["id"], meta["version"], meta["shape"], meta["dtype"]) == ("happy", 1, [HIDDEN], "float32")
    assert meta["sha256"] == hashlib.sha256(_vector().tobytes()).hexdigest()
    method, args = engine.calls[0]
    assert method == contract.REGISTER
    assert args == ("happy", _vector().tobytes(), "float32", [HIDDEN], None, False)

    assert client.get("/steer/vectors/happy").json()["version"] == 1
    assert [v["id"] for v in client.get("/steer/vectors").json()["vectors"]] == ["happy"]
    assert client.delete("/steer/vectors/happy").status_code == 204
    _error(client.get("/steer/vectors/happy"), 404, "unknown_vector", "id")
    _error(client.delete("/steer/vectors/happy"), 404, "unknown_vector", "id")


def test_register_json_base64_and_per_layer_lists(client: TestClient, engine: FakeEngine) -> None:
    rows = _vector(2)
    body = {
        "id": "b64",
        "data": base64.b64encode(rows.astype(np.float16).tobytes()).decode(),
        "dtype": "float16",
        "shape": [2, HIDDEN],
        "layers": [1, 3],
    }
    assert client.post("/steer/vectors", json=body).status_code == 201
    assert engine.calls[-3][1][2:5] == ("float16", [2, HIDDEN], [1, 3])  # before the catalog and stats refreshes

    response = client.post("/steer/vectors", json={"id": "lists", "layers": {"2": [1.0] * HIDDEN}})
    assert response.status_code == 201, response.text
    assert response.json()["layers"] == [2] and response.json()["norms"] == {"2": pytest.approx(HIDDEN**0.5)}


def test_register_safetensors_named_by_layer(client: TestClient, engine: FakeEngine) -> None:
    file = save_numpy({"3": np.ones(HIDDEN, np.float32), "0": np.zeros(HIDDEN, np.float32)})
    response = client.post(
        "/steer/vectors", data={"id": "by-layer"}, files={"file": ("v.safetensors", file, "application/octet-stream")}
    )
    assert response.status_code == 201, response.text
    assert response.json()["layers"] == [0, 3]


def test_same_id_conflicts_unless_replace(client: TestClient) -> None:
    assert _upload(client, "v", _vector()).status_code == 201
    error = _error(_upload(client, "v", _vector()), 409, "exists", "id")
    assert "replace" in error["message"]
    response = _upload(client, "v", _vector() * 2, replace=True)
    assert response.status_code == 200 and response.json()["version"] == 2
    assert _upload(client, "new", _vector(), replace=True).status_code == 201


@pytest.mark.parametrize(
    "array,layers,status,code,field",
    [
        (np.ones(HIDDEN + 1, np.float32), None, 400, "hidden_size_mismatch", "file"),  # engine-side check, named as the upload
        (np.ones((2, HIDDEN), np.float32), "2,9", 400, "layer_out_of_range", "layers"),  # engine-side check
        (np.ones(HIDDEN, np.float64), None, 400, "bad_dtype", "file"),
        (np.full(HIDDEN, np.nan, np.float32), None, 400, "not_finite", "file"),
        (np.ones((2, HIDDEN), np.float32), "1", 400, "bad_layers", "layers"),
    ],
)
def test_register_errors(
    client: TestClient, engine: FakeEngine, array: np.ndarray, layers: str | None, status: int, code: str, field: str
) -> None:
    _error(_upload(client, "v", array, layers=layers), status, code, field)
    if code not in ("hidden_size_mismatch", "layer_out_of_range"):
        assert engine.calls == []  # refused in the API, before any RPC


def test_register_bad_id_and_body(client: TestClient, engine: FakeEngine) -> None:
    _error(_upload(client, "no spaces", _vector()), 400, "bad_id", "id")
    _error(client.post("/steer/vectors", content=b"{", headers={"content-type": "application/json"}), 400, "bad_body")
    deep = b"[" * 2000  # a RecursionError in json (past the interpreter's depth): a 400, not a bare 500
    _error(client.post("/steer/vectors", content=deep, headers={"content-type": "application/json"}), 400, "bad_body")
    _error(
        client.post("/steer/vectors", content=b"x", headers={"content-type": "text/plain"}),
        415,
        "unsupported_media_type",
    )
    _error(client.post("/steer/vectors", data={"id": "v"}), 415, "unsupported_media_type")  # urlencoded: no file
    no_file = b'--B\r\nContent-Disposition: form-data; name="id"\r\n\r\nv\r\n--B--\r\n'
    multipart = {"content-type": "multipart/form-data; boundary=B"}
    response = client.post("/steer/vectors", content=no_file, headers=multipart)
    _error(response, 400, "bad_file", "file")
    _error(
        client.post("/steer/vectors", content=b"garbage", headers={"content-type": "multipart/form-data"}),
        400,
        "bad_body",
    )
    torch_pickle = b"PK\x03\x04" + b"\x00" * 100  # torch.save writes a zip of pickles
    response = client.post("/steer/vectors", data={"id": "v"}, files={"file": ("v.pt", torch_pickle)})
    assert "never pickles" in _error(response, 400, "bad_file", "file")["message"]
    _error(client.post("/steer/vectors?replace=maybe", json={}), 400, "bad_request", "replace")
    assert engine.calls == []


def test_register_oversize_is_413(client: TestClient, engine: FakeEngine) -> None:
    big = np.ones((N_LAYERS * 40, HIDDEN), np.float32)  # 5 KiB > the fixture's 4 KiB limit
    _error(_upload(client, "big", big), 413, "payload_too_large")

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"id": "big", "data": "'
        for _ in range(10):
            yield b"A" * 1024

    response = client.post("/steer/vectors", content=chunked(), headers={"content-type": "application/json"})
    _error(response, 413, "payload_too_large")
    assert engine.calls == []


def test_delete_with_in_flight_users_is_202(client: TestClient, engine: FakeEngine) -> None:
    _upload(client, "v", _vector())
    engine.in_flight["v"] = 2
    assert client.get("/steer/vectors/v").json()["in_flight"] == 2
    response = client.delete("/steer/vectors/v")
    assert response.status_code == 202 and response.json() == {"id": "v", "in_flight": 2}


def test_engine_failures_are_503(app: FastAPI) -> None:
    class Dead:
        async def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
            raise AttributeError("'EngineCoreProc' object has no attribute 'hotwire_list'")

    app.state.engine_client = Dead()
    error = _error(TestClient(app).get("/steer/vectors"), 503, "engine_unavailable")
    assert "VLLM_PLUGINS" in error["message"]
    app.state.engine_client = None
    _error(TestClient(app).get("/steer/slots"), 503, "engine_unavailable")


# ---- /steer/slots and metrics -----------------------------------------------------------------------------


def test_slots_is_one_rpc(client: TestClient, engine: FakeEngine) -> None:
    _upload(client, "v", _vector())
    engine.calls.clear()
    stats = client.get("/steer/slots").json()
    assert engine.methods() == [contract.STATS]
    assert (stats["capacity"], stats["used"], stats["free"], stats["evictions"], stats["vectors"]) == (16, 1, 15, 3, 1)
    assert stats["rows"][0] == {
        "slot": 1, "id": "v", "version": 1, "layer": 0, "refcount": 0, "last_use": 1.0, "engine": 0
    }
    assert stats["model"]["hidden_size"] == HIDDEN and "ok" not in stats and stats["engines"] == 1


def test_slots_max_age_serves_the_snapshot_and_revalidates(client: TestClient, engine: FakeEngine) -> None:
    _upload(client, "v", _vector())  # its background refresh takes a snapshot
    engine.calls.clear()
    cached = client.get("/steer/slots", params={"max_age_ms": 60_000}).json()
    assert engine.methods() == [] and cached["vectors"] == 1 and 0 <= cached["age_ms"] < 60_000
    # Older than half the accepted age: answered from the snapshot, refreshed in the background.
    STATS.taken_at -= 40
    stale = client.get("/steer/slots", params={"max_age_ms": 60_000}).json()
    assert stale["age_ms"] >= 40_000
    assert engine.methods() == [contract.STATS] and STATS.age_s() < 5
    # Older than the accepted age: waits for the engine.
    engine.calls.clear()
    STATS.taken_at -= 120
    fresh = client.get("/steer/slots", params={"max_age_ms": 60_000}).json()
    assert engine.methods() == [contract.STATS] and fresh["age_ms"] < 5_000
    # The default asks the engine every time.
    engine.calls.clear()
    client.get("/steer/slots")
    client.get("/steer/slots")
    assert engine.methods() == [contract.STATS, contract.STATS]
    bad = client.get("/steer/slots", params={"max_age_ms": -1})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "max_age_ms"


def test_steer_calls_refresh_the_metrics_snapshot(client: TestClient, engine: FakeEngine) -> None:
    _upload(client, "v", _vector())
    assert engine.methods() == [contract.REGISTER, contract.CATALOG, contract.STATS]
    assert STATS.snapshot is not None and STATS.snapshot.vectors == 1


def test_metrics_series(client: TestClient, engine: FakeEngine) -> None:
    assert "hotwire_slots_capacity" not in client.get("/metrics").text  # no snapshot yet: no bank series
    _upload(client, "happy", _vector())
    engine.refused["version_gone"] = 2  # refused by the engine when it admitted requests
    client.post("/v1/chat/completions", json=_chat({"hotwire": _spec("happy", layer=99)}))  # refused by admission
    client.post("/v1/chat/completions", json=_chat({"hotwire": _spec("nope")}))
    client.get("/steer/slots")
    text = client.get("/metrics").text
    for line in (
        "hotwire_slots_capacity 16.0",
        "hotwire_slots_used 1.0",
        "hotwire_slots_pinned 0.0",
        "hotwire_slot_evictions_total 3.0",
        "hotwire_vectors_registered 1.0",
        "hotwire_steered_requests_total 0.0",
        'hotwire_refusals_total{reason="version_gone"} 2.0',
        'hotwire_refusals_total{reason="layer_out_of_range"} 1.0',
        'hotwire_refusals_total{reason="unknown_vector"} 1.0',
    ):
        assert line in text, line
    assert text.count("# TYPE hotwire_refusals_total counter") == 1
    assert generate_latest(REGISTRY).decode().count("hotwire_slots_capacity 16.0") == 1


def test_metrics_collect_never_calls_the_engine(client: TestClient, engine: FakeEngine) -> None:
    client.get("/steer/slots")
    engine.calls.clear()
    generate_latest(REGISTRY)
    assert engine.calls == []


def test_lifespan_refreshes_stats_in_the_background(app: FastAPI, engine: FakeEngine) -> None:
    STATS.snapshot = None
    with TestClient(app):
        deadline = time.monotonic() + 5
        while contract.STATS not in engine.methods() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert contract.STATS in engine.methods()
    assert STATS.snapshot is not None


def test_at_startup_the_hosts_routes_come_before_hotwires(app: FastAPI) -> None:
    """The host added its OpenAI routes after attach: once started, they are tried first, /steer still answers."""
    paths = lambda: [getattr(route, "path", "") for route in app.router.routes]  # noqa: E731
    assert paths().index("/v1/completions") > paths().index("/steer/slots")
    with TestClient(app) as client:
        steer = [i for i, path in enumerate(paths()) if path.startswith("/steer/")]
        assert paths().index("/v1/completions") < min(steer) and steer == list(range(min(steer), len(paths())))
        assert client.get("/steer/slots").status_code == 200


def test_hotwires_routes_stay_ahead_of_a_catch_all(app: FastAPI) -> None:
    from starlette.routing import Mount

    from hotwire_api.steer_router import routes_last

    app.router.routes.append(Mount("/", app=FastAPI()))  # a host serving files at its root
    app.add_api_route("/{anything:path}", lambda: {}, methods=["GET"])
    routes_last(app)
    paths = [getattr(route, "path", "") for route in app.router.routes]
    steer = [i for i, path in enumerate(paths) if path.startswith("/steer/")]
    assert paths.index("/v1/completions") < min(steer) and max(steer) < paths.index("")  # before the root mount
    assert TestClient(app).get("/steer/slots").status_code == 200


# ---- auth -------------------------------------------------------------------------------------------------


def _auth_status(client: TestClient, key: str | None) -> int:
    return client.get("/steer/slots", headers={"Authorization": f"Bearer {key}"} if key else None).status_code


def test_auth_off_by_default(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _auth_status(client, None) == 200


def test_hotwire_api_key(engine: FakeEngine) -> None:
    client = TestClient(_openai_app(engine, Settings(api_key="s3cret")))
    response = client.get("/steer/vectors")
    _error(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"
    assert _auth_status(client, "wrong") == 401
    assert client.get("/steer/slots", headers={"Authorization": "Basic s3cret"}).status_code == 401
    assert _auth_status(client, "s3cret") == 200
    assert client.post("/steer/vectors", json={}).status_code == 401  # before the body is even read
    assert client.post("/v1/chat/completions", json=_chat()).status_code == 200  # /v1 is vLLM's to guard


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """hmac.compare_digest for each configured key, with no early exit on a match."""
    from hotwire_api import auth

    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert auth.bearer_matches("Bearer k1", ["k1", "k2", "k3"]) is True
    assert compared == [b"k1", b"k2", b"k3"]
    assert auth.bearer_matches("Bearer nope", ["k1"]) is False
    assert auth.bearer_matches("Basic k1", ["k1"]) is False


def test_vllm_api_keys_apply_when_hotwire_has_none(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _openai_app(engine, Settings())
    app.state.args = Namespace(api_key=["k1", "k2"])  # vLLM 0.25.1: --api-key is a list
    client = TestClient(app)
    assert (_auth_status(client, None), _auth_status(client, "k2"), _auth_status(client, "k3")) == (401, 200, 401)

    app.state.args = Namespace(api_key=None)
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert (_auth_status(client, "env-key"), _auth_status(client, "k1")) == (200, 401)

    app.state.hotwire_access = Access(Settings(api_key="mine"))  # HOTWIRE_API_KEY wins
    assert (_auth_status(client, "mine"), _auth_status(client, "env-key")) == (200, 401)


ROUTE_ROLES = {  # docs/security.md, "Keys with roles"
    ("GET", "/steer/slots"): Role.READ, ("GET", "/steer/fleet"): Role.READ,
    ("GET", "/steer/vectors"): Role.STEER, ("GET", "/steer/vectors/{vector_id}"): Role.STEER,
    ("GET", "/steer/vectors/{vector_id}/file"): Role.STEER,
    ("POST", "/steer/vectors"): Role.ADMIN, ("POST", "/steer/vectors/extract"): Role.ADMIN,
    ("DELETE", "/steer/vectors/{vector_id}"): Role.ADMIN, ("GET", "/steer/audit"): Role.ADMIN,
    ("GET", "/steer/keys"): Role.ADMIN, ("POST", "/steer/keys"): Role.ADMIN,
    ("POST", "/steer/keys/{name}/rotate"): Role.ADMIN, ("DELETE", "/steer/keys/{name}"): Role.ADMIN,
    ("GET", "/steer/monitors"): Role.READ, ("POST", "/steer/monitors"): Role.ADMIN,
    ("DELETE", "/steer/monitors/{monitor_id}"): Role.ADMIN,
}


def test_every_steer_route_names_the_role_it_needs() -> None:
    from hotwire_api.key_routes import router as key_router
    from hotwire_api.monitor_routes import router as monitor_router
    from hotwire_api.routes import router

    declared = {}
    for route in [*router.routes, *key_router.routes, *monitor_router.routes]:
        roles = [d.call.role for d in route.dependant.dependencies if hasattr(d.call, "role")]
        assert len(roles) == 1, f"{route.path} declares {len(roles)} roles"
        for method in route.methods:
            declared[(method, route.path)] = roles[0]
    assert declared == ROUTE_ROLES


def test_with_a_keys_file_a_steered_request_takes_a_steer_key_as_its_bearer(engine: FakeEngine, tmp_path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM has no key, the bearer token is the hotwire key; beside vLLM's key it goes in X-Hotwire-Key
    (against a real vllm serve: tests/integration/test_roles.py)."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    path = tmp_path / "keys.json"
    keys = {role: add_key(path, role.value, role) for role in Role}
    client = TestClient(_openai_app(engine, Settings(keys_file=str(path))))
    bearer = {role: {"Authorization": f"Bearer {key}"} for role, key in keys.items()}
    assert _upload(client, "happy", _vector(), headers=bearer[Role.ADMIN]).status_code == 201
    steered = _chat({"hotwire": _spec()})
    assert "x-hotwire-receipt" in client.post("/v1/chat/completions", json=steered, headers=bearer[Role.STEER]).headers
    assert "x-hotwire-receipt" in client.post("/v1/chat/completions", json=steered,
                                              headers={"X-Hotwire-Key": keys[Role.STEER]}).headers
    _error(client.post("/v1/chat/completions", json=steered, headers=bearer[Role.READ]), 403, "forbidden")
    _error(client.post("/v1/chat/completions", json=steered), 401, "unauthorized")
    assert client.post("/v1/chat/completions", json=_chat()).status_code == 200  # plain: vLLM's to guard
    _error(client.get("/steer/vectors", headers=bearer[Role.READ]), 403, "forbidden")
    assert client.get("/steer/slots", headers=bearer[Role.READ]).status_code == 200
    with pytest.raises(KeysFileError):  # a server whose keys file cannot be read does not start
        _openai_app(engine, Settings(keys_file=str(tmp_path / "missing.json")))


# ---- admission --------------------------------------------------------------------------------------------


def test_requests_without_hotwire_are_untouched(client: TestClient, engine: FakeEngine) -> None:
    raw = json.dumps(_chat({"other": "x"})).encode() + b"   "
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.json()["raw"].encode() == raw
    assert "x-hotwire-receipt" not in response.headers
    mention = _chat(None, messages=[{"role": "user", "content": "what is a hotwire?"}])
    assert client.post("/v1/chat/completions", json=mention).status_code == 200
    assert client.post("/v1/embeddings", json={"vllm_xargs": {"other": "x"}}).status_code == 200
    assert engine.calls == []


def test_steered_request_is_admitted_with_a_receipt_and_pinned_without_an_engine_call(
    client: TestClient, engine: FakeEngine
) -> None:
    _upload(client, "happy", _vector())
    calls = len(engine.calls)
    raw = json.dumps(_chat({"hotwire": _spec(), "keep": 1}), indent=1).encode()
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.headers["x-hotwire-receipt"] == "happy@1:L1x4"
    forwarded = json.loads(response.json()["raw"])
    xargs = forwarded.pop("vllm_xargs")
    assert forwarded == {k: v for k, v in json.loads(raw).items() if k != "vllm_xargs"}  # the rest unchanged
    assert json.loads(xargs["hotwire"]) == [{"id": "happy", "layer": [1], "scale": 4.0, "version": 1}]
    assert xargs["keep"] == 1 and len(xargs["hotwire_ticket"]) == 32
    assert response.json()["content_length"] == str(len(response.json()["raw"]))
    response = client.post("/v1/responses", json={"input": "hi", "vllm_xargs": {"hotwire": _spec()}})
    assert response.headers["x-hotwire-receipt"] == "happy@1:L1x4"
    assert engine.methods()[calls:] == []  # decided from the catalog this process holds


def test_a_replace_is_seen_by_the_next_request_and_receipts_name_the_pinned_version(
    client: TestClient, engine: FakeEngine
) -> None:
    _upload(client, "happy", _vector())
    assert client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()})).headers["x-hotwire-receipt"] == "happy@1:L1x4"
    assert _upload(client, "happy", _vector() + 1, replace=True).status_code == 200
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()}))
    assert response.headers["x-hotwire-receipt"] == "happy@2:L1x4"
    assert json.loads(json.loads(response.json()["raw"])["vllm_xargs"]["hotwire"])[0]["version"] == 2


def test_a_spec_is_decided_once_per_catalog_state_and_the_decisions_kept_are_bounded(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hotwire_api import admission

    resolved = []
    real = admission.resolve
    monkeypatch.setattr(admission, "resolve", lambda *a: resolved.append(a[0]) or real(*a))
    monkeypatch.setattr(admission, "_DECIDED_KEPT", 3)
    admission._DECIDED.clear()
    _upload(client, "happy", _vector())
    receipts = [client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()})).headers["x-hotwire-receipt"]
                for _ in range(3)]
    assert receipts == ["happy@1:L1x4"] * 3 and resolved == [_spec()]
    _error(client.post("/v1/chat/completions", json=_chat({"hotwire": _spec("nope")})), 400, "unknown_vector",
           "vllm_xargs.hotwire[0].id")
    assert len(admission._DECIDED) == 1  # a refusal is not kept
    assert _upload(client, "happy", _vector() + 1, replace=True).status_code == 200  # a new catalog state
    assert client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()})).headers["x-hotwire-receipt"] \
        == "happy@2:L1x4"
    assert resolved.count(_spec()) == 2
    for scale in (1.0, 2.0, 3.0, 5.0):
        client.post("/v1/chat/completions", json=_chat({"hotwire": _spec(scale=scale)}))
    assert len(admission._DECIDED) <= 3


def test_an_id_registered_elsewhere_is_fetched_on_first_use(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/chat/completions", json=_chat(None))
    _upload(client, "first", _vector())
    engine.hotwire_register("elsewhere", _vector().tobytes(), "float32", [HIDDEN], None, False)  # another API server
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec("elsewhere")}))
    assert response.headers["x-hotwire-receipt"] == "elsewhere@1:L1x4"


def test_a_version_the_catalog_does_not_hold_is_decided_by_the_engine(client: TestClient, engine: FakeEngine) -> None:
    _upload(client, "happy", _vector())
    pinned = json.dumps({"id": "happy", "layer": 1, "scale": 4.0, "version": 7})
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": pinned}))
    assert response.headers["x-hotwire-receipt"] == "happy@v1"  # the fake engine's receipt
    assert (contract.CHECK, (pinned, False)) in engine.calls  # asked without the 429: a request waits for rows


def test_reserved_cache_salt_is_refused_before_the_engine(client: TestClient, engine: FakeEngine) -> None:
    for xargs in (None, {"hotwire": _spec()}):
        body = _chat(xargs, cache_salt="hotwire:forged")
        response = client.post("/v1/chat/completions", json=body)
        _error(response, 400, "reserved_salt", "cache_salt")
    assert engine.calls == []
    assert client.post("/v1/chat/completions", json=_chat(None, cache_salt="mine")).status_code == 200


def test_no_receipt_when_vllm_rejects_the_request(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())

    async def reject(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"error": "max_tokens too large"}, status_code=400)

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/chat/completions"]
    app.add_api_route("/v1/chat/completions", reject, methods=["POST"])
    client = TestClient(app)
    _upload(client, "happy", _vector())
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()}))
    assert response.status_code == 400 and "x-hotwire-receipt" not in response.headers
    assert response.json() == {"error": "max_tokens too large"}


# What vLLM 0.25.1 answers for a request the engine finished with an error (generation_error_handler).
_VLLM_500 = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


def _ticket(body: bytes) -> str:
    _to_engine(body)
    return json.loads(body)["vllm_xargs"]["hotwire_ticket"]


def _refuse_in_engine(engine: FakeEngine) -> Callable[[str], None]:
    """What the engine does for a request it refuses after admission: keep the refusal under its ticket."""
    def refuse(ticket: str) -> None:
        engine.kept_refusals[ticket] = _fail(410, "version_gone", "version 1 of 'happy' is not retained any more",
                                             "hotwire[0].version")
    return refuse


def _failing_chat_route(app: FastAPI, before_failing: Callable[[str], None]) -> None:
    async def fail(request: Request) -> JSONResponse:
        before_failing(_ticket(await request.body()))
        return JSONResponse(_VLLM_500, status_code=500)

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/chat/completions"]
    app.add_api_route("/v1/chat/completions", fail, methods=["POST"])


def test_engine_refusal_after_admission_is_answered_with_its_status(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _failing_chat_route(app, _refuse_in_engine(engine))
    client = TestClient(app)
    _upload(client, "happy", _vector())
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()}))
    _error(response, 410, "version_gone", "vllm_xargs.hotwire[0].version")
    assert "x-hotwire-receipt" not in response.headers
    assert engine.kept_refusals == {}  # asked for, and handed out


def test_other_engine_errors_pass_through(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _failing_chat_route(app, lambda ticket: None)  # the engine kept no refusal: the 500 is not about steering
    client = TestClient(app)
    _upload(client, "happy", _vector())
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()}))
    assert (response.status_code, response.json()) == (500, _VLLM_500)
    assert "x-hotwire-receipt" not in response.headers


# What vLLM 0.25.1 streams for such a request after its 200 (_convert_generation_error_to_streaming_response).
_VLLM_STREAM_ERROR = f"data: {json.dumps(_VLLM_500)}\n\n".encode()


# Events before the error: chat's opening role-only chunk (no output yet), then one carrying generated text.
_ROLE_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
_TEXT_CHUNK = b'data: {"choices": [{"index": 0, "text": " jumps"}]}\n\n'


def _failing_stream_route(app: FastAPI, before_failing: Callable[[str], None], first: bytes = _ROLE_CHUNK,
                          error: bytes | None = _VLLM_STREAM_ERROR) -> None:
    async def stream(request: Request) -> StreamingResponse:
        ticket = _ticket(await request.body())

        async def chunks():
            yield first
            before_failing(ticket)
            if error is not None:
                yield error
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/completions"]
    app.add_api_route("/v1/completions", stream, methods=["POST"])


def _stream_events(client: TestClient, spec: str, status: int = 200) -> list[bytes]:
    body = {"model": "m", "prompt": "hi", "stream": True, "vllm_xargs": {"hotwire": spec}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == status
        return [e + b"\n\n" for e in b"".join(response.iter_bytes()).split(b"\n\n") if e]


@pytest.mark.parametrize("error", [_VLLM_STREAM_ERROR, None], ids=["error-event", "no-event"])
def test_engine_refusal_before_any_output_answers_the_stream_with_its_status(engine: FakeEngine, error) -> None:
    """Refused before output (vLLM's chat stream then ends with no error event at all): the held start and role
    chunk never go out; the client gets the refusal as a plain 4xx."""
    app = _openai_app(engine, Settings())
    _failing_stream_route(app, _refuse_in_engine(engine), error=error)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    [body] = _stream_events(client, _spec(), status=410)
    assert json.loads(body)["error"]["code"] == "version_gone"


def test_engine_refusal_after_output_is_an_error_event(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _failing_stream_route(app, _refuse_in_engine(engine), first=_TEXT_CHUNK)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    first, error, done = _stream_events(client, _spec())
    assert (first, done) == (_TEXT_CHUNK, b"data: [DONE]\n\n")
    event = json.loads(error.removeprefix(b"data: "))["error"]
    assert (event["type"], event["param"], event["code"]) == ("version_gone", "vllm_xargs.hotwire[0].version", 410)


def test_other_stream_errors_pass_through(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _failing_stream_route(app, lambda ticket: None)  # no refusal kept: the error is not about steering
    client = TestClient(app)
    _upload(client, "happy", _vector())
    assert _stream_events(client, _spec()) == [_ROLE_CHUNK, _VLLM_STREAM_ERROR, b"data: [DONE]\n\n"]


_CREATED = b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
_DELTA = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "hi"}\n\n'


def _crashing_responses_route(app: FastAPI, engine: FakeEngine, first: bytes, refuse: bool) -> None:
    """vLLM 0.25.1's /v1/responses stream for a failed request: its events so far, then an exception (turning
    the failure into an event fails validation), which ends the connection mid-stream."""
    async def stream(request: Request) -> StreamingResponse:
        ticket = _ticket(await request.body())

        async def events():
            yield first
            if refuse:
                _refuse_in_engine(engine)(ticket)
            raise ValueError("105 validation errors for union[ResponseCreatedEvent, ...]")

        return StreamingResponse(events(), media_type="text/event-stream")

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/responses"]
    app.add_api_route("/v1/responses", stream, methods=["POST"])


def _responses_stream(client: TestClient, status: int) -> bytes:
    body = {"model": "m", "input": "hi", "stream": True, "vllm_xargs": {"hotwire": _spec()}}
    with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == status
        return b"".join(response.iter_bytes())


def test_a_responses_stream_that_crashes_on_a_refusal_before_output_answers_with_the_refusal(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _crashing_responses_route(app, engine, _CREATED, refuse=True)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    assert json.loads(_responses_stream(client, 410))["error"]["code"] == "version_gone"


def test_a_responses_stream_that_crashes_after_output_ends_with_an_error_event(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _crashing_responses_route(app, engine, _DELTA, refuse=True)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    delta, error = _responses_stream(client, 200).split(b"\n\n")[:2]
    assert delta + b"\n\n" == _DELTA
    event = json.loads(error.split(b"data: ", 1)[1])
    assert error.startswith(b"event: error\n") and (event["type"], event["code"]) == ("error", "version_gone")


def test_a_crash_without_a_refusal_is_not_hidden(engine: FakeEngine) -> None:
    """Not about steering: the exception goes on to the server, which answers 500 (nothing was sent yet)."""
    app = _openai_app(engine, Settings())
    _crashing_responses_route(app, engine, _CREATED, refuse=False)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    with pytest.raises(ValueError, match="validation errors"):
        _responses_stream(client, 500)


def test_a_stream_error_after_generated_text_without_a_refusal_passes_through(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    _failing_stream_route(app, lambda ticket: engine.vectors.pop("happy"), first=_TEXT_CHUNK)
    client = TestClient(app)
    _upload(client, "happy", _vector())
    assert _stream_events(client, _spec()) == [_TEXT_CHUNK, _VLLM_STREAM_ERROR, b"data: [DONE]\n\n"]


def test_streaming_response_passes_through(client: TestClient) -> None:
    _upload(client, "happy", _vector())
    body = {"model": "m", "prompt": "hi", "stream": True, "vllm_xargs": {"hotwire": _spec()}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["x-hotwire-receipt"] == "happy@1:L1x4"
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = b"".join(response.iter_bytes())
    assert chunks == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(
    "spec,status,code,field",
    [
        (_spec("nope"), 400, "unknown_vector", "vllm_xargs.hotwire[0].id"),
        (_spec("happy", layer=99), 400, "layer_out_of_range", "vllm_xargs.hotwire[0].layer"),
        ("{not json", 400, "bad_spec", "vllm_xargs.hotwire"),
        (["a", "b"], 400, "bad_spec", "vllm_xargs.hotwire"),  # chat allows lists of strings; not our format
        (json.dumps([{"id": "happy", "layer": 1, "scale": 1.0}] * 5), 400, "too_many_entries", "vllm_xargs.hotwire"),
        (_spec("happy", scale=1e30), 400, "too_strong", "vllm_xargs.hotwire[0].scale"),
    ],
)
def test_admission_refusals(
    client: TestClient, engine: FakeEngine, spec: Any, status: int, code: str, field: str | None
) -> None:
    _upload(client, "happy", _vector())
    calls = len(engine.calls)
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": spec}))
    error = _error(response, status, code, field)
    if code == "unknown_vector":
        assert error["message"] == "unknown steering vector 'nope'; register it first"
        assert engine.methods()[calls:] == [contract.CATALOG]  # one refresh: registered elsewhere meanwhile?
    else:
        assert engine.methods()[calls:] == []
    assert "retry-after" not in response.headers and "x-hotwire-receipt" not in response.headers


@pytest.mark.parametrize("value", [True, 1, 1.0, "true", "True", "YES", "on", "t", "1", False, 0, "false", "no", "off",
                                   2, "2", " true", None, [True]])  # fmt: skip
def test_beam_search_is_refused_in_every_spelling_vllm_reads_as_true(client: TestClient, value: Any) -> None:
    """vLLM's request model reads ``use_beam_search`` with pydantic's lax bool: whatever it takes for true runs beam
    search, whose sampling parameters drop the steering, so admission refuses it by name."""
    from pydantic import BaseModel, ValidationError

    class Flag(BaseModel):
        use_beam_search: bool = False

    try:
        beam = Flag(use_beam_search=value).use_beam_search
    except ValidationError:
        beam = False  # vLLM answers such a body with its own 400
    _upload(client, "happy", _vector())
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "use_beam_search": value,
                                                    "vllm_xargs": {"hotwire": _spec()}})
    if beam:
        assert "beam search" in _error(response, 400, "steering_unsupported", "use_beam_search")["message"]
    else:
        assert response.status_code == 200 and response.headers["x-hotwire-receipt"] == "happy@1:L1x4"


def test_unsteerable_model_is_503(client: TestClient, engine: FakeEngine) -> None:
    engine.steerable = False
    _error(
        client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"hotwire": _spec()}}),
        503,
        "model_not_steerable",
    )


def test_lenient_mode_serves_unsteered(engine: FakeEngine) -> None:
    client = TestClient(_openai_app(engine, Settings(lenient=True)))
    body = _chat({"hotwire": _spec("nope"), "keep": 1}, temperature=0.5)
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["x-hotwire-lenient"] == "unknown_vector: unknown steering vector 'nope'; register it first"
    assert "x-hotwire-receipt" not in response.headers
    echoed = response.json()
    assert json.loads(echoed["raw"]) == _chat({"keep": 1}, temperature=0.5)
    assert int(echoed["content_length"]) == len(echoed["raw"].encode())

    _upload(client, "happy", _vector())
    response = client.post("/v1/chat/completions", json=_chat({"hotwire": _spec("happy", layer=99)}))
    assert response.status_code == 200 and response.headers["x-hotwire-lenient"].startswith("layer_out_of_range")

    unsteerable = FakeEngine()
    unsteerable.steerable = False  # 5xx is not softened
    client = TestClient(_openai_app(unsteerable, Settings(lenient=True)))
    _error(client.post("/v1/chat/completions", json=_chat({"hotwire": _spec()})), 503, "model_not_steerable")


def test_admission_honours_root_path(engine: FakeEngine) -> None:
    app = _openai_app(engine, Settings())
    client = TestClient(app, root_path="/api")
    response = client.post("/api/v1/chat/completions", json=_chat({"hotwire": _spec("nope")}))
    _error(response, 400, "unknown_vector", "vllm_xargs.hotwire[0].id")


# ---- settings ---------------------------------------------------------------------------------------------


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOTWIRE_MAX_UPLOAD_MB", "HOTWIRE_LENIENT", "HOTWIRE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert Settings.from_env() == Settings(64 * 2**20, False, None)
    monkeypatch.setenv("HOTWIRE_MAX_UPLOAD_MB", "0.5")
    monkeypatch.setenv("HOTWIRE_LENIENT", "1")
    monkeypatch.setenv("HOTWIRE_API_KEY", "k")
    assert Settings.from_env() == Settings(2**19, True, "k")
    for bad in ("lots", "0", "-1", "nan"):
        monkeypatch.setenv("HOTWIRE_MAX_UPLOAD_MB", bad)
        with pytest.raises(ValueError, match="HOTWIRE_MAX_UPLOAD_MB"):
            Settings.from_env()
    monkeypatch.setenv("HOTWIRE_MAX_UPLOAD_MB", "1")
    monkeypatch.setenv("HOTWIRE_LENIENT", "lenient")  # not quietly "off": a start-up error naming the variable
    with pytest.raises(ValueError, match="HOTWIRE_LENIENT='lenient' must be 1 or 0"):
        Settings.from_env()
    monkeypatch.setenv("HOTWIRE_LENIENT", "off")
    assert Settings.from_env().lenient is False


def test_attach_reads_the_environment(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWIRE_LENIENT", "1")
    app = FastAPI()
    attach(app)
    app.state.engine_client = engine
    app.add_api_route("/v1/completions", lambda: {}, methods=["POST"])
    response = TestClient(app).post("/v1/completions", json={"vllm_xargs": {"hotwire": _spec("nope")}})
    assert response.status_code == 200 and "x-hotwire-lenient" in response.headers


# ---- OpenAPI ----------------------------------------------------------------------------------------------


def test_openapi_schema_lists_routes_and_models(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/steer/vectors"]) == {"get", "post"}
    assert set(paths["/steer/vectors/{vector_id}"]) == {"get", "delete"}
    assert "get" in paths["/steer/slots"]
    register = paths["/steer/vectors"]["post"]
    assert set(register["requestBody"]["content"]) == {"multipart/form-data", "application/json"}
    assert {"200", "201", "409", "413"} <= set(register["responses"])
    assert {"VectorMeta", "VectorList", "SlotStats", "SlotRow", "ErrorBody", "DeleteResult"} <= set(
        schema["components"]["schemas"]
    )



def test_openapi_declares_the_400_the_routes_send_for_bad_parameters_not_fastapis_422(
    app: FastAPI, client: TestClient, engine: FakeEngine
) -> None:
    steer = {p: ops for p, ops in app.openapi()["paths"].items() if p.startswith("/steer/")}
    assert steer and "HTTPValidationError" not in json.dumps(steer)
    for path, ops in steer.items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            if any(param["in"] == "query" for param in op.get("parameters", [])):
                assert "400" in op["responses"], (method, path)  # a query parameter that does not parse
    engine.vectors["v"] = {}  # any id: the parameters are refused before the engine is asked
    _error(client.get("/steer/slots?max_age_ms=-1"), 400, "bad_request", "max_age_ms")
    _error(client.get("/steer/vectors/v/file?version=0"), 400, "bad_request", "version")
    _error(client.get("/steer/vectors/v/file?format=pt"), 400, "bad_request", "format")
    _error(client.post("/steer/vectors?replace=maybe", json={}), 400, "bad_request", "replace")

# ---- client and CLI ---------------------------------------------------------------------------------------


def test_sync_client(client: TestClient, engine: FakeEngine, tmp_path: Path) -> None:
    hw = HotwireClient("http://testserver", http_client=client)
    assert hw.register("arr", _vector()).version == 1
    assert hw.register("rows", _vector(2), layers=[0, 2]).layers == [0, 2]
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"layers": {"1": [0.5] * HIDDEN}}))
    assert hw.register("js", path).layers == [1]
    assert hw.register("arr", np.ones(HIDDEN), replace=True).dtype == "float32"  # float64 sent as float32
    assert sorted(v.id for v in hw.list()) == ["arr", "js", "rows"]
    assert hw.get("arr").version == 2
    assert hw.slots().vectors == 3
    engine.in_flight["js"] = 1
    assert hw.delete("js").in_flight == 1 and hw.delete("arr").in_flight == 0
    with pytest.raises(HotwireError) as info:
        hw.get("arr")
    assert (info.value.status, info.value.code, info.value.field) == (404, "unknown_vector", "id")
    with pytest.raises(ValueError, match="convert"):
        hw.register("pt", tmp_path / "v.pt")
    with pytest.raises(HotwireError) as info:
        hw.register("..", _vector())  # would name the store file "..safetensors"
    assert (info.value.status, info.value.code) == (400, "bad_id")
    assert hw.register("_..", _vector()).id == "_.."
    assert hw.get("_..").id == "_.." and hw.delete("_..").in_flight == 0


def test_sync_client_torch_tensor(client: TestClient, engine: FakeEngine) -> None:
    torch = pytest.importorskip("torch")
    hw = HotwireClient("http://testserver", http_client=client)
    assert hw.register("bf", torch.ones(HIDDEN, dtype=torch.bfloat16)).dtype == "bfloat16"


def test_async_client(app: FastAPI) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            hw = AsyncHotwireClient("http://test", http_client=http)
            assert (await hw.register("v", _vector())).id == "v"
            assert [v.id for v in await hw.list()] == ["v"]
            assert (await hw.get("v")).version == 1
            assert (await hw.slots()).used == 1
            assert (await hw.delete("v")).in_flight == 0
            with pytest.raises(HotwireError) as info:
                await hw.delete("v")
            assert info.value.status == 404

    asyncio.run(scenario())


@pytest.fixture
def run_cli(client: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    seen: dict[str, Any] = {}

    def make_client(url: str, api_key: str | None) -> HotwireClient:
        seen.update(url=url, api_key=api_key)
        return HotwireClient(url, api_key, http_client=client)

    monkeypatch.setattr(cli, "HotwireClient", make_client)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    run.seen = seen  # type: ignore[attr-defined]
    return run


def test_cli_commands(run_cli: Any, tmp_path: Path) -> None:
    file = tmp_path / "v.safetensors"
    file.write_bytes(save_numpy({"v": _vector(2)}))
    code, out, _ = run_cli("register", "happy", str(file), "--layers", "1,2")
    assert code == 0 and json.loads(out)["layers"] == [1, 2]
    code, _, err = run_cli("register", "happy", str(file), "--layers", "1,2")
    assert code == 1 and "HTTP 409 exists" in err
    code, out, _ = run_cli("register", "happy", str(file), "--layers", "0,3", "--replace")
    assert code == 0 and json.loads(out)["version"] == 2
    js = tmp_path / "v.json"
    js.write_text(
        json.dumps({"data": base64.b64encode(_vector().tobytes()).decode(), "dtype": "float32", "shape": [HIDDEN]})
    )
    assert run_cli("register", "js", str(js))[0] == 0
    code, out, _ = run_cli("list")
    assert code == 0 and [v["id"] for v in json.loads(out)] == ["happy", "js"]
    code, out, _ = run_cli("slots")
    assert code == 0 and json.loads(out)["used"] == 2
    code, out, _ = run_cli("delete", "js")
    assert code == 0 and json.loads(out) == {"id": "js", "in_flight": 0}
    code, _, err = run_cli("delete", "js")
    assert code == 1 and "unknown steering vector 'js'" in err


def test_cli_refuses_pickles_and_reads_env(run_cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = tmp_path / "v.pt"
    pt.write_bytes(b"PK\x03\x04")
    code, _, err = run_cli("register", "v", str(pt))
    assert code == 2 and "never loads pickles" in err and "safetensors" in err

    monkeypatch.setenv("HOTWIRE_URL", "http://testserver")
    monkeypatch.setenv("HOTWIRE_API_KEY", "k")
    run_cli("list")
    assert run_cli.seen == {"url": "http://testserver", "api_key": "k"}
    run_cli("--url", "http://other", "--api-key", "x", "list")
    assert run_cli.seen == {"url": "http://other", "api_key": "x"}
    run_cli("list", "--url", "http://after", "--api-key", "y")  # after the command name too
    assert run_cli.seen == {"url": "http://after", "api_key": "y"}
    run_cli("--url", "http://before", "slots")  # one given before the command is not reset by the command's parser
    assert run_cli.seen == {"url": "http://before", "api_key": "k"}


def test_cli_with_auth(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    client = TestClient(_openai_app(engine, Settings(api_key="s3cret")))
    monkeypatch.setattr(cli, "HotwireClient", lambda url, key: HotwireClient(url, key, http_client=client))
    assert cli.main(["--url", "http://testserver", "list"]) == 1
    assert "HTTP 401 unauthorized" in capsys.readouterr().err
    assert cli.main(["--url", "http://testserver", "--api-key", "s3cret", "list"]) == 0


def test_an_unknown_id_is_looked_up_in_a_catalog_answer_given_after_the_request_arrived() -> None:
    """A catalog fetch already in flight when the request came may predate the id's registration (through another
    API server): the unknown-id lookup waits for an answer the engine gave later, not for that one."""
    from hotwire_api.admission import _decide
    from hotwire_api.catalog import CATALOG
    from hotwire_api.engine import HotwireEngine

    class SlowCatalog(FakeEngine):
        release = asyncio.Event()

        async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                                 kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
            answer = await super().collective_rpc(method, timeout, args, kwargs)  # the engine's state now
            if method == contract.CATALOG:
                await self.release.wait()
            return answer

    async def scenario() -> str:
        fake = SlowCatalog()
        engine = HotwireEngine(fake)
        SlowCatalog.release.set()
        await CATALOG.refresh(engine)  # this process holds the rules
        SlowCatalog.release = asyncio.Event()
        early = asyncio.ensure_future(CATALOG.refresh(engine, not_before=time.monotonic()))  # e.g. the background one
        await asyncio.sleep(0.01)  # its answer is taken: the engine's state before the registration
        fake.hotwire_register("late", _vector().tobytes(), "float32", [HIDDEN], None, False)
        await asyncio.sleep(0.01)
        decided = asyncio.ensure_future(_decide(engine, _spec("late")))
        await asyncio.sleep(0.01)
        SlowCatalog.release.set()
        await early
        receipt, _, _ = await decided
        return receipt

    assert asyncio.run(scenario()) == "late@1:L1x4"


def test_fleet_view_and_registry_of_a_lone_server(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without HOTWIRE_REGISTRY the server is a fleet of one with the embedded registry (docs/fleet.md)."""
    assert _upload(client, "happy", _vector()).status_code == 201
    assert client.get("/steer/slots").json()["registry"]["kind"] == "local"
    view = client.get("/steer/fleet").json()
    assert view["registry"]["kind"] == "local"
    assert [r["replica"] for r in view["replicas"]] == ["local"]
    assert [(v["id"], v["version"], v["held_by"]) for v in view["vectors"]] == [("happy", 1, ["local"])]
    monkeypatch.setattr(cli, "HotwireClient", lambda url, key: HotwireClient(url, key, http_client=client))
    assert cli.main(["--url", "http://testserver", "fleet"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"][0]["vectors"][0]["id"] == "happy"


def test_with_a_fleet_registry_the_routes_never_fall_back_to_the_local_one(engine: FakeEngine) -> None:
    """HOTWIRE_REGISTRY picks the fleet's registry once, at attach; before the app's lifespan connected it, a change
    is refused (503), not made in this server's engine alone, outside the fleet's numbering."""
    client = TestClient(_openai_app(engine, Settings(registry_url="redis://127.0.0.1:1/0")))
    _error(_upload(client, "happy", _vector()), 503, "registry_unavailable")
    _error(client.delete("/steer/vectors/happy"), 503, "registry_unavailable")
    assert "hotwire_register" not in engine.methods() and "hotwire_unregister" not in engine.methods()


def test_a_steered_stream_under_way_passes_its_events_as_they_come(engine: FakeEngine) -> None:
    """After the first output, events go out untouched (the word "error" in generated text is not an error event);
    a refusal after many of them still ends the stream as an error event."""
    app = _openai_app(engine, Settings())
    text = [b'data: {"choices": [{"index": 0, "text": " error %d"}]}\n\n' % i for i in range(5)]

    async def stream(request: Request) -> StreamingResponse:
        ticket = _ticket(await request.body())

        async def chunks():
            for chunk in text:
                yield chunk
            _refuse_in_engine(engine)(ticket)
            yield _VLLM_STREAM_ERROR
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/completions"]
    app.add_api_route("/v1/completions", stream, methods=["POST"])
    client = TestClient(app)
    _upload(client, "happy", _vector())
    *passed, error, done = _stream_events(client, _spec())
    assert passed == text and done == b"data: [DONE]\n\n"
    assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "version_gone"
