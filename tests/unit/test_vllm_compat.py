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


def test_the_compile_cache_key_is_told_from_the_config_class() -> None:
    factors = type("Factors", (), {"compile_factors": lambda self: {}})  # 0.34+
    string = type("String", (), {"compute_hash": lambda self: ""})  # 0.25.1-0.33
    assert compat.config_hashes_factors(factors) is True
    assert compat.config_hashes_factors(string) is False
    with pytest.raises(AttributeError, match="compile caches"):
        compat.config_hashes_factors(type("Neither", (), {}))
    from vllm.config.vllm import VllmConfig

    assert compat.config_hashes_factors(VllmConfig) is (_installed_release() >= (0, 34))


def test_breakable_cuda_graphs_are_read_where_this_vllm_keeps_the_choice(monkeypatch) -> None:
    """0.34 auto-enables breakable CUDA graphs for some architectures in the config alone: the environment does not
    say so. Earlier releases write the choice into the environment."""
    from types import SimpleNamespace

    from vllm.compilation import breakable_cudagraph

    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    chosen = SimpleNamespace(compilation_config=SimpleNamespace(use_breakable_cudagraph=True))
    assert compat.breakable_cudagraphs_enabled(chosen) is (_installed_release() >= (0, 34))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    on = SimpleNamespace(compilation_config=SimpleNamespace(use_breakable_cudagraph=None))  # unresolved: the variable
    assert compat.breakable_cudagraphs_enabled(on) is True

    def reads_the_config(compilation_config=None):  # 0.34's signature
        return compilation_config.use_breakable_cudagraph

    def reads_the_environment():  # 0.25.1-0.33's, with the variable unset
        return False

    for function, expected in ((reads_the_config, True), (reads_the_environment, False)):
        monkeypatch.setattr(breakable_cudagraph, "is_breakable_cudagraph_enabled", function)
        assert compat.breakable_cudagraphs_enabled(chosen) is expected


def test_frontend_block_hashes_are_dropped_only_where_there_are_some() -> None:
    from types import SimpleNamespace

    sent = SimpleNamespace(block_hashes=[b"user-salted"])
    compat.drop_frontend_block_hashes(sent)
    assert sent.block_hashes is None
    older = SimpleNamespace()  # an EngineCoreRequest before 0.34 has no such field
    compat.drop_frontend_block_hashes(older)
    assert not hasattr(older, "block_hashes")


def test_the_installed_vllms_compile_cache_key_takes_hotwires_fingerprint() -> None:
    """The installed vLLM's own key method, on a real config, through hotwire's hook (applied to a copy of the
    method, so that vLLM's class stays untouched): the key changes, and stays stable for one build."""
    import json
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from hotwire_core.vllm_glue import config as glue_config

    name = "compile_factors" if compat.config_hashes_factors(VllmConfig) else "compute_hash"
    vllms = VllmConfig.__dict__[name]
    vllms = getattr(vllms, "__wrapped__", vllms)  # vLLM's own, should another test have installed hotwire
    copy = type("VllmConfig", (), {name: vllms})
    glue_config.patch_config(SimpleNamespace(VllmConfig=copy))
    config = VllmConfig()
    own, hooked = vllms(config), copy.__dict__[name](config)
    assert hooked != own and hooked == copy.__dict__[name](config)
    if name == "compile_factors":  # vLLM hashes the factors as JSON: they must stay serialisable
        assert hooked.items() >= own.items() and json.dumps(hooked, sort_keys=True)


def test_a_model_runner_whose_steps_hotwire_does_not_hook_is_named() -> None:
    """Steering is placed in hooked runner methods: a runner class that does not pass its steps through them
    (0.34's StandaloneCPUModelRunner, for CPUs without Triton, or a subclass overriding one) must make the model
    unsteerable, or steered requests would run unsteered."""
    from types import SimpleNamespace

    from hotwire_core.vllm_glue import runners

    class Runner:  # stands for V2's GPUModelRunner
        def execute_model(self, scheduler_output, *args, **kwargs):
            return None

        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            return None

    class Platforms(Runner):  # CPUModelRunner, XPUModelRunner: vLLM's steps, their own devices
        pass

    class Overrides(Runner):
        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            return None

    class Standalone:  # a runner of its own
        def execute_model(self, scheduler_output, *args, **kwargs):
            return None

    assert runners.unhooked_runner(Runner()) is not None  # not patched yet
    runners.patch_v2_runner(SimpleNamespace(GPUModelRunner=Runner))
    assert runners.unhooked_runner(Runner()) is None and runners.unhooked_runner(Platforms()) is None
    assert runners.unhooked_runner(Overrides()) == "vLLM's Overrides runs the model in steps hotwire does not hook"
    assert "Standalone" in runners.unhooked_runner(Standalone())
    try:
        from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner
    except ImportError:  # before 0.34
        return
    assert "StandaloneCPUModelRunner" in runners.unhooked_runner(object.__new__(StandaloneCPUModelRunner))


def test_the_model_runner_is_v2_where_vllm_has_no_other() -> None:
    from types import SimpleNamespace

    assert compat.uses_v2_model_runner(SimpleNamespace(use_v2_model_runner=False)) is False  # 0.25.1-0.33
    assert compat.uses_v2_model_runner(SimpleNamespace()) is True  # 0.34: V1 is gone
    from vllm.config import VllmConfig

    assert hasattr(VllmConfig, "use_v2_model_runner") is (_installed_release() < (0, 34))
