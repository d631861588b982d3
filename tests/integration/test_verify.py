"""``python -m hotwire_core.verify`` end to end on the built-in tiny model: a real engine runs checks a-d (and f
and g, with ``--readout``).

On the CPU there are no CUDA graphs, so check d reports one graph set; on a GPU the same run needs every rank's
hotwire-free graphs in place after an unsteered step (``benchmarks/gpu_checks.sh matrix`` runs it there)."""

import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration


class DecodeTimingOnABusyCpu(AssertionError):
    """Only check d failed, on the CPU: its wall-clock decode timing shares two cores with the other test run (CI
    runs two at a time), whose bursts can triple a step; alone, steering costs far less than the +200% guard."""


# Such a failure gets two more attempts on the CPU; any other failure, and every failure on a GPU, stands at once.
retried_when_only_timing_failed = pytest.mark.flaky(reruns=0 if torch.cuda.is_available() else 2,
                                                    only_rerun=[DecodeTimingOnABusyCpu])

BUDGET_S = 300  # about 40 s on a 2-core CPU, most of it the engine start


NGRAM = ["--vanilla", "--runner", "v1", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
         '"prompt_lookup_max": 3}']


@retried_when_only_timing_failed
@pytest.mark.parametrize("flags", [[], ["--readout"], NGRAM], ids=["plain", "readout", "ngram-vanilla"])
def test_verify_passes_and_reports_every_check(tmp_path, flags):
    proc = subprocess.run(
        [sys.executable, "-m", "hotwire_core.verify", "--kv-cache-gib", "1", *flags],
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
        cwd=tmp_path,
    )
    out = proc.stdout
    if proc.returncode and re.findall(r"^FAIL  (.+?)  ", out, re.M) == ["d. decode cost"] and "device     CPU" in out:
        raise DecodeTimingOnABusyCpu(f"only check d failed\n{out[-3000:]}")
    assert proc.returncode == 0, f"verify exited {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    for check in ("a. steering fires", "b. batchmates", "c. prefix cache: steered -> plain",
                  "c. prefix cache: plain -> steered", "c. prefix cache: steered hit", "d. decode cost"):
        assert re.search(rf"^PASS  {re.escape(check)} ", out, re.M), f"{check!r} did not pass\n{out[-3000:]}"
    decode = re.search(r"^PASS  d\. decode cost .*$", out, re.M).group(0)
    expected = "one graph set" if "device     CPU" in out else "had their hotwire-free set in place"
    assert expected in decode, decode
    if "--readout" in flags:  # check f: the steering vector read as a probe shows what steering added, at every prompt token
        assert re.search(r"^PASS  f\. readout +\d+ prompt tokens: steered minus plain score", out, re.M), out[-3000:]
        # check g: gated on a condition that always holds it steers as ungated; on one that never holds, not at all
        assert re.search(r"^PASS  g\. gates +gated on a condition that always holds", out, re.M), out[-3000:]
    checks = 6 + 2 * ("--readout" in flags) + ("--vanilla" in flags)  # --vanilla: check e, plugin-free vLLM
    assert re.search(rf"^result +PASS \({checks}/{checks} checks\)$", out, re.M), out[-3000:]
