"""The boundary around vLLM: ``lint-imports`` (import-linter) holds pyproject.toml's contracts (hotwire_core never
imports hotwire_api; only hotwire_core.vllm_glue imports vllm; in hotwire_core the engine logic never imports the
glue or the self-test), each contract is shown to break on a copy of the tree with an import it forbids, and an AST
check finds reads of vLLM objects' attributes outside the glue, which no import contract sees."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hotwire_core", "hotwire_api")
GLUE = ROOT / "hotwire_core" / "vllm_glue"

# import-linter's CLI, run by this interpreter (its ``lint-imports`` script is the same function).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the tree at ``root``: its pyproject.toml, its packages first on the path."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed: pip install -r requirements/test.txt (scripts/setup-cpu.sh does)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_import_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("hotwire_api/auth.py", "import vllm", "only hotwire_core.vllm_glue imports vllm"),
    ("hotwire_core/verify/checks.py", "from vllm.sampling_params import SamplingParams",
     "only hotwire_core.vllm_glue imports vllm"),
    ("hotwire_core/spec.py", "from hotwire_api import errors", "hotwire_core never imports hotwire_api"),
    ("hotwire_core/bindings.py", "from hotwire_core.vllm_glue import requests", "in hotwire_core, the self-test"),
])
def test_each_contract_breaks_on_an_import_it_forbids(tmp_path: Path, module: str, line: str, broken: str) -> None:
    """A copy of the tree with one forbidden import added (inside a function: every import counts) fails, naming
    the contract and the import."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _added():\n    {line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-6000:] + result.stderr[-3000:]
    assert "Contracts: 2 kept, 1 broken." in result.stdout
    broken_part = result.stdout.split("Broken contracts", 1)[1]
    assert broken in broken_part and module.removesuffix(".py").replace("/", ".") in broken_part


# Attributes only vLLM's objects have (hotwire's own objects use none of these names), with the vLLM classes that
# hold them: read outside the glue, they are vLLM knowledge an import contract does not see.
VLLM_ATTRIBUTES = {
    "sampling_params": "Request, EngineCoreRequest, NewRequestData",
    "block_hashes": "Request, EngineCoreRequest",
    "update_block_hashes": "Request",
    "cache_salt": "Request, EngineCoreRequest",
    "client_index": "Request, EngineCoreRequest",
    "prompt_token_ids": "Request, NewRequestData, RequestOutput",
    "prompt_embeds": "Request, NewRequestData",
    "resumable": "EngineCoreRequest",
    "req_id": "NewRequestData",
    "scheduled_new_reqs": "SchedulerOutput",
    "preempted_req_ids": "SchedulerOutput",
    "finished_req_ids": "SchedulerOutput",
    "num_scheduled_tokens": "SchedulerOutput",
    "num_computed_tokens": "Request",
    "input_batch": "GPUModelRunner (V1)",
    "query_start_loc": "GPUModelRunner (V1)",
    "model_runner": "Worker",
    "llm_engine": "LLM",
    "engine_core": "LLMEngine, AsyncLLM",
    "core_engines": "the engine-core clients",
    "vllm_config": "LLMEngine, Worker, EngineCore",
    "model_config": "LLMEngine, AsyncLLM, VllmConfig",
    "parallel_config": "VllmConfig",
    "cache_config": "VllmConfig",
    "compilation_config": "VllmConfig",
    "hf_config": "ModelConfig",
    "engine_client": "the API server's app.state",
    "prompt_logprobs": "RequestOutput",
}


def vllm_reads(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of every read of a :data:`VLLM_ATTRIBUTES` name in ``source``: ``x.name``, and
    ``getattr`` / ``hasattr`` / ``setattr`` with the name as a string constant."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in VLLM_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in VLLM_ATTRIBUTES):
            found.append((node.lineno, node.args[1].value))
    return found


def test_the_check_finds_reads_of_vllm_attributes() -> None:
    source = ("def f(request, app, out):\n"
              "    request.sampling_params.extra_args\n"
              "    client = getattr(app.state, 'engine_client', None)\n"
              "    return [r.req_id for r in out.scheduled_new_reqs]\n")
    assert sorted(vllm_reads(source)) == [(2, "sampling_params"), (3, "engine_client"), (4, "req_id"),
                                          (4, "scheduled_new_reqs")]
    assert vllm_reads("def f(self):\n    return self.requests.request_id(self.request), {'req_id': 1}\n") == []


def test_no_vllm_object_is_read_outside_the_glue() -> None:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GLUE in path.parents:
                continue
            name = path.relative_to(ROOT).as_posix()
            for line, attribute in vllm_reads(path.read_text()):
                found.setdefault((name, attribute), []).append(line)
    unexpected = {f"{name}:{lines} .{attribute} ({VLLM_ATTRIBUTES[attribute]})": None
                  for (name, attribute), lines in found.items()}
    assert list(unexpected) == [], "read these through hotwire_core.vllm_glue"


MAX_MODULE_LINES = 400  # one job per module: a module past this has taken on a second one


def test_no_module_of_the_packages_is_over_400_lines() -> None:
    long = {str(path.relative_to(ROOT)): n for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, "split these by job"
