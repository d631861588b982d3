"""Host time hotwire's HTTP admission adds to one request in the API server, without an engine or a socket.

The ASGI app of the unit tests (``tests/unit/test_api_routes.py``: hotwire attached to a FastAPI app whose engine
client answers the ``hotwire_*`` RPCs from memory) serves ``POST /v1/chat/completions``; the route behind
admission is a stand-in that reads the body, passes it through the engine client's ticket guard and answers a
small JSON body. Each figure is process CPU time per request, over ``--requests`` requests, called straight on
the ASGI interface:

    bare                the stand-in route alone (no hotwire)
    plain               through admission, no steering
    steered, repeated   one spec string again and again (the decision cache hits)
    steered, distinct   a scale drawn per request (every spec string new: parsed and decided anew)

    python benchmarks/bench_admission_http.py --requests 5000 [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests"),
                str(Path(__file__).resolve().parent.parent / "tests" / "unit")]

import test_api_routes as harness  # noqa: E402  (the unit tests' app and engine stand-in)
from fastapi.testclient import TestClient  # noqa: E402

from hotwire_api.admission import AdmissionMiddleware  # noqa: E402
from hotwire_api.settings import Settings  # noqa: E402

ANSWER = b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}'


async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    harness._to_engine(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": ANSWER})


async def one(app: Any, target: Any, body: bytes) -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    out: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        out.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "root_path": "", "query_string": b"", "app": app,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    await target(scope, receive, send)
    assert out[0]["status"] == 200, out


def bodies(kind: str, n: int) -> list[bytes]:
    rng = random.Random(0)
    if kind == "plain":
        return [json.dumps(harness._chat()).encode()] * n
    if kind == "repeated":
        return [json.dumps(harness._chat({"hotwire": harness._spec()})).encode()] * n
    return [json.dumps(harness._chat({"hotwire": harness._spec(scale=4 + 2 * rng.random())})).encode()
            for _ in range(n)]


async def timed(app: Any, target: Any, batch: list[bytes]) -> float:
    start = time.process_time()
    for body in batch:
        await one(app, target, body)
    return (time.process_time() - start) / len(batch) * 1e6


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the distinct-spec requests afterwards")
    args = parser.parse_args(argv)
    app = harness._openai_app(harness.FakeEngine(), Settings())
    assert harness._upload(TestClient(app), "happy", harness._vector()).status_code == 201
    admission = AdmissionMiddleware(route)
    cases = {"bare": (route, "plain"), "plain": (admission, "plain"), "steered, repeated": (admission, "repeated"),
             "steered, distinct": (admission, "distinct")}
    for target, kind in cases.values():
        await timed(app, target, bodies(kind, 200))  # warm up
    for r in range(args.rounds):
        figures = [f"{name} {await timed(app, target, bodies(kind, args.requests)):.1f} us"
                   for name, (target, kind) in cases.items()]
        print(f"round {r}: " + ", ".join(figures), flush=True)
    if args.profile:
        profile = cProfile.Profile()
        batch = bodies("distinct", args.requests)
        profile.enable()
        await timed(app, admission, batch)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    asyncio.run(main())
