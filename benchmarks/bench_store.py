"""How long the engine core's loop stops for one registration with the store on (``HOTWIRE_STORE``, the default
under ``vllm serve``): ``VectorStore.save`` of a ``[hidden]`` vector, which the engine core runs inline between
steps (``SteeringController.register``), with ``versions.json`` holding about N ids (it is read and rewritten whole
on every registration, and keeps every id ever registered).

    python -m benchmarks.bench_store [--dir /path/on/the/store/disk] [--hidden 2560] [--ids 1 1000 4000 16000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hotwire_core.registry import VectorRegistry
from hotwire_core.store import VectorStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="a folder on the disk the store would use (default: the temp dir)")
    parser.add_argument("--hidden", type=int, default=2560, help="the vector's size (Qwen3-4B: 2560)")
    parser.add_argument("--ids", type=int, nargs="+", default=[1, 1000, 4000, 16000])
    parser.add_argument("--saves", type=int, default=30, help="timed saves per size")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    store = VectorStore(Path(tempfile.mkdtemp(prefix="hotwire-bench-store-", dir=args.dir)))
    registry = VectorRegistry(36, args.hidden)
    data = np.random.default_rng(0).random(args.hidden, dtype=np.float32).tobytes()
    rows = []
    for n in sorted(args.ids):
        have = store.last_versions()
        store.note_versions({f"t/old{i}": 1 for i in range(len(have), n - 1)})  # one write up to the size
        taken = []
        for i in range(args.saves):
            vector = registry.prepare(f"t/new{n}-{i}", data, "float32", [args.hidden], None, False)
            began = time.perf_counter()
            store.save(vector)
            taken.append(time.perf_counter() - began)
        ms = sorted(1e3 * t for t in taken)
        rows.append({"ids": n, "versions_json_bytes": (store.root / store.VERSIONS).stat().st_size,
                     "p50_ms": round(statistics.median(ms), 2), "max_ms": round(ms[-1], 2)})  # fmt: skip
        print(f"bench_store: ~{n:>6} ids in versions.json ({rows[-1]['versions_json_bytes']:>9,} bytes): save p50 "
              f"{rows[-1]['p50_ms']:6.2f} ms, max {rows[-1]['max_ms']:6.2f} ms over {args.saves}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"hidden": args.hidden, "dir": str(store.root.parent), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
