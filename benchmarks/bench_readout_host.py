"""Host time of the readout's per-step work on the worker (``WorkerReadout.fill``: the token rows, the gather and
copy-out of the last forward's values, each reader's values), with every request of a decode batch reading 4 probes
at one layer of a 36-layer model, on this machine's CPU (no GPU: the copy-out is a host copy). What a reading step
adds to the engine's host work before the forward, by batch:

    python benchmarks/bench_readout_host.py [--steps 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from hotwire_core.contract import SteerItem
from hotwire_core.readout_worker import WorkerReadout

N_LAYERS, PROBES, PROMPT = 36, 4, 32


class _HostUploader:
    to_device = staticmethod(lambda t: t)
    copy_ = staticmethod(lambda dst, src: dst.copy_(src))


def reading_worker(batch: int) -> WorkerReadout:
    worker = WorkerReadout(range(N_LAYERS), N_LAYERS, torch.device("cpu"), 8192, PROBES, 4 * batch, _HostUploader())
    probes = [{"name": f"v{k}@1:L18", "layer": N_LAYERS // 2, "bias": 0.0, "norm": 1.0} for k in range(PROBES)]
    rows = [SteerItem(N_LAYERS // 2, k + 1, 0.0, 0.0) for k in range(PROBES)]
    worker.on_step([], [(f"r{i}", PROMPT, {"tag": f"t{i}", "tokens": "generated", "probes": probes}, rows)
                        for i in range(batch)], {})
    return worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--profile", action="store_true", help="where the time goes at the largest batch")
    args = parser.parse_args()
    for batch in map(int, args.batches.split(",")):
        worker, ids, one = reading_worker(batch), [f"r{i}" for i in range(batch)], np.ones(batch, np.int64)
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            worker.fill(ids, one, np.full(batch, PROMPT + step, np.int64), batch)
            times.append(time.perf_counter() - start)
        print(f"batch {batch}: {np.median(times) * 1e6:.0f} us per decode step (median of {args.steps})")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for step in range(args.steps):
            worker.fill(ids, one, np.full(batch, PROMPT + args.steps + step, np.int64), batch)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
