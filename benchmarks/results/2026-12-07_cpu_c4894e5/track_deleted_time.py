import sys, time, tempfile, pathlib, asyncio
sys.path[:0] = ["tests", "tests/unit", "."]
import redis
from redis_fixture import RedisServer
from hotwire_api.fleet import lua
d = pathlib.Path(tempfile.mkdtemp(dir="/tmp/tt"))
s = RedisServer(d / "r", appendonly=False); s.start()
try:
    r = redis.Redis.from_url(s.url, socket_timeout=600)
    N = int(sys.argv[1])
    p = r.pipeline(transaction=False)
    for i in range(N):
        p.hset("lv", f"id{i}", i % 1000 + 1)
        if i % 10000 == 9999: p.execute()
    p.execute()
    t0 = time.time(); longest = 0; cursor = "0"; left = 0; added = 0; calls = 0
    while cursor or left:
        t = time.perf_counter()
        c, a, left = r.eval(lua.TRACK_DELETED, 4, "cur", "lv", "del", "floor", 4096, cursor, 1000)
        longest = max(longest, time.perf_counter() - t); calls += 1
        cursor = "" if c.decode() == "0" else c.decode(); added += a
    print(N, "added", added, "calls", calls, "took %.2f s" % (time.time() - t0), "longest script %.1f ms" % (longest * 1000),
          "hlen", r.hlen("lv"), "zcard", r.zcard("del"), "floor", r.get("floor"))
finally:
    s.stop()
