"""hotwire's series in vLLM's multiprocess ``/metrics`` mode (several API servers, ``PROMETHEUS_MULTIPROC_DIR``).

Two real processes named like vLLM's API servers write their series; the scrape is the registry vLLM's own
``get_prometheus_registry`` builds in that mode, merging the processes' files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

_API_SERVER = textwrap.dedent("""
    import asyncio, json, multiprocessing, sys

    multiprocessing.current_process().name = sys.argv[1]
    from hotwire_api.metrics import register_collector
    from hotwire_api.stats_cache import STATS
    from hotwire_api.models import SlotStats

    class Engine:
        def __init__(self, stats):
            self.result = SlotStats.model_validate(stats)

        async def stats(self):
            return self.result

    register_collector()
    for reason in json.loads(sys.argv[2]):
        STATS.count_refusal(reason)
    for stats in json.loads(sys.argv[3]):
        asyncio.run(STATS.refresh(Engine(stats)))
""")


def _stats(**overrides) -> dict:
    return {
        "capacity": 16, "used": 3, "pinned": 1, "free": 13, "evictions": 0, "refused": {}, "steered_requests": 0,
        "vectors": 2, "rows": [],
        "model": {"steerable": True, "reason": "", "n_layers": 4, "hidden_size": 8, "max_stack": 4, "norm": False},
        **overrides,
    }


def _api_server(env: dict, name: str, refusals: list[str], snapshots: list[dict]) -> None:
    subprocess.run([sys.executable, "-c", _API_SERVER, name, json.dumps(refusals), json.dumps(snapshots)],
                   env=env, check=True, timeout=120)


def _scrape(env: dict) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as vLLM builds it in multiprocess mode: {(sample name, labels): value} of hotwire's series."""
    code = ("from prometheus_client import generate_latest\n"
            "from vllm.v1.metrics.prometheus import get_prometheus_registry\n"
            "print(generate_latest(get_prometheus_registry()).decode())")
    text = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                          timeout=300).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) if family.name.startswith("hotwire")
            for s in family.samples if not s.name.endswith("_created")}


@pytest.fixture
def env(tmp_path) -> dict:
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}


def test_engine_series_once_and_admission_refusals_summed(env):
    # The first API server sees two snapshots: counters advance by the difference, gauges take the last value.
    _api_server(env, "ApiServer_0", ["bad_spec"], [
        _stats(evictions=2, steered_requests=5, refused={"slots_exhausted": 1}),
        _stats(used=7, evictions=5, steered_requests=9, refused={"slots_exhausted": 3, "unknown_vector": 1}),
    ])
    # Another API server polls the same engine: its snapshots must not count again, its own refusals must.
    _api_server(env, "ApiServer_1", ["bad_spec", "bad_spec", "reserved_salt"], [
        _stats(used=9, evictions=5, steered_requests=9, refused={"slots_exhausted": 3, "unknown_vector": 1}),
    ])
    assert _scrape(env) == {
        ("hotwire_slots_capacity", ()): 16.0,
        ("hotwire_slots_used", ()): 7.0,
        ("hotwire_slots_pinned", ()): 1.0,
        ("hotwire_vectors_registered", ()): 2.0,
        ("hotwire_slot_evictions_total", ()): 5.0,
        ("hotwire_steered_requests_total", ()): 9.0,
        ("hotwire_refusals_total", (("reason", "bad_spec"),)): 3.0,
        ("hotwire_refusals_total", (("reason", "reserved_salt"),)): 1.0,
        ("hotwire_refusals_total", (("reason", "slots_exhausted"),)): 3.0,
        ("hotwire_refusals_total", (("reason", "unknown_vector"),)): 1.0,
    }


def test_a_lone_api_server_with_the_variable_set_writes_everything(env):
    _api_server(env, "MainProcess", [], [_stats(evictions=4)])
    scraped = _scrape(env)
    assert scraped[("hotwire_slot_evictions_total", ())] == 4.0
    assert scraped[("hotwire_slots_capacity", ())] == 16.0
