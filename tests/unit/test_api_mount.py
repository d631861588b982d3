"""hotwire_api.mount: install() hooks vLLM's router registration only in the API server, once; and
hotwire_core.vllm_glue.api_server, the vLLM facts it and the data-parallel RPCs rely on.

The fast tests stand a fake ``vllm.entrypoints.serve`` in for the real one; ``test_real_build_app`` builds
vLLM 0.25.1's actual app (no engine needed) and is marked ``integration`` because importing vLLM is slow."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import types

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import vllm_app
from hotwire_api import mount
from hotwire_core.vllm_glue import api_server as glue_api
from hotwire_api.admission import AdmissionMiddleware
from hotwire_api.errors import HotwireError
from hotwire_api.tickets import TICKETS
from hotwire_core import contract, vllm_glue

SERVE = "vllm.entrypoints.serve"
API_SERVER = "vllm.entrypoints.openai.api_server"


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(SERVE)
    module.calls = []  # type: ignore[attr-defined]

    def register_vllm_serve_api_routers(app: FastAPI) -> None:
        module.calls.append(app)  # type: ignore[attr-defined]

    module.register_vllm_serve_api_routers = register_vllm_serve_api_routers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, SERVE, module)
    monkeypatch.delitem(sys.modules, API_SERVER, raising=False)
    return module


def _as_process(monkeypatch: pytest.MonkeyPatch, name: str, api_server_loaded: bool = False) -> None:
    monkeypatch.setattr(multiprocessing.current_process(), "name", name)
    if api_server_loaded:
        monkeypatch.setitem(sys.modules, API_SERVER, types.ModuleType(API_SERVER))


@pytest.mark.parametrize("name", ["EngineCore", "EngineCore_DP1", "VllmWorker-0", "MainProcess"])
def test_outside_the_api_server_install_does_nothing(
    fake_serve: types.ModuleType, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    _as_process(monkeypatch, name)  # MainProcess without vLLM's API server loaded: e.g. an offline LLM script
    original = fake_serve.register_vllm_serve_api_routers
    assert mount.install() is False
    assert fake_serve.register_vllm_serve_api_routers is original


@pytest.mark.parametrize("name,api_server_loaded", [("MainProcess", True), ("ApiServer_1", False)])
def test_api_server_gets_hotwire_once(
    fake_serve: types.ModuleType, monkeypatch: pytest.MonkeyPatch, name: str, api_server_loaded: bool
) -> None:
    _as_process(monkeypatch, name, api_server_loaded)
    guards = []
    monkeypatch.setattr(mount, "guard_engine_requests", guards.append)  # the real one wraps vLLM's AsyncLLM
    original = fake_serve.register_vllm_serve_api_routers
    assert mount.install() is True
    hooked = fake_serve.register_vllm_serve_api_routers
    assert hooked is not original and hooked.__wrapped__ is original
    assert mount.install() is True and fake_serve.register_vllm_serve_api_routers is hooked  # idempotent

    app = FastAPI()
    hooked(app)
    assert fake_serve.calls == [app]  # vLLM's own routers still registered
    assert {"/steer/vectors", "/steer/slots"} <= {route.path for route in app.routes}
    assert [m.cls for m in app.user_middleware] == [AdmissionMiddleware]
    assert guards == [TICKETS.check]  # every request the engine client adds passes admission's tickets


def test_the_guard_refuses_steering_admission_did_not_decide_before_vllm_sees_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's real AsyncLLM.add_request, wrapped: a spec without a live ticket for exactly that spec never gets past
    the guard; a plain request, and one with its ticket, reach vLLM's own code (here: its dead-engine check)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setattr(AsyncLLM, "add_request", AsyncLLM.__dict__["add_request"])  # unwrapped after the test
    monkeypatch.setattr(glue_api, "_GUARD", [])
    glue_api.guard_engine_requests(TICKETS.check)
    dead = types.SimpleNamespace(errored=True)
    spec = json.dumps({"id": "happy", "layer": 1, "scale": 4.0})

    def add(extra_args: dict | None) -> None:
        asyncio.run(AsyncLLM.add_request(dead, "r", "hi", SamplingParams(extra_args=extra_args)))

    for extra in ({"hotwire": spec}, {"hotwire": spec, "hotwire_ticket": "forged"}, {"hotwire_ticket": "x"}):
        with pytest.raises(HotwireError) as info:
            add(extra)
        assert (info.value.status, info.value.code) == (400, "not_admitted")
    ticket = TICKETS.issue(spec)
    with pytest.raises(HotwireError):
        add({"hotwire": spec.replace("4.0", "8.0"), "hotwire_ticket": ticket})  # not what was decided
    for extra in (None, {"other": 1}, {"hotwire": spec, "hotwire_ticket": ticket}):
        with pytest.raises(EngineDeadError):
            add(extra)
    assert TICKETS.get(ticket).presented
    TICKETS.close(ticket)
    with pytest.raises(HotwireError):
        add({"hotwire": spec, "hotwire_ticket": ticket})  # the request is over
    readout = json.dumps({"probes": [{"id": "happy", "layer": 1, "version": 1}], "tokens": "all", "tag": "t"})
    with pytest.raises(HotwireError) as info:
        add({"hotwire_readout": readout})  # a readout needs its ticket too
    assert info.value.code == "not_admitted"
    ticket = TICKETS.issue(None, readout)
    with pytest.raises(HotwireError):
        add({"hotwire_readout": readout.replace('"all"', '"prompt"'), "hotwire_ticket": ticket})
    with pytest.raises(HotwireError):
        add({"hotwire": spec, "hotwire_readout": readout, "hotwire_ticket": ticket})  # steering it was not given
    with pytest.raises(EngineDeadError):
        add({"hotwire_readout": readout, "hotwire_ticket": ticket})
    TICKETS.close(ticket)


def test_python_m_api_server_counts_as_api_server(
    fake_serve: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_process(monkeypatch, "MainProcess")
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=API_SERVER)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert glue_api.is_api_server_process()


@pytest.mark.integration
def test_real_build_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's build_app serves /steer behind --api-key, with admission inside vLLM's middleware."""
    monkeypatch.delenv("HOTWIRE_API_KEY", raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "MainProcess")
    import vllm.entrypoints.serve as serve

    monkeypatch.setattr(serve, "register_vllm_serve_api_routers", serve.register_vllm_serve_api_routers)
    vllm_app.app_module()
    assert mount.install() is True
    app = vllm_app.build_app(["--model", "m", "--api-key", "k"])
    classes = [m.cls for m in app.user_middleware]
    assert classes.index(vllm_app.authentication_middleware()) < classes.index(AdmissionMiddleware)  # auth runs first
    assert classes[-1] is AdmissionMiddleware  # innermost: vLLM's HTTP metrics see admission refusals

    client = TestClient(app)
    assert "/steer/slots" in client.get("/openapi.json").json()["paths"]
    response = client.get("/steer/slots")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    response = client.get("/steer/slots", headers={"Authorization": "Bearer k"})
    assert response.status_code == 503  # authorised; no engine in this test


def test_on_a_vllm_hotwire_does_not_support_every_answer_is_503_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control plane still attaches to vLLM's app, and answers its routes and steered requests 503
    ``hotwire_inactive`` naming the installed vLLM; plain requests pass to vLLM untouched."""
    import vllm

    monkeypatch.delenv("HOTWIRE_API_KEY", raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "MainProcess")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    import vllm.entrypoints.serve as serve

    monkeypatch.setattr(serve, "register_vllm_serve_api_routers", serve.register_vllm_serve_api_routers)
    vllm_app.app_module()
    assert mount.install() is True
    app = vllm_app.build_app(["--model", "m"])
    steer = {"hotwire": json.dumps({"id": "happy", "layer": 1, "scale": 4.0})}
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: vLLM's needs an engine
    for response in (
        client.get("/steer/slots"),
        client.post("/v1/completions", json={"model": "m", "prompt": "hi", "vllm_xargs": steer}),
    ):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "hotwire_inactive"
        assert "vLLM 0.99.0 is installed" in error["message"] and "supports vLLM 0.25.1" in error["message"]
    plain = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert "hotwire" not in plain.text  # vLLM's own answer (no engine in this test)


def test_the_engine_side_hooks_nothing_on_a_vllm_it_does_not_support_and_says_so_once() -> None:
    """In a fresh interpreter whose vLLM reports another version: the plugin patches nothing of vLLM, and warns
    once, in the first process of the server (its children log it at debug level)."""
    code = """
import logging, sys
import vllm
vllm.__version__ = "0.99.0"
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(message)s")
import hotwire_core
hotwire_core.register()
from hotwire_core import vllm_glue
print("hooks", sum(type(f).__name__ == "PatchOnImport" for f in sys.meta_path))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("WARNING hotwire is inactive")]
    assert len(warnings) == 1 and "vLLM 0.99.0 is installed; hotwire" in warnings[0], out.stdout
    assert "hooks 0" in lines, out.stdout


def test_a_vllm_without_the_app_hook_starts_and_is_told_steering_is_off(monkeypatch, caplog) -> None:
    """An unsupported vLLM whose app builder lacks the hook: nothing attaches, and a warning says what follows."""
    import vllm
    import vllm.entrypoints.serve as serve

    monkeypatch.setattr(multiprocessing.current_process(), "name", "MainProcess")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delattr(serve, "register_vllm_serve_api_routers")
    with caplog.at_level("WARNING", logger="hotwire_api.mount"):
        assert mount.install() is False
    assert "steered requests are served as plain ones, without a receipt" in caplog.text
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    with pytest.raises(AttributeError):  # on a supported vLLM a missing hook is hotwire's bug: it says so loudly
        mount.install()


@pytest.mark.parametrize("version", ["0.25.1", "0.25.1+cpu", "0.26.0", "0.28.1", "0.32.0+cpu", "0.33.0", "0.33.1",
                                     "0.34.0"])
def test_every_release_from_the_reference_to_the_newest_is_supported(version: str) -> None:
    assert vllm_glue.unsupported_version(version) is None


@pytest.mark.parametrize("version", ["0.25.0", "0.24.2", "0.34.1", "0.35.0", "1.0.0", "0.35.0rc1", "0.34.0.dev3",
                                     "0.26.0rc1", "unknown"])
def test_a_release_outside_the_range_or_unreleased_is_not(version: str) -> None:
    reason = vllm_glue.unsupported_version(version)
    assert reason is not None and reason.startswith(f"vLLM {version} is installed; hotwire ") and reason.endswith(
        "supports vLLM 0.25.1 to 0.34.0")


def test_per_engine_rpc_asks_every_data_parallel_engine_core() -> None:
    """vLLM's DP client returns only the first engine core's answer; per_engine_rpc gathers all of them through
    the same utility call vLLM uses, one per engine core."""
    sent = []

    async def call_utility(method, *args, engine):
        sent.append((method, args, engine))
        return [f"answer of {engine}"]

    dp_core = types.SimpleNamespace(core_engines=["e0", "e1"], _call_utility_async=call_utility)
    rpc = glue_api.per_engine_rpc(types.SimpleNamespace(engine_core=dp_core))
    assert rpc is not None
    assert asyncio.run(rpc(contract.STATS, ("a",))) == [["answer of e0"], ["answer of e1"]]
    assert sent == [("collective_rpc", (contract.STATS, None, ("a",), None), e) for e in ("e0", "e1")]
    sent.clear()
    assert asyncio.run(rpc(contract.CHECK, ("s",), slice(1))) == [["answer of e0"]] and [e for *_, e in sent] == ["e0"]
    sent.clear()
    assert asyncio.run(rpc(contract.REGISTER, ("r",), slice(1, None))) == [["answer of e1"]]
    assert [e for *_, e in sent] == ["e1"]
    async def e1_fails(method, *args, engine):
        if engine == "e1":
            raise ConnectionError("e1 died")
        return [f"answer of {engine}"]

    rpc = glue_api.per_engine_rpc(types.SimpleNamespace(engine_core=types.SimpleNamespace(
        core_engines=["e0", "e1"], _call_utility_async=e1_fails)))
    first, second = asyncio.run(rpc(contract.REFUSALS, ((),), slice(None), True))  # failures stand in for answers
    assert first == ["answer of e0"] and isinstance(second, ConnectionError)
    with pytest.raises(ConnectionError):
        asyncio.run(rpc(contract.REFUSALS, ((),)))
    one_core = types.SimpleNamespace(core_engines=["e0"], _call_utility_async=call_utility)
    assert glue_api.per_engine_rpc(types.SimpleNamespace(engine_core=one_core)) is None
    assert glue_api.per_engine_rpc(object()) is None


def test_per_engine_rpc_matches_vllms_utility_call() -> None:
    """The private vLLM method per_engine_rpc relies on, and how vLLM's own collective_rpc calls it."""
    import inspect

    from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient

    params = inspect.signature(AsyncMPClient._call_utility_async).parameters
    assert list(params)[:3] == ["self", "method", "args"] and params["engine"].kind is inspect.Parameter.KEYWORD_ONLY
    source = inspect.getsource(AsyncMPClient.collective_rpc_async)
    assert 'call_utility_async(\n            "collective_rpc", method, timeout, args, kwargs' in source
    # vLLM's DP client fans a utility call out over ``core_engines`` (0.32+: through call_utility_all_async) and
    # returns the first answer: the reason per_engine_rpc exists.
    fan_out = inspect.getsource(DPLBAsyncMPClient.call_utility_async)
    if "call_utility_all_async" in fan_out:
        fan_out = inspect.getsource(DPLBAsyncMPClient.call_utility_all_async)
    assert "core_engines" in fan_out and "[0]" in inspect.getsource(DPLBAsyncMPClient.call_utility_async)


@pytest.mark.parametrize("name,api_server_loaded,mounted", [("MainProcess", True, True), ("EngineCore", False, False)])
def test_register_turns_the_store_on_only_in_the_api_server(
    fake_serve: types.ModuleType, monkeypatch: pytest.MonkeyPatch, name: str, api_server_loaded: bool, mounted: bool
) -> None:
    """The ``hotwire_api`` entry point: the API server mounts hotwire and gives the engine processes it spawns a
    store by default; elsewhere (an engine process, an offline script) it changes nothing."""
    _as_process(monkeypatch, name, api_server_loaded)
    monkeypatch.delenv("HOTWIRE_STORE", raising=False)
    original = fake_serve.register_vllm_serve_api_routers
    mount.register()
    assert (fake_serve.register_vllm_serve_api_routers is not original) is mounted
    assert ("HOTWIRE_STORE" in os.environ) is mounted


def test_with_a_fleet_registry_the_engine_keeps_no_store_and_preloads_nothing(
    fake_serve: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``HOTWIRE_REGISTRY``: Redis is the store, and every version an engine holds must be the registry's
    (docs/fleet.md), so the engine processes are started without a store of their own or preloaded files."""
    _as_process(monkeypatch, "MainProcess", True)
    monkeypatch.setenv("HOTWIRE_REGISTRY", "redis://:pw@127.0.0.1:6379/0")
    monkeypatch.setenv("HOTWIRE_STORE", "/somewhere")
    monkeypatch.setenv("HOTWIRE_VECTORS", "/vectors")
    with caplog.at_level("WARNING"):
        mount.register()
    assert os.environ["HOTWIRE_STORE"] == "off" and "HOTWIRE_VECTORS" not in os.environ
    assert "HOTWIRE_STORE is ignored" in caplog.text and "HOTWIRE_VECTORS is ignored" in caplog.text
