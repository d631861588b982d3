"""The soak's flood windows (``benchmarks/soak/windows.py``): which window a time is in, how long each kind lasted,
the split of judged requests, and the comparison across tenants (no server)."""

import sys

import pytest
from benchmark_module import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))  # imported by name: its dataclasses need the module in sys.modules
from soak.responses import Observation  # noqa: E402
from soak.steering import Spec  # noqa: E402
from soak.windows import Windows, compare, split  # noqa: E402


def test_windows_alternate_from_a_quiet_one() -> None:
    w = Windows(began=10.0, seconds=5.0)
    assert [w.flooding(t) for t in (10.0, 14.99, 15.0, 19.99, 20.0, 25.0)] == [False, False, True, True, False, True]
    assert w.next_flood(10.0) == 15.0 and w.next_flood(17.0) == 15.0 and w.next_flood(21.0) == 25.0
    assert w.seconds_of(12.0) == {"quiet": 7.0, "flood": 5.0}  # quiet 0-5, flood 5-10, quiet 10-12
    assert w.seconds_of(17.5) == {"quiet": 10.0, "flood": 7.5}
    assert w.seconds_of(20.0) == {"quiet": 10.0, "flood": 10.0}


def obs(start: float, seconds: float, steered: bool) -> Observation:
    spec = Spec("single", (object(),)) if steered else Spec("plain")  # only .steered is read
    return Observation(0, "completions", False, spec, 0, start, start + seconds)


def test_requests_are_split_by_the_window_they_started_in_and_compared() -> None:
    w = Windows(began=0.0, seconds=10.0)
    ok = {"plain": [obs(1, 0.1, False), obs(9.9, 0.1, False), obs(11, 0.3, False), obs(25, 0.1, False)],
          "steered": [obs(2, 0.2, True), obs(12, 0.4, True)]}
    parts = split(ok, w, 30.0)
    assert parts["quiet"]["seconds"] == 20.0 and parts["flood"]["seconds"] == 10.0
    assert parts["quiet"]["total_ms"]["plain"]["n"] == 3 and parts["flood"]["total_ms"]["plain"]["n"] == 1
    assert parts["quiet"]["ok_rps"] == pytest.approx(4 / 20) and parts["flood"]["ok_rps"] == pytest.approx(2 / 10)
    assert parts["flood"]["total_ms"]["steered"]["p99"] == pytest.approx(400)
    other = {"quiet": {"ok_rps": 1.0, "total_ms": {"plain": {"p50": 100.0, "p99": 200.0},
                                                   "steered": {"p50": None, "p99": None}}},
             "flood": {"ok_rps": 0.5, "total_ms": {"plain": {"p50": 110.0, "p99": 150.0},
                                                   "steered": {"p50": None, "p99": None}}}}
    result = compare({"a": parts, "b": other})
    assert result["by_tenant"]["a"]["steered_p99"] == pytest.approx(2.0)
    assert result["by_tenant"]["b"]["steered_p99"] is None
    # the worst tenant for each: the highest latency ratio, the lowest requests-per-second ratio
    assert result["worst"]["steered_p99"] == pytest.approx(2.0) and result["worst"]["ok_rps"] == pytest.approx(0.5)
    assert result["by_tenant"]["a"]["plain_p99"] == pytest.approx(3.0)  # 300 ms in the flood window, 100 in quiet ones
    assert result["worst"]["plain_p99"] == pytest.approx(3.0) and result["by_tenant"]["b"]["plain_p99"] == 0.75
