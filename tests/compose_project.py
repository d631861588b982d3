"""A docker-compose project for tests: ``up``, wait for healthchecks, ``down`` (with or without volumes), logs.

    with ComposeProject("hotwire-test-cpu", ["cpu"], env={"HOTWIRE_CPU_IMAGE": tag, "HOTWIRE_PORT": "18000"}) as p:
        p.up()
        p.wait_healthy("hotwire-cpu", timeout=600)
        ...
    # leaving the block runs `down -v --remove-orphans`: containers, networks and named volumes are gone

Compose here is v1 (``docker-compose`` 1.29, Debian's package): no ``include``, ``develop`` or
``depends_on.required``. Each project gets its own name, so its containers, network and volumes
(``<name>_hotwire-store``) never collide with a user's. ``files`` are the compose files, docker-compose.yml first;
later ones override it (docker-compose's ``-f`` merge).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from docker_images import DOCKER, ROOT, docker, run

COMPOSE_FILE = ROOT / "docker-compose.yml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComposeProject:
    def __init__(self, name: str, profiles: Sequence[str], *, env: Mapping[str, str] | None = None,
                 files: Sequence[Path] = (COMPOSE_FILE,)):
        self.name = name
        self.profiles = list(profiles)
        self.env = dict(env or {})
        self.files = list(files)

    def command(self, *args: str) -> list[str]:
        words = ["docker-compose", "-p", self.name, "--project-directory", str(ROOT)]
        for path in self.files:
            words += ["-f", str(path)]
        for profile in self.profiles:
            words += ["--profile", profile]
        return [*words, *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True):
        return run(self.command(*args), timeout=timeout, check=check, env=self.env)

    def up(self, *services: str, build: bool = False, timeout: float = 600) -> None:
        self.compose("up", "-d", "--build" if build else "--no-build", *services, timeout=timeout)

    def down(self, *, volumes: bool, timeout: float = 300) -> None:
        self.compose("down", "--remove-orphans", *(["-v"] if volumes else []), timeout=timeout)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service, timeout=60).stdout.split()
        if len(ids) != 1:
            raise RuntimeError(f"{service}: {len(ids)} containers ({ids})")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(docker("inspect", self.container(service), timeout=60).stdout)[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return (state.get("Health") or {}).get("Status", "none") if state.get("Running") else state.get("Status", "?")

    def wait_healthy(self, service: str, timeout: float) -> float:
        """Seconds until the service's healthcheck passed; raises with the logs and the last checks if it fails,
        the container stops or is restarted (``restart: unless-stopped`` hides a crash), or ``timeout`` passes."""
        start = time.monotonic()
        status = "?"
        while time.monotonic() - start < timeout:
            status = self.health(service)
            if self.inspect(service).get("RestartCount", 0):
                status = "restarted (the server exited)"
                break
            if status == "healthy":
                return time.monotonic() - start
            if status not in ("starting", "none"):
                break
            time.sleep(3)
        health = self.inspect(service)["State"].get("Health") or {}
        checks = "\n".join(f"  exit {c.get('ExitCode')}: {c.get('Output', '').strip()}" for c in health.get("Log", []))
        raise AssertionError(
            f"{service} is {status!r} after {time.monotonic() - start:.0f} s (timeout {timeout:.0f} s)\n"
            f"healthchecks:\n{checks}\nlogs:\n{self.logs(service)}"
        )

    def logs(self, service: str, tail: int = 80) -> str:
        result = self.compose("logs", "--no-color", "--tail", str(tail), service, timeout=60, check=False)
        return result.stdout + result.stderr

    def volumes(self) -> list[str]:
        out = docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={self.name}", timeout=60)
        return out.stdout.split()

    def containers(self) -> list[str]:
        out = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}", timeout=60)
        return out.stdout.split()

    def __enter__(self) -> ComposeProject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down(volumes=True)


__all__ = ["COMPOSE_FILE", "ComposeProject", "DOCKER", "free_port"]
