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
    operator key        steered, repeated, on an app with a keys file: the operator's key
    tenant key          the same with a tenant's key, naming the tenant's vector by its plain name
    plain, streamed     plain, the stand-in answering as vLLM streams a chat completion: ``--chunks`` SSE events
    steered, streamed   steered, repeated, streamed the same way (what an admitted stream costs per event)

    python benchmarks/bench_admission_http.py --requests 5000 [--chunks 32] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests"),
                str(Path(__file__).resolve().parent.parent / "tests" / "unit")]

import test_api_routes as harness  # noqa: E402  (the unit tests' app and engine stand-in)
from fastapi.testclient import TestClient  # noqa: E402

from hotwire_api.admission import AdmissionMiddleware  # noqa: E402
from hotwire_api.keys import Role, add_key  # noqa: E402
from hotwire_api.settings import Settings  # noqa: E402

ANSWER = b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}'


async def _to_engine(receive: Any) -> None:
    """Read the request's body and pass it through the engine client's ticket guard, as vLLM's route would."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    harness._to_engine(body)


async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await _to_engine(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": ANSWER})


CHUNK = (b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
         b'"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n')
ROLE = (b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')


def streaming_route(chunks: int) -> Any:
    """The stand-in, answering with vLLM's shape of a streamed chat completion: the role event, ``chunks`` events
    of one token each, ``[DONE]``."""
    async def stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _to_engine(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for event in [ROLE, *[CHUNK] * chunks, b"data: [DONE]\n\n"]:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return stream


async def one(app: Any, target: Any, body: bytes, key: str | None = None) -> None:
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
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *([(b"authorization", f"Bearer {key}".encode())] if key else [])]}
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


def _keyed_app() -> tuple[Any, dict[str, str]]:
    """An app with a keys file: an operator's admin key, which registers the shared ``happy``, and a tenant's admin
    key (tenant ``acme``), which registers its own ``happy``."""
    path = Path(tempfile.mkdtemp(prefix="hotwire-bench-")) / "keys.json"
    keys = {"operator": add_key(path, "ops", Role.ADMIN), "tenant": add_key(path, "acme", Role.ADMIN, "acme")}
    app = harness._openai_app(harness.FakeEngine(), Settings(keys_file=str(path)))
    client = TestClient(app)
    for key in keys.values():
        client.headers["Authorization"] = f"Bearer {key}"
        assert harness._upload(client, "happy", harness._vector()).status_code == 201
    return app, keys


async def timed(app: Any, target: Any, batch: list[bytes], key: str | None = None) -> float:
    start = time.process_time()
    for body in batch:
        await one(app, target, body, key)
    return (time.process_time() - start) / len(batch) * 1e6


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32, help="token events of a streamed answer")
    parser.add_argument("--profile", action="store_true", help="cProfile the distinct-spec requests afterwards")
    args = parser.parse_args(argv)
    app = harness._openai_app(harness.FakeEngine(), Settings())
    assert harness._upload(TestClient(app), "happy", harness._vector()).status_code == 201
    keyed, keys = _keyed_app()
    admission = AdmissionMiddleware(route)
    streamed = AdmissionMiddleware(streaming_route(args.chunks))
    cases = {"bare": (app, route, "plain", None), "plain": (app, admission, "plain", None),
             "steered, repeated": (app, admission, "repeated", None),
             "steered, distinct": (app, admission, "distinct", None),
             "operator key": (keyed, admission, "repeated", keys["operator"]),
             "tenant key": (keyed, admission, "repeated", keys["tenant"]),
             "plain, streamed": (app, streamed, "plain", None),
             "steered, streamed": (app, streamed, "repeated", None)}
    for where, target, kind, key in cases.values():
        await timed(where, target, bodies(kind, 200), key)  # warm up
    for r in range(args.rounds):
        figures = [f"{name} {await timed(where, target, bodies(kind, args.requests), key):.1f} us"
                   for name, (where, target, kind, key) in cases.items()]
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
