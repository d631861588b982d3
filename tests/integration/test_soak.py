"""A short soak (``benchmarks/soak``) against a real ``vllm serve`` with hotwire: concurrent clients on every
OpenAI route, streamed and not, plain and steered (single, stacked, decode_only, prefill_only), while vectors are
replaced and deleted; every response is judged from its content (marker vectors at the last layer) against its
receipt. No failure of any kind may occur, and the slot bank must drain to 0 pinned.

The server is the integration tests' (``server_fixture.VllmServer``: tiny float32 model, ``--max-num-seqs 8``,
so requests also queue in the engine; ``--enforce-eager`` on the CPU for a short engine start). 40 ids share
``HOTWIRE_SLOTS=16`` bank rows: more ids than rows, so rows are evicted and reloaded all the time, and fewer
rows than the 12 clients can pin at once (a stacked request pins two): such requests wait in the engine for rows,
never refused (a 429 is a failure). About three minutes on a two-core CPU, start included.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from benchmark_module import BENCHMARKS
from benchmarks.api_profile import parse_raw
from benchmarks.server_processes import ServerWatch
from server_fixture import VllmServer

sys.path.insert(0, str(BENCHMARKS))  # imported by name: its dataclasses need the module in sys.modules
from soak.plan import SoakConfig  # noqa: E402
from soak.report import examples_text, table  # noqa: E402
from soak.responses import PATHS  # noqa: E402
from soak.run import run_soak  # noqa: E402
from soak.steering import CLASS_WEIGHTS  # noqa: E402

pytestmark = pytest.mark.integration

CONFIG = SoakConfig(clients=12, duration=45.0, ids=40, churned=8, pool=3, max_tokens=8)
SLOTS = 16


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    args = [] if torch.cuda.is_available() else ["--enforce-eager"]
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("soak-serve"), {"HOTWIRE_SLOTS": str(SLOTS)}, args)
    srv.start(timeout=480)  # the default 240 s ran out once while other vLLM engines shared the two cores
    yield srv
    srv.stop()


def test_soak_has_no_failures_and_drains(server, tiny_model, tmp_path):
    watch = ServerWatch(server.proc.pid, profile_s=4.0, prefix=tmp_path / "soak")
    result = asyncio.run(run_soak(CONFIG, [server.url], tiny_model, watch))
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=1))
    summary = table(result)
    print(summary)
    failed = {kind: n for kind, n in result["failures"].items() if n}
    assert not failed, (
        f"{summary}\n\nexamples:\n{examples_text(result, per_kind=3)}\n\nserver log ({server.log_path}):\n"
        f"{server.log_tail(3000)}"
    )
    assert result["drain"]["pinned"] == 0
    requests = result["requests"]
    # the soak did what it claims: every route and class ran, vectors churned
    assert set(requests["by_route"]) == {f"{r}{s}" for r in PATHS for s in ("", "/stream")}
    assert set(requests["by_class"]) == set(CLASS_WEIGHTS)
    assert result["churn"]["replaced"] > 0 and result["churn"]["deleted"] > 0
    assert requests["ok"] > 0.9 * requests["total"]
    # the clients ran in a process of their own, which said how busy it was
    assert len(result["client_processes_busy"]) == 1 and 0 < result["client_processes_busy"][0] < 1.5
    # and how busy the server's two processes were
    assert set(result["server_busy"]) == {"api_server", "engine_core"}
    assert all(0 < share < 4 for share in result["server_busy"].values()), result["server_busy"]
    # and what they ran, sampled in the middle of the traffic
    for process, path in result["server_profiles"].items():
        assert sum(parse_raw(Path(path).read_text()).values()) > 0, f"no samples of the {process}"
    assert set(result["server_profiles"]) == {"api_server", "engine_core"}
