"""The clients' request side: what the CLI's shorthands mean, that a spec or readout that cannot be served is
refused before anything is sent (``hotwire_api.completion``), and the clients' keep-alive. Their answers are checked
against a real ``vllm serve`` in tests/integration/test_readout_http.py."""

from __future__ import annotations

import json

import pytest

from hotwire_api import cli
from hotwire_api.completion import completion_body, parse_probe, parse_steering


def test_the_shorthands_are_spec_entries_and_probes() -> None:
    assert parse_steering("happy:10:4") == {"id": "happy", "layer": 10, "scale": 4.0}
    assert parse_steering("a:b:3:-1.5") == {"id": "a:b", "layer": 3, "scale": -1.5}  # the id keeps its colons
    assert parse_probe("refusal:14") == {"id": "refusal", "layer": 14}
    assert parse_probe("refusal:14:-0.5") == {"id": "refusal", "layer": 14, "bias": -0.5}


@pytest.mark.parametrize("parse, value, says", [
    (parse_steering, "happy:10", "ID:LAYER:SCALE"), (parse_steering, "happy:x:1", "LAYER must be an integer"),
    (parse_steering, "happy:1:big", "SCALE must be a number"), (parse_probe, "refusal", "ID:LAYER"),
    (parse_probe, ":3", "ID:LAYER"), (parse_probe, "r:1:2:3", "ID:LAYER"), (parse_probe, "r:1:x", "BIAS must be"),
])
def test_bad_shorthands_say_what_they_take(parse, value, says) -> None:
    with pytest.raises(ValueError, match=says):
        parse(value)


def test_the_body_carries_the_spec_and_the_readout_as_vllm_xargs() -> None:
    body = completion_body("m", "hi", 8, [{"id": "a", "layer": 2, "scale": 1.5}], [{"id": "p", "layer": 1}], "all",
                           {"temperature": 0})
    assert body["model"] == "m" and body["prompt"] == "hi" and body["max_tokens"] == 8 and body["temperature"] == 0
    assert json.loads(body["vllm_xargs"]["hotwire"]) == [{"id": "a", "layer": [2], "scale": 1.5}]
    assert json.loads(body["vllm_xargs"]["hotwire_readout"]) == {"probes": [{"id": "p", "layer": 1, "bias": 0.0}],
                                                                 "tokens": "all"}
    same = completion_body("m", [1, 2], 8, '{"id": "a", "layer": 2, "scale": 1.5}', None, "generated", {})
    assert same["vllm_xargs"] == {"hotwire": body["vllm_xargs"]["hotwire"]} and same["prompt"] == [1, 2]
    assert "vllm_xargs" not in completion_body("m", "hi", 8, None, None, "generated", {})  # plain


@pytest.mark.parametrize("steer, read, tokens, params, says", [
    ({"id": "a", "layer": 2}, None, "generated", {}, "scale"),
    ("{not json", None, "generated", {}, "not a JSON spec"),
    (None, [{"id": "p"}], "generated", {}, "layer"),
    (None, [{"id": "p", "layer": 1}], "some", {}, "tokens"),
    (None, None, "generated", {"vllm_xargs": {}}, "not vllm_xargs"),
])
def test_what_cannot_be_served_is_refused_before_sending(steer, read, tokens, params, says) -> None:
    with pytest.raises(ValueError, match=says):
        completion_body("m", "hi", 8, steer, read, tokens, params)


def test_the_cli_refuses_steer_and_spec_together_and_bad_shorthands(capsys) -> None:
    assert cli.main(["--url", "http://127.0.0.1:9", "complete", "hi", "--steer", "a:1:1", "--spec", "[]"]) == 2
    assert "--steer or --spec" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["complete", "hi", "--read", "p:one"])
    assert info.value.code == 2 and "LAYER must be an integer, got 'one'" in capsys.readouterr().err


def test_the_clients_drop_idle_connections_before_vllms_server_does() -> None:
    """vLLM closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; a client keeping it as long may send
    on a connection being closed (docs/deployment.md, "Idle connections")."""
    import asyncio

    import vllm.envs

    from hotwire_api.client import KEEPALIVE_S, AsyncHotwireClient, HotwireClient

    assert KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    with HotwireClient() as client:
        assert client._http._transport._pool._keepalive_expiry == KEEPALIVE_S
    async_client = AsyncHotwireClient()
    assert async_client._http._transport._pool._keepalive_expiry == KEEPALIVE_S
    asyncio.run(async_client.aclose())
