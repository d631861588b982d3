"""profile.json from this run's py-spy samples (profile_raw.tgz) and throughput_gpu.txt: the run's own report
(throughput_gpu.json) did not come back from the device (at most 8 files do), so the comparison
bench_throughput --profile prints is recomputed here with the same function (benchmarks/api_profile.compare); the
completed requests of a round are its req/s x 20 s, its API-server CPU the printed ms/request x completed.

    python benchmarks/results/2026-12-06_h100_a629f11/profile_from_raw.py
"""

import io
import json
import re
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))
from benchmarks.api_profile import compare, parse_raw  # noqa: E402
from benchmarks.bench_throughput import PROFILE_PAIRS, PROFILE_RATE_HZ  # noqa: E402

ROUND = re.compile(r"round (\d) (\w+)\s+([\d.]+) req/s .* API server CPU ([\d.]+) ms/request")
rounds = {}
for line in (HERE / "throughput_gpu.txt").read_text().splitlines():
    if m := ROUND.search(line):
        completed = round(float(m[3]) * 20)
        rounds[(int(m[1]), m[2])] = (completed, float(m[4]) * completed / 1000)
runs = {}
with tarfile.open(HERE / "profile_raw.tgz") as tar:
    for (r, config), (completed, cpu_s) in sorted(rounds.items()):
        text = tar.extractfile(f"./profile_round{r}_{config}.txt").read().decode()
        runs.setdefault(config, []).append((parse_raw(text), completed, cpu_s))
report = compare(runs, PROFILE_RATE_HZ, PROFILE_PAIRS, top=40)
(HERE / "profile.json").write_text(json.dumps(report, indent=1))
for config, figures in report["configs"].items():
    print(f"{config:8s} {figures['ms_per_request']:.3f} ms sampled per request, {figures['sampled_of_measured']:.0%} "
          "of the measured CPU")
