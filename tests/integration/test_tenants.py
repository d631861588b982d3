"""Tenants against a real ``vllm serve`` (vLLM 0.25.1, tiny float32 model; CPU backend in CI): keys of two tenants
and the operator's in one keys file, each tenant with a vector named ``calm`` beside a shared ``calm``. A tenant
steers, reads and gates with its own vectors and the shared ones by their plain names and gets everything back in
those names; it never sees, uses, replaces or deletes the other's, and naming the other's vector answers exactly as
naming a vector nobody has; its quotas refuse with 429 ``quota_exceeded``. The operator sees every namespace.

One server for most of the module (``HOTWIRE_READOUT=1`` for the readout and gate receipts), and one on a real
redis-server with the fleet's keys (``HOTWIRE_FLEET_KEYS=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from hotwire_api.keys import Role, add_key
from redis_fixture import RedisServer
from server_fixture import VllmServer

pytestmark = pytest.mark.integration

HIDDEN, LAYERS = 256, 4
RECEIPT = "x-hotwire-receipt"
SERVER_ARGS = [] if torch.cuda.is_available() else ["--enforce-eager"]
PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5]
KEYS = {"ops": (Role.ADMIN, None), "acme-admin": (Role.ADMIN, "acme"), "acme-app": (Role.STEER, "acme"),
        "acme-view": (Role.READ, "acme"), "beta-admin": (Role.ADMIN, "beta"), "beta-app": (Role.STEER, "beta")}


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return {"file": str(path), **{name: add_key(path, name, role, tenant) for name, (role, tenant) in KEYS.items()}}


@pytest.fixture(scope="module")
def server(tiny_model, secret, tmp_path_factory) -> Iterator[VllmServer]:
    env = {"HOTWIRE_KEYS_FILE": secret["file"], "HOTWIRE_STORE": str(tmp_path_factory.mktemp("store")),
           "HOTWIRE_READOUT": "1", "HOTWIRE_TENANT_VECTORS": "4", "HOTWIRE_TENANT_MB": "0.008",
           "HOTWIRE_TENANT_REGISTRATIONS_PER_MIN": "8", "HOTWIRE_TENANT_LIMITS": '{"beta": {"vectors": 5, "rows": 1}}'}
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), env, SERVER_ARGS)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def key(name: str, secret: dict[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret[name]}"}


def rows(seed: int, layers: tuple[int, ...] = (1,)) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    return {str(layer): (rng.standard_normal(HIDDEN) * 6).astype(np.float32).tolist() for layer in layers}


@pytest.fixture(scope="module")
def vectors(http, secret) -> None:
    """acme's calm, beta's calm and secret, and the operator's shared calm and pub."""
    for who, vector_id, seed in (("acme-admin", "calm", 1), ("beta-admin", "calm", 2), ("beta-admin", "secret", 3),
                                 ("ops", "calm", 4), ("ops", "pub", 5)):
        made = http.post("/steer/vectors", json={"id": vector_id, "layers": rows(seed, (0, 1))},
                         headers=key(who, secret))
        assert made.status_code == 201, made.text
        assert made.json()["id"] == vector_id and made.json()["tenant"] == KEYS[who][1]


@pytest.fixture(scope="module")
def generate(http, secret, tiny_model):
    """POST /v1/completions as ``who``, steered with ``spec`` and reading ``readout``."""
    def post(who: str, spec: list[dict] | None = None, readout: dict | None = None) -> httpx.Response:
        xargs = {}
        if spec is not None:
            xargs["hotwire"] = json.dumps(spec)
        if readout is not None:
            xargs["hotwire_readout"] = json.dumps(readout)
        body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "vllm_xargs": xargs}
        return http.post("/v1/completions", json=body, headers=key(who, secret))

    return post


def logprobs(response: httpx.Response) -> list[float]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def refused(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and RECEIPT not in response.headers, error
    return error["message"]


def test_each_tenant_steers_with_its_own_vector_and_the_operator_sees_every_namespace(http, secret, vectors,
                                                                                       generate) -> None:
    def steer(who: str, vector_id: str) -> httpx.Response:
        response = generate(who, [{"id": vector_id, "layer": 1, "scale": 1.0}])
        assert response.status_code == 200, response.text
        return response

    acme, beta, shared = steer("acme-app", "calm"), steer("beta-app", "calm"), steer("ops", "calm")
    assert acme.headers[RECEIPT] == beta.headers[RECEIPT] == shared.headers[RECEIPT] == "calm@1:L1x1"
    assert logprobs(acme) == logprobs(steer("ops", "acme/calm"))  # the operator names it by its full id
    assert logprobs(beta) == logprobs(steer("ops", "beta/calm"))
    assert steer("ops", "acme/calm").headers[RECEIPT] == "acme/calm@1:L1x1"
    assert len({tuple(logprobs(r)) for r in (acme, beta, shared)}) == 3  # three different vectors
    pub = steer("acme-app", "pub")  # a shared vector no tenant shadows
    assert pub.headers[RECEIPT] == "pub@1:L1x1" and logprobs(pub) == logprobs(steer("ops", "pub"))

    listed = {who: [(v["id"], v["tenant"]) for v in
                    http.get("/steer/vectors", headers=key(who, secret)).json()["vectors"]]
              for who in ("acme-app", "beta-app", "ops")}
    assert sorted(listed["acme-app"], key=str) == sorted([("calm", "acme"), ("calm", None), ("pub", None)], key=str)
    assert ("secret", "beta") in listed["beta-app"] and len(listed["beta-app"]) == 4
    assert {vid for vid, _ in listed["ops"]} == {"acme/calm", "beta/calm", "beta/secret", "calm", "pub"}
    got = http.get("/steer/vectors/calm", params={"tenant": "beta"}, headers=key("ops", secret)).json()
    assert (got["id"], got["tenant"]) == ("beta/calm", "beta")
    assert http.get("/steer/vectors/calm", headers=key("acme-app", secret)).json()["tenant"] == "acme"
    exported = http.get("/steer/vectors/calm/file", headers=key("acme-app", secret))
    assert exported.status_code == 200 and exported.headers["x-hotwire-version"] == "1"
    assert exported.content == http.get("/steer/vectors/calm/file", params={"tenant": "acme"},
                                        headers=key("ops", secret)).content


def test_naming_another_tenants_vector_answers_as_naming_one_nobody_has(http, secret, vectors, generate) -> None:
    """beta has ``secret``; acme has none: every way acme can name it answers exactly as for ``nosuch``."""
    def both(call) -> tuple[httpx.Response, httpx.Response]:
        return call("secret"), call("nosuch")

    def same(pair: tuple[httpx.Response, httpx.Response], status: int, code: str) -> None:
        theirs, nobodys = pair
        message = refused(theirs, status, code)
        assert message.replace("secret", "nosuch") == refused(nobodys, status, code)
        assert theirs.json()["error"].get("field") == nobodys.json()["error"].get("field")

    app, admin = key("acme-app", secret), key("acme-admin", secret)
    same(both(lambda v: generate("acme-app", [{"id": v, "layer": 1, "scale": 1.0}])), 400,
         "unknown_vector")
    same(both(lambda v: generate("acme-app", readout={"probes": [{"id": v, "layer": 1}]})), 400,
         "unknown_vector")
    same(both(lambda v: http.get(f"/steer/vectors/{v}", headers=app)), 404, "unknown_vector")
    same(both(lambda v: http.get(f"/steer/vectors/{v}/file", headers=app)), 404, "unknown_vector")
    same(both(lambda v: http.delete(f"/steer/vectors/{v}", headers=admin)), 404, "unknown_vector")
    same(both(lambda v: http.get(f"/steer/vectors/calm", params={"tenant": "beta" if v == "secret" else "gamma"},
                                 headers=app)), 404, "unknown_vector")
    # a full id is refused alike whether or not it exists
    same(both(lambda v: generate("acme-app", [{"id": f"beta/{v}", "layer": 1, "scale": 1.0}])), 400,
         "bad_id")


def test_a_tenant_changes_only_its_own_vectors(http, secret, vectors) -> None:
    admin = key("acme-admin", secret)
    refused(http.delete("/steer/vectors/pub", headers=admin), 403, "forbidden")
    assert "shared" in refused(http.delete("/steer/vectors/pub", headers=admin), 403, "forbidden")
    refused(http.post("/steer/vectors", json={"id": "x", "layers": rows(9)}, headers=key("acme-app", secret)), 403,
            "forbidden")
    assert "operator" in refused(http.get("/steer/monitors", headers=admin), 403, "forbidden")
    made = http.post("/steer/vectors", json={"id": "beta/x", "layers": rows(9)}, headers=admin)
    assert refused(made, 400, "bad_id")
    replaced = http.post("/steer/vectors?replace=true", json={"id": "calm", "layers": rows(11, (0, 1))},
                         headers=admin)
    assert replaced.status_code == 200 and replaced.json()["version"] == 2
    assert http.get("/steer/vectors/calm", params={"tenant": "beta"}, headers=key("ops", secret)).json()["version"] == 1
    assert http.get("/steer/vectors/calm", headers=key("ops", secret)).json()["version"] == 1  # the shared one
    assert http.post("/steer/vectors", json={"id": "gone", "layers": rows(12)}, headers=admin).status_code == 201
    assert http.delete("/steer/vectors/gone", headers=admin).status_code == 204
    trail = http.get("/steer/audit", headers=admin).json()["entries"]
    assert [(e["action"], e["id"], e["who"]) for e in reversed(trail)] == [
        ("register", "calm", "acme-admin"), ("replace", "calm", "acme-admin"), ("register", "gone", "acme-admin"),
        ("delete", "gone", "acme-admin")]
    everyone = http.get("/steer/audit", headers=key("ops", secret)).json()["entries"]
    assert {e["id"] for e in everyone} >= {"acme/calm", "beta/calm", "beta/secret", "calm", "pub"}


def test_readouts_gates_slots_and_the_fleet_view_are_in_the_tenants_names(http, secret, vectors, generate) -> None:
    read = generate("acme-app", [{"id": "pub", "layer": 1, "scale": 1.0,
                                                "when": {"id": "calm", "layer": 0, "above": -1e30}}],
                    readout={"probes": [{"id": "calm", "layer": 1}, {"id": "pub", "layer": 0}], "tokens": "generated"})
    assert read.status_code == 200, read.text
    data = read.json()
    text = json.dumps({k: data[k] for k in ("hotwire_readout", "hotwire_gate")})
    assert "acme/" not in text and "acme/" not in read.headers[RECEIPT]
    assert [p["probe"].split("@")[0] for p in data["hotwire_readout"]["probes"]] == ["calm", "pub"]
    assert data["hotwire_gate"]["condition"].startswith("calm@2:L0")
    assert data["hotwire_gate"]["fired"] is True
    generate("beta-app", [{"id": "secret", "layer": 1, "scale": 1.0}])  # a row of beta's, resident

    seen = {who: {row["id"] for row in http.get("/steer/slots", headers=key(who, secret)).json()["rows"]}
            for who in ("acme-view", "ops")}
    assert "beta/secret" in seen["ops"] and "acme/calm" in seen["ops"]
    assert "calm" in seen["acme-view"] and not any("/" in i or i == "secret" for i in seen["acme-view"])
    before = http.get("/steer/slots", headers=key("acme-view", secret)).json()
    assert before["vectors"] == 3 and before["registry"]["position"] is None  # acme's calm, the shared calm and pub
    made = http.post("/steer/vectors", json={"id": "hidden", "layers": rows(50)}, headers=key("beta-admin", secret))
    assert made.status_code == 201
    assert http.get("/steer/slots", headers=key("acme-view", secret)).json()["vectors"] == 3  # beta's is no news
    assert http.delete("/steer/vectors/hidden", headers=key("beta-admin", secret)).status_code == 204
    monitor = {"id": "m", "probe": "acme/calm", "layer": 1, "threshold": 1.0}
    assert "shared vector" in refused(http.post("/steer/monitors", json=monitor, headers=key("ops", secret)), 400,
                                      "bad_request")
    fleet = http.get("/steer/fleet", headers=key("acme-view", secret)).json()
    assert {v["id"] for v in fleet["vectors"]} == {"calm", "pub"}
    assert not any("/" in v["id"] for r in fleet["replicas"] for v in r["vectors"] + r["pinned_rows"])


def test_every_role_of_a_tenant_on_every_route(http, secret, vectors, tiny_model) -> None:
    """acme's read, steer and admin keys on every /steer route and on steering: what their role allows, in acme's
    namespace; the keys routes on acme's keys only, the operator's (monitors) refused to every tenant key."""
    role_of = {"acme-view": Role.READ, "acme-app": Role.STEER, "acme-admin": Role.ADMIN}
    steer = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
             "vllm_xargs": {"hotwire": json.dumps({"id": "calm", "layer": 1, "scale": 1.0})}}
    routes = [  # (method, path, body, role, operator's only, status when allowed)
        ("GET", "/steer/slots", None, Role.READ, False, 200),
        ("GET", "/steer/fleet", None, Role.READ, False, 200),
        ("GET", "/steer/vectors", None, Role.STEER, False, 200),
        ("GET", "/steer/vectors/calm", None, Role.STEER, False, 200),
        ("GET", "/steer/vectors/calm/file", None, Role.STEER, False, 200),
        ("GET", "/steer/usage", None, Role.STEER, False, 200),
        ("POST", "/v1/completions", steer, Role.STEER, False, 200),
        ("POST", "/steer/vectors", {"id": "{mine}", "layers": rows(60)}, Role.ADMIN, False, 201),
        ("DELETE", "/steer/vectors/{mine}", None, Role.ADMIN, False, 204),
        ("POST", "/steer/vectors/extract", {"id": "x", "positive": ["a"], "negative": ["b"]}, Role.ADMIN, False, 503),
        ("GET", "/steer/audit", None, Role.ADMIN, False, 200),
        ("GET", "/steer/monitors", None, Role.READ, True, None),
        ("POST", "/steer/monitors", {"id": "m", "probe": "calm", "layer": 1, "threshold": 1}, Role.ADMIN, True, None),
        ("DELETE", "/steer/monitors/m", None, Role.ADMIN, True, None),
        ("GET", "/steer/keys", None, Role.ADMIN, False, 200),
        ("POST", "/steer/keys", {"name": "{mine}", "role": "read"}, Role.ADMIN, False, 201),
        ("POST", "/steer/keys/{mine}/rotate", None, Role.ADMIN, False, 200),
        ("DELETE", "/steer/keys/{mine}", None, Role.ADMIN, False, 204),
        ("DELETE", "/steer/keys/beta-admin", None, Role.ADMIN, False, 404),  # another tenant's key: unknown
    ]
    for who, role in role_of.items():
        for method, path, body, needed, operator, allowed in routes:
            mine = f"by-{who}"
            body = {k: mine if v == "{mine}" else v for k, v in body.items()} if body is not None else None
            response = http.request(method, path.format(mine=mine), json=body, headers=key(who, secret))
            case = f"{who} {method} {path}"
            if not role.allows(needed):
                assert f"'{who}'" in refused(response, 403, "forbidden"), case
            elif operator:
                assert "operator" in refused(response, 403, "forbidden"), case
            else:
                assert response.status_code == allowed, (case, response.text)
                if allowed == 201:
                    made = response.json()
                    assert made.get("id", made.get("name")) == mine and made["tenant"] == "acme", case
                if allowed == 503:  # extraction needs HOTWIRE_CAPTURE=1
                    assert response.json()["error"]["code"] == "capture_off", case
    listed = {v["id"] for v in http.get("/steer/vectors", params={"tenant": "acme"}, headers=key("ops", secret))
              .json()["vectors"]}
    assert not any(i.startswith("by-") or i.startswith("acme/by-") for i in listed)  # made and deleted by acme-admin


def test_quotas_refuse_a_tenant_past_its_vectors_bytes_and_rate(http, secret, vectors) -> None:
    """HOTWIRE_TENANT_VECTORS=4, HOTWIRE_TENANT_MB=0.008 (8,388 bytes), 8 registrations a minute."""
    admin = key("acme-admin", secret)
    for k in range(3):  # acme holds calm (2 rows, 2 KB): three more of one row each make four
        assert http.post("/steer/vectors", json={"id": f"v{k}", "layers": rows(20 + k)}, headers=admin).status_code == 201
    message = refused(http.post("/steer/vectors", json={"id": "v3", "layers": rows(23)}, headers=admin), 429,
                      "quota_exceeded")
    assert "holds 4 vectors" in message and "HOTWIRE_TENANT_VECTORS=4" in message
    assert http.post("/steer/vectors", json={"id": "v3", "layers": rows(23)}, headers=key("ops", secret)).status_code == 201
    beta = key("beta-admin", secret)  # holds calm and secret: 4 KB
    big = {"id": "big", "layers": rows(30, (0, 1, 2, 3))}  # 4 KB more: 8,192 bytes
    assert http.post("/steer/vectors", json=big, headers=beta).status_code == 201
    message = refused(http.post("/steer/vectors", json={"id": "more", "layers": rows(31)}, headers=beta), 429,
                      "quota_exceeded")
    assert "HOTWIRE_TENANT_MB" in message
    # acme registered in the tests above and v0-v2 here (the refused ones do not count): replacements up to 8
    # registrations this minute; the next one is refused, whatever it is
    (usage,) = http.get("/steer/usage", headers=admin).json()["tenants"]
    assert 5 <= usage["registrations_last_minute"] < 8
    for _ in range(8 - usage["registrations_last_minute"]):
        assert http.post("/steer/vectors?replace=true", json={"id": "v0", "layers": rows(40)},
                         headers=admin).status_code == 200
    response = http.post("/steer/vectors?replace=true", json={"id": "v0", "layers": rows(40)}, headers=admin)
    assert "registrations in the last minute" in refused(response, 429, "quota_exceeded")
    assert response.headers["Retry-After"]

    (mine,) = http.get("/steer/usage", headers=key("acme-app", secret)).json()["tenants"]
    assert (mine["tenant"], mine["vectors"], mine["bytes"], mine["registrations_last_minute"]) == ("acme", 4, 5 * 1024, 8)
    assert mine["limits"] == {"vectors": 4, "bytes": 8388, "registrations_per_minute": 8, "rows": mine["limits"]["rows"]}
    assert mine["limits"]["rows"] >= 1
    every = {u["tenant"]: u for u in http.get("/steer/usage", headers=key("ops", secret)).json()["tenants"]}
    assert set(every) == {"acme", "beta"} and every["beta"]["bytes"] == 8192 and every["acme"] == mine
    beta = every["beta"]["limits"]  # beta's own (HOTWIRE_TENANT_LIMITS): 5 vectors, its bank share at its floor
    assert beta["vectors"] == 5 and beta["bytes"] == 8388 and beta["rows"] < mine["limits"]["rows"]


@pytest.fixture(scope="module")
def fleet_server(tiny_model, tmp_path_factory) -> Iterator[tuple[VllmServer, RedisServer, str]]:
    """A replica keeping its keys in the fleet's Redis (HOTWIRE_FLEET_KEYS=1), its operator key made with the CLI
    before it starts."""
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    env = {"HOTWIRE_REGISTRY": redis.url, "HOTWIRE_FLEET_KEYS": "1", "HOTWIRE_STORE": "off",
           "HOTWIRE_TENANT_REGISTRATIONS_PER_MIN": "2", "HOTWIRE_CATALOG_REFRESH_MS": "50"}
    made = subprocess.run([sys.executable, "-m", "hotwire_api.cli", "keys", "--fleet", str(tiny_model), "add", "ops",
                           "--role", "admin"], env={**os.environ, "HOTWIRE_REGISTRY": redis.url},
                          capture_output=True, text=True, check=True)
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve-fleet"), env, SERVER_ARGS)
    srv.start()
    yield srv, redis, json.loads(made.stdout)["key"]
    srv.stop()
    redis.stop()


def test_a_fleets_keys_tenants_quotas_and_audit_live_in_its_redis(fleet_server, tiny_model) -> None:
    srv, redis, ops_key = fleet_server
    ops = {"Authorization": f"Bearer {ops_key}"}
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        made = http.post("/steer/keys", json={"name": "acme-admin", "role": "admin", "tenant": "acme"}, headers=ops)
        assert made.status_code == 201 and made.json()["tenant"] == "acme", made.text
        acme = {"Authorization": f"Bearer {made.json()['key']}"}
        assert http.get("/steer/keys", headers=ops).json()["file"] == "redis"
        assert [k["name"] for k in http.get("/steer/keys", headers=acme).json()["keys"]] == ["acme-admin"]
        assert refused(http.delete("/steer/keys/ops", headers=acme), 404, "unknown_key")  # not acme's: unknown
        assert http.post("/steer/keys", json={"name": "beta-app", "role": "steer", "tenant": "beta"},
                         headers=ops).status_code == 201
        for response in (http.post("/steer/keys/beta-app/rotate", headers=acme), http.delete("/steer/keys/beta-app",
                                                                                             headers=acme)):
            assert refused(response, 404, "unknown_key")  # another tenant's key, in the fleet's script
        assert [k["name"] for k in http.get("/steer/keys", headers=acme).json()["keys"]] == ["acme-admin"]
        for k in range(2):
            assert http.post("/steer/vectors", json={"id": f"v{k}", "layers": rows(k)}, headers=acme).status_code == 201
        message = refused(http.post("/steer/vectors", json={"id": "v2", "layers": rows(2)}, headers=acme), 429,
                          "quota_exceeded")
        assert "made 2 registrations in the last minute" in message
        body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                "vllm_xargs": {"hotwire": json.dumps({"id": "v1", "layer": 1, "scale": 1.0})}}
        steered = http.post("/v1/completions", json=body, headers=acme)
        assert steered.status_code == 200 and steered.headers[RECEIPT] == "v1@1:L1x1", steered.text
        listed = {v["id"] for v in http.get("/steer/vectors", headers=ops).json()["vectors"]}
        assert listed == {"acme/v0", "acme/v1"}
        trail = [(e["who"], e["action"], e["id"]) for e in
                 reversed(http.get("/steer/audit", headers=ops).json()["entries"])]
        assert trail == [("cli", "key_added", "ops"), ("ops", "key_added", "acme-admin"), ("ops", "key_added", "beta-app"),
                         ("acme-admin", "register", "acme/v0"), ("acme-admin", "register", "acme/v1")]
        (usage,) = http.get("/steer/usage", headers=acme).json()["tenants"]
        assert (usage["vectors"], usage["registrations_last_minute"]) == (2, 2)  # counted in Redis
        assert http.delete("/steer/keys/acme-admin", headers=ops).status_code == 204
        refused(http.get("/steer/vectors", headers=acme), 401, "unauthorized")
        assert "last operator admin" in refused(http.delete("/steer/keys/ops", headers=ops), 409, "last_admin")
