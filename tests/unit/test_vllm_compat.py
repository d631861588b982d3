"""hotwire_core.vllm_glue.compat: each difference between the supported vLLM releases, told from what vLLM has.
Synthetic classes stand for the releases not installed; the installed vLLM's own classes must be told right too."""

from __future__ import annotations

import sys
import types

import pytest

from hotwire_core.vllm_glue import api_server, compat


def _installed_release() -> tuple[int, ...]:
    import vllm

    return tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:3])


class Request:
    pass


class Pairs:  # 0.25.1
    def finish_requests(self, request_ids, finished_status) -> list[tuple[str, int]]:
        return []


class Requests:  # 0.26+
    def finish_requests(self, request_ids, finished_status) -> list[Request]:
        return []


class PostponedPairs:
    def finish_requests(self, request_ids, finished_status) -> "list[tuple[str, int]]":
        return []


def test_finish_requests_result_is_told_from_its_annotation() -> None:
    assert compat.finish_requests_returns_requests(Pairs) is False
    assert compat.finish_requests_returns_requests(PostponedPairs) is False
    assert compat.finish_requests_returns_requests(Requests) is True


def test_the_installed_schedulers_finish_requests_is_told_right() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    assert compat.finish_requests_returns_requests(Scheduler) is (_installed_release() >= (0, 26))


def test_the_blocked_request_hook_is_the_one_the_scheduler_has() -> None:
    old = type("Old", (), {"_try_promote_blocked_waiting_request": lambda self, r: True})
    new = type("New", (), {"_handle_blocked_waiting_request": lambda self, r: True})
    assert compat.promotes_blocked_requests_only(old) is True
    assert compat.promotes_blocked_requests_only(new) is False
    with pytest.raises(AttributeError, match="cannot hold a preempted request"):
        compat.promotes_blocked_requests_only(type("Neither", (), {}))
    from vllm.v1.core.sched.scheduler import Scheduler

    assert compat.promotes_blocked_requests_only(Scheduler) is (_installed_release() < (0, 31))


@pytest.mark.parametrize("module", compat.API_SERVER_MODULES)
def test_any_of_vllms_api_server_modules_marks_the_main_process(monkeypatch, module: str) -> None:
    for name in compat.API_SERVER_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert api_server.is_api_server_process() is False
    monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    assert api_server.is_api_server_process() is True


def test_the_installed_vllm_serve_loads_one_of_them() -> None:
    """``vllm serve`` imports its subcommand module before loading plugins; one of them must be what marks the API server
    (0.29 moved the app to ``vllm.entrypoints.launchers``, and nothing imports the old module there)."""
    import subprocess

    code = ("import sys, vllm.entrypoints.cli.serve; from hotwire_core.vllm_glue import compat; "
            "print([m for m in compat.API_SERVER_MODULES if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() not in ("", "[]"), out.stdout
