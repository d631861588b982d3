"""How long the engine core's loop stops for one registration with the store on (``HOTWIRE_STORE``, the default
under ``vllm serve``), after about N ids without a file (deleted) went into ``versions.json`` (it is read and
rewritten whole on every registration, and keeps the last ``HISTORY_KEPT`` of them: the ids it holds are given):

- ``inline``: ``VectorStore.save`` of a ``[hidden]`` vector in the calling thread (as an in-process engine writes
  it, in its loop between two steps);
- ``deferred``: the longest gap between two "steps" of a loop standing in for the engine core's (each step a pump of
  ``VectorChanges`` and 0.2 ms of sleep) while a registration runs as in ``vllm serve``: its write in the store's
  thread (whose Python work still takes the GIL from the loop), its taking effect in the loop. The same loop's
  longest gap without registrations is given as ``idle``.

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
from hotwire_core.slots import SlotCache
from hotwire_core.store import VectorStore
from hotwire_core.vector_changes import VectorChanges


def deferred_gap(changes: VectorChanges | None, vector_id: str, data: bytes, hidden: int) -> float:
    """The longest gap (s) between two steps of a stand-in engine loop while ``changes`` registers ``vector_id``
    (None: 20 ms of the loop alone)."""
    last = began = time.perf_counter()  # (the registration's own start in the loop counts too)
    answer = changes.register(vector_id, data, "float32", [hidden]) if changes is not None else None
    longest = 0.0
    while (answer is not None and not (isinstance(answer, dict) or answer.done())) or (
            answer is None and last - began < 0.02):  # fmt: skip
        if changes is not None:
            changes.pump()
        time.sleep(0.0002)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    if answer is not None:
        assert (answer if isinstance(answer, dict) else answer.result())["ok"], answer
    return longest


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
    changes = VectorChanges(VectorRegistry(36, args.hidden), store, SlotCache(16), 60.0)
    changes.deferring = True
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
        gaps = sorted(1e3 * deferred_gap(changes, f"t/def{n}-{i}", data, args.hidden) for i in range(args.saves))
        idle = 1e3 * max(deferred_gap(None, "", data, args.hidden) for _ in range(5))
        rows.append({"ids": n, "ids_in_versions_json": len(store.last_versions()),
                     "versions_json_bytes": (store.root / store.VERSIONS).stat().st_size,
                     "inline_p50_ms": round(statistics.median(ms), 2), "inline_max_ms": round(ms[-1], 2),
                     "deferred_gap_p50_ms": round(statistics.median(gaps), 2), "deferred_gap_max_ms": round(gaps[-1], 2),
                     "idle_gap_max_ms": round(idle, 2)})  # fmt: skip
        r = rows[-1]
        print(f"bench_store: ~{n:>6} ids noted, {r['ids_in_versions_json']:>6} in versions.json "
              f"({r['versions_json_bytes']:>9,} bytes): inline p50 "
              f"{r['inline_p50_ms']:6.2f} ms, max {r['inline_max_ms']:6.2f}; deferred: the loop's longest gap p50 "
              f"{r['deferred_gap_p50_ms']:5.2f} ms, max {r['deferred_gap_max_ms']:5.2f} (idle {r['idle_gap_max_ms']:.2f}) "
              f"over {args.saves}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"hidden": args.hidden, "dir": str(store.root.parent), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
