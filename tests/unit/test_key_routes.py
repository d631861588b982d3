"""``/steer/keys``: admins manage the keys file over HTTP (against a real vllm serve: tests/integration/test_roles.py)."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hotwire_api.keys import Role, add_key, read_keys
from hotwire_api.server import attach
from hotwire_api.settings import Settings


def _app(settings: Settings) -> TestClient:
    app = FastAPI()
    attach(app, settings)
    return TestClient(app)


def _code(response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["code"]


@pytest.fixture
def keys(tmp_path):
    path = tmp_path / "keys.json"
    return path, {"ops": add_key(path, "ops", Role.ADMIN), "app": add_key(path, "app", Role.STEER)}


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_an_admin_adds_rotates_and_revokes_keys_and_each_works_at_once(keys) -> None:
    path, secret = keys
    client = _app(Settings(keys_file=str(path)))
    admin = _bearer(secret["ops"])
    listed = client.get("/steer/keys", headers=admin).json()
    assert listed["file"] == str(path)
    assert [(k["name"], k["role"]) for k in listed["keys"]] == [("ops", "admin"), ("app", "steer")]
    assert "sha256" not in json.dumps(listed)

    made = client.post("/steer/keys", json={"name": "dash", "role": "read"}, headers=admin)
    assert made.status_code == 201 and made.json()["role"] == "read" and made.json()["key"].startswith("hw_")
    dash = _bearer(made.json()["key"])
    assert client.get("/steer/slots", headers=dash).status_code != 401  # works on the next request
    assert _code(client.get("/steer/keys", headers=dash), 403) == "forbidden"
    assert _code(client.get("/steer/keys", headers=_bearer(secret["app"])), 403) == "forbidden"

    rotated = client.post("/steer/keys/dash/rotate", headers=admin)
    assert rotated.status_code == 200 and rotated.json()["role"] == "read"
    assert _code(client.get("/steer/slots", headers=dash), 401) == "unauthorized"  # the old key stops now
    assert client.delete("/steer/keys/dash", headers=admin).status_code == 204
    assert _code(client.get("/steer/slots", headers=_bearer(rotated.json()["key"])), 401) == "unauthorized"
    assert [k.name for k in read_keys(path)] == ["ops", "app"]

    trail = client.get("/steer/audit", headers=admin).json()["entries"]
    assert [(e["who"], e["action"], e["id"]) for e in reversed(trail)] == [
        ("ops", "key_added", "dash"), ("ops", "key_rotated", "dash"), ("ops", "key_revoked", "dash")]


def test_key_edits_that_cannot_be_made_say_why(keys) -> None:
    path, secret = keys
    client = _app(Settings(keys_file=str(path)))
    admin = _bearer(secret["ops"])
    assert _code(client.post("/steer/keys", json={"name": "app", "role": "read"}, headers=admin), 409) == "exists"
    assert _code(client.post("/steer/keys/nobody/rotate", headers=admin), 404) == "unknown_key"
    assert _code(client.delete("/steer/keys/nobody", headers=admin), 404) == "unknown_key"
    for body in ({"name": "-x", "role": "read"}, {"name": "x", "role": "root"}, {"name": "x"},
                 {"name": "x", "role": "read", "extra": 1}):
        assert _code(client.post("/steer/keys", json=body, headers=admin), 400) == "bad_request"
    refused = client.delete("/steer/keys/ops", headers=admin)
    assert _code(refused, 409) == "last_admin" and "add another admin key first" in refused.json()["error"]["message"]
    assert [k.name for k in read_keys(path)] == ["ops", "app"]
    assert _code(client.post("/steer/keys", json={"name": "x", "role": "read"}), 401) == "unauthorized"

    # beside HOTWIRE_API_KEY (an admin key no file edit removes) the file's last admin key may go
    with_env_key = _app(Settings(keys_file=str(path), api_key="root-key"))
    assert with_env_key.delete("/steer/keys/ops", headers=_bearer("root-key")).status_code == 204

    path.write_text("{")  # a broken file: keys_unavailable, and no edit is made over it
    assert _code(with_env_key.get("/steer/keys", headers=_bearer("root-key")), 503) == "keys_unavailable"
    assert _code(with_env_key.post("/steer/keys/app/rotate", headers=_bearer("root-key")), 503) == "keys_unavailable"
    assert path.read_text() == "{"


def test_without_a_keys_file_key_management_is_off() -> None:
    client = _app(Settings(api_key="root-key"))
    refused = client.get("/steer/keys", headers=_bearer("root-key"))
    assert _code(refused, 503) == "keys_off" and "HOTWIRE_KEYS_FILE" in refused.json()["error"]["message"]
    assert _code(client.post("/steer/keys", json={"name": "x", "role": "read"}, headers=_bearer("root-key")),
                 503) == "keys_off"


def test_a_tenants_admin_manages_its_tenants_keys_only(keys) -> None:
    path, secret = keys
    acme = _bearer(add_key(path, "acme-admin", Role.ADMIN, "acme"))
    beta_secret = add_key(path, "beta-app", Role.STEER, "beta")
    client = _app(Settings(keys_file=str(path)))
    listed = client.get("/steer/keys", headers=acme).json()
    assert [k["name"] for k in listed["keys"]] == ["acme-admin"] and str(path) not in json.dumps(listed)

    made = client.post("/steer/keys", json={"name": "acme-app", "role": "steer"}, headers=acme)
    assert made.status_code == 201 and made.json()["tenant"] == "acme"  # a tenant's admin makes its tenant's keys
    assert client.post("/steer/keys", json={"name": "acme-2", "role": "read", "tenant": "acme"},
                       headers=acme).status_code == 201
    refused = client.post("/steer/keys", json={"name": "x", "role": "admin", "tenant": "beta"}, headers=acme)
    assert _code(refused, 403) == "forbidden"
    taken = client.post("/steer/keys", json={"name": "beta-app", "role": "read"}, headers=acme)  # beta's name
    assert _code(taken, 409) == "exists" and str(path) not in taken.text and "rotate" not in taken.text
    assert client.post("/steer/keys/acme-app/rotate", headers=acme).status_code == 200
    assert client.delete("/steer/keys/acme-2", headers=acme).status_code == 204

    # another tenant's key and the operator's answer as a name nobody has, and stay as they were
    unknown = client.delete("/steer/keys/nobody", headers=acme).json()["error"]
    for name in ("beta-app", "ops"):
        for response in (client.post(f"/steer/keys/{name}/rotate", headers=acme),
                         client.delete(f"/steer/keys/{name}", headers=acme)):
            error = response.json()["error"]
            assert response.status_code == 404 and error["code"] == "unknown_key"
            assert error["message"] == unknown["message"].replace("nobody", name)
    assert client.get("/steer/slots", headers=_bearer(beta_secret)).status_code != 401
    assert {k.name: k.tenant for k in read_keys(path)} == {"ops": None, "app": None, "acme-admin": "acme",
                                                           "beta-app": "beta", "acme-app": "acme"}
    everyone = [(e["who"], e["action"], e["id"]) for e in client.get("/steer/audit", headers=_bearer(secret["ops"])).json()["entries"]]
    assert ("acme-admin", "key_revoked", "acme-2") in everyone
