"""bench_api_cpu's fit: the plugin's CPU per request apart from how each server's engine batched."""

from __future__ import annotations

import pytest

from benchmarks.bench_api_cpu import at_equal_steps


def _row(server: str, steps: float | None, ms: float) -> dict:
    return {"kind": "streamed", "server": server, "engine_steps_per_request": steps, "api_cpu_ms_per_request": ms}


def test_the_fit_separates_the_plugins_cost_from_batching() -> None:
    # hotwire's rounds happened to take more steps per request: its medians are higher, the plugin costs 0.05 ms
    rows = [_row("vanilla", s, 2.0 + 0.3 * s) for s in (20.0, 22.0, 24.0)]
    rows += [_row("hotwire", s, 2.05 + 0.3 * s) for s in (26.0, 28.0, 30.0)]
    rows.append(_row("hotwire", None, 99.0))  # a round without /metrics is left out
    fit = at_equal_steps(rows)
    assert fit is not None
    assert fit["hotwire_ms"] == pytest.approx(0.05)
    assert fit["per_step_ms"] == pytest.approx(0.3)
    assert fit["base_ms"] == pytest.approx(2.0)
    assert fit["hotwire_se_ms"] == pytest.approx(0.0, abs=1e-6)


def test_too_few_rounds_give_no_fit() -> None:
    assert at_equal_steps([_row("vanilla", 20.0, 8.0), _row("hotwire", 21.0, 8.3), _row("hotwire", None, 9.0)]) is None
