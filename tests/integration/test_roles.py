"""Keys with roles (``HOTWIRE_KEYS_FILE``) against a real ``vllm serve`` (vLLM 0.25.1, tiny float32 model; CPU
backend in CI): every role on every ``/steer`` route (the keys' own routes too), steering with and without a steer key beside vLLM's own,
the client and the CLI, keys rotated and revoked while requests run, and a keys file broken and mended, all
without a restart; then the audit trail of what the tests changed.

One server for the module: a keys file with an ``admin``, two ``steer`` and a ``read`` key, ``HOTWIRE_API_KEY``
(one more admin key) and ``VLLM_API_KEY`` (vLLM's, which guards ``/v1``).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hotwire_api import cli
from hotwire_api.client import HotwireClient
from hotwire_api.json_file import LOOK_S
from hotwire_api.keys import Role, add_key, revoke_key, rotate_key
from server_fixture import VllmServer

pytestmark = pytest.mark.integration

ENV_ADMIN, VLLM_KEY = "env-admin-key", "vllm-key"
HIDDEN, LAYERS = 256, 4
RECEIPT = "x-hotwire-receipt"
STEERED = "base@1:L1x4"  # the receipt of completion()'s spec
SERVER_ARGS = [] if torch.cuda.is_available() else ["--enforce-eager"]


class Keys:
    """The keys file and the keys made in it (name -> key)."""

    def __init__(self, path: Path):
        self.path = path
        self.secret = {name: add_key(path, name, role) for name, role in
                       (("ops", Role.ADMIN), ("app", Role.STEER), ("app2", Role.STEER), ("viewer", Role.READ))}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys") / "keys.json")


@pytest.fixture(scope="module")
def server(tiny_model, keys, tmp_path_factory) -> Iterator[VllmServer]:
    env = {"HOTWIRE_KEYS_FILE": str(keys.path), "HOTWIRE_API_KEY": ENV_ADMIN, "VLLM_API_KEY": VLLM_KEY,
           "HOTWIRE_STORE": str(tmp_path_factory.mktemp("store"))}
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), env, SERVER_ARGS)
    srv.start()
    with HotwireClient(srv.url, keys.secret["ops"]) as admin:
        admin.register("base", vector(1))
    yield srv
    srv.stop()


def vector(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(HIDDEN) * 4).astype(np.float32)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def completion(model: str, steered: bool = True) -> dict:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}
    if steered:
        body["vllm_xargs"] = {"hotwire": json.dumps({"id": "base", "layer": 1, "scale": 4.0})}
    return body


def refused(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and RECEIPT not in response.headers, error
    return error["message"]


def test_every_role_on_every_route(server, keys) -> None:
    presented = {"none": None, "wrong": "hw_wrong", "vllm": VLLM_KEY, **keys.secret, "env": ENV_ADMIN}
    role_of = {"viewer": Role.READ, "app": Role.STEER, "app2": Role.STEER, "ops": Role.ADMIN, "env": Role.ADMIN}
    upload = {"id": "", "layers": {"1": vector(2).tolist()}}
    newkey = {"name": "", "role": "read"}
    routes = [  # (method, path, body, role, status when allowed)
        ("GET", "/steer/slots", None, Role.READ, 200),
        ("GET", "/steer/fleet", None, Role.READ, 200),
        ("GET", "/steer/vectors", None, Role.STEER, 200),
        ("GET", "/steer/usage", None, Role.STEER, 200),
        ("GET", "/steer/vectors/base", None, Role.STEER, 200),
        ("GET", "/steer/vectors/base/file", None, Role.STEER, 200),
        ("POST", "/steer/vectors", upload, Role.ADMIN, 201),
        ("DELETE", "/steer/vectors/{mine}", None, Role.ADMIN, 204),
        ("POST", "/steer/vectors/extract", {"id": "x", "positive": ["a"], "negative": ["b"]}, Role.ADMIN, 503),
        ("GET", "/steer/audit", None, Role.ADMIN, 200),
        ("GET", "/steer/keys", None, Role.ADMIN, 200),
        ("POST", "/steer/keys", newkey, Role.ADMIN, 201),
        ("DELETE", "/steer/keys/{mine}", None, Role.ADMIN, 204),
        ("GET", "/steer/monitors", None, Role.READ, 200),
        ("POST", "/steer/monitors", {"id": "m", "probe": "base", "layer": 1, "threshold": 1}, Role.ADMIN, 503),
    ]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for who, key in presented.items():
            for method, path, body, needed, allowed in routes:
                mine = f"by-{who}"
                if body is upload:
                    body = {**upload, "id": mine}
                if body is newkey:
                    body = {**newkey, "name": mine}
                response = http.request(method, path.format(mine=mine), json=body, headers=bearer(key))
                case = f"{who} {method} {path}"
                if who not in role_of:
                    assert "HOTWIRE_KEYS_FILE" in refused(response, 401, "unauthorized"), case
                elif not role_of[who].allows(needed):
                    message = refused(response, 403, "forbidden")
                    assert f"'{who}'" in message and needed.value in message, (case, message)
                else:
                    assert response.status_code == allowed, (case, response.text)
                    if allowed == 503:  # extraction and monitors need HOTWIRE_CAPTURE=1 and HOTWIRE_READOUT=1
                        assert response.json()["error"]["code"] in ("capture_off", "readout_off"), case


def test_steering_needs_a_steer_key_beside_vllms(server, keys, model) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        def post(path: str, body: dict, **headers: str) -> httpx.Response:
            return http.post(path, json=body, headers=headers)

        vllm = bearer(VLLM_KEY)
        for who in ("app", "ops"):
            ok = post("/v1/completions", completion(model), **vllm, **{"X-Hotwire-Key": keys.secret[who]})
            assert ok.status_code == 200 and ok.headers[RECEIPT] == STEERED, ok.text
        assert "X-Hotwire-Key" in refused(post("/v1/completions", completion(model), **vllm), 401, "unauthorized")
        refused(post("/v1/completions", completion(model), **vllm, **{"X-Hotwire-Key": "hw_wrong"}), 401,
                "unauthorized")
        refused(post("/v1/completions", completion(model), **vllm, **{"X-Hotwire-Key": keys.secret["viewer"]}), 403,
                "forbidden")
        # vLLM's key is still needed: a steer key as the bearer is refused (vLLM's middleware, on /v1; hotwire's
        # admission on /invocations, which vLLM leaves open)
        assert post("/v1/completions", completion(model), **bearer(keys.secret["app"])).status_code == 401
        refused(post("/invocations", completion(model), **bearer(keys.secret["app"])), 401, "unauthorized")
        ok = post("/invocations", completion(model), **vllm, **{"X-Hotwire-Key": keys.secret["app"]})
        assert ok.status_code == 200 and ok.headers[RECEIPT] == STEERED, ok.text
        plain = post("/v1/completions", completion(model, steered=False), **vllm)
        assert plain.status_code == 200 and RECEIPT not in plain.headers
        assert plain.json()["usage"]["completion_tokens"] == 3


def test_the_client_and_the_cli_send_the_steer_key_beside_vllms(server, keys, model, capsys) -> None:
    steer = {"id": "base", "layer": 1, "scale": 4.0}
    with HotwireClient(server.url, keys.secret["app"]) as client:
        out = client.complete("The quick brown fox", 3, steer=steer, model=model, api_key=VLLM_KEY, temperature=0)
        assert out.receipt == STEERED and out.completion_tokens == 3
    code = cli.main(["--url", server.url, "--api-key", keys.secret["app"], "complete", "The quick brown fox",
                     "--steer", "base:1:4", "--max-tokens", "3", "--model", model, "--vllm-key", VLLM_KEY])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["receipt"] == STEERED, err


def test_keys_change_under_load_without_a_restart(server, keys, model, tmp_path) -> None:
    """``app2`` steers throughout, from its own threads, while ``app`` is rotated and revoked and ``ops`` is
    revoked: every one of app2's requests is answered steered, and each change holds from the next request."""
    stop, failures, answered = threading.Event(), [], []

    def steer_as_app2() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json=completion(model),
                              headers={**bearer(VLLM_KEY), "X-Hotwire-Key": keys.secret["app2"]})
                (answered if r.status_code == 200 and r.headers.get(RECEIPT) == STEERED else failures).append(r)

    workers = [threading.Thread(target=steer_as_app2) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            def steer(key: str) -> httpx.Response:
                return http.post("/v1/completions", json=completion(model),
                                 headers={**bearer(VLLM_KEY), "X-Hotwire-Key": key})

            old = keys.secret["app"]
            assert steer(old).status_code == 200
            # each edit below is another process's (the CLI's): in force on the server within LOOK_S
            keys.secret["app"] = new = rotate_key(keys.path, "app")
            time.sleep(LOOK_S)
            refused(steer(old), 401, "unauthorized")
            assert steer(new).status_code == 200
            revoke_key(keys.path, "app")
            time.sleep(LOOK_S)
            refused(steer(new), 401, "unauthorized")
            keys.secret["app"] = add_key(keys.path, "app", Role.STEER)
            time.sleep(LOOK_S)
            assert steer(keys.secret["app"]).status_code == 200

            saved = tmp_path / "keys.json"
            shutil.copy2(keys.path, saved)
            keys.path.write_text('{"keys": [')  # broken by hand: file keys open nothing, the env admin key does
            time.sleep(LOOK_S)
            message = refused(http.get("/steer/slots", headers=bearer(keys.secret["ops"])), 503, "keys_unavailable")
            assert str(keys.path) in message and "HOTWIRE_API_KEY" in message
            refused(steer(keys.secret["app"]), 503, "keys_unavailable")
            assert http.get("/steer/slots", headers=bearer(ENV_ADMIN)).status_code == 200
            shutil.copy(saved, keys.path)  # mended
            time.sleep(LOOK_S)
            assert http.get("/steer/slots", headers=bearer(keys.secret["ops"])).status_code == 200
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    # app2's requests made while the file was broken are refused (503) like everyone's; the rest are steered
    assert all(r.status_code == 503 and r.json()["error"]["code"] == "keys_unavailable" for r in failures), \
        [r.text[:200] for r in failures if r.status_code != 503][:3]
    assert len(answered) >= 4, len(answered)


def test_the_audit_trail_says_who_changed_what(server, keys) -> None:
    """After the tests above: the registrations and deletions each admin key made, and the key changes of the
    rotation test, in the store folder's audit.jsonl, newest first."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        page = http.get("/steer/audit", params={"limit": 50}, headers=bearer(keys.secret["ops"])).json()
    assert page["kept"].startswith("file ") and page["kept"].endswith("audit.jsonl")
    assert Path(page["kept"].removeprefix("file ")).parent.parent == Path(server.extra_env["HOTWIRE_STORE"])
    changes = [(e["who"], e["action"], e["id"]) for e in reversed(page["entries"])]
    assert changes == [
        ("ops", "register", "base"),
        ("ops", "register", "by-ops"), ("ops", "delete", "by-ops"),
        ("ops", "key_added", "by-ops"), ("ops", "key_revoked", "by-ops"),  # over /steer/keys: by the caller
        ("HOTWIRE_API_KEY", "register", "by-env"), ("HOTWIRE_API_KEY", "delete", "by-env"),
        ("HOTWIRE_API_KEY", "key_added", "by-env"), ("HOTWIRE_API_KEY", "key_revoked", "by-env"),
        ("keys file", "key_rotated", "app"), ("keys file", "key_revoked", "app"), ("keys file", "key_added", "app"),
    ]
    registered = {e["id"]: e for e in page["entries"] if e["action"] == "register"}
    assert registered["by-ops"]["version"] == 1 and len(registered["by-ops"]["sha256"]) == 64
    assert registered["by-ops"]["via"] == "upload" and registered["by-ops"]["replica"] == "local"
    deleted = next(e for e in page["entries"] if e["action"] == "delete" and e["id"] == "by-ops")
    assert deleted["version"] == 1 and deleted["sha256"] == registered["by-ops"]["sha256"]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)
