"""vLLM's compile-cache key (``VllmConfig.compute_hash``, used by the Inductor and AOT caches) must differ with
and without hotwire, and with different hotwire settings, so a cached graph is never reused across them."""

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
print("HASH", config.compute_hash())
"""


def _hash(model, **env) -> str:
    full = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", _HASH, str(model)], env=full, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("HASH ")]
    assert lines, out.stderr[-3000:]
    return lines[0].split()[1]


def test_compile_hash_separates_hotwire_builds(tiny_model):
    without = _hash(tiny_model, VLLM_PLUGINS="")
    with_hotwire = _hash(tiny_model, VLLM_PLUGINS="hotwire")
    other_slots = _hash(tiny_model, VLLM_PLUGINS="hotwire", HOTWIRE_SLOTS="17")
    assert without != with_hotwire
    assert with_hotwire != other_slots
    assert _hash(tiny_model, VLLM_PLUGINS="hotwire") == with_hotwire, "the key must be stable for one build"
