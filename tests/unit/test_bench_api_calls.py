"""bench_api_calls' probe counts a process's calls between two SIGUSR2, in a real Python process started the way
the benchmark starts its servers (the probe's folder leading PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.api_profile import where
from benchmarks.bench_api_calls import PROBE

_CHILD = """
import os, signal, time
def counted_function():
    return len("abc")
os.kill(os.getpid(), signal.SIGUSR2)
for _ in range(7):
    counted_function()
os.kill(os.getpid(), signal.SIGUSR2)
counted_function()  # after the second signal: not counted
"""


def test_the_probe_counts_calls_between_two_signals_only(tmp_path: Path) -> None:
    env = {**os.environ, "HOTWIRE_API_CALLS_OUT": str(tmp_path), "PYTHONPATH": str(PROBE)}
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    (written,) = tmp_path.glob("*.json")
    counts = {(path, name): n for path, name, n in json.loads(written.read_text())}
    assert counts[("<string>", "counted_function")] == 7
    assert counts[("<built-in>", "len")] == 7


def test_the_probe_does_nothing_unless_asked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HOTWIRE_API_CALLS_OUT"} | {"PYTHONPATH": str(PROBE)}
    child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL)"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "True", child.stderr


def test_functions_are_named_from_their_package_or_the_project() -> None:
    assert where("/x/.venv/lib/python3.11/site-packages/vllm/v1/engine/async_llm.py") == "vllm/v1/engine/async_llm.py"
    project = Path(__file__).resolve().parent.parent.parent
    assert where(str(project / "hotwire_api" / "answer.py")) == "hotwire_api/answer.py"
    assert where("<built-in>") == "<built-in>"
