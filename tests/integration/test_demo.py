"""``python -m hotwire_api.demo`` end to end: trains the tiny speaker, starts a real server, extracts a vector from\nexamples over HTTP, steers a sad continuation happy, shuts down."""

import re
import subprocess
import sys

import pytest

from hotwire_api.demo_server import port_is_free
from hotwire_api.server_process import free_port, group_alive

pytestmark = pytest.mark.integration

BUDGET_S = 300  # about 2-3 minutes on a 2-core CPU, most of it the engine start


def test_demo_steers_and_leaves_nothing_running(tmp_path):
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "hotwire_api.demo", "--port", str(port), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"

    assert re.search(r"\[\s*\d+ s\] starting\.\.\.", out), "no startup progress was shown"
    assert re.search(r"^extracted 'happy' v1 \(mean_diff, last token\) from 4 happy and 4 sad examples:$", out, re.M)
    assert re.search(r"^  layer 1: separation \d+\.\d\d \(Cohen's d\), accuracy 1\.00", out, re.M)
    assert re.search(r"^prompt: +'the morning was'$", out, re.M)
    assert re.search(r"^generate: +16 tokens after the prompt", out, re.M)
    assert re.search(r"^plain text: +'.+'$", out, re.M)
    assert re.search(r"^steered text: +'.+'$", out, re.M)
    assert re.search(r"^  mood: +sad \(\d+ happy, \d+ sad words\)$", out, re.M), "the plain text is not sad"
    assert re.search(r"^  mood: +happy \(\d+ happy, \d+ sad words\)$", out, re.M), "the steered text is not happy"
    assert "per-token logprob difference" in out
    table = re.findall(r"^ +\d+ +\S.*[-+]\d+\.\d{4}(?: \*)?$", out, re.M)
    assert len(table) == 16, "expected one logprob row per generated token"
    assert re.search(r"^receipt header: +x-hotwire-receipt: happy@1:L1x3$", out, re.M)
    assert "slot table (GET /steer/slots):" in out
    assert re.search(r"^ +\d+ +happy +1 +1 +0 +[\d.]+$", out, re.M), "the demo vector's bank row is not listed"
    assert re.search(r"^plain again +identical to the first plain run$", out, re.M)
    assert re.search(r"^shutdown +stopped cleanly", out, re.M)
    assert re.search(r"^RESULT +PASS: the steered text took the happy mood$", out, re.M)

    pgid = int(re.search(r"process group (\d+)", out).group(1))
    assert not group_alive(pgid), "a server process is still running"
    assert port_is_free(port)
