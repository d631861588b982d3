"""Docker images for the tests that run Docker for real (tests/integration/test_compose.py and later ones).

No image registry is reachable where the tests run (see scripts/setup-docker.sh), so every base is built here from
``local/debian:bookworm`` (debootstrapped and imported by setup-docker.sh) plus ``apt-get install`` of what the
official image would hold, and the project's Dockerfiles are built with ``--build-arg BASE_IMAGE=`` pointing at it:

    base = apt_image("hotwire-test/python:bookworm", PYTHON_PACKAGES)        # stands in for python:3.11-slim
    image = build("deploy/Dockerfile.cpu", "hotwire-vllm:cpu-test", build_args={"BASE_IMAGE": base})

The host's extra CA certificates (HTTPS goes through a TLS-intercepting proxy here) are added to the bases this
module builds, with ``PIP_CERT`` set, so pip inside the builds reaches PyPI; the project's Dockerfiles never see
them. Builds go through ``/usr/bin/docker`` with BuildKit, so layers are cached between builds: a second build of
an unchanged Dockerfile and context takes seconds, and editing the project's code rebuilds only the layers after
its COPY. :func:`docker_problem` says why Docker cannot be used (None: it can).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKER = "/usr/bin/docker"  # Debian's client matches its daemon; /usr/local/bin/docker (first on PATH) lacks buildx
LOCAL_DEBIAN = os.environ.get("HOTWIRE_LOCAL_DEBIAN", "local/debian:bookworm")
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
# What python:3.11-slim holds that a Debian minbase lacks (bookworm's python3 is 3.11). python3-dev: the official
# image has Python's headers, and torch.compile (Inductor) on the CPU builds C++ that includes Python.h.
PYTHON_PACKAGES = ("python3", "python3-venv", "python3-pip", "python3-dev", "ca-certificates")
# "Docker must work": set by .ci/run. Without it a machine without a usable Docker skips the Docker tests.
REQUIRE_ENV = "HOTWIRE_REQUIRE_DOCKER"


def docker_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def docker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "DOCKER_BUILDKIT": "1", "COMPOSE_DOCKER_CLI_BUILD": "1"}
    # docker-compose (v1) runs `docker` from PATH for builds: make it Debian's.
    env["PATH"] = f"{Path(DOCKER).parent}:{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def run(args: Sequence[str], *, timeout: float, check: bool = True, env: Mapping[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a command (output captured); with ``check`` a non-zero exit raises with the output's tail."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=docker_env(env),
                            cwd=cwd or ROOT)
    if check and result.returncode != 0:
        tail = (result.stdout + result.stderr)[-6000:]
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}:\n{tail}")
    return result


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run([DOCKER, *args], timeout=timeout, check=check)


def docker_problem() -> str | None:
    """Why Docker cannot be used for the tests, or None."""
    if not Path(DOCKER).is_file():
        return f"{DOCKER} is not installed (bash scripts/setup-docker.sh installs it)"
    if shutil.which("docker-compose") is None:
        return "docker-compose is not installed (bash scripts/setup-docker.sh installs it)"
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker info: {exc}"
    if info.returncode != 0:
        return f"the Docker daemon does not answer (bash scripts/setup-docker.sh starts it): {info.stderr.strip()}"
    if not image_exists(LOCAL_DEBIAN):
        return f"no {LOCAL_DEBIAN} image (bash scripts/setup-docker.sh builds it)"
    return None


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, timeout=30, check=False).returncode == 0


@dataclass
class Built:
    tag: str
    seconds: float
    log: str  # BuildKit's plain progress output

    @property
    def cached_steps(self) -> int:
        return self.log.count(" CACHED")


def build(dockerfile: str | Path, tag: str, *, build_args: Mapping[str, str] | None = None, target: str | None = None,
          context: Path = ROOT, timeout: float = 3600) -> Built:
    """``docker build -f DOCKERFILE -t TAG CONTEXT`` with BuildKit (layers cached between builds)."""
    args = [DOCKER, "build", "--progress=plain", "-f", str(context / dockerfile), "-t", tag]
    for name, value in (build_args or {}).items():
        args += ["--build-arg", f"{name}={value}"]
    if target:
        args += ["--target", target]
    start = time.monotonic()
    result = run([*args, str(context)], timeout=timeout)
    return Built(tag, time.monotonic() - start, result.stdout + result.stderr)


def apt_image(tag: str, packages: Sequence[str], *, base: str = LOCAL_DEBIAN, extra: Sequence[str] = (),
              timeout: float = 900) -> Built:
    """A base image: ``base`` plus ``apt-get install packages`` plus the host's extra CA certificates (installed
    with update-ca-certificates, ``PIP_CERT`` set), then the Dockerfile lines ``extra``. Stands in for an official
    image that cannot be pulled here."""
    with tempfile.TemporaryDirectory(prefix="hotwire-docker-base.") as tmp:
        context = Path(tmp)
        certs = context / "ca-certificates"
        certs.mkdir()
        for cert in sorted(HOST_CA_DIR.rglob("*.crt")) if HOST_CA_DIR.is_dir() else []:
            shutil.copy(cert, certs / cert.name)
        lines = [
            f"FROM {base}",
            "RUN apt-get update \\",
            f" && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {' '.join(packages)} \\",
            " && rm -rf /var/lib/apt/lists/*",
            "COPY ca-certificates/ /usr/local/share/ca-certificates/",
            "RUN update-ca-certificates",
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt",
            *extra,
        ]
        (context / "Dockerfile").write_text("\n".join(lines) + "\n")
        return build("Dockerfile", tag, context=context, timeout=timeout)


def redis_base(tag: str = "hotwire-test/redis:bookworm") -> Built:
    """Debian's redis-server and redis-cli: what the fleet profiles use of the official redis image."""
    return apt_image(tag, ("redis-server", "ca-certificates"))


def nginx_base(tag: str = "hotwire-test/nginx:bookworm") -> Built:
    """Debian's nginx without its default site (the official nginx image has none on the fleet's port either)."""
    return apt_image(tag, ("nginx", "ca-certificates"), extra=("RUN rm -f /etc/nginx/sites-enabled/default",))


def python_base(tag: str = "hotwire-test/python:bookworm") -> Built:
    """Debian bookworm with Python 3.11, venv and pip: what deploy/Dockerfile.cpu's default python:3.11-slim holds."""
    return apt_image(tag, PYTHON_PACKAGES)
