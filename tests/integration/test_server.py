"""hotwire's HTTP control plane against a real ``vllm serve`` (vLLM 0.25.1, tiny float32 model; CPU backend in CI).

One server serves the whole module, started with ``HOTWIRE_API_KEY`` set, ``HOTWIRE_STORE`` in a temporary folder,
``HOTWIRE_SLOTS=8``, ``HOTWIRE_MAX_ROWS=6`` and ``HOTWIRE_MAX_UPLOAD_MB=1``; a late test restarts it on the same store.
On the CPU it runs with ``--enforce-eager`` to keep engine starts short (steering through torch.compile is covered by
test_engine.py); on a GPU with torch.compile and CUDA graphs, as served in production.

Tests share the server, so each uses its own vector ids; ``keep`` (registered by a fixture) is the vector bad
requests try to damage. Streams steer from their own connection, so the main client stays free to act mid-stream.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_numpy

from hotwire_api import cli, healthcheck
from hotwire_api.client import AsyncHotwireClient, HotwireClient, HotwireError
from server_fixture import (
    DRAINED_STREAM_TOKENS,
    LONG_STREAM_TOKENS,
    MAX_MODEL_LEN,
    StreamMissed,
    VllmServer,
    retried_on_a_busy_cpu,
)

pytestmark = pytest.mark.integration

KEY = "hotwire-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HIDDEN, LAYERS, SLOTS = 256, 4, 8
MAX_ROWS = 6  # the hogs below pin 5 of the 8 rows
MAX_WAIT_S = 2  # HOTWIRE_MAX_WAIT_S from the restart on (test_restart_restores_vectors_with_their_versions)
MAX_UPLOAD_MB = 1
PROMPT = "The quick brown fox jumps over"
SERVER_ARGS = [] if torch.cuda.is_available() else ["--enforce-eager"]
RECEIPT = "x-hotwire-receipt"


# -- helpers ---------------------------------------------------------------------------------------------------


def vec(seed: int, shape: tuple[int, ...] = (HIDDEN,), dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()


def json_body(vector_id: str, arr: np.ndarray, dtype: str = "float32", layers: list[int] | None = None) -> dict:
    body = {"id": vector_id, "data": b64(arr), "dtype": dtype, "shape": list(arr.shape)}
    if layers is not None:
        body["layers"] = layers
    return body


def multipart(vector_id: str, raw: bytes, layers: str | None = None) -> dict:
    data = {"id": vector_id}
    if layers is not None:
        data["layers"] = layers
    return {"data": data, "files": {"file": ("v.safetensors", raw, "application/octet-stream")}}


def expected_sha(arr: np.ndarray, dtype: str, layers: tuple[int, ...] | None) -> str:
    """hotwire_core.registry.content_sha256 of rows [R, hidden] (rows sorted by layer)."""
    rows = arr.reshape(-1, arr.shape[-1])
    h = hashlib.sha256(f"{dtype}|{list(rows.shape)}|{layers}|".encode())
    h.update(np.ascontiguousarray(rows).tobytes())
    return h.hexdigest()


def spec(vector_id: str, layer: int | list[int], scale: float = 8.0, **flags: Any) -> str:
    return json.dumps({"id": vector_id, "layer": layer, "scale": scale, **flags})


def completion_body(model: str, hotwire: Any = None, **params: Any) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, **params}
    if hotwire is not None:
        body["vllm_xargs"] = {"hotwire": hotwire}
    return body


def token_logprobs(response: httpx.Response) -> list[float]:
    assert response.status_code == 200, response.text
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert values and all(isinstance(v, float) and math.isfinite(v) for v in values), values
    return values


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def assert_error(response: httpx.Response, status: int, code: str, field: str | None = None) -> dict:
    assert response.status_code == status, f"{response.status_code} {response.text}"
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"], error
    if field is not None:
        assert error.get("field") == field, error
    return error


def assert_error_any(response: httpx.Response, status: int, text: str) -> None:
    """An error of ``status`` whose body mentions ``text`` (vLLM's and hotwire's error bodies differ)."""
    assert response.status_code == status, f"{response.status_code} {response.text}"
    assert text in response.text, response.text


def slots(http: httpx.Client) -> dict:
    """The slot bank, fresh, without ``age_ms`` (when the numbers were taken, not what they are)."""
    response = http.get("/steer/slots")
    assert response.status_code == 200, response.text
    stats = response.json()
    assert 0 <= stats.pop("age_ms") < 1000
    return stats


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict:
    """/steer/slots once no row is pinned (finished requests release their rows in the engine)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = slots(http)
        if stats["pinned"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def wait_pinned_at_most(http: httpx.Client, floor: int, timeout: float = 20.0) -> dict:
    """/steer/slots once at most ``floor`` rows are pinned."""
    deadline = time.monotonic() + timeout
    while True:
        stats = slots(http)
        if stats["pinned"] <= floor or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def snapshot(http: httpx.Client) -> tuple[list[dict], dict]:
    """Everything a refused request must leave unchanged: the vector list and the whole slot bank."""
    stats = wait_idle(http)
    vectors = http.get("/steer/vectors")
    assert vectors.status_code == 200, vectors.text
    return sorted(vectors.json()["vectors"], key=lambda v: v["id"]), stats


def by_id(http: httpx.Client) -> dict[str, dict]:
    return {v["id"]: v for v in http.get("/steer/vectors").json()["vectors"]}


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@contextlib.contextmanager
def stream(server: VllmServer, body: dict) -> Iterator[tuple[httpx.Response, Iterator[str]]]:
    """A steered streaming /v1/completions on its own connection; yields (response, data lines) once the engine
    admitted it and it is running (it then holds bank rows). This waits on the engine's count of steered
    requests, not for a first token: vLLM on a busy two-core CPU may hold a stream's headers and chunks back
    until the request ends (plugin-free vLLM too); then it raises :class:`StreamMissed`. Leaving early aborts
    the request."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as own:
        admitted = slots(own)["steered_requests"]
        with own.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                response.read()
                yield response, iter(())
                return
            deadline = time.monotonic() + 60
            while (now := slots(own))["steered_requests"] == admitted:
                assert time.monotonic() < deadline, "the engine did not admit the stream"
                time.sleep(0.02)
            if now["pinned"] == 0:  # admitted and already finished: its headers came late
                raise StreamMissed(f"the stream ended before its headers arrived ({body['max_tokens']} tokens)")
            yield response, (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))


def drain(lines: Iterator[str]) -> tuple[int, str | None, dict | None]:
    """Read a stream to the end: (text chunks, last finish_reason, usage)."""
    chunks, finish, usage = 0, None, None
    for line in lines:
        if line == "[DONE]":
            return chunks, finish, usage
        event = json.loads(line)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            chunks += 1
            finish = choice.get("finish_reason") or finish
    raise AssertionError("the stream ended without [DONE]")


# -- fixtures --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hotwire-store")


@pytest.fixture(scope="module")
def server(tiny_model, store, tmp_path_factory) -> Iterator[VllmServer]:
    env = {
        "HOTWIRE_API_KEY": KEY,
        "HOTWIRE_STORE": str(store),
        "HOTWIRE_SLOTS": str(SLOTS),
        "HOTWIRE_MAX_ROWS": str(MAX_ROWS),
        "HOTWIRE_MAX_UPLOAD_MB": str(MAX_UPLOAD_MB),
    }
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), env, SERVER_ARGS)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    """Authorised client of the current server (the restart test changes its port)."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def keep(server) -> dict:
    """A vector that every bad request tries to damage (they send ?replace=true for it)."""
    with HotwireClient(server.url, KEY) as hw:
        return hw.register("keep", vec(1)).model_dump()


def store_file(store: Path, vector_id: str) -> Path:
    (folder,) = [p for p in store.iterdir() if p.is_dir()]  # one folder per served model
    return folder / f"{vector_id}.safetensors"


# -- discovery and auth ----------------------------------------------------------------------------------------


def test_routes_in_openapi(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    paths = schema["paths"]
    assert set(paths["/steer/vectors"]) == {"get", "post"}
    assert set(paths["/steer/vectors/{vector_id}"]) == {"get", "delete"}
    assert set(paths["/steer/slots"]) == {"get"}
    assert set(paths["/steer/vectors/extract"]) == {"post"}
    register = paths["/steer/vectors"]["post"]
    assert set(register["requestBody"]["content"]) == {"multipart/form-data", "application/json"}
    assert {"200", "201", "400", "401", "409", "413", "415"} <= set(register["responses"])
    assert "202" in paths["/steer/vectors/{vector_id}"]["delete"]["responses"]
    schemas = set(schema["components"]["schemas"])
    assert {"VectorMeta", "VectorList", "SlotStats", "ErrorBody", "DeleteResult"} <= schemas
    assert "/v1/completions" in paths  # vLLM's own routes are still there


ROUTES = [
    ("GET", "/steer/vectors", {}),
    ("GET", "/steer/vectors/keep", {}),
    ("GET", "/steer/vectors/keep/file", {}),
    ("DELETE", "/steer/vectors/keep", {}),
    ("GET", "/steer/slots", {}),
    ("POST", "/steer/vectors", {"json": json_body("auth-probe", vec(2))}),
    ("POST", "/steer/vectors?replace=true", {"json": json_body("keep", vec(3))}),
    ("POST", "/steer/vectors/extract", {"json": {"id": "keep", "positive": ["a"], "negative": ["b"], "replace": True}}),
]


def test_every_steer_route_needs_the_key(server, http, keep):
    before = snapshot(http)
    bad_headers = [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}]
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        for method, path, kwargs in ROUTES:
            for headers in bad_headers:
                response = anon.request(method, path, headers=headers, **kwargs)
                assert_error(response, 401, "unauthorized")
                assert response.headers["www-authenticate"] == "Bearer", (method, path)
        # vLLM has no key of its own here: hotwire's key guards /steer only
        assert anon.get("/v1/models").status_code == 200
    assert snapshot(http) == before  # no 401 registered, replaced or deleted anything
    assert http.get("/steer/vectors/keep").json()["version"] == keep["version"]
    assert http.get("/steer/vectors").status_code == 200
    assert slots(http)["capacity"] == SLOTS


# -- registration ----------------------------------------------------------------------------------------------


def test_register_in_every_format_then_list_and_get(http):
    one = vec(10)
    per_layer = vec(11, (2, HIDDEN))
    full16 = vec(12, (LAYERS, HIDDEN), np.float16)
    bf = {"0": vec(13), "2": vec(14)}

    r = http.post("/steer/vectors", **multipart("fmt-st", save_numpy({"v": one})))
    assert r.status_code == 201, r.text
    st = r.json()
    assert (st["id"], st["version"], st["dtype"], st["shape"], st["layers"]) == ("fmt-st", 1, "float32", [HIDDEN], None)
    assert st["sha256"] == expected_sha(one, "float32", None)
    assert st["norms"] == {"*": pytest.approx(float(np.linalg.norm(one)), rel=1e-5)}
    assert st["in_flight"] == 0 and abs(st["created_at"] - time.time()) < 300

    r = http.post("/steer/vectors", json=json_body("fmt-b64", one))
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == st["sha256"]  # the same bytes, whichever format carried them

    # rows given for layers 3 and 1 are stored sorted by layer
    r = http.post("/steer/vectors", **multipart("fmt-rows", save_numpy({"v": per_layer}), layers="3,1"))
    assert r.status_code == 201, r.text
    rows = r.json()
    assert rows["layers"] == [1, 3] and rows["shape"] == [2, HIDDEN]
    assert rows["norms"]["3"] == pytest.approx(float(np.linalg.norm(per_layer[0])), rel=1e-5)
    assert rows["norms"]["1"] == pytest.approx(float(np.linalg.norm(per_layer[1])), rel=1e-5)
    assert rows["sha256"] == expected_sha(per_layer[::-1], "float32", (1, 3))

    # safetensors with 1-D tensors named by layer index, bfloat16
    import torch
    from safetensors.torch import save as save_torch

    named = save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in bf.items()})
    r = http.post("/steer/vectors", **multipart("fmt-named", named))
    assert r.status_code == 201, r.text
    assert (r.json()["dtype"], r.json()["layers"], r.json()["shape"]) == ("bfloat16", [0, 2], [2, HIDDEN])

    # JSON base64, float16, a row per layer (no layers given)
    r = http.post("/steer/vectors", json=json_body("fmt-f16", full16, "float16"))
    assert r.status_code == 201, r.text
    assert (r.json()["dtype"], r.json()["layers"]) == ("float16", [0, 1, 2, 3])
    assert r.json()["sha256"] == expected_sha(full16, "float16", (0, 1, 2, 3))

    # JSON per-layer float lists (stored as float32)
    lists = {"2": vec(15).tolist(), "0": vec(16).tolist()}
    r = http.post("/steer/vectors", json={"id": "fmt-lists", "layers": lists})
    assert r.status_code == 201, r.text
    meta = r.json()
    assert (meta["dtype"], meta["layers"], meta["shape"]) == ("float32", [0, 2], [2, HIDDEN])
    assert meta["sha256"] == expected_sha(np.stack([vec(16), vec(15)]), "float32", (0, 2))

    listed = by_id(http)
    for vector_id in ("fmt-st", "fmt-b64", "fmt-rows", "fmt-named", "fmt-f16", "fmt-lists"):
        got = http.get(f"/steer/vectors/{vector_id}")
        assert got.status_code == 200, got.text
        assert got.json() == listed[vector_id]
    assert listed["fmt-st"] == st and listed["fmt-lists"] == meta
    assert slots(http)["vectors"] == len(listed)


def test_replace_needs_the_flag_and_bumps_the_version(http, model, store):
    first = http.post("/steer/vectors", json=json_body("swap", vec(20)))
    assert first.status_code == 201 and first.json()["version"] == 1
    before = snapshot(http)
    assert_error(http.post("/steer/vectors", json=json_body("swap", vec(21))), 409, "exists", "id")
    form = multipart("swap", save_numpy({"v": vec(21)}))
    assert_error(http.post("/steer/vectors?replace=false", **form), 409, "exists", "id")
    assert snapshot(http) == before

    v1 = token_logprobs(http.post("/v1/completions", json=completion_body(model, spec("swap", 1))))
    second = http.post("/steer/vectors?replace=true", json=json_body("swap", vec(21)))
    assert second.status_code == 200, second.text  # 200: replaced, not created
    meta = second.json()
    assert meta["version"] == 2 and meta["sha256"] == expected_sha(vec(21), "float32", None) != first.json()["sha256"]
    assert http.get("/steer/vectors/swap").json() == meta
    assert [v["id"] for v in http.get("/steer/vectors").json()["vectors"]].count("swap") == 1

    response = http.post("/v1/completions", json=completion_body(model, spec("swap", 1)))
    assert response.headers[RECEIPT] == "swap@2:L1x8"
    assert max_diff(token_logprobs(response), v1) > 1e-3  # the new version steers, not the old one
    # the durable copy follows the new version
    from safetensors import safe_open

    with safe_open(str(store_file(store, "swap")), framework="np") as f:
        assert f.metadata()["version"] == "2" and f.metadata()["sha256"] == meta["sha256"]


def test_delete_is_204_and_frees_everything(http, model, store):
    assert http.post("/steer/vectors", json=json_body("short-lived", vec(30))).status_code == 201
    assert token_logprobs(http.post("/v1/completions", json=completion_body(model, spec("short-lived", 2))))
    stats = wait_idle(http)
    assert any(row["id"] == "short-lived" for row in stats["rows"])
    assert store_file(store, "short-lived").exists()

    response = http.delete("/steer/vectors/short-lived")
    assert response.status_code == 204 and response.content == b""
    assert_error(http.get("/steer/vectors/short-lived"), 404, "unknown_vector", "id")
    assert_error(http.delete("/steer/vectors/short-lived"), 404, "unknown_vector")
    assert "short-lived" not in by_id(http)
    after = slots(http)
    assert not any(row["id"] == "short-lived" for row in after["rows"]) and after["used"] == stats["used"] - 1
    assert not store_file(store, "short-lived").exists()
    assert_error(
        http.post("/v1/completions", json=completion_body(model, spec("short-lived", 2))),
        400, "unknown_vector", "vllm_xargs.hotwire[0].id",
    )  # fmt: skip


# -- bad registrations -----------------------------------------------------------------------------------------

BIG = vec(40, (MAX_UPLOAD_MB * 2**20 // 4 // HIDDEN + 64, HIDDEN))  # a little over the limit as raw float32


def _nan(arr: np.ndarray, index: int = 7, value: float = math.nan) -> np.ndarray:
    arr = arr.copy()
    arr.flat[index] = value
    return arr


def _chunked(raw: bytes) -> Iterator[bytes]:
    for start in range(0, len(raw), 64 * 1024):
        yield raw[start : start + 64 * 1024]


BAD_REGISTRATIONS = {
    # name: (request kwargs, status, code, field)
    "bad-id-json": ({"json": json_body("bad id!", vec(1))}, 400, "bad_id", "id"),
    "bad-id-form": (multipart("a/b/c", save_numpy({"v": vec(1)})), 400, "bad_id", "id"),
    "id-too-long": ({"json": json_body("x" * 65, vec(1))}, 400, "bad_id", "id"),
    "missing-id": ({"json": {"data": b64(vec(1)), "dtype": "float32", "shape": [HIDDEN]}}, 400, "bad_id", "id"),
    "hidden-255": ({"json": json_body("keep", vec(1, (255,)))}, 400, "bad_shape", "shape"),
    # a file and per-layer lists carry their own shape: the error names the field the client sent
    "hidden-300-form": (multipart("keep", save_numpy({"v": vec(1, (300,))})), 400, "bad_shape", "file"),
    "lists-128": ({"json": {"id": "keep", "layers": {"1": vec(1, (128,)).tolist()}}}, 400, "bad_shape", "layers"),
    "3-rows-no-layers": ({"json": json_body("keep", vec(1, (3, HIDDEN)))}, 400, "bad_shape", "shape"),
    "nan-b64": ({"json": json_body("keep", _nan(vec(1)))}, 400, "not_finite", "data"),
    "inf-f16": ({"json": json_body("keep", _nan(vec(1, dtype=np.float16), 3, math.inf), "float16")}, 400,
                "not_finite", "data"),
    "nan-safetensors": (multipart("keep", save_numpy({"v": _nan(vec(1))})), 400, "not_finite", "file"),
    "nan-lists": ({"content": json.dumps({"id": "keep", "layers": {"2": _nan(vec(1)).tolist()}}),
                   "headers": {"content-type": "application/json"}}, 400, "not_finite", "layers.2"),
    "dtype-float64": ({"json": json_body("keep", vec(1).astype(np.float64), "float64")}, 400, "bad_dtype", "dtype"),
    "dtype-int8": ({"json": json_body("keep", vec(1).astype(np.int8), "int8")}, 400, "bad_dtype", "dtype"),
    "dtype-f64-safetensors": (multipart("keep", save_numpy({"v": vec(1).astype(np.float64)})), 400, "bad_dtype",
                              "file"),
    "layer-out-of-range": ({"json": json_body("keep", vec(1, (1, HIDDEN)), layers=[LAYERS])}, 400,
                           "layer_out_of_range", "layers"),
    "layers-vs-rows": ({"json": json_body("keep", vec(1, (2, HIDDEN)), layers=[0])}, 400, "bad_layers", "layers"),
    "short-data": ({"json": {**json_body("keep", vec(1)), "shape": [HIDDEN + 1]}}, 400, "bad_data", "data"),
    "bad-base64": ({"json": {**json_body("keep", vec(1)), "data": "***"}}, 400, "bad_data", "data"),
    "not-safetensors": (multipart("keep", b"\x80\x04 this is a pickle, honest"), 400, "bad_file", "file"),
    "unknown-field": ({"json": {**json_body("keep", vec(1)), "scale": 2}}, 400, "bad_body", "scale"),
    "not-json": ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "bad_body", None),
    "text-plain": ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type",
                   None),
    "oversize-json": ({"json": json_body("keep", BIG)}, 413, "payload_too_large", None),
    "oversize-form": (multipart("keep", save_numpy({"v": BIG})), 413, "payload_too_large", None),
    "oversize-chunked": ({"content": _chunked(json.dumps(json_body("keep", BIG)).encode()),
                          "headers": {"content-type": "application/json"}}, 413, "payload_too_large", None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REGISTRATIONS))
def test_bad_registration_is_refused_and_changes_nothing(http, keep, case):
    kwargs, status, code, field = BAD_REGISTRATIONS[case]
    before = snapshot(http)
    # ?replace=true: a bad upload must not even replace (or drop) the vector it names
    response = http.post("/steer/vectors", params={"replace": "true"}, **kwargs)
    assert_error(response, status, code, field)
    assert snapshot(http) == before
    assert http.get("/steer/vectors/keep").json()["version"] == keep["version"]


# -- steering over HTTP ----------------------------------------------------------------------------------------


def test_steered_completion_differs_and_carries_a_receipt(http, model):
    assert http.post("/steer/vectors", json=json_body("steer-a", vec(50))).status_code == 201
    assert http.post("/steer/vectors", **multipart("steer-a-form", save_numpy({"v": vec(50)}))).status_code == 201
    base = wait_idle(http)["steered_requests"]

    plain = http.post("/v1/completions", json=completion_body(model))
    assert RECEIPT not in plain.headers
    plain_lp = token_logprobs(plain)
    assert max_diff(token_logprobs(http.post("/v1/completions", json=completion_body(model))), plain_lp) < 1e-5

    steered = http.post("/v1/completions", json=completion_body(model, spec("steer-a", 1)))
    assert steered.headers[RECEIPT] == "steer-a@1:L1x8"
    steered_lp = token_logprobs(steered)
    assert max_diff(steered_lp, plain_lp) > 1e-3, (steered_lp, plain_lp)

    again = http.post("/v1/completions", json=completion_body(model, spec("steer-a", 1)))
    assert max_diff(token_logprobs(again), steered_lp) < 1e-4
    # the same bytes uploaded as multipart safetensors steer exactly like the JSON upload
    twin = http.post("/v1/completions", json=completion_body(model, spec("steer-a-form", 1)))
    assert twin.headers[RECEIPT] == "steer-a-form@1:L1x8"
    assert max_diff(token_logprobs(twin), steered_lp) < 1e-4
    # scale 0 adds nothing; another layer and a negative scale steer differently
    zero = http.post("/v1/completions", json=completion_body(model, spec("steer-a", 1, 0.0)))
    assert zero.headers[RECEIPT] == "steer-a@1:L1x0"
    assert max_diff(token_logprobs(zero), plain_lp) < 1e-4
    other = http.post("/v1/completions", json=completion_body(model, spec("steer-a", [0, 2], -4.0)))
    assert other.headers[RECEIPT] == "steer-a@1:L0+2x-4"
    assert max_diff(token_logprobs(other), steered_lp) > 1e-3
    # a per-layer vector registered as float lists steers at its own layers
    lists = {"id": "steer-lists", "layers": {"1": vec(51).tolist(), "3": vec(52).tolist()}}
    assert http.post("/steer/vectors", json=lists).status_code == 201
    per_layer = http.post("/v1/completions", json=completion_body(model, spec("steer-lists", [1, 3], 4.0)))
    assert per_layer.headers[RECEIPT] == "steer-lists@1:L1+3x4"
    assert max_diff(token_logprobs(per_layer), plain_lp) > 1e-3

    stats = wait_idle(http)
    assert stats["steered_requests"] == base + 6
    assert stats["pinned"] == 0


def test_steered_chat_completion(http, model):
    assert http.post("/steer/vectors", json=json_body("chat-v", vec(60))).status_code == 201
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello, how are you today?"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
    }

    def chat_logprobs(response: httpx.Response) -> list[float]:
        assert response.status_code == 200, response.text
        return [t["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"]]

    plain = http.post("/v1/chat/completions", json=body)
    assert RECEIPT not in plain.headers
    steered = http.post("/v1/chat/completions", json={**body, "vllm_xargs": {"hotwire": spec("chat-v", 2)}})
    assert steered.headers[RECEIPT] == "chat-v@1:L2x8"
    assert max_diff(chat_logprobs(steered), chat_logprobs(plain)) > 1e-3
    refused = http.post("/v1/chat/completions", json={**body, "vllm_xargs": {"hotwire": spec("chat-nope", 2)}})
    assert_error(refused, 400, "unknown_vector", "vllm_xargs.hotwire[0].id")


def test_steered_responses_request(http, model):
    """/v1/responses takes vllm_xargs too: admitted with a receipt, steered, refused with a 4xx, streamed."""
    assert http.post("/steer/vectors?replace=true", json=json_body("resp-v", vec(61))).status_code in (200, 201)
    version = http.get("/steer/vectors/resp-v").json()["version"]
    body = {"model": model, "input": "Hello, how are you today?", "max_output_tokens": 6, "temperature": 0,
            "top_logprobs": 1, "include": ["message.output_text.logprobs"]}  # fmt: skip

    def output(response: httpx.Response) -> tuple[str, list[float]]:
        """Text and token logprobs (vLLM leaves a message's content empty when a random tiny model's tokens
        decode to nothing, so both are compared)."""
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["output_tokens"] == 6
        (message,) = [item for item in response.json()["output"] if item["type"] == "message"]
        parts = message["content"]
        return "".join(p["text"] for p in parts), [t["logprob"] for p in parts for t in p["logprobs"]]

    def apart(a: tuple[str, list[float]], b: tuple[str, list[float]], tolerance: float) -> bool:
        return a[0] != b[0] or len(a[1]) != len(b[1]) or (bool(a[1]) and max_diff(a[1], b[1]) > tolerance)

    plain = http.post("/v1/responses", json=body)
    assert RECEIPT not in plain.headers
    assert not apart(output(http.post("/v1/responses", json=body)), output(plain), 1e-4)
    steered = http.post("/v1/responses", json={**body, "vllm_xargs": {"hotwire": spec("resp-v", 2)}})
    assert steered.headers[RECEIPT] == f"resp-v@{version}:L2x8"
    assert apart(output(steered), output(plain), 1e-3)
    refused = http.post("/v1/responses", json={**body, "vllm_xargs": {"hotwire": spec("resp-nope", 2)}})
    assert_error(refused, 400, "unknown_vector", "vllm_xargs.hotwire[0].id")
    streamed = http.post("/v1/responses", json={**body, "stream": True, "vllm_xargs": {"hotwire": spec("resp-v", 2)}})
    assert streamed.status_code == 200 and streamed.headers[RECEIPT] == f"resp-v@{version}:L2x8"
    assert "response.completed" in streamed.text


# -- bad steering requests -------------------------------------------------------------------------------------

BAD_SPECS = {
    # name: (vllm_xargs.hotwire value, status, code, field)
    "unknown-vector": (spec("nope", 1), 400, "unknown_vector", "vllm_xargs.hotwire[0].id"),
    "missing-scale": (json.dumps({"id": "keep", "layer": 1}), 400, "bad_spec", "vllm_xargs.hotwire.scale"),
    "scale-not-number": (json.dumps({"id": "keep", "layer": 1, "scale": "big"}), 400, "bad_spec",
                         "vllm_xargs.hotwire.scale"),
    "unknown-field": (json.dumps({"id": "keep", "layer": 1, "scale": 1, "strength": 2}), 400, "bad_spec",
                      "vllm_xargs.hotwire.strength"),
    "second-entry-layer": (json.dumps([{"id": "keep", "layer": 1, "scale": 1}, {"id": "keep", "layer": "x",
                                                                                "scale": 1}]),
                           400, "bad_spec", "vllm_xargs.hotwire[1].layer"),
    "not-json": ("{id: keep", 400, "bad_spec", "vllm_xargs.hotwire"),
    "not-a-string": (5, 400, "bad_spec", "vllm_xargs.hotwire"),
    "empty-list": ("[]", 400, "bad_spec", "vllm_xargs.hotwire"),
    # JSON Python's parser cannot read: once a 503 "engine did not answer" (the exception left the engine's RPC)
    "nested-past-the-stack": ("[" * 5000, 400, "bad_spec", "vllm_xargs.hotwire"),
    "scale-of-5000-digits": ('{"id": "keep", "layer": 1, "scale": %s}' % ("9" * 5000), 400, "bad_spec", "vllm_xargs.hotwire"),
    "both-phases": (spec("keep", 1, decode_only=True, prefill_only=True), 400, "bad_spec",
                    "vllm_xargs.hotwire.decode_only"),
    "layer-4": (spec("keep", LAYERS), 400, "layer_out_of_range", "vllm_xargs.hotwire[0].layer"),
    "layer-99-in-list": (spec("keep", [0, 99]), 400, "layer_out_of_range", "vllm_xargs.hotwire[0].layer"),
    "negative-layer": (spec("keep", -1), 400, "bad_spec", "vllm_xargs.hotwire.layer"),
    "norm-without-HOTWIRE_NORM": (spec("keep", 1, 0.5, norm=True), 400, "norm_disabled", "vllm_xargs.hotwire[0].norm"),
    "too-many-on-a-layer": (json.dumps([{"id": "keep", "layer": 1, "scale": 1.0}] * 5), 400, "too_many_entries",
                            "vllm_xargs.hotwire"),
    "scale-outside-float32": (spec("keep", 1, 1e39), 400, "bad_spec", "vllm_xargs.hotwire.scale"),
    "too-strong": (spec("keep", 1, 3e38), 400, "too_strong", "vllm_xargs.hotwire[0].scale"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_steering_request_is_refused_and_changes_nothing(http, model, keep, case):
    value, status, code, field = BAD_SPECS[case]
    before = snapshot(http)
    response = http.post("/v1/completions", json=completion_body(model, value))
    assert_error(response, status, code, field)
    assert RECEIPT not in response.headers
    assert snapshot(http) == before  # nothing pinned, loaded or counted as steered


def test_no_row_for_layer(http, model):
    assert http.post("/steer/vectors", json={"id": "only-l3", "layers": {"3": vec(70).tolist()}}).status_code == 201
    before = snapshot(http)
    response = http.post("/v1/completions", json=completion_body(model, spec("only-l3", 0)))
    assert_error(response, 400, "no_row_for_layer", "vllm_xargs.hotwire[0].layer")
    assert snapshot(http) == before
    steered = http.post("/v1/completions", json=completion_body(model, spec("only-l3", 3)))
    assert steered.headers[RECEIPT] == "only-l3@1:L3x8"


def test_a_spec_over_hotwire_max_rows_is_400_streamed_or_not(http, model):
    for vector_id, seed in (("cap-a", 160), ("cap-b", 161)):
        r = http.post("/steer/vectors?replace=true", json=json_body(vector_id, vec(seed, (LAYERS, HIDDEN))))
        assert r.status_code in (200, 201), r.text
    wide = {"id": "cap-a", "layer": [0, 1, 2, 3], "scale": 1}
    over = json.dumps([wide, {"id": "cap-b", "layer": [0, 1, 2], "scale": 1}])  # 7 rows: they fit the bank of 8
    before = snapshot(http)
    for streamed in (False, True):
        response = http.post("/v1/completions", json=completion_body(model, over, stream=streamed))
        error = assert_error(response, 400, "too_many_rows", "vllm_xargs.hotwire")
        assert "needs 7 bank rows" in error["message"] and f"HOTWIRE_MAX_ROWS={MAX_ROWS}" in error["message"], error
        assert RECEIPT not in response.headers
    assert snapshot(http) == before  # nothing pinned, loaded or counted as steered
    fits = json.dumps([wide, {"id": "cap-b", "layer": [0, 1], "scale": 1}])
    assert http.post("/v1/completions", json=completion_body(model, fits)).headers[RECEIPT].startswith("cap-a@")


# -- in-flight requests: delete, slot budget, aborts -----------------------------------------------------------


@retried_on_a_busy_cpu
def test_delete_while_streaming_is_202_and_frees_on_completion(server, http, model, store):
    registered = http.post("/steer/vectors?replace=true", json=json_body("doomed", vec(80, (LAYERS, HIDDEN))))
    assert registered.status_code in (200, 201)  # 200: left by an earlier attempt (see retried_on_a_busy_cpu)
    body = completion_body(model, spec("doomed", [0, 1]), max_tokens=DRAINED_STREAM_TOKENS, ignore_eos=True, logprobs=None,
                           stream_options={"include_usage": True})  # fmt: skip
    with stream(server, body) as (response, lines):
        assert response.status_code == 200 and response.headers[RECEIPT] == f"doomed@{registered.json()['version']}:L0+1x8"
        running = slots(http)
        doomed_rows = [row for row in running["rows"] if row["id"] == "doomed"]
        assert sorted(row["layer"] for row in doomed_rows) == [0, 1]
        assert all(row["refcount"] == 1 for row in doomed_rows) and running["pinned"] == 2
        assert http.get("/steer/vectors/doomed").json()["in_flight"] == 1

        deleted = http.delete("/steer/vectors/doomed")
        assert deleted.status_code == 202, deleted.text
        assert deleted.json() == {"id": "doomed", "in_flight": 1}
        # gone for everyone else at once, durable copy included; the running request keeps its rows
        assert_error(http.get("/steer/vectors/doomed"), 404, "unknown_vector")
        assert "doomed" not in by_id(http)
        assert not store_file(store, "doomed").exists()
        assert_error(
            http.post("/v1/completions", json=completion_body(model, spec("doomed", 0))),
            400, "unknown_vector", "vllm_xargs.hotwire[0].id",
        )  # fmt: skip
        still = slots(http)
        assert still["pinned"] == 2 and sum(row["id"] == "doomed" for row in still["rows"]) == 2

        chunks, finish, usage = drain(lines)
    assert finish == "length" and usage["completion_tokens"] == DRAINED_STREAM_TOKENS, (chunks, finish, usage)
    after = wait_idle(http)
    assert after["pinned"] == 0
    assert not any(row["id"] == "doomed" for row in after["rows"]), after["rows"]
    assert after["free"] >= 2 and after["used"] + after["free"] == SLOTS  # its two rows went back to the free list
    assert "doomed" not in by_id(http)


def _not_served_early(http: httpx.Client, waiting: concurrent.futures.Future, what: str) -> None:
    """A request that should wait for the hog's rows has an answer already: a defect while the hog still holds its
    five rows (the answer is shown), a missed stream when the hog ended first (a stalled CPU: tried again)."""
    if not waiting.done():
        return
    if slots(http)["pinned"] < 5:
        raise StreamMissed(f"the hog's stream ended before the test saw its request wait ({what})")
    r = waiting.result()
    raise AssertionError(f"{what}: answered {r.status_code} while the hog held its rows: {r.text[:300]}")


@retried_on_a_busy_cpu
def test_requests_whose_rows_are_taken_wait_for_them_in_order(server, http, model):
    versions = {}  # replace=true makes a new version on every attempt (see retried_on_a_busy_cpu)
    for vector_id, seed in (("wide-a", 90), ("wide-b", 91)):
        r = http.post("/steer/vectors?replace=true", json=json_body(vector_id, vec(seed, (LAYERS, HIDDEN))))
        assert r.status_code in (200, 201), r.text
        versions[vector_id] = r.json()["version"]
    assert http.post("/steer/vectors?replace=true", json=json_body("narrow", vec(92))).status_code in (200, 201)
    hog = json.dumps([{"id": "wide-a", "layer": [0, 1, 2, 3], "scale": 1.0}, {"id": "narrow", "layer": 0, "scale": 1}])
    body = completion_body(model, hog, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True, logprobs=None)
    all_b = completion_body(model, spec("wide-b", [0, 1, 2, 3]))  # 4 new rows, 3 can be had while the hog runs
    three_b = completion_body(model, spec("wide-b", [0, 1, 2]))  # would fit now, but comes after all_b
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        with stream(server, body) as (response, _lines):
            assert response.status_code == 200, response.text
            before = slots(http)
            assert before["pinned"] == 5 and before["capacity"] == SLOTS  # 4 rows of wide-a + 1 of narrow
            waiting = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=b, headers=AUTH, timeout=180)
                       for b in (all_b,)]
            deadline = time.monotonic() + 60
            while slots(http)["deferred"] < 1:
                assert time.monotonic() < deadline, "all_b was not deferred within 60 s"
                _not_served_early(http, waiting[0], "all_b did not wait for rows")
                time.sleep(0.05)
            waiting.append(pool.submit(httpx.post, f"{server.url}/v1/completions", json=three_b, headers=AUTH, timeout=180))
            while slots(http)["deferred"] < 2:
                assert time.monotonic() < deadline, "three_b was not deferred within 60 s"
                _not_served_early(http, waiting[1], "three_b jumped the queue")
                time.sleep(0.05)
            assert slots(http)["pinned"] == 5  # a waiting request pins and loads nothing
        # leaving the stream early aborts the hog; its rows are unpinned and the waiting requests run in order
        served = [f.result(timeout=180) for f in waiting]
    finally:
        pool.shutdown()
    assert [r.headers.get(RECEIPT) for r in served] == [
        f"wide-b@{versions['wide-b']}:L0+1+2+3x8", f"wide-b@{versions['wide-b']}:L0+1+2x8"
    ], [r.text[:300] for r in served]
    for r in served:
        token_logprobs(r)
    idle = wait_idle(http)
    assert idle["pinned"] == 0 and idle["deferred"] == 0 and all(row["refcount"] == 0 for row in idle["rows"])


@retried_on_a_busy_cpu
def test_replace_while_streaming_keeps_the_running_version(server, http, model):
    assert http.post("/steer/vectors?replace=true", json=json_body("live", vec(95))).status_code in (200, 201)
    version = http.get("/steer/vectors/live").json()["version"]
    body = completion_body(model, spec("live", 1), max_tokens=DRAINED_STREAM_TOKENS, ignore_eos=True, logprobs=None)
    with stream(server, body) as (response, lines):
        assert response.headers[RECEIPT] == f"live@{version}:L1x8"
        replaced = http.post("/steer/vectors?replace=true", json=json_body("live", vec(96)))
        assert replaced.status_code == 200 and replaced.json()["version"] == version + 1
        assert http.get("/steer/vectors/live").json()["in_flight"] == 1  # the old version, still running
        newer = http.post("/v1/completions", json=completion_body(model, spec("live", 1)))
        assert newer.headers[RECEIPT] == f"live@{version + 1}:L1x8"
        token_logprobs(newer)
        rows = {(row["version"], row["layer"]): row["refcount"] for row in slots(http)["rows"] if row["id"] == "live"}
        assert rows == {(version, -1): 1, (version + 1, -1): 0}
        _, finish, _ = drain(lines)
        assert finish == "length"
    idle = wait_idle(http)
    rows = {(row["version"], row["layer"]) for row in idle["rows"] if row["id"] == "live"}
    assert rows == {(version + 1, -1)}  # the retired version's row is freed once its last request is done
    assert http.get("/steer/vectors/live").json()["in_flight"] == 0


@retried_on_a_busy_cpu
def test_requests_past_the_check_wait_for_rows_instead_of_failing(server, http, model):
    """Concurrent requests that each fit the rows left, but not together: all pass the API check, the engine
    admits what fits and defers the rest until rows free up. Every request is served with tokens — never a
    429, a 500 or an empty stream."""
    for vector_id, seed, shape in (("race-hog", 139, (LAYERS, HIDDEN)), ("race-one", 138, (HIDDEN,))):
        r = http.post("/steer/vectors?replace=true", json=json_body(vector_id, vec(seed, shape)))
        assert r.status_code in (200, 201)
    hog = json.dumps(
        [{"id": "race-hog", "layer": [0, 1, 2, 3], "scale": 1}, {"id": "race-one", "layer": 0, "scale": 1}]
    )
    racers = 6
    bodies = []
    for i in range(racers):
        vector_id = f"race-{i}"
        r = http.post("/steer/vectors?replace=true", json=json_body(vector_id, vec(150 + i, (LAYERS, HIDDEN))))
        assert r.status_code in (200, 201)
        steer = spec(vector_id, [0, 1, 2])
        streamed = i % 2 == 1
        options = {"stream_options": {"include_usage": True}} if streamed else {}
        bodies.append(completion_body(model, steer, max_tokens=8, ignore_eos=True, logprobs=None, stream=streamed, **options))
    clients = [httpx.Client(base_url=server.url, timeout=180) for _ in range(racers)]
    for client in clients:
        client.get("/health")
    gate = threading.Barrier(racers)

    def send(i: int) -> httpx.Response:
        gate.wait()
        return clients[i].post("/v1/completions", json=bodies[i])

    deferrals = slots(http)["deferrals"]
    pool = concurrent.futures.ThreadPoolExecutor(racers)
    try:
        with stream(server, completion_body(model, hog, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True, logprobs=None)):
            assert slots(http)["pinned"] == 5  # 3 rows left: one racer fits at a time
            futures = [pool.submit(send, i) for i in range(racers)]
            deadline = time.time() + 30
            while time.time() < deadline and slots(http)["deferred"] == 0 and not all(f.done() for f in futures):
                time.sleep(0.05)
        # leaving the hog's stream aborts it: its rows free up and deferred racers get their turn
        results = [f.result(timeout=180) for f in futures]
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
    wait_idle(http)
    for body, response in zip(bodies, results):
        assert response.status_code == 200, response.text[:500]
        events = sse_events(response.text) if body["stream"] else [response.json()]
        usage = [e["usage"] for e in events if e.get("usage")]
        # token count, not text: a random tiny model may emit partial UTF-8 bytes that decode to ""
        assert usage and usage[-1]["completion_tokens"] == 8, f"an incomplete 200: {response.text[:500]}"
        assert RECEIPT in response.headers
    assert slots(http)["deferred"] == 0
    if slots(http)["deferrals"] == deferrals:  # checked last: the answers above hold either way
        pytest.skip("every racer was refused at the API check; the engine-side wait was not reached")


def test_extraction_is_503_while_capture_is_off(http):
    """This server runs without HOTWIRE_CAPTURE: the capture op is not compiled in (test_vector_formats.py serves
    extraction)."""
    body = {"id": "extracted", "positive": ["good"], "negative": ["bad"]}
    response = http.post("/steer/vectors/extract", json=body)
    assert_error(response, 503, "capture_off")
    assert "HOTWIRE_CAPTURE=1" in response.json()["error"]["message"]
    assert slots(http)["model"]["capture_rows"] == 0
    assert http.get("/steer/vectors/extracted").status_code == 404


def test_reserved_cache_salt_is_400(http, model):
    before = snapshot(http)
    response = http.post("/v1/completions", json=completion_body(model, cache_salt="hotwire:forged"))
    assert snapshot(http)[0] == before[0]
    assert_error_any(response, 400, "cache_salt")


def test_no_receipt_when_vllm_rejects_the_request(http, model):
    before = snapshot(http)
    response = http.post("/v1/completions", json=completion_body(model, spec("keep", 0), max_tokens=MAX_MODEL_LEN + 1))
    assert response.status_code == 400 and "max_tokens" in response.text
    assert snapshot(http) == before  # not admitted: nothing pinned, nothing counted
    assert RECEIPT not in response.headers, response.headers[RECEIPT]


def test_concurrent_traffic_returns_slots_to_zero(server, http, model):
    for i in range(3):
        r = http.post("/steer/vectors?replace=true", json=json_body(f"traffic-{i}", vec(100 + i)))
        assert r.status_code in (200, 201)
    base = wait_idle(http)["steered_requests"]
    specs = [spec(f"traffic-{i % 3}", i % LAYERS, 2.0 + i) for i in range(6)] + [None, None]

    def send(value: str | None) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=120) as own:
            return own.post("/v1/completions", json=completion_body(model, value, max_tokens=24, ignore_eos=True))

    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        responses = list(pool.map(send, specs))
    for value, response in zip(specs, responses):
        token_logprobs(response)
        if value is None:
            assert RECEIPT not in response.headers
        else:
            assert response.headers[RECEIPT].startswith(json.loads(value)["id"] + "@")
    idle = wait_idle(http)
    assert idle["pinned"] == 0 and all(row["refcount"] == 0 for row in idle["rows"])
    assert idle["steered_requests"] == base + 6
    assert idle["used"] <= SLOTS and idle["used"] + idle["free"] == SLOTS
    assert all(v["in_flight"] == 0 for v in by_id(http).values())


@retried_on_a_busy_cpu  # a 2-core machine running anything beside the server stalls it for 100s of ms
def test_slots_latency(http):
    slots(http)  # warm the connection
    latencies = []
    for _ in range(50):
        began = time.perf_counter()
        response = http.get("/steer/slots")
        latencies.append(time.perf_counter() - began)
        assert response.status_code == 200
    p99 = float(np.percentile(latencies, 99))
    print(f"GET /steer/slots: p50 {np.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    assert p99 < 0.100, sorted(latencies)[-5:]


# -- metrics ---------------------------------------------------------------------------------------------------


def scrape(server: VllmServer) -> dict[tuple[str, tuple], float]:
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in server.hotwire_samples()}


def refusal_counts(server: VllmServer) -> dict[str, float]:
    """``hotwire_refusals_total`` by reason."""
    return {labels["reason"]: value for name, labels, value in server.hotwire_samples() if name == "hotwire_refusals_total"}


def test_metrics_series(server, http, model, keep):
    stats = wait_idle(http)
    metrics = scrape(server)
    assert metrics[("hotwire_slots_capacity", ())] == SLOTS
    assert metrics[("hotwire_slots_used", ())] == stats["used"]
    assert metrics[("hotwire_slots_pinned", ())] == 0
    assert metrics[("hotwire_slot_evictions_total", ())] == stats["evictions"]
    assert metrics[("hotwire_vectors_registered", ())] == stats["vectors"] == len(by_id(http))
    assert metrics[("hotwire_steered_requests_total", ())] == stats["steered_requests"]  # counting: see the end
    # a refusal at admission (it never reaches the engine) counts at once, by reason
    assert http.post("/steer/vectors?replace=true", json={"id": "m-l3", "layers": {"3": vec(71).tolist()}}).status_code in (200, 201)
    refused = {"unknown_vector": spec("nope", 0), "bad_spec": "{not json", "layer_out_of_range": spec("keep", 99),
               "no_row_for_layer": spec("m-l3", 0)}  # fmt: skip
    for reason, steer in refused.items():
        before = refusal_counts(server).get(reason, 0)
        assert http.post("/v1/completions", json=completion_body(model, steer)).status_code == 400
        assert refusal_counts(server).get(reason) == before + 1, reason
    # a steered request shows up through the background refresh (every 2 s)
    stats = wait_idle(http)
    token_logprobs(http.post("/v1/completions", json=completion_body(model, spec("keep", 0))))
    deadline = time.monotonic() + 10
    while scrape(server)[("hotwire_steered_requests_total", ())] != stats["steered_requests"] + 1:
        assert time.monotonic() < deadline, "the metrics snapshot was not refreshed in the background"
        time.sleep(0.5)


def test_the_engine_steps_and_tokens_the_throughput_bench_reads(server, http, model):
    """``bench_throughput`` divides the engine's steps by the requests served (each step's outputs are one message
    to the API server) and reads the engine's TTFT and queue time: a request of 4 tokens is 4 tokens, alone 1 to 4
    steps, one first token and one queued request on vLLM's /metrics."""
    from benchmarks.bench_throughput import engine_counts

    wait_idle(http)
    before = engine_counts(server.url)
    assert before is not None
    body = completion_body(model, max_tokens=4, ignore_eos=True)
    assert http.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 10
    while (after := engine_counts(server.url))["generated_tokens"] != before["generated_tokens"] + 4:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.2)
    assert 1 <= after["steps"] - before["steps"] <= 4, (before, after)
    assert after["first_tokens"] == before["first_tokens"] + 1 and after["engine_ttft_s"] > before["engine_ttft_s"]
    assert after["queued"] == before["queued"] + 1


# -- Python client, CLI, healthcheck ---------------------------------------------------------------------------


def test_python_client(server, tmp_path, model):
    import torch

    with HotwireClient(server.url, KEY) as hw:
        assert hw.register("cl-np", vec(110)).version == 1
        assert hw.register("cl-torch", torch.from_numpy(vec(111)).to(torch.bfloat16)).dtype == "bfloat16"
        path = tmp_path / "rows.safetensors"
        path.write_bytes(save_numpy({"v": vec(112, (2, HIDDEN))}))
        assert hw.register("cl-file", path, layers=[2, 0]).layers == [0, 2]
        js = tmp_path / "v.json"
        js.write_text(json.dumps({"layers": {"3": vec(113).tolist()}}))
        assert hw.register("cl-json", js).layers == [3]
        replaced = hw.register("cl-np", vec(114), replace=True)
        assert replaced.version == 2
        with pytest.raises(HotwireError) as info:
            hw.register("cl-np", vec(114))
        assert (info.value.status, info.value.code) == (409, "exists")
        listed = {v.id: v for v in hw.list()}
        assert {"cl-np", "cl-torch", "cl-file", "cl-json"} <= set(listed)
        assert hw.get("cl-np") == listed["cl-np"] == replaced
        stats = hw.slots()
        assert stats.capacity == SLOTS and stats.model.steerable and stats.model.hidden_size == HIDDEN
        assert stats.model.n_layers == LAYERS
        assert hw.delete("cl-json").in_flight == 0
        with pytest.raises(HotwireError) as info:
            hw.get("cl-json")
        assert (info.value.status, info.value.code, info.value.field) == (404, "unknown_vector", "id")
        with pytest.raises(HotwireError) as info:
            hw.register("cl-bad", vec(1, (HIDDEN + 1,)))
        assert (info.value.status, info.value.code) == (400, "bad_shape")

    with HotwireClient(server.url, "wrong") as hw, pytest.raises(HotwireError) as info:
        hw.list()
    assert (info.value.status, info.value.code) == (401, "unauthorized")

    async def scenario() -> None:
        async with AsyncHotwireClient(server.url, KEY) as hw:
            assert (await hw.register("cl-async", vec(115))).version == 1
            assert (await hw.get("cl-async")).id == "cl-async"
            assert "cl-async" in {v.id for v in await hw.list()}
            assert (await hw.slots()).capacity == SLOTS
            assert (await hw.delete("cl-async")).in_flight == 0

    asyncio.run(scenario())
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        steered = http.post("/v1/completions", json=completion_body(model, spec("cl-file", 2)))
        assert steered.headers[RECEIPT] == "cl-file@1:L2x8"


def test_cli(server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HOTWIRE_API_KEY", raising=False)
    monkeypatch.delenv("HOTWIRE_URL", raising=False)
    base = ["--url", server.url, "--api-key", KEY]

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main([*base, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    file = tmp_path / "cli.safetensors"
    file.write_bytes(save_numpy({"v": vec(120, (2, HIDDEN))}))
    code, out, err = run("register", "cli-v", str(file), "--layers", "1,2")
    assert code == 0, err
    assert json.loads(out)["layers"] == [1, 2] and json.loads(out)["version"] == 1
    code, _, err = run("register", "cli-v", str(file), "--layers", "1,2")
    assert code == 1 and "HTTP 409 exists" in err
    code, out, err = run("register", "cli-v", str(file), "--layers", "0,3", "--replace")
    assert code == 0 and json.loads(out)["version"] == 2 and json.loads(out)["layers"] == [0, 3], err
    code, out, _ = run("list")
    assert code == 0
    listed = {v["id"]: v for v in json.loads(out)}
    assert listed["cli-v"]["version"] == 2 and listed["cli-v"]["layers"] == [0, 3]
    code, out, _ = run("slots")
    assert code == 0 and json.loads(out)["capacity"] == SLOTS
    code, out, _ = run("delete", "cli-v")
    assert code == 0 and json.loads(out) == {"id": "cli-v", "in_flight": 0}
    code, _, err = run("delete", "cli-v")
    assert code == 1 and "HTTP 404 unknown_vector" in err

    code = cli.main(["--url", server.url, "--api-key", "wrong", "list"])
    assert code == 1 and "HTTP 401 unauthorized" in capsys.readouterr().err
    code = cli.main(["--url", server.url, "list"])  # no key at all
    assert code == 1 and "HTTP 401" in capsys.readouterr().err

    # the real command line, in its own interpreter
    proc = subprocess.run(
        [sys.executable, "-m", "hotwire_api.cli", *base, "list"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "keep" in {v["id"] for v in json.loads(proc.stdout)}


def test_healthcheck(server, http, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("HOTWIRE_API_KEY", KEY)
    assert healthcheck.main(["--url", server.url]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok:"), (out, err)
    assert healthcheck.PROBE_ID not in by_id(http)  # the probe is deleted again
    monkeypatch.setenv("HOTWIRE_API_KEY", "wrong")
    assert healthcheck.main(["--url", server.url]) == 1
    assert "401" in capsys.readouterr().err


# -- restart on the same store (last: it replaces the server) --------------------------------------------------


def test_restart_restores_vectors_with_their_versions(server, model, store, keep):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        # a version above 1 must survive too
        assert http.post("/steer/vectors?replace=true", json=json_body("persist", vec(130))).status_code in (200, 201)
        assert http.post("/steer/vectors?replace=true", json=json_body("persist", vec(131))).status_code == 200
        rows = {"id": "persist-rows", "layers": {"2": vec(132).tolist(), "0": vec(133).tolist()}}
        assert http.post("/steer/vectors?replace=true", json=rows).status_code in (200, 201)
        before = by_id(http)
        assert before["persist"]["version"] >= 2
        requests = {
            "plain": completion_body(model),
            "persist": completion_body(model, spec("persist", 1)),
            "persist-rows": completion_body(model, spec("persist-rows", [0, 2], 3.0)),
            "keep": completion_body(model, spec("keep", 3, -6.0)),
        }
        expected = {}
        for name, body in requests.items():
            response = http.post("/v1/completions", json=body)
            expected[name] = (token_logprobs(response), response.headers.get(RECEIPT))
    assert {p.stem for p in store_file(store, "keep").parent.glob("*.safetensors")} == set(before)

    server.stop()
    # restarted lenient, with a preload folder and a short wait for rows: the tests after this one use them
    preload = store.parent / "preload"
    preload.mkdir(exist_ok=True)
    (preload / "preloaded.safetensors").write_bytes(save_numpy({"v": vec(136)}))
    server.extra_env.update(HOTWIRE_LENIENT="1", HOTWIRE_VECTORS=str(preload), HOTWIRE_MAX_WAIT_S=str(MAX_WAIT_S))
    server.start()

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        fresh = slots(http)
        assert (fresh["steered_requests"], fresh["pinned"], fresh["used"]) == (0, 0, 0)
        after = by_id(http)
        assert after.pop("preloaded")["version"] == 1
        assert after == before  # ids, versions, sha256, dtypes, shapes, layers, norms, created_at
        assert fresh["vectors"] == len(before) + 1
        # steering with restored vectors works before anything new is registered, exactly as before
        for name, body in requests.items():
            response = http.post("/v1/completions", json=body)
            logprobs, receipt = expected[name]
            assert response.headers.get(RECEIPT) == receipt
            assert max_diff(token_logprobs(response), logprobs) < 1e-4, name
        assert expected["persist"][1] == f"persist@{before['persist']['version']}:L1x8"
        assert max_diff(expected["persist"][0], expected["plain"][0]) > 1e-3
        # versions continue from the restored ones
        replaced = http.post("/steer/vectors?replace=true", json=json_body("persist", vec(134)))
        assert replaced.status_code == 200 and replaced.json()["version"] == before["persist"]["version"] + 1
        assert_error(http.post("/steer/vectors", json=json_body("keep", vec(135))), 409, "exists", "id")
        assert http.get("/steer/vectors/keep").json() == keep


def test_lenient_server_serves_refused_steering_unsteered(server, model):
    """HOTWIRE_LENIENT=1 (set by the restart above): a spec refused with a 4xx is stripped and the request served
    unsteered, exactly as a plain one, with the reason in x-hotwire-lenient; valid steering is still applied."""
    assert server.extra_env.get("HOTWIRE_LENIENT") == "1", "run it after test_restart_restores_vectors_with_their_versions"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        plain = token_logprobs(http.post("/v1/completions", json=completion_body(model)))
        lenient = http.post("/v1/completions", json=completion_body(model, spec("nope", 1)))
        assert lenient.headers["x-hotwire-lenient"].startswith("unknown_vector: unknown steering vector 'nope'")
        assert RECEIPT not in lenient.headers
        assert max_diff(token_logprobs(lenient), plain) < 1e-4
        steered = http.post("/v1/completions", json=completion_body(model, spec("preloaded", 1)))
        assert steered.headers[RECEIPT] == "preloaded@1:L1x8" and "x-hotwire-lenient" not in steered.headers
        assert max_diff(token_logprobs(steered), plain) > 1e-3


@retried_on_a_busy_cpu
def test_a_request_that_waits_past_hotwire_max_wait_s_gets_503_slots_busy(server, model):
    """With HOTWIRE_MAX_WAIT_S=2 (set by the restart above), requests that cannot pin their rows while a hog runs
    are answered 503 ``slots_busy`` once they have waited 2 s: as an HTTP error, streamed or not, never a bare 500
    or an empty stream. The hog runs on; once it is gone the same request is served."""
    assert server.extra_env.get("HOTWIRE_MAX_WAIT_S") == str(MAX_WAIT_S), "run it after the restart test"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        for vector_id, seed, shape in (("busy-hog", 170, (LAYERS, HIDDEN)), ("busy-one", 171, (HIDDEN,)),
                                       ("busy-two", 172, (HIDDEN,)), ("busy-wait", 173, (LAYERS, HIDDEN))):  # fmt: skip
            r = http.post("/steer/vectors?replace=true", json=json_body(vector_id, vec(seed, shape)))
            assert r.status_code in (200, 201), r.text
        hog = json.dumps([{"id": "busy-hog", "layer": [0, 1, 2, 3], "scale": 1},
                          {"id": "busy-one", "layer": 0, "scale": 1}, {"id": "busy-two", "layer": 1, "scale": 1}])
        wait = spec("busy-wait", [0, 1, 2])  # 3 new rows; 2 can be had while the hog pins 6
        refused = slots(http)["refused"].get("slots_busy", 0)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        try:
            body = completion_body(model, hog, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True, logprobs=None)
            with stream(server, body) as (response, _):
                assert response.status_code == 200, response.text
                assert slots(http)["pinned"] == MAX_ROWS
                started = time.monotonic()
                waiting = [pool.submit(httpx.post, f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                                       json=completion_body(model, wait, stream=streamed)) for streamed in (False, True)]
                answers = [f.result(timeout=120) for f in waiting]
                waited = time.monotonic() - started
                if any(a.status_code != 503 for a in answers) and slots(http)["pinned"] < MAX_ROWS:
                    raise StreamMissed("the hog ended before the waiting requests gave up: they were served after it")
        finally:
            pool.shutdown()
        assert waited >= MAX_WAIT_S
        pinned = f"{MAX_ROWS} of the {SLOTS} rows are pinned by 1 running steered request(s), the largest holding {MAX_ROWS}"
        for answer in answers:
            error = assert_error(answer, 503, "slots_busy")
            assert answer.headers["content-type"].startswith("application/json") and RECEIPT not in answer.headers
            assert answer.headers["retry-after"] == "1"
            for text in (f"HOTWIRE_MAX_WAIT_S={MAX_WAIT_S}", "needs 3 more bank rows and only 2 can be freed", pinned):
                assert text in error["message"], error
        idle = wait_idle(http)
        assert idle["refused"].get("slots_busy", 0) == refused + 2 and idle["deferred"] == 0
        served = http.post("/v1/completions", json=completion_body(model, wait))  # the hog is gone: rows are free
        assert served.headers[RECEIPT].startswith("busy-wait@") and token_logprobs(served)
