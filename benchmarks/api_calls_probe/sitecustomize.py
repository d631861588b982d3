"""Loaded by every Python process of a server that ``bench_api_calls.py`` starts (this folder leads its
PYTHONPATH): SIGUSR2 starts counting the calls the receiving process's main thread makes (``sys.setprofile``:
Python functions by file and name, built-ins by name), the next SIGUSR2 stops and writes them as JSON to
``$HOTWIRE_API_CALLS_OUT/<pid>.json``. Calls are counted, not timed: the count does not move with the machine's load."""

import collections
import json
import os
import signal
import sys

_OUT = os.environ.get("HOTWIRE_API_CALLS_OUT")
_counts: collections.Counter | None = None


def _count(frame, event, arg):
    if event == "call":
        _counts[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
    elif event == "c_call":
        _counts[("<built-in>", getattr(arg, "__qualname__", repr(arg)))] += 1


def _toggle(signum, frame):
    global _counts
    if _counts is None:
        _counts = collections.Counter()
        sys.setprofile(_count)
        return
    sys.setprofile(None)
    counts, _counts = _counts, None
    with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
        json.dump([[path, name, n] for (path, name), n in counts.items()], f)


if _OUT:
    signal.signal(signal.SIGUSR2, _toggle)
