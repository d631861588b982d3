"""Two real ``vllm serve`` replicas (tiny float32 model; eager on the CPU, with CUDA graphs on one shared GPU) on
one real redis-server (``HOTWIRE_REGISTRY``): what is registered, replaced or deleted on either is served by both; one id registered
on both at once gets one 201 and one 409; replica B starts after vectors were registered on A and serves them;
Redis killed mid-traffic leaves both steering while registration answers 503, and both recover when it returns;
a soak (benchmarks/soak) over both replicas judges every response against its receipt;
a Redis that comes back empty gets every vector back from the replicas, and one that comes back from an older
snapshot every change acknowledged after it (a change sent meanwhile waits for that); B restarted while Redis holds 500 more
vectors catches up with all of them, and serves a request pinned to a version replaced before it started.
Replica A runs data parallel (``--data-parallel-size 2``: two engine cores, and two API servers, one of which
follows the registry; both register through it): requests placed on each engine core steer alike. With one GPU
(data parallelism needs one per engine core) A runs one engine core and ``--api-server-count 2`` instead.

The propagation latency (registration answered on A -> B serves the new version) is measured over
``HOTWIRE_FLEET_LATENCY_N`` replaces (default 30); with ``HOTWIRE_FLEET_RESULTS=<file.json>`` the figures are
written there (benchmarks/results/*_fleet_*: the same test with N=200); with ``HOTWIRE_FLEET_SOAK_RESULTS=<file.json>``
the soak's report.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from benchmark_module import BENCHMARKS
from redis_fixture import RedisServer
from server_fixture import VllmServer, max_diff, retried_on_a_busy_cpu
from server_fixture import completion_logprobs as logprobs

sys.path.insert(0, str(BENCHMARKS))  # imported by name: its dataclasses need the module in sys.modules
from soak.plan import SoakConfig  # noqa: E402
from soak.report import examples_text, table  # noqa: E402
from soak.responses import PATHS  # noqa: E402
from soak.run import run_soak  # noqa: E402
from soak.steering import CLASS_WEIGHTS  # noqa: E402

pytestmark = pytest.mark.integration

HIDDEN, LAYER = 256, 2
PROMPT = "The quick brown fox jumps over"


class Fleet:
    def __init__(self, redis: RedisServer, a: VllmServer, b: VllmServer):
        self.redis, self.a, self.b = redis, a, b
        self.http = {name: httpx.Client(base_url=srv.url, timeout=120) for name, srv in (("a", a), ("b", b))}


# Data parallelism puts each engine core on its own GPU: on a machine with one GPU, replica A has one engine core.
A_ENGINES = 1 if torch.cuda.is_available() and torch.cuda.device_count() < 2 else 2


def _server(tiny_model: Path, workdir: Path, redis: RedisServer, replica: str, engines: int = 1,
            api_servers: int = 1) -> VllmServer:
    # Replaced versions are retained for 15 min: the test that pins one runs minutes after the replace.
    env = {"HOTWIRE_REGISTRY": redis.url, "HOTWIRE_REPLICA_ID": replica, "HOTWIRE_FLEET_HEARTBEAT_S": "0.5",
           "HOTWIRE_RETAIN_S": "900"}
    if not torch.cuda.is_available():
        # On a two-core machine running two test files at once, Redis (appendfsync always) has answered a soak's
        # replace only after its 2 s limit three times in a row: CPU and fsync starvation, not a fleet fault.
        env["HOTWIRE_REGISTRY_TIMEOUT_S"] = "10"
    # Eager on the CPU (start time); on a GPU the replicas capture CUDA graphs and share it (server_fixture.GPU_ARGS).
    args = [] if torch.cuda.is_available() else ["--enforce-eager"]
    if engines > 1:  # `vllm serve` itself: it starts one API server per engine core by default
        return VllmServer(tiny_model, workdir, env, [*args, "--data-parallel-size", str(engines)], cli=True)
    if api_servers > 1:  # `vllm serve` itself: only it starts several API servers
        return VllmServer(tiny_model, workdir, env, [*args, "--api-server-count", str(api_servers)], cli=True)
    return VllmServer(tiny_model, workdir, env, args)


def body(vector_id: str, seed: int) -> dict:
    vector = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32) * 4
    return {"id": vector_id, "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32", "shape": [HIDDEN]}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory, request) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    failed_before = request.session.testsfailed
    redis = RedisServer(root / "redis")
    redis.start()
    a = _server(tiny_model, root / "a", redis, "a", engines=A_ENGINES, api_servers=2)  # two API servers either way
    b = _server(tiny_model, root / "b", redis, "b")
    try:
        a.start()
        with httpx.Client(base_url=a.url, timeout=120) as http:  # before B exists: B must catch up at start
            assert http.post("/steer/vectors", json=body("early", 7)).status_code == 201
        b.start()
        f = Fleet(redis, a, b)
        yield f
        for client in f.http.values():
            client.close()
    finally:
        if request.session.testsfailed > failed_before:  # what the replicas said: the test run's folder is removed
            for name, srv in (("a", a), ("b", b)):
                print(f"---- replica {name}: the end of {srv.log_path.name} ----\n{srv.log_tail(20_000)}")
        b.stop()
        a.stop()
        redis.stop()


def completion(
    http: httpx.Client, model: str, vector_id: str | None = None, rank: int | None = None, version: int | None = None
) -> httpx.Response:
    """``rank``: the engine core of a data-parallel replica to run on; ``version``: the vector version to pin."""
    req = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    if vector_id is not None:
        spec = {"id": vector_id, "layer": LAYER, "scale": 8.0, **({"version": version} if version else {})}
        req["vllm_xargs"] = {"hotwire": json.dumps(spec)}
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    return http.post("/v1/completions", json=req, headers=headers)


def held(http: httpx.Client, vector_id: str) -> tuple[int, str] | None:
    r = http.get(f"/steer/vectors/{vector_id}")
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return r.json()["version"], r.json()["sha256"]


def wait_for(check, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.005)
    return time.monotonic() - start


def test_a_replica_started_later_serves_what_was_registered_before(fleet: Fleet) -> None:
    a, b = fleet.http["a"], fleet.http["b"]
    assert held(b, "early") == held(a, "early") and held(a, "early")[0] == 1


def test_registered_on_a_steers_on_b_and_changes_follow(fleet: Fleet, tiny_model) -> None:
    a, b, model = fleet.http["a"], fleet.http["b"], str(tiny_model)
    r = a.post("/steer/vectors", json=body("joy", 1))
    assert r.status_code == 201, r.text
    meta = r.json()
    wait_for(lambda: held(b, "joy") == (1, meta["sha256"]), 5)
    plain = logprobs(completion(b, model))
    on_a, on_b = completion(a, model, "joy"), completion(b, model, "joy")
    assert on_a.headers["x-hotwire-receipt"] == on_b.headers["x-hotwire-receipt"] == "joy@1:L2x8"
    assert max_diff(logprobs(on_b), plain) > 1e-3, "B did not steer"
    assert max_diff(logprobs(on_b), logprobs(on_a)) < 1e-5, "B steered differently from A"

    r = b.post("/steer/vectors?replace=true", json=body("joy", 2))
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    wait_for(lambda: held(a, "joy") == (2, r.json()["sha256"]), 5)
    # A's engine holds version 2 a moment before A's API server's catalog copy names it (the follower refreshes
    # that copy after applying): until then requests are pinned to version 1, which the engine retains.
    wait_for(lambda: completion(a, model, "joy").headers.get("x-hotwire-receipt") == "joy@2:L2x8", 5)
    assert b.post("/steer/vectors", json=body("joy", 3)).status_code == 409

    assert a.delete("/steer/vectors/joy").status_code == 204
    wait_for(lambda: held(b, "joy") is None, 5)
    wait_for(lambda: completion(b, model, "joy").status_code == 400, 5)  # B's catalog copy follows its engine
    assert b.delete("/steer/vectors/joy").json()["error"]["code"] == "unknown_vector"


@pytest.mark.skipif(A_ENGINES < 2, reason="data parallelism needs a GPU per engine core; this machine has one")
def test_registered_on_b_steers_on_both_engine_cores_of_a(fleet: Fleet, tiny_model) -> None:
    a, b, model = fleet.http["a"], fleet.http["b"], str(tiny_model)
    assert a.get("/steer/slots").json()["engines"] == 2
    for version, seed in ((1, 30), (2, 31)):
        r = b.post("/steer/vectors?replace=true", json=body("dp", seed))
        assert r.status_code in (200, 201) and r.json()["version"] == version, r.text
        on_b = completion(b, model, "dp")
        receipt = f"dp@{version}:L2x8"
        assert on_b.headers["x-hotwire-receipt"] == receipt
        wait_for(lambda: all(completion(a, model, "dp", rank).headers.get("x-hotwire-receipt") == receipt
                             for rank in (0, 1)), 5)
        for rank in (0, 1):
            on_a = completion(a, model, "dp", rank)
            assert max_diff(logprobs(on_a), logprobs(on_b)) < 1e-5, f"A's engine core {rank} steered differently"
    rows = [row for row in a.get("/steer/slots").json()["rows"] if row["id"] == "dp"]
    assert {row["engine"] for row in rows if row["version"] == 2} == {0, 1}  # each engine core's own bank
    assert b.delete("/steer/vectors/dp").status_code == 204
    wait_for(lambda: all(completion(a, model, "dp", rank).status_code == 400 for rank in (0, 1)), 5)


def test_one_id_registered_on_both_at_once(fleet: Fleet) -> None:
    for i in range(3):
        vid = f"race{i}"
        answers: dict[str, int] = {}

        def post(name: str, seed: int) -> None:
            with httpx.Client(base_url=fleet.http[name].base_url, timeout=120) as own:
                answers[name] = own.post("/steer/vectors", json=body(vid, seed)).status_code

        threads = [threading.Thread(target=post, args=(n, s)) for n, s in (("a", 10 + i), ("b", 20 + i))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(answers.values()) == [201, 409], answers
        wait_for(lambda: held(fleet.http["a"], vid) == held(fleet.http["b"], vid) is not None, 5)


def test_both_replicas_list_the_same_after_churn_on_both(fleet: Fleet) -> None:
    """Four clients, two per replica, register, replace and delete eight ids at random at once: every answer is
    one a client expects, and afterwards both replicas and Redis hold exactly the same versions and hashes."""
    ids = [f"churn{i}" for i in range(8)]
    answers: list[tuple[str, int, str]] = []

    def client(name: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=fleet.http[name].base_url, timeout=120) as own:
            for _ in range(40):
                vector_id = ids[int(rng.integers(len(ids)))]
                if rng.random() < 0.3:
                    r = own.delete(f"/steer/vectors/{vector_id}")
                else:
                    r = own.post("/steer/vectors?replace=true", json=body(vector_id, int(rng.integers(1 << 30))))
                answers.append((name, r.status_code, r.text))

    threads = [threading.Thread(target=client, args=(name, seed)) for seed, name in enumerate("aabb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    unexpected = [a for a in answers if a[1] not in (200, 201, 202, 204, 404)]
    assert not unexpected and len(answers) == 160, unexpected[:3]
    assert {status for _, status, _ in answers} >= {200, 204}
    wait_for(lambda: listing(fleet.http["a"]) == listing(fleet.http["b"]) == registry_current(fleet), 10)
    assert any(vector_id in listing(fleet.http["a"]) for vector_id in ids)


# Six clients on each replica; half of the 12 ids churned through both replicas in turn.
SOAK = dict(clients=12, duration=30.0, ids=12, churned=6, pool=3, max_tokens=8, id_prefix="fleet-soak")


# On the CPU the soak runs again when it fails: with two lanes on two cores, a replica has once held a re-registered
# version 5 s after the registry had it (the soak's bound; its other propagations on that run up to 4.0 s, p50 0.4 s).
# A wrong answer or a change that never arrives fails every attempt.
@retried_on_a_busy_cpu
def test_a_soak_over_both_replicas_has_no_failures(fleet: Fleet, tiny_model) -> None:
    """benchmarks/soak over both replicas at once: every OpenAI route, streamed and not, plain, single,
    stacked and one-phase steering while ids are replaced and deleted through either replica; every response is
    judged from its content against its receipt with one book of the fleet's versions, so a replica that served
    another version's bytes under a receipt, or a vector it should not have, is a failure."""
    result = asyncio.run(run_soak(SoakConfig(**SOAK), [fleet.a.url, fleet.b.url], tiny_model))
    if os.environ.get("HOTWIRE_FLEET_SOAK_RESULTS"):
        Path(os.environ["HOTWIRE_FLEET_SOAK_RESULTS"]).write_text(json.dumps(result, indent=1))
    summary = table(result)
    print(summary)
    failed = {kind: n for kind, n in result["failures"].items() if n}
    assert not failed, f"{summary}\n\nexamples:\n{examples_text(result, per_kind=3)}"
    requests = result["requests"]
    assert set(requests["by_route"]) == {f"{r}{s}" for r in PATHS for s in ("", "/stream")}
    assert set(requests["by_class"]) == set(CLASS_WEIGHTS)
    assert sorted(requests["by_server"]) == sorted([fleet.a.url, fleet.b.url])
    churn = result["churn"]
    assert churn["replaced"] > 0 and churn["deleted"] > 0 and sorted(churn["by_server"]) == sorted(requests["by_server"])
    assert churn["latency_ms"]["propagation"]["n"] >= churn["deleted"]
    assert requests["ok"] > 0.9 * requests["total"]
    assert [d["pinned"] for d in result["drain"]["servers"]] == [0, 0]
    wait_for(lambda: listing(fleet.http["a"]) == listing(fleet.http["b"]) == registry_current(fleet), 10)
    assert not any(vector_id.startswith("fleet-soak") for vector_id in listing(fleet.http["a"]))


def test_the_fleet_view_lists_both_replicas(fleet: Fleet) -> None:
    def in_sync() -> bool:
        view = fleet.http["b"].get("/steer/fleet").json()
        return [r["replica"] for r in view["replicas"]] == ["a", "b"] and all(r["in_sync"] for r in view["replicas"])

    wait_for(in_sync, 10)
    view = fleet.http["a"].get("/steer/fleet").json()
    early = next(v for v in view["vectors"] if v["id"] == "early")
    assert early["held_by"] == ["a", "b"] and early["missing_on"] == []
    assert view["registry"]["reachable"] is True and "slots" in view["replicas"][0]


def test_redis_down_mid_traffic(fleet: Fleet, tiny_model) -> None:
    a, b, model = fleet.http["a"], fleet.http["b"], str(tiny_model)
    assert a.post("/steer/vectors", json=body("steady", 4)).status_code == 201
    wait_for(lambda: held(b, "steady") is not None, 5)
    before = {name: logprobs(completion(c, model, "steady")) for name, c in fleet.http.items()}
    fleet.redis.kill()
    try:
        for name, client in fleet.http.items():
            r = client.post("/steer/vectors", json=body("while-down", 5))
            assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable", r.text
            assert f"127.0.0.1:{fleet.redis.port}" in r.json()["error"]["message"]
            assert client.delete("/steer/vectors/steady").status_code == 503
            assert max_diff(logprobs(completion(client, model, "steady")), before[name]) < 1e-5  # still steering
            registry = client.get("/steer/slots").json()["registry"]
            assert registry["kind"] == "redis" and registry["reachable"] is False and registry["error"]
            assert "hotwire_registry_reachable 0.0" in client.get("/metrics").text
    finally:
        fleet.redis.start()  # same port and append-only file
    wait_for(lambda: a.post("/steer/vectors", json=body("after", 6)).status_code == 201, 15)
    wait_for(lambda: held(b, "after") is not None, 5)
    for client in fleet.http.values():
        assert client.get("/steer/slots").json()["registry"]["reachable"] is True
        assert max_diff(logprobs(completion(client, model, "steady")), before["a"]) < 1e-5
    assert held(a, "steady") == held(b, "steady")


def registry_current(fleet: Fleet) -> dict[str, tuple[int, str]]:
    import redis

    from hotwire_api.fleet.config import Keys

    with redis.Redis.from_url(fleet.redis.url) as client:
        raw = client.hgetall(Keys.for_model(str(fleet.a.model)).current)
    return {k.decode(): (int(v.split(b":")[0]), v.split(b":")[1].decode()) for k, v in raw.items()}


def test_a_redis_that_lost_its_data_gets_it_back_from_the_replicas(fleet: Fleet, tiny_model) -> None:
    a, b, model = fleet.http["a"], fleet.http["b"], str(tiny_model)
    assert a.post("/steer/vectors", json=body("survivor", 40)).status_code == 201
    wait_for(lambda: listing(b) == listing(a), 5)
    before, steered = listing(a), logprobs(completion(b, model, "survivor"))
    assert registry_current(fleet) == before
    fleet.redis.restart(wipe=True)  # back empty: no append-only file
    wait_for(lambda: registry_current(fleet) == before, 10)  # put back, same versions and hashes
    assert listing(a) == listing(b) == before
    assert max_diff(logprobs(completion(b, model, "survivor")), steered) < 1e-5
    for client in (a, b):  # A's two API servers alike: the one without the follower reads its heartbeat
        wait_for(lambda: all(client.get("/steer/slots").json()["registry"]["reset"] for _ in range(4)), 5)
    r = b.post("/steer/vectors?replace=true", json=body("survivor", 41))
    assert r.status_code == 200 and r.json()["version"] == 2, r.text  # numbering goes on
    wait_for(lambda: held(a, "survivor") == (2, r.json()["sha256"]), 5)


def test_a_redis_restored_from_an_older_snapshot_loses_nothing_acknowledged(fleet: Fleet) -> None:
    """Redis comes back with a snapshot older than some acknowledged changes: a delete and a replace sent at once
    wait until the replicas put back what came after the snapshot, then act on it: the vector registered after the snapshot is deleted (204, not 404), the replace makes version 3 (not a
    second version 2), the deletion made after the snapshot holds."""
    a, b = fleet.http["a"], fleet.http["b"]
    assert a.post("/steer/vectors", json=body("restored", 60)).status_code == 201
    assert a.post("/steer/vectors", json=body("dropped", 61)).status_code == 201
    wait_for(lambda: listing(b) == listing(a), 5)
    fleet.redis.save()
    r = b.post("/steer/vectors?replace=true", json=body("restored", 62))
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    assert a.delete("/steer/vectors/dropped").status_code == 204
    assert a.post("/steer/vectors", json=body("after-snapshot", 63)).status_code == 201
    wait_for(lambda: listing(a) == listing(b) == registry_current(fleet), 5)
    fleet.redis.restart(snapshot=True)
    assert b.delete("/steer/vectors/after-snapshot").status_code == 204
    r = b.post("/steer/vectors?replace=true", json=body("restored", 64))
    assert r.status_code == 200 and r.json()["version"] == 3, r.text
    wait_for(lambda: listing(a) == listing(b) == registry_current(fleet), 10)
    assert listing(a)["restored"] == (3, r.json()["sha256"])
    assert not {"dropped", "after-snapshot"} & set(listing(a))


def test_propagation_latency(fleet: Fleet) -> None:
    a, b = fleet.http["a"], fleet.http["b"]
    n = int(os.environ.get("HOTWIRE_FLEET_LATENCY_N", "30"))
    assert a.post("/steer/vectors", json=body("lat", 0)).status_code == 201
    from_answer, from_send, register_ms = [], [], []
    for i in range(n):
        sent = time.monotonic()
        r = a.post("/steer/vectors?replace=true", json=body("lat", i + 1))
        answered = time.monotonic()
        assert r.status_code == 200, r.text
        version = r.json()["version"]
        wait_for(lambda: (held(b, "lat") or (0,))[0] >= version, 10)
        seen = time.monotonic()
        from_answer.append(1000 * (seen - answered))
        from_send.append(1000 * (seen - sent))
        register_ms.append(1000 * (answered - sent))

    def summary(values: list[float]) -> dict[str, float]:
        q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {"p50": round(statistics.median(values), 2), "p99": round(q[98], 2), "max": round(max(values), 2)}

    result = {
        "registrations": n,
        "propagation_ms_after_answer": summary(from_answer),
        "propagation_ms_after_send": summary(from_send),
        "register_ms": summary(register_ms),
        "note": "B polled with GET /steer/vectors/lat (an engine round trip, ~5 ms apart): figures include up to "
                "one poll interval and one engine step",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=2))
    out = os.environ.get("HOTWIRE_FLEET_RESULTS")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    assert result["propagation_ms_after_answer"]["p99"] < 3000  # the target is 1 s; a busy CI machine gets slack


def listing(http: httpx.Client) -> dict[str, tuple[int, str]]:
    r = http.get("/steer/vectors")
    assert r.status_code == 200, r.text
    return {v["id"]: (v["version"], v["sha256"]) for v in r.json()["vectors"]}


def test_a_replica_restarted_while_redis_holds_500_vectors(fleet: Fleet, tiny_model) -> None:
    """B restarts (a new process, new port) while Redis holds 500 more vectors: it catches up with every one of
    them before its health check passes, both replicas list exactly the same ids, versions and hashes, and both
    steer alike."""
    a, model = fleet.http["a"], str(tiny_model)
    assert a.post("/steer/vectors", json=body("pinned", 50)).status_code == 201
    assert a.post("/steer/vectors?replace=true", json=body("pinned", 51)).status_code == 200
    pinned_on_a = completion(a, model, "pinned", version=1)
    assert pinned_on_a.headers["x-hotwire-receipt"] == "pinned@1:L2x8"
    ids = [f"bulk{i:03d}" for i in range(500)]
    for i, vector_id in enumerate(ids):
        assert a.post("/steer/vectors", json=body(vector_id, 1000 + i)).status_code == 201
    wait_for(lambda: listing(fleet.http["b"]) == listing(a), 30)
    fleet.http["b"].close()
    fleet.b.stop()
    fleet.b.start()
    fleet.http["b"] = b = httpx.Client(base_url=fleet.b.url, timeout=120)
    assert listing(b) == listing(a)  # caught up before its health check passed: no "unknown vector" meanwhile
    assert set(ids) <= set(listing(b))
    for vector_id in (ids[0], ids[-1]):
        on_a, on_b = completion(a, model, vector_id), completion(b, model, vector_id)
        assert on_a.headers["x-hotwire-receipt"] == on_b.headers["x-hotwire-receipt"] == f"{vector_id}@1:L2x8"
        assert max_diff(logprobs(on_b), logprobs(on_a)) < 1e-5
    # B never held pinned@1 (replaced before it started): within the retention it serves a request pinned to it
    pinned_on_b = completion(b, model, "pinned", version=1)
    log = [line for line in fleet.b.log_tail(200_000).splitlines() if "pinned" in line or "synced" in line]
    assert pinned_on_b.status_code == 200, (pinned_on_b.text, log)
    assert pinned_on_b.headers["x-hotwire-receipt"] == "pinned@1:L2x8"
    assert max_diff(logprobs(pinned_on_b), logprobs(pinned_on_a)) < 1e-5
