"""The fleet's version numbering stays bounded (``lua``'s numbering, ``Standing.note``): Redis and each follower keep
the last version of live ids and of the last ``history_kept`` deleted ids; older ones only raise a floor every id's
next version goes on above, so no version is given out twice, across a wipe too. Real redis-server, replicas whose
engines are real controllers (``test_fleet_registry``'s nodes)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from hotwire_api.fleet import heartbeat
from hotwire_api.fleet.config import FleetConfig, Keys
from hotwire_api.fleet.redis_registry import RedisRegistry
from hotwire_api.fleet.standing import Standing
from hotwire_api.models import FleetView
from test_fleet_registry import Node, eventually, run, started, vector

KEPT = 3


async def churn(node: Node, ids: list[str]) -> dict[str, int]:
    """Register each id, replace it as many times as its place in ``ids``, delete it; returns each id's last version."""
    last = {}
    for i, vector_id in enumerate(ids):
        for replace in range(i + 1):
            payload = vector(100 * i + replace)
            _, meta = await node.replica.changes.register(node.engine, vector_id, payload, replace > 0)
        assert await node.replica.changes.unregister(node.engine, vector_id) == 0
        last[vector_id] = meta.version
    return last


async def numbering(url: str, keys: Keys) -> tuple[dict[str, int], list[str], int, list[tuple[str, int, str]]]:
    """Redis's last_version hash, its deleted ids oldest first, its floor, and every registration the stream holds."""
    raw = aioredis.from_url(url, decode_responses=True)
    try:
        last = {k: int(v) for k, v in (await raw.hgetall(keys.last_version)).items()}
        deleted = await raw.zrange(keys.deleted, 0, -1)
        floor = int(await raw.get(keys.version_floor) or 0)
        registered = [(f["id"], int(f["version"]), f["sha256"]) for _, f in await raw.xrange(keys.events)
                      if f["op"] == "register"]
    finally:
        await raw.aclose()
    return last, deleted, floor, registered


async def gate_open(node: Node) -> bool:
    return (await node.registry.gate()).open


async def come_back(nodes: list[Node], before: str) -> None:
    """Replicas that were away start again after a Redis restart (their last run id ``before``): away long, each
    looks at the gate first, before the stream, and repairs."""
    for node in nodes:
        node.replica.follower._gate_checked = -1e9
        node.start()
        await eventually(lambda: node.replica.follower.repair.run_id not in (None, before), 5.0)


def test_redis_and_the_followers_forget_the_oldest_deleted_ids_into_a_floor(redis_server) -> None:
    async def body() -> None:
        async with started(redis_server.url, "a", "b", history_kept=KEPT) as (a, b):
            _, live = await a.replica.changes.register(a.engine, "live", vector(1), False)
            ids = ["d3", "d0", "d5", "d1", "d6", "d2", "d4"]  # deleted in this order: forgotten by when, not by name
            last = await churn(a, ids)
            await eventually(lambda: b.client.held() == a.client.held() == {"live": (live.version, live.sha256)})
            await eventually(lambda: b.replica.known("d4") == (last["d4"], True))
            forgotten, kept = ids[:-KEPT], ids[-KEPT:]
            floor_wanted = max(last[i] for i in forgotten)

            versions, deleted, floor, registered = await numbering(redis_server.url, a.registry.keys)
            assert deleted == kept and versions == {"live": live.version, **{i: last[i] for i in kept}}
            assert floor == floor_wanted
            for node in (a, b):  # each follower alike: the last KEPT deletions by id, the rest in its floor
                assert node.replica.deleted == {i: last[i] for i in kept} and node.replica.floor == floor_wanted
                assert node.replica.applied == {"live": live.version}
                assert node.replica.known_version("d3") == floor_wanted

            # A forgotten id comes back above every version it had; a live one goes on above the floor too.
            _, again = await b.replica.changes.register(b.engine, "d3", vector(7), False)
            _, live2 = await b.replica.changes.register(b.engine, "live", vector(8), True)
            assert again.version == live2.version == floor_wanted + 1
            versions, deleted, _, registered = await numbering(redis_server.url, a.registry.keys)
            assert "d3" not in deleted and versions["d3"] == again.version
            assert len({(i, v) for i, v, _ in registered}) == len(registered)  # no id@version given twice
            # A deleted id still remembered by id numbers on from its own version when that is above the floor, and
            # is no longer among the deleted ones.
            assert last["d4"] > floor_wanted
            _, d4 = await a.replica.changes.register(a.engine, "d4", vector(9), False)
            versions, deleted, _, _ = await numbering(redis_server.url, a.registry.keys)
            assert d4.version == last["d4"] + 1 and deleted == ["d6", "d2"] and versions["d4"] == d4.version

    run(body)


def test_a_wiped_registry_gets_its_floor_back_from_the_replicas(tmp_path) -> None:
    """A Redis that lost everything: a replica's floor (the ids it forgot) is put back with what it holds, so a
    forgotten id is never numbered again from 1."""
    from redis_fixture import RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()

    async def body() -> None:
        async with started(server.url, "a", history_kept=KEPT) as (a,):
            _, live = await a.replica.changes.register(a.engine, "live", vector(1), False)
            last = await churn(a, [f"d{i}" for i in range(6)])
            floor_wanted = max(last[f"d{i}"] for i in range(6 - KEPT))
            await eventually(lambda: a.replica.follower._synced_at == a.replica.position is not None, 3.0)
            server.restart()  # no persistence: every key is gone
            await eventually(lambda: a.replica.reset_seen, 5.0)

            async def put_back() -> bool:
                return await a.registry.current() == {"live": (live.version, live.sha256)}

            await eventually(put_back, 3.0)
            versions, deleted, floor, _ = await numbering(server.url, a.registry.keys)
            assert floor == floor_wanted  # from the replica's own floor
            assert versions == {"live": live.version, **{f"d{i}": last[f"d{i}"] for i in range(6 - KEPT, 6)}}
            assert sorted(deleted) == [f"d{i}" for i in range(6 - KEPT, 6)]
            _, d0 = await a.replica.changes.register(a.engine, "d0", vector(2), False)
            assert d0.version == floor_wanted + 1

    try:
        run(body)
    finally:
        server.stop()


def test_ids_an_earlier_hotwire_left_deleted_are_tracked_and_forgotten_past_the_bound(redis_server) -> None:
    """A Redis written before the numbering was bounded: its last_version hash holds deleted ids the deleted set
    does not; they are counted as the oldest deletions, in batches, and all but the last ``history_kept`` forgotten
    into the floor; the follower's first collection does it."""

    async def body() -> None:
        keys = Keys.for_model("org/model")
        legacy = {f"old{i}": i * 7919 % 1000 + 1 for i in range(300)}  # past 128 fields HSCAN honours COUNT
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        await raw.hset(keys.last_version, mapping=legacy)
        await raw.aclose()
        async with started(redis_server.url, "a", history_kept=KEPT) as (a,):
            _, live = await a.replica.changes.register(a.engine, "live", vector(1), False)
            assert live.version == 1  # nothing is forgotten yet: no floor
            script, calls = a.registry._track_deleted, []
            a.registry._track_deleted = lambda **kw: calls.append(kw["args"][1]) or script(**kw)
            assert await a.registry.track_deleted(batch=50) == len(legacy)
            assert len(calls) >= 3 and calls[0] == "0"  # several scripts: the scan, then what is left to forget
            a.registry._track_deleted = script
            versions, deleted, floor, _ = await numbering(redis_server.url, keys)
            assert len(deleted) == KEPT and set(versions) == {"live", *deleted}
            forgotten = legacy.keys() - set(deleted)
            assert len(forgotten) == len(legacy) - KEPT and floor == max(legacy[i] for i in forgotten)
            a.replica.follower.collect_every_s = 0.0
            await eventually(lambda: a.replica.follower._tracked, 3.0)
            assert await a.registry.track_deleted() == 0  # once counted, never again
            assert (await numbering(redis_server.url, keys))[:3] == (versions, deleted, floor)
            _, back = await a.replica.changes.register(a.engine, next(iter(forgotten)), vector(2), False)
            assert back.version == floor + 1

    run(body)


def test_a_replica_that_missed_a_forgotten_deletion_does_not_bring_it_back(tmp_path) -> None:
    """Replica b holds x@1 while it is away; x is deleted and, past ``history_kept`` more deletions, forgotten by
    Redis and by replica a; Redis then restarts with all its data. b's repair must not put x back (Redis no longer
    knows x, but x@1 is at or below the floor of the ids forgotten after a deletion), and b drops x as it catches
    up."""
    from redis_fixture import RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()

    async def body() -> None:
        async with started(server.url, "a", "b", history_kept=KEPT) as (a, b):
            _, x = await a.replica.changes.register(a.engine, "x", vector(1), False)
            await eventually(lambda: b.client.held().get("x") == (x.version, x.sha256))
            await eventually(lambda: b.replica.follower.repair.run_id is not None)
            before = b.replica.follower.repair.run_id
            await b.stop()  # away: its engine still holds x@1
            assert await a.replica.changes.unregister(a.engine, "x") == 0
            await churn(a, [f"d{i}" for i in range(KEPT + 1)])
            assert a.replica.known("x") == (0, False) and "x" not in (await numbering(server.url, a.registry.keys))[0]
            server.restart()  # its data kept (append-only file): only the run id is new
            await come_back([b], before)
            await eventually(lambda: "x" not in b.client.held(), 5.0)
            assert await a.registry.current() == {}
            late = Node(server.url, "c", history_kept=KEPT)  # a replica started now holds nothing
            late.start()
            await eventually(lambda: late.replica.position is not None, 5.0)
            assert late.client.held() == {} and a.client.held() == {}
            await late.close()

    try:
        run(body)
    finally:
        server.stop()


def test_nothing_is_forgotten_while_the_gate_is_closed(redis_server) -> None:
    """An earlier hotwire's deleted ids found while the restart gate is closed are counted, not forgotten, and the
    caller hears it must come back (the follower's next collection); with the gate open they are forgotten."""

    async def body() -> None:
        registry = RedisRegistry(FleetConfig(redis_server.url, history_kept=KEPT, restart_settle_s=0.0),
                                 Keys.for_model("org/model"))
        legacy = {f"old{i}": i + 1 for i in range(6)}
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        await raw.hset(registry.keys.last_version, mapping=legacy)
        assert await registry.track_deleted() is None  # a new Redis: the gate is closed
        versions, deleted, floor, _ = await numbering(redis_server.url, registry.keys)
        assert versions == legacy and sorted(deleted) == sorted(legacy) and floor == 0
        assert await raw.get(registry.keys.deleted_floor) is None
        while not (await registry.gate()).open:
            await asyncio.sleep(0.05)
        assert await registry.track_deleted() == 0  # counted before; now forgotten past the bound
        versions, deleted, floor, _ = await numbering(redis_server.url, registry.keys)
        assert deleted == ["old3", "old4", "old5"] and floor == 3 == int(await raw.get(registry.keys.deleted_floor))
        await raw.aclose()
        await registry.close()

    run(body)


def test_two_replicas_away_for_a_deletion_cannot_undo_it_between_them(tmp_path) -> None:
    """b holds z@1, c holds z@2, both away while z is deleted and forgotten; Redis restarts with all its data. b's
    repair (z@1, refused) must not leave z a last version that c's z@2 would pass."""
    from redis_fixture import RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()

    async def body() -> None:
        async with started(server.url, "a", "b", "c", history_kept=KEPT, restart_settle_s=8.0) as (a, b, c):
            await eventually(lambda: gate_open(a), 12.0)
            _, z1 = await a.replica.changes.register(a.engine, "z", vector(1), False)
            for n in (b, c):
                await eventually(lambda: n.client.held() == {"z": (z1.version, z1.sha256)})
                await eventually(lambda: n.replica.follower.repair.run_id is not None)
            before = b.replica.follower.repair.run_id
            await b.stop()  # away, holding z@1
            _, z2 = await a.replica.changes.register(a.engine, "z", vector(2), True)
            await eventually(lambda: c.client.held() == {"z": (z2.version, z2.sha256)})
            await c.stop()  # away, holding z@2
            assert await a.replica.changes.unregister(a.engine, "z") == 0
            await churn(a, [f"d{i}" for i in range(KEPT + 1)])  # z's deletion forgotten
            assert "z" not in (await numbering(server.url, a.registry.keys))[0]
            server.restart()  # append-only file: nothing lost
            await come_back([b, c], before)  # b repairs first, then c
            assert not await gate_open(a)
            assert "z" not in await a.registry.current()
            assert "z" not in (await numbering(server.url, a.registry.keys))[0]

    try:
        run(body)
    finally:
        server.stop()


def test_a_repair_forgets_nothing_so_that_a_replica_away_for_a_deletion_cannot_undo_it(tmp_path) -> None:
    """Replicas b and c saw a1 deleted (and a gated deletion forget it), then were away, holding x@3, while x was
    deleted; Redis restarts with all its data. b's repair puts a1's deletion back, which must not forget x (the
    oldest deletion Redis keeps) without raising deleted_floor: c's repair would then put x@3 back."""
    from redis_fixture import RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()

    async def body() -> None:
        # the gate stays closed 8 s after the restart (no replica heartbeats): both repairs run while it is
        async with started(server.url, "a", "b", "c", history_kept=KEPT, restart_settle_s=8.0) as (a, b, c):
            await eventually(lambda: gate_open(a), 12.0)
            await a.replica.changes.register(a.engine, "a1", vector(1), False)
            for i in range(3):
                _, x = await a.replica.changes.register(a.engine, "x", vector(50 + i), i > 0)
            assert await a.replica.changes.unregister(a.engine, "a1") == 0
            for n in (b, c):
                await eventually(lambda: n.client.held() == {"x": (x.version, x.sha256)})
                await eventually(lambda: n.replica.known("a1") == (1, True))
                await eventually(lambda: n.replica.follower.repair.run_id is not None)
            before = b.replica.follower.repair.run_id
            await b.stop()
            await c.stop()
            assert await a.replica.changes.unregister(a.engine, "x") == 0
            await churn(a, ["d0", "d1"])  # a1 forgotten by a gated deletion: deleted_floor 1; x, d0, d1 kept
            assert (await numbering(server.url, a.registry.keys))[1] == ["x", "d0", "d1"]
            server.restart()  # append-only file: nothing lost
            await come_back([b, c], before)
            assert not await gate_open(a)  # both repaired while the gate was closed
            assert "x" not in await a.registry.current()
            await eventually(lambda: "x" not in b.client.held() and "x" not in c.client.held(), 15.0)

    try:
        run(body)
    finally:
        server.stop()


def test_a_followers_note_keeps_the_newest_and_lets_a_deletion_win_a_tie() -> None:
    standing = Standing(RedisRegistry(FleetConfig("redis://unused", history_kept=2), Keys.for_model("m")),
                        lambda: None, "r")
    standing.note("a", 3)
    standing.note("a", 2, deleted=True)  # older: ignored
    assert standing.known("a") == (3, False)
    standing.note("a", 3, deleted=True)
    standing.note("a", 3)  # the same version applied again after its deletion: still deleted
    assert standing.known("a") == (3, True) and standing.applied == {}
    standing.note("a", 4)
    assert standing.known("a") == (4, False) and standing.deleted == {}
    for i, version in enumerate((7, 5, 6)):
        standing.note(f"x{i}", version, deleted=True)
    assert standing.deleted == {"x1": 5, "x2": 6} and standing.floor == 7  # x0, the oldest deletion, forgotten
    assert standing.known("x0") == (0, False) and standing.known_version("x0") == 7
    assert standing.known_version("a") == 7 and standing.known_ids() == {"a", "x1", "x2"}


def test_a_live_replica_of_another_key_schema_is_named_in_an_error_once(redis_server, caplog, monkeypatch) -> None:
    """A rolling upgrade across a change of the key schema: each replica names a live one that runs another schema
    (here one from before schemas, whose heartbeat has none) in an error, once."""

    async def body() -> None:
        async with started(redis_server.url, "a", "b", heartbeat=True, heartbeat_s=0.05) as (a, b):
            state = b.replica.heartbeat.state

            async def before_schemas(engine):
                return {k: v for k, v in (await state(engine)).items() if k != "schema"}

            b.replica.heartbeat.state = before_schemas
            await eventually(lambda: ("b", "None") in a.replica.heartbeat.told, 3.0)
            await a.replica.heartbeat.check_schemas()  # a later look names it no more
            assert a.replica.heartbeat.told == {("b", "None")}
            assert b.replica.heartbeat.told == set()  # a runs this schema; b's own heartbeat is not another's
            # A schema of a shape this one does not know is named; heartbeats that are not hotwire's are skipped.
            raw = aioredis.from_url(redis_server.url, decode_responses=True)
            await raw.set(a.registry.keys.replica("z"), json.dumps({"replica": "z", "schema": [3, 0]}))
            await raw.set(a.registry.keys.replica("junk"), "[1]")
            await raw.set(a.registry.keys.replica("deep"), "[" * 100_000)
            await a.replica.heartbeat.check_schemas()
            assert a.replica.heartbeat.told == {("b", "None"), ("z", "[3, 0]")}
            view = FleetView.model_validate(await a.replica.heartbeat.view())  # as GET /steer/fleet answers
            assert [beat.replica for beat in view.replicas] == ["a", "b"]  # z's heartbeat is not one this can read
            # A check that fails does not end the heartbeats (the gate waits for live replicas only).
            await raw.delete(a.registry.keys.replica("a"))

            async def failing() -> None:
                raise RuntimeError("a check that fails")

            a.replica.heartbeat.check_schemas = failing
            monkeypatch.setattr(heartbeat, "SCHEMA_CHECK_EVERY", 2)  # every other beat checks
            await asyncio.sleep(0.3)
            assert not any(task.done() for task in a.tasks + b.tasks)
            assert await raw.get(a.registry.keys.replica("a")) is not None  # a's heartbeats went on
            await raw.aclose()

    with caplog.at_level("ERROR", logger="hotwire_api.fleet.heartbeat"):
        run(body)
    named = [r.getMessage() for r in caplog.records if "runs another hotwire" in r.getMessage()]
    assert {m.split(" runs")[0] for m in named} == {"hotwire: replica b", "hotwire: replica z"}, named  # b names z too
    assert sum(m.startswith("hotwire: replica b ") for m in named) == 1  # a names b once; b never itself
    assert sum("a check that fails" in r.getMessage() for r in caplog.records) >= 2
