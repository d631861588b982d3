"""Container healthcheck: proves that steering is live, not only that the model answers.

    python -m hotwire_api.healthcheck [--url URL] [--timeout SECONDS] [--keep]

Against ``http://localhost:${PORT:-8000}`` (or ``--url`` / ``HOTWIRE_HEALTHCHECK_URL``):

1. ``GET /steer/slots`` must answer 200 with ``model.steerable`` true (hotwire is attached and the engine can steer);
2. a probe vector ``_healthcheck`` of float32 values, ``model.hidden_size`` long (norm 16, the same values at every
   check), is registered with ``POST /steer/vectors?replace=true`` (JSON registration). On a replica of a fleet
   (``HOTWIRE_REGISTRY`` set) the id is ``_healthcheck.<replica>`` (``HOTWIRE_REPLICA_ID``, else host name and port), so
   one replica's check never deletes the probe another's is steering with; fixed values make every check store
   the same content-addressed blob in Redis, not a new one;
3. one short greedy completion (``max_tokens`` 2, ``logprobs`` 1) is sent twice to ``/v1/completions``, plain and
   with ``vllm_xargs.hotwire`` steering the probe at the first layer the server hooks (``model.layers``, e.g.
   0, or the first of ``HOTWIRE_LAYERS``), scale 50; the logprobs must differ. A server whose bank has no row
   free for the probe (429 ``slots_exhausted``, or with ``HOTWIRE_LENIENT=1`` an unsteered answer that says so) is
   busy, not broken: healthy, with the steering unproven this time;
4. the probe is deleted again (best effort; ``--keep`` leaves it registered).

``--timeout`` (default 25 s) bounds the whole check, so it ends within the 30 s the Docker healthchecks allow.
Exit 0 when all holds (one ``ok`` line on stdout), else 1 with a one-line reason on stderr, as Docker's
``HEALTHCHECK`` expects. Keys: ``/steer/*`` gets ``HOTWIRE_API_KEY`` (else ``VLLM_API_KEY``), the OpenAI routes get
``VLLM_API_KEY`` (else ``HOTWIRE_API_KEY``), each as ``Authorization: Bearer <key>`` and only when set.
Needs only httpx, the standard library, ``hotwire_core.settings`` and ``hotwire_api.fleet.config`` (both standard
library only).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import random
import re
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

import httpx

from hotwire_api.fleet.config import REGISTRY, REPLICA_ID, default_replica_name
from hotwire_api.settings import API_KEY
from hotwire_core.error_codes import ErrorCode
from hotwire_core.settings import parse_layers

PROBE_ID = "_healthcheck"
PROBE_SCALE = 50
PROMPT = "The quick brown fox"
MAX_TOKENS = 2
# Smallest change in a token's logprob that counts as "steered" (steering at scale 50 moves them by far more;
# this only keeps run-to-run numerical noise from passing for steering).
MIN_LOGPROB_DELTA = 1e-4
DEFAULT_TIMEOUT_S = 25.0  # the whole check; Docker's healthchecks here give it 30 s
BANK_FULL = ErrorCode.SLOTS_EXHAUSTED  # the refusal (or lenient reason) of a steered request when no bank row is free


class Unhealthy(Exception):
    """A failed check; its message is the one-line reason."""


def default_url() -> str:
    return os.environ.get("HOTWIRE_HEALTHCHECK_URL") or f"http://localhost:{os.environ.get('PORT') or 8000}"


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _keys() -> tuple[str | None, str | None]:
    """(key for /steer/*, key for /v1/*): hotwire's key guards /steer, vLLM's own guards /v1."""
    hotwire = API_KEY.read()
    vllm = os.environ.get("VLLM_API_KEY") or None
    return hotwire or vllm, vllm or hotwire


class Deadline:
    """The time left for the whole check; each request may take what is left."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise Unhealthy(f"{what}: the check ran past its {self.seconds:g} s (--timeout)")
        return left


def _send(client: httpx.Client, deadline: Deadline, method: str, path: str, **kwargs: Any) -> httpx.Response:
    what = f"{method} {path}"
    try:
        return client.request(method, path, timeout=deadline.left(what), **kwargs)
    except httpx.TimeoutException:
        raise Unhealthy(f"{what}: no answer within the check's {deadline.seconds:g} s (--timeout)") from None
    except httpx.ConnectError as exc:
        # vLLM binds its port at once but listens only once its engine is up: until then a connection fails
        # (refused, or in some containers [Errno 99]), which says "starting", not "broken".
        raise Unhealthy(f"{what}: nothing listens at {client.base_url} yet: the server is still starting (or not "
                        f"running) ({type(exc).__name__}: {exc})") from None
    except httpx.HTTPError as exc:
        raise Unhealthy(f"{what}: cannot reach {client.base_url}: {type(exc).__name__}: {exc}") from None


def _json(resp: httpx.Response, what: str, ok: tuple[int, ...] = (200,)) -> Any:
    if resp.status_code not in ok:
        raise Unhealthy(f"{what}: HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        return resp.json()
    except ValueError:
        raise Unhealthy(f"{what}: HTTP {resp.status_code} but the body is not JSON: {resp.text[:200]}") from None


def _call(client: httpx.Client, deadline: Deadline, method: str, path: str, ok: tuple[int, ...] = (200,), **kwargs: Any) -> Any:
    return _json(_send(client, deadline, method, path, **kwargs), f"{method} {path}", ok)


def _bank_full(resp: httpx.Response) -> bool:
    """A steered answer that found no free bank row: a 429 ``slots_exhausted``, or (lenient mode) served unsteered
    with that reason in ``x-hotwire-lenient``."""
    if resp.status_code == 429:
        try:
            return resp.json()["error"]["code"] == BANK_FULL
        except (ValueError, KeyError, TypeError):
            return False
    return resp.headers.get("x-hotwire-lenient", "").startswith(BANK_FULL)


PROBE_NORM = 16.0  # x PROBE_SCALE: well inside what the server lets a request add (float16 models: 4096)


def probe_vector(hidden: int, rng: random.Random) -> bytes:
    """``hidden`` random float32 values (little-endian) of norm :data:`PROBE_NORM`, whatever the model's width."""
    values = [rng.gauss(0.0, 1.0) for _ in range(hidden)]
    factor = PROBE_NORM / math.sqrt(sum(v * v for v in values))
    return struct.pack(f"<{hidden}f", *(v * factor for v in values))


def probe_layer(model: dict[str, Any]) -> int:
    """The first hooked layer (``model.layers``, e.g. ``"14-21"``); 0 when the server does not say."""
    layers = model.get("layers")
    return min(parse_layers(layers)) if isinstance(layers, str) and layers else 0


def probe_id(port: int | None = None, env: Mapping[str, str] = os.environ) -> str:
    """:data:`PROBE_ID`, or on a fleet replica ``_healthcheck.<replica>``: ``HOTWIRE_REPLICA_ID``, else the name the
    replica on ``port`` gives itself (``<host name>:<port>``); characters outside the id alphabet become ``-``, at
    most 64 in all."""
    try:
        fleet = REGISTRY.read(env) is not None
    except ValueError:  # a server with such a setting does not start; its check must not crash on it
        fleet = True
    if not fleet:
        return PROBE_ID
    replica = REPLICA_ID.read(env) or default_replica_name(port)
    return f"{PROBE_ID}.{re.sub(r'[^A-Za-z0-9._-]', '-', replica)}"[:64]


def steering_spec(layer: int, vector_id: str = PROBE_ID) -> str:
    return json.dumps({"id": vector_id, "layer": layer, "scale": PROBE_SCALE})


def _logprobs(body: Any, label: str) -> dict[str, Any]:
    try:
        logprobs = body["choices"][0]["logprobs"]
        tokens = logprobs["tokens"]
        values = logprobs["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise Unhealthy(f"the {label} completion returned no logprobs: {json.dumps(body)[:200]}") from None
    if not tokens or len(tokens) != len(values):
        raise Unhealthy(f"the {label} completion returned no usable logprobs: {json.dumps(logprobs)[:200]}")
    return logprobs


def logprobs_differ(plain: dict[str, Any], steered: dict[str, Any]) -> bool:
    """True when the sampled tokens differ or some token's logprob moved by more than MIN_LOGPROB_DELTA."""
    if plain["tokens"] != steered["tokens"]:
        return True
    for a, b in zip(plain["token_logprobs"], steered["token_logprobs"]):
        if a is None or b is None:
            if a is not b:
                return True
        elif not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > MIN_LOGPROB_DELTA:
            return True
    return False


def check(
    client: httpx.Client,
    steer_key: str | None = None,
    openai_key: str | None = None,
    rng: random.Random | None = None,
    keep: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Run the checks against ``client`` (its base URL is the server) within ``timeout`` seconds in all; return a
    one-line summary or raise :class:`Unhealthy`."""
    deadline = Deadline(timeout)
    steer = _bearer(steer_key)
    openai = _bearer(openai_key)
    slots = _call(client, deadline, "GET", "/steer/slots", headers=steer)
    model = slots.get("model") if isinstance(slots, dict) else None
    if not isinstance(model, dict):
        raise Unhealthy(f"GET /steer/slots: no 'model' in the answer: {json.dumps(slots)[:200]}")
    if model.get("steerable") is not True:
        raise Unhealthy(f"the served model cannot be steered: {model.get('reason') or 'model.steerable is not true'}")
    hidden = model.get("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise Unhealthy(f"GET /steer/slots: model.hidden_size is {hidden!r}, not a positive integer")

    # Seeded by the width: the same bytes at every check (one blob in a fleet's Redis).
    data = probe_vector(hidden, rng or random.Random(f"hotwire-healthcheck-{hidden}"))
    vector_id = probe_id(client.base_url.port)
    registration = {
        "id": vector_id,
        "data": base64.b64encode(data).decode("ascii"),
        "dtype": "float32",
        "shape": [hidden],
    }
    _call(client, deadline, "POST", "/steer/vectors", ok=(200, 201), params={"replace": "true"}, json=registration, headers=steer)
    try:
        models = _call(client, deadline, "GET", "/v1/models", headers=openai)
        try:
            name = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise Unhealthy(f"GET /v1/models: no model listed: {json.dumps(models)[:200]}") from None
        request = {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
        plain = _logprobs(_call(client, deadline, "POST", "/v1/completions", json=request, headers=openai), "plain")
        layer = probe_layer(model)
        steered_request = {**request, "vllm_xargs": {"hotwire": steering_spec(layer, vector_id)}}
        answer = _send(client, deadline, "POST", "/v1/completions", json=steered_request, headers=openai)
        if _bank_full(answer):
            return f"ok: {name!r} answers; every bank row is pinned by running requests, so steering was not probed"
        steered = _logprobs(_json(answer, "POST /v1/completions (steered)"), "steered")
        lenient = answer.headers.get("x-hotwire-lenient")
        if lenient:
            raise Unhealthy(f"the steered probe was served unsteered (lenient mode): {lenient}")
        if not logprobs_differ(plain, steered):
            raise Unhealthy(
                f"steering had no effect: {vector_id} at layer {layer}, scale {PROBE_SCALE} left the logprobs "
                f"of {name!r} unchanged ({plain['token_logprobs']})"
            )
    finally:
        if not keep:
            try:  # given a few seconds even past the deadline: a probe left behind holds a vector, not a row
                client.delete(f"/steer/vectors/{vector_id}", headers=steer, timeout=3.0)
            except httpx.HTTPError:
                pass
    return (
        f"ok: {name!r} answers and is steered (hidden {hidden}; tokens {plain['tokens']} -> {steered['tokens']})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hotwire_api.healthcheck", description="Check that a hotwire server answers and steers."
    )
    parser.add_argument("--url", default=default_url(), help="server URL (default http://localhost:${PORT:-8000})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the whole check")
    parser.add_argument("--keep", action="store_true",
                        help=f"leave the probe vector ({PROBE_ID!r}; on a fleet replica {PROBE_ID}.<replica>) registered")
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steer_key, openai_key = _keys()
    try:
        with httpx.Client(base_url=args.url) as client:
            summary = check(client, steer_key, openai_key, keep=args.keep, timeout=args.timeout)
    except Unhealthy as exc:
        print(f"unhealthy: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # a healthcheck must answer, whatever went wrong
        print(f"unhealthy: {_one_line(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
        return 1
    print(_one_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
