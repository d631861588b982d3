"""benchmarks/api_profile.py: py-spy's samples of a real process, and how samples become CPU per request by
function and a comparison of two configurations."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.api_profile import Recording, by_package, compare, package, parse_raw, per_function, where

_BUSY = """
import time
def spin_here():
    end = time.monotonic() + 8
    while time.monotonic() < end:
        sum(range(1000))
def wait_here():
    time.sleep(8)
import threading
threading.Thread(target=wait_here).start()
spin_here()
"""


def test_a_recording_samples_the_running_function_and_not_a_waiting_thread(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _BUSY])
    try:
        time.sleep(1.0)
        stacks = Recording(child.pid, 2, tmp_path / "samples.txt", rate=100).stacks()
    finally:
        child.kill()
        child.wait()
    own, inclusive = per_function(stacks)
    spinning = sum(n for f, n in inclusive.items() if f.startswith("spin_here "))
    assert spinning >= 0.8 * sum(stacks.values()) and sum(stacks.values()) >= 100, stacks
    assert not any(f.startswith("wait_here ") for f in inclusive), inclusive  # asleep: no CPU, no sample


def test_raw_lines_become_stacks_with_the_line_numbers_left_out() -> None:
    root = Path(__file__).resolve().parent.parent.parent
    text = (f"main (/x/site-packages/vllm/a.py:10);handle ({root}/hotwire_api/answer.py:20) 7\n"
            f"main (/x/site-packages/vllm/a.py:10);handle ({root}/hotwire_api/answer.py:20) 2\n"
            "main (/x/site-packages/vllm/a.py:10) 1\n"
            "\n")  # fmt: skip
    assert parse_raw(text) == Counter({("main (vllm/a.py)", "handle (hotwire_api/answer.py)"): 9,
                                       ("main (vllm/a.py)",): 1})  # fmt: skip
    assert where("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"


def test_self_and_inclusive_samples_count_a_recursive_function_once_per_sample() -> None:
    stacks = Counter({("a", "b", "a"): 3, ("a", "c"): 2})
    own, inclusive = per_function(stacks)
    assert own == Counter({"a": 3, "c": 2})
    assert inclusive == Counter({"a": 5, "b": 3, "c": 2})


def test_samples_become_ms_per_request_and_the_pair_lists_what_differs_most() -> None:
    rate = 100  # a sample is 10 ms
    base = [(Counter({("loop", "vllm_work"): 100}), 50, 2.0)]  # 1000 ms over 50 requests: 20 ms each
    ours = [(Counter({("loop", "vllm_work"): 50}), 25, 0.5),
            (Counter({("loop", "vllm_work"): 50, ("loop", "hotwire"): 25}), 25, None)]  # fmt: skip
    report = compare({"plain": ours, "vanilla": base}, rate, [("plain", "vanilla"), ("steered", "plain")])
    assert report["configs"]["vanilla"]["ms_per_request"] == 20.0
    assert report["configs"]["vanilla"]["sampled_of_measured"] == 0.5  # 1 s sampled of 2 s measured
    assert report["configs"]["plain"]["ms_per_request"] == 25.0
    assert report["configs"]["plain"]["sampled_of_measured"] is None  # a round without a measurement
    difference = report["differences"]["plain-vanilla"]
    assert difference["ms_per_request"] == 5.0
    assert difference["self"][0] == {"name": "hotwire", "plain": 5.0, "vanilla": 0.0, "difference": 5.0}
    # "loop" is under every sample, "vllm_work" under every plugin-free one: left out of the inclusive list
    assert {row["name"]: row["difference"] for row in difference["inclusive"]} == {"hotwire": 5.0}
    assert difference["by_package"][0] == {"name": "hotwire", "plain": 5.0, "vanilla": 0.0, "difference": 5.0}
    assert "steered-plain" not in report["differences"]  # no steered rounds: no comparison


def test_a_sample_belongs_to_the_package_whose_code_ran_or_called_the_standard_library() -> None:
    assert package("ServeSubcommand.cmd (vllm/entrypoints/cli/serve.py)") == "vllm"
    assert package("_decide (hotwire_api/admission.py)") == "hotwire_api"
    assert package("dumps (json/__init__.py)") is None and package("Runner.run (asyncio/runners.py)") is None
    assert package("_run_code (<frozen runpy>)") is None and package("f (/usr/lib/python3.12/x.py)") is None
    loop, admission, dumps = "run (uvloop/__init__.py)", "_decide (hotwire_api/admission.py)", "dumps (json/__init__.py)"
    stacks = Counter({(loop, admission, dumps): 3, (loop, admission): 1, (loop,): 2, ("Runner.run (asyncio/runners.py)",): 4})
    assert by_package(stacks) == Counter({"hotwire_api": 4, "uvloop": 2, "stdlib": 4})
