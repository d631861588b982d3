"""vLLM's compile-cache key (the factors ``VllmConfig.compile_factors`` gives, 0.34+, or ``VllmConfig.compute_hash``,
used by the Inductor and AOT caches) must differ with and without hotwire, and with different hotwire settings, so a
cached graph is never reused across them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

_HASH = """
import sys
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
config = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256).create_engine_config()
if hasattr(config, "compile_factors"):  # 0.34+: the caches hash these factors
    from vllm.config.utils import hash_factors
    print("HASH", hash_factors(config.compile_factors()))
else:
    print("HASH", config.compute_hash())
"""


def _hashes(model, *envs: dict[str, str]) -> list[str]:
    """The compile-cache key in a fresh interpreter per environment (all at once: each is mostly vLLM's import)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _HASH, str(model)], env={**os.environ, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]  # fmt: skip
    hashes = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            lines = [line for line in out.splitlines() if line.startswith("HASH ")]
            assert lines, err[-3000:]
            hashes.append(lines[0].split()[1])
    finally:
        for proc in procs:  # after a failure, the ones not read yet
            proc.kill()
            proc.wait()
    return hashes


def test_compile_hash_separates_hotwire_builds(tiny_model):
    without, with_hotwire, other_slots, again = _hashes(
        tiny_model,
        {"VLLM_PLUGINS": ""},
        {"VLLM_PLUGINS": "hotwire"},
        {"VLLM_PLUGINS": "hotwire", "HOTWIRE_SLOTS": "17"},
        {"VLLM_PLUGINS": "hotwire"},
    )
    assert without != with_hotwire
    assert with_hotwire != other_slots
    assert again == with_hotwire, "the key must be stable for one build"
