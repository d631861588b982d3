"""A fleet's numbering as a tenant registers and deletes ever new ids: what Redis keeps of it and what a
registration costs, against a real ``redis-server`` (on PATH; no vLLM, no engine: the registry's own commands).

Each id is registered (one blob for all, so blobs do not grow) and deleted at once, as a flood of distinct vectors
does; every ``--every`` ids the bench reads ``last_version``'s and ``deleted``'s sizes, the floor, the audit
stream's length (append-only by design), the two numbering keys' ``MEMORY USAGE`` and Redis's ``used_memory`` (the
retired versions, the event stream and the audit grow too: no follower forgets retired ones here), and the register + delete round trip's p50
over that window. A follower's own numbering (``Standing``) is fed the same deletions and reported beside.

    python -m benchmarks.bench_fleet_numbering --ids 20000 --out fleet_numbering.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hotwire_api.codec import VectorPayload
from hotwire_api.fleet import blobs
from hotwire_api.fleet.config import FleetConfig, Keys
from hotwire_api.fleet.redis_registry import RedisRegistry
from hotwire_api.fleet.standing import Standing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(url: str, ids: int, every: int) -> list[dict]:
    registry = RedisRegistry(FleetConfig(url, restart_settle_s=0.0), Keys.for_model("bench/model"))
    follower = Standing(registry, lambda: None, "bench")
    while not (await registry.gate("")).open:  # a new Redis: the gate opens once nobody is left to wait for
        await asyncio.sleep(0.05)
    blob = blobs.encode(VectorPayload(bytes(4 * 64), "float32", (64,), None))
    sha = hashlib.sha256(blob).hexdigest()  # a key to Redis: it never reads the bytes
    await registry.put_blob(sha, blob)
    rows, window = [], []
    for i in range(ids):
        start = time.perf_counter()
        _, version, _ = await registry.register(f"flood/{i}", sha, False, floor=follower.known_version(f"flood/{i}"))
        deleted = await registry.delete(f"flood/{i}")
        window.append((time.perf_counter() - start) * 1000)
        follower.note(f"flood/{i}", deleted[0], deleted=True)
        if (i + 1) % every == 0:
            raw = registry._redis
            last, dels, floor, audit, memory, last_bytes, deleted_bytes = await asyncio.gather(
                raw.hlen(registry.keys.last_version), raw.zcard(registry.keys.deleted),
                raw.get(registry.keys.version_floor), raw.xlen(registry.keys.audit), raw.info("memory"),
                raw.memory_usage(registry.keys.last_version), raw.memory_usage(registry.keys.deleted))
            rows.append({"ids": i + 1, "last_version_ids": last, "deleted_ids": dels, "floor": int(floor or 0),
                         "last_version_given": version, "numbering_bytes": (last_bytes or 0) + (deleted_bytes or 0), "audit_entries": audit,
                         "used_memory_bytes": memory["used_memory"], "follower_ids": len(follower.known_ids()),
                         "follower_floor": follower.floor, "register_delete_ms_p50": statistics.median(window)})
            print(json.dumps(rows[-1]), flush=True)
            window = []
    await registry.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=2_000)
    parser.add_argument("--out", type=Path, default=Path("fleet_numbering.json"))
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("bench_fleet_numbering: redis-server is not on PATH (scripts/setup-cpu.sh installs it)")
    port, folder = free_port(), tempfile.mkdtemp(prefix="hotwire-fleet-numbering-")
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        rows = asyncio.run(run(f"redis://127.0.0.1:{port}/0", args.ids, args.every))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
