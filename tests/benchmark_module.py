"""Import a script from ``benchmarks/`` (not a package) by name, for unit tests of its pure parts."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``load("bench_decode")`` -> the module ``benchmarks/bench_decode.py``. ``benchmarks/`` goes on ``sys.path``,
    as for a script run from there, so a script's imports of its siblings resolve."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
