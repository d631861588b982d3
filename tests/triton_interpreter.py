"""Run a test module's check in Triton's interpreter (``TRITON_INTERPRET=1``), in a fresh interpreter: Triton reads
the variable when it is imported, so the test process itself keeps compiled kernels (CPU-only machines run the
Triton kernels this way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def check_in_interpreter(test_file: str, call: str) -> None:
    """Import the module of ``test_file`` (a test's ``__file__``) in Triton's interpreter and run ``call`` on it,
    e.g. ``'check_ops("cpu", triton=True)'``; fail with its output when it fails."""
    pytest.importorskip("triton")
    module = Path(test_file)
    paths = [str(module.parent), str(Path(__file__).parent)]  # the test's folder, and this one (tests/)
    script = (f"import os, sys\nos.environ['TRITON_INTERPRET'] = '1'\nsys.path[:0] = {paths!r}\n"
              f"import {module.stem}\n{module.stem}.{call}\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
