"""hotwire behind one ``vllm serve`` with data parallelism (``--data-parallel-size 2``, two engine cores, each
with its own registry copy and slot bank; vLLM's CPU backend, tiny float32 model, eager). ``vllm serve`` then
starts two API servers (vLLM's default ``--api-server-count`` for internal load balancing), which share the
port: each request lands on either, and both must answer alike.

Requests are placed on an engine core with vLLM's ``X-data-parallel-rank`` header, so each test knows where its
request runs: a vector registered over HTTP steers on both engine cores alike, ``/steer/slots`` counts both
banks, and ``DELETE`` answers 202 while the vector's only user runs on the second engine core.

The server keeps no replaced version (``HOTWIRE_RETAIN_S=0``) and refreshes each API server's catalog only once
an hour (``HOTWIRE_CATALOG_REFRESH_MS``), so an API server that did not see a replace pins requests to a version
the engine cores no longer have: the refusal that vLLM reports as a bare failure must reach the client as itself.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psutil
import pytest

from server_fixture import LONG_STREAM_TOKENS, StreamMissed, VllmServer, max_diff, retried_on_a_busy_cpu
from server_fixture import completion_logprobs as logprobs

pytestmark = pytest.mark.integration

HIDDEN, LAYER = 256, 2
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    args = ["--enforce-eager", "--data-parallel-size", "2"]
    env = {"HOTWIRE_RETAIN_S": "0", "HOTWIRE_CATALOG_REFRESH_MS": "3600000", "HOTWIRE_READOUT": "1"}
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve-dp"), env, args, cli=True)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def register(http: httpx.Client, vector_id: str, seed: int) -> None:
    vector = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32) * 4
    body = {"id": vector_id, "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32", "shape": [HIDDEN]}
    response = http.post("/steer/vectors", json=body)
    assert response.status_code == 201, response.text


def completion(http: httpx.Client, model: str, rank: int, vector_id: str | None = None, **params) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, **params}
    if vector_id is not None:
        body["vllm_xargs"] = {"hotwire": json.dumps({"id": vector_id, "layer": LAYER, "scale": 8.0})}
    return http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})


def test_a_vector_registered_over_http_steers_on_every_engine_core(http, tiny_model) -> None:
    model = str(tiny_model)
    register(http, "dp-both", seed=1)
    before = http.get("/steer/slots").json()
    assert before["engines"] == 2 and before["capacity"] == 2 * 256
    plain = [logprobs(completion(http, model, rank)) for rank in (0, 1)]
    assert max_diff(*plain) < 1e-5  # the two engine cores serve the same model
    steered = [completion(http, model, rank, "dp-both") for rank in (0, 1)]
    assert [r.headers["x-hotwire-receipt"] for r in steered] == ["dp-both@1:L2x8"] * 2
    first, second = (logprobs(r) for r in steered)
    assert max_diff(first, plain[0]) > 1e-3, "the request on engine core 0 was not steered"
    assert max_diff(second, first) < 1e-5, "engine core 1 steered differently (or not at all)"
    after = http.get("/steer/slots").json()
    assert after["steered_requests"] - before["steered_requests"] == 2  # one on each engine core's counter
    assert {row["engine"] for row in after["rows"] if row["id"] == "dp-both"} == {0, 1}


@retried_on_a_busy_cpu
def test_a_readout_comes_back_from_the_engine_core_that_ran_it(http, tiny_model) -> None:
    """The API server takes a readout from every engine core; only the one that ran the request holds it, and the
    same request on either engine core reads the same values."""
    model = str(tiny_model)
    register(http, "dp-probe", seed=3)
    readout = json.dumps({"probes": [{"id": "dp-probe", "layer": LAYER}], "tokens": "all"})
    values = []
    for rank in (0, 1):
        response = completion(http, model, rank, vllm_xargs={"hotwire_readout": readout})
        assert response.status_code == 200, response.text
        (probe,) = response.json()["hotwire_readout"]["probes"]
        assert probe["probe"] == "dp-probe@1:L2" and len(probe["generated"]["score"]) == 4
        values.append(probe["prompt"]["score"] + probe["generated"]["score"])
    apart = np.abs(np.array(values[0]) - np.array(values[1])).max() / np.abs(values[0]).max()
    print(f"the same readout on engine cores 0 and 1: {apart:.2e} of the largest score")
    assert apart < 1e-4
    assert np.abs(values[0]).max() > 1.0  # not a readout of zeros


def test_delete_waits_for_a_user_on_the_second_engine_core(http, tiny_model) -> None:
    """The vector's only in-flight user runs on engine core 1: DELETE is a 202, not a 204, and the rows go once
    that request ends (here: its client disconnects, which aborts it)."""
    http.delete("/steer/vectors/dp-del")  # left by an earlier attempt (retried_on_a_busy_cpu): start from none
    register(http, "dp-del", seed=2)
    started, hang_up = threading.Event(), threading.Event()
    outcome: dict = {}

    def stream() -> None:
        body = {
            "model": str(tiny_model), "prompt": PROMPT, "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0, "vllm_xargs": {"hotwire": json.dumps({"id": "dp-del", "layer": LAYER, "scale": 8.0})},
        }
        with httpx.Client(base_url=http.base_url, timeout=300) as own:
            with own.stream("POST", "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}) as response:
                outcome["status"] = response.status_code
                started.set()
                for line in response.iter_lines():
                    outcome["finished"] = line == "data: [DONE]"
                    if hang_up.is_set():
                        break

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(120), "the stream did not start"
        # Wait for the engine, not for a first chunk: vLLM on a busy CPU may send a stream's chunks only at its end.
        deadline = time.monotonic() + 60
        while {v["id"]: v for v in http.get("/steer/vectors").json()["vectors"]}["dp-del"]["in_flight"] != 1:
            if not worker.is_alive():
                raise StreamMissed("the stream ended before the engine was seen running it")
            assert time.monotonic() < deadline, "the engine did not admit the stream"
            time.sleep(0.05)
        deleted = http.delete("/steer/vectors/dp-del")
        assert deleted.status_code == 202, deleted.text
        assert deleted.json() == {"id": "dp-del", "in_flight": 1}
    finally:
        hang_up.set()
        worker.join(300)
    assert outcome == {"status": 200, "finished": False}, "the stream ended before the checks: make it longer"
    deadline = time.monotonic() + 30
    while any(row["id"] == "dp-del" for row in http.get("/steer/slots").json()["rows"]):
        assert time.monotonic() < deadline, "the deleted vector's rows were not freed after its last user finished"
        time.sleep(0.2)


def scrape(server: VllmServer) -> dict[str, list[tuple[dict, float]]]:
    """hotwire's samples on ``/metrics``, by sample name (a series served twice shows as two entries)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for name, labels, value in server.hotwire_samples():
        out.setdefault(name, []).append((labels, value))
    return out


def unknown_vector_refusals(metrics: dict[str, list[tuple[dict, float]]]) -> float:
    return sum(v for labels, v in metrics.get("hotwire_refusals_total", []) if labels["reason"] == "unknown_vector")


def test_two_api_servers_share_routes_and_metrics(server, tiny_model) -> None:
    """Every API server mounts the routes and answers from the same engine cores; ``/metrics`` (merged over the
    API servers by vLLM) holds each engine-wide series once and sums the admission refusals of both."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        register(client, "dp-api", seed=3)
    log = server.log_path
    assert "Defaulting api_server_count to data_parallel_size (2)" in log.read_text(errors="replace")
    # vLLM hands one listening socket to both API servers: which one accepts a connection is a race, so keep
    # opening new connections until both have answered.
    seen, refused, answering = set(), 0, set()
    before = unknown_vector_refusals(scrape(server))
    while refused < 12 or len(answering) < 2:
        assert refused < 100, f"100 connections all reached the same API server ({answering})"
        with httpx.Client(base_url=server.url, timeout=120) as fresh:
            listed = fresh.get("/steer/vectors").json()["vectors"]
            seen.add(tuple(sorted(v["id"] for v in listed)))
            response = completion(fresh, str(tiny_model), 0, "no-such-vector")
            assert response.status_code == 400 and "unknown steering vector" in response.text, response.text
            refused += 1
            answering.add(acceptor_pid(server, response))
            logprobs(completion(fresh, str(tiny_model), 1, "dp-api"))
    assert len(seen) == 1 and "dp-api" in next(iter(seen))
    deadline = time.monotonic() + 15
    while True:
        metrics = scrape(server)
        stats = httpx.get(server.url + "/steer/slots", timeout=30).json()
        capacity = metrics.get("hotwire_slots_capacity", [])
        steered = metrics.get("hotwire_steered_requests_total", [])
        now = unknown_vector_refusals(metrics)
        if capacity == [({}, 2 * 256.0)] and steered == [({}, float(stats["steered_requests"]))] and now - before == refused:
            break
        assert time.monotonic() < deadline, (capacity, steered, stats["steered_requests"], now - before, refused)
        time.sleep(0.5)


def acceptor_pid(server: VllmServer, response: httpx.Response) -> int:
    """The pid of the API server that accepted ``response``'s connection (its client still open), from the
    kernel's socket table: vLLM 0.32's access log no longer names the process that wrote a line."""
    client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    server_port = httpx.URL(server.url).port
    for conn in psutil.net_connections("tcp"):
        if conn.pid and conn.laddr and conn.raddr and (conn.laddr.port, conn.raddr.port) == (server_port, client_port):
            return conn.pid
    raise AssertionError(f"no process holds the server side of connection :{client_port} -> :{server_port}")


def _steered_body(route: str, model: str, vector_id: str, stream: bool) -> dict:
    steer = {"hotwire": json.dumps({"id": vector_id, "layer": LAYER, "scale": 8.0})}
    body = {"model": model, "temperature": 0, "stream": stream, "vllm_xargs": steer}
    if route == "/v1/responses":
        return {**body, "input": PROMPT, "max_output_tokens": 4}
    if route == "/v1/chat/completions":
        return {**body, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    return {**body, "prompt": PROMPT, "max_tokens": 4}


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _concurrently(server: VllmServer, route: str, body: dict, n: int = 4) -> list[tuple[httpx.Response, int]]:
    """``n`` requests at once, each on a connection of its own. vLLM hands one listening socket to both API
    servers and the kernel picks the acceptor: one at a time, consecutive connections can all land on the same
    (idle) API server, while with several at once the busy one leaves some to the other. Each response comes
    with the pid of the API server that answered it."""
    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=120) as fresh:
            response = fresh.post(route, json=body)
            return response, acceptor_pid(server, response)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_an_engine_refusal_after_admission_reaches_the_client_as_itself(server, tiny_model) -> None:
    """Both API servers learn vec@1; a replace through one leaves the other's copy at version 1, which the
    engine cores dropped at once. On every route, streamed or not, a request either steers with version 2 or
    comes back as hotwire's 410 ``version_gone`` — never vLLM's bare 500, an error event, or an empty success."""
    model = str(tiny_model)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        register(client, "dp-stale", seed=4)
    first = _steered_body("/v1/completions", model, "dp-stale", False)
    steered_by: set[int] = set()
    for _ in range(30):  # until both API servers steered with version 1
        if len(steered_by) >= 2:
            break
        for response, pid in _concurrently(server, "/v1/completions", first):
            assert response.headers["x-hotwire-receipt"].startswith("dp-stale@1:"), response.text
            steered_by.add(pid)
    assert len(steered_by) >= 2, "120 connections all reached one API server"
    with httpx.Client(base_url=server.url, timeout=120) as client:
        vector = np.random.default_rng(5).standard_normal(HIDDEN).astype(np.float32) * 4
        body = {"id": "dp-stale", "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32", "shape": [HIDDEN]}
        replaced = client.post("/steer/vectors?replace=true", json=body)
        assert replaced.status_code == 200 and replaced.json()["version"] == 2, replaced.text
    for route in ROUTES:
        for stream in (False, True):
            outcomes: set[int] = set()
            for _ in range(30):
                if outcomes == {200, 410}:
                    break
                for response, _ in _concurrently(server, route, _steered_body(route, model, "dp-stale", stream)):
                    outcomes.add(response.status_code)
                    if response.status_code == 200:
                        assert response.headers["x-hotwire-receipt"].startswith("dp-stale@2:"), response.text
                        assert ('"error"' not in response.text) and len(response.text) > 50, response.text
                        continue
                    assert response.status_code == 410, (route, stream, response.status_code, response.text[:500])
                    error = response.json()["error"]
                    assert (error["code"], error["field"]) == ("version_gone", "vllm_xargs.hotwire[0].version"), error
                    assert "x-hotwire-receipt" not in response.headers
            assert outcomes == {200, 410}, (route, stream, outcomes)
