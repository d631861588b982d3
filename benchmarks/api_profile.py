"""Where a saturated server's processes spend their CPU: py-spy samples a process's Python threads over a measured
window (``bench_throughput.py --profile``: the API server and the engine core), and the samples become milliseconds
of CPU per completed request, by package and by function, so that two configurations (plugin-free vLLM and
hotwire; plain and steered) compare package by package and function by function.

py-spy reads the process from outside (no code in the server, no slowdown of its own beyond the reads) and by
default counts only threads that are running, not waiting: a sample is CPU time. ``--function`` folds a function's
lines into one frame.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["Recording", "by_package", "compare", "package", "parse_raw", "per_function", "py_spy", "where"]

Stack = tuple[str, ...]  # outermost frame first, each "function (file)"


def py_spy() -> str:
    """The py-spy executable: beside this Python's, else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("profiling needs py-spy: pip install -r requirements/test.txt (or pip install py-spy)")
    return found


class Recording:
    """``py-spy record`` of process ``pid`` for ``seconds`` at ``rate`` samples per second into ``out``, started now
    (off ``core``, the API server's, where given); :meth:`stacks` waits for it and reads the samples."""

    def __init__(self, pid: int, seconds: float, out: Path, rate: int = 250, core: int | None = None):
        self.out, self.rate = out, rate
        command = [py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
                   "--format", "raw", "--function", "--nonblocking", "--output", str(out)]  # fmt: skip
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if core is not None:
            os.sched_setaffinity(self._proc.pid, [c for c in os.sched_getaffinity(0) if c != core] or [core])

    def stacks(self, timeout: float = 60.0) -> Counter[Stack]:
        output, _ = self._proc.communicate(timeout=timeout)
        if self._proc.returncode != 0 or not self.out.exists():
            raise RuntimeError(f"py-spy exited {self._proc.returncode}: {output.strip()[-500:]}")
        return parse_raw(self.out.read_text())


def parse_raw(text: str) -> Counter[Stack]:
    """py-spy's ``--format raw`` (one line per stack: frames joined by ``;``, outermost first, then a space and the
    count) as counts by stack."""
    stacks: Counter[Stack] = Counter()
    for line in text.splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks[tuple(_short(frame) for frame in frames.split(";"))] += int(count)
    return stacks


def _short(frame: str) -> str:
    """``function (path:line)`` as ``function (path as where() gives it)``: the line (the function's first) is
    left out, and the path is the same on every machine."""
    name, _, place = frame.partition(" (")
    return f"{name} ({where(place.rstrip(')').rsplit(':', 1)[0])})"


def where(path: str) -> str:
    """A function's file as a reader finds it: from its package on (site-packages), relative to this project, or
    as Python names it (the standard library's full path, ``<built-in>``, ``<frozen ...>``)."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    project = str(Path(__file__).resolve().parent.parent) + os.sep
    return path.removeprefix(project)


def package(frame: str) -> str | None:
    """The package of a frame's file (``vllm``, ``hotwire_api``, ``starlette``, ...); None for the standard library
    and the interpreter's own frames."""
    path = frame.rpartition(" (")[2].rstrip(")")
    first = path.split("/", 1)[0]
    if path.startswith(("/", "<")) or first.removesuffix(".py") in sys.stdlib_module_names:
        return None
    return first


def by_package(stacks: Mapping[Stack, int]) -> Counter[str]:
    """Samples by the package whose code ran: that of the innermost frame outside the standard library, which ran
    or called what ran (``json.dumps`` called by hotwire counts as hotwire's); "stdlib" when none is on the stack."""
    counts: Counter[str] = Counter()
    for stack, count in stacks.items():
        counts[next((p for p in map(package, reversed(stack)) if p is not None), "stdlib")] += count
    return counts


def per_function(stacks: Mapping[Stack, int]) -> tuple[Counter[str], Counter[str]]:
    """Samples by function: ``self`` (the function was the innermost frame) and ``inclusive`` (it was anywhere on
    the stack; a recursive function counts once per sample)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, count in stacks.items():
        own[stack[-1]] += count
        for function in set(stack):
            inclusive[function] += count
    return own, inclusive


def compare(runs: Mapping[str, Iterable[tuple[Counter[Stack], int, float | None]]], rate: int,
            pairs: Iterable[tuple[str, str]], top: int = 25) -> dict:
    """Per configuration (``runs``: its rounds' samples, completed requests and the sampled process's CPU seconds
    measured over the same window, None where unknown) the sampled CPU in ms per completed request, in all, by
    package (:func:`by_package`) and by function, and how much of the measured CPU the samples account for (py-spy
    samples Python threads only: threads without a Python frame, such as ZeroMQ's, are the rest); for each
    (configuration, baseline) pair the packages and functions whose ms per request differ most (``name``), self and
    inclusive. The inclusive list leaves out the frames under nearly every sample (the event loop, the server's
    entry point): they differ by the total."""
    figures: dict[str, dict] = {}
    for config, rounds in runs.items():
        rounds = list(rounds)
        total: Counter[Stack] = sum((stacks for stacks, _, _ in rounds), Counter())
        completed = sum(done for _, done, _ in rounds)
        cpu = [cpu_s for _, _, cpu_s in rounds]
        measured_s = None if None in cpu else sum(cpu)
        own, inclusive = per_function(total)
        scale = 1000.0 / rate / max(completed, 1)
        samples = sum(total.values())
        figures[config] = {"completed": completed, "samples": samples, "ms_per_request": samples * scale,
                           "sampled_of_measured": samples / rate / measured_s if measured_s else None,
                           "by_package": {p: n * scale for p, n in by_package(total).most_common()},
                           "self": {f: n * scale for f, n in own.items()},
                           "inclusive": {f: n * scale for f, n in inclusive.items()}}  # fmt: skip
    differences = {}
    for config, base in pairs:
        if config not in figures or base not in figures:
            continue
        entry = {"ms_per_request": figures[config]["ms_per_request"] - figures[base]["ms_per_request"]}
        for kind in ("by_package", "self", "inclusive"):
            ours, theirs = figures[config][kind], figures[base][kind]
            functions = set(ours) | set(theirs)
            if kind == "inclusive":
                functions = {f for f in functions if ours.get(f, 0.0) < 0.9 * figures[config]["ms_per_request"]
                             and theirs.get(f, 0.0) < 0.9 * figures[base]["ms_per_request"]}  # fmt: skip
            ranked = sorted(functions, key=lambda f: -abs(ours.get(f, 0.0) - theirs.get(f, 0.0)))
            entry[kind] = [{"name": f, config: ours.get(f, 0.0), base: theirs.get(f, 0.0),
                            "difference": ours.get(f, 0.0) - theirs.get(f, 0.0)} for f in ranked[:top]]  # fmt: skip
        differences[f"{config}-{base}"] = entry
    for config in figures:  # the full tables are for the JSON reader; keep the top of each
        for kind in ("self", "inclusive"):
            table = figures[config][kind]
            figures[config][kind] = dict(sorted(table.items(), key=lambda item: -item[1])[: top * 4])
    return {"rate_hz": rate, "configs": figures, "differences": differences}
