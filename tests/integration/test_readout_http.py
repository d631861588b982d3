"""Readout through a real ``vllm serve`` (vLLM 0.25.1, CPU, ``HOTWIRE_READOUT=1``): the values come back in the JSON
body of chat and completions responses, equal to the projections on a transformers forward with hooks on the same
weights; what cannot be served (a stream, ``n > 1``, a bad probe) is refused, never answered without its values."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

import hf_reference
from server_fixture import VllmServer

pytestmark = pytest.mark.integration

HIDDEN, LAYERS = 256, 4
ATOL = 2e-3
# float32 on a GPU too, but its kernels sum in other orders than transformers' on the CPU, beyond ATOL: there the
# bound is 1% of the largest score (test_readout's is 2% for bf16)
ON_GPU = torch.cuda.is_available()
GPU_RELATIVE = 1e-2
SERVER_ARGS = [] if torch.cuda.is_available() else ["--enforce-eager"]
PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[list[float]]]:
    rng = np.random.default_rng(5)
    return {"joy": rng.standard_normal((LAYERS, HIDDEN)).tolist(), "calm": rng.standard_normal((LAYERS, HIDDEN)).tolist()}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, rows) -> Iterator[VllmServer]:
    env = {"HOTWIRE_STORE": "off", "HOTWIRE_READOUT": "1", "HOTWIRE_READOUT_PROBES": "2"}
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), env, SERVER_ARGS)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for vector_id, values in rows.items():
            body = {"id": vector_id, "layers": {str(layer): row for layer, row in enumerate(values)}}
            assert http.post("/steer/vectors", json=body).status_code == 201
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return hf_reference.load(tiny_model)


def readout(*probes: tuple[str, int], tokens: str = "all") -> dict[str, str]:
    return {"hotwire_readout": json.dumps({"probes": [{"id": i, "layer": l} for i, l in probes], "tokens": tokens})}


def check(entry: dict, part: str, stream: torch.Tensor, vector: list[float]) -> None:
    v = torch.tensor(vector)
    dots = stream @ v
    err = np.abs(np.array(entry[part]["score"]) - dots.numpy()).max()
    tolerance = max(ATOL, GPU_RELATIVE * dots.abs().max().item()) if ON_GPU else ATOL
    print(f"{entry['probe']} {part}: readout through vllm serve vs transformers + hooks: {err:.3g} "
          f"(largest {dots.abs().max().item():.3g}, tolerance {tolerance:.3g})")
    assert len(entry[part]["score"]) == len(stream) and err < tolerance
    cosine = dots / (stream.norm(dim=-1) * v.norm())
    assert np.abs(np.array(entry[part]["cosine"]) - cosine.numpy()).max() < ATOL


def test_slots_say_how_many_probes_a_request_may_read_and_at_which_layers(http):
    model = http.get("/steer/slots").json()["model"]
    assert (model["readout_probes"], model["readout_layers"]) == (2, f"0-{LAYERS - 1}"), model


@pytest.mark.parametrize("steered", [False, True])
def test_a_completion_carries_its_readout_equal_to_transformers_hooks(http, tiny_model, hf_model, rows, steered):
    xargs = readout(("joy", 1), ("calm", 3))
    if steered:
        xargs["hotwire"] = json.dumps({"id": "calm", "layer": 1, "scale": 2.0})
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": xargs}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    generated = data["choices"][0]["token_ids"]
    got = data["hotwire_readout"]
    assert got["tokens"] == "all" and [p["probe"] for p in got["probes"]] == ["joy@1:L1", "calm@1:L3"]
    assert ("x-hotwire-receipt" in response.headers) == steered
    steering = [(1, torch.tensor(rows["calm"][1]), 2.0)] if steered else []
    reference = hf_reference.layer_outputs(hf_model, PROMPT + generated[:-1], [1, 3], steering)
    P = len(PROMPT)
    for entry, (name, layer) in zip(got["probes"], [("joy", 1), ("calm", 3)]):
        check(entry, "prompt", reference[layer][:P], rows[name][layer])
        check(entry, "generated", reference[layer][P - 1 :], rows[name][layer])


def test_a_chat_response_carries_the_generated_tokens_readout(http, tiny_model):
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "vllm_xargs": readout(("joy", 2), tokens="generated")}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (probe,) = response.json()["hotwire_readout"]["probes"]
    assert list(probe) == ["probe", "bias", "generated"] and len(probe["generated"]["score"]) == 4
    assert all(np.isfinite(probe["generated"]["score"])) and any(probe["generated"]["score"])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_carries_its_readout_in_a_chunk_before_done(http, tiny_model, route, usage):
    """The readout chunk (no choices) comes last before [DONE], equal to the same request's readout unstreamed; the
    usage chunk admission asked vLLM for goes out only if the client asked for it too."""
    body = {"model": str(tiny_model), "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "vllm_xargs": readout(("joy", 1), ("calm", 2))}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    plain = http.post(route, json=body)
    assert plain.status_code == 200, plain.text
    options = {"stream_options": {"include_usage": True}} if usage else {}
    with http.stream("POST", route, json={**body, "stream": True, **options}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[-1]["choices"] == [] and "error" not in events[-1]
    expected = plain.json()["hotwire_readout"]
    for got, want in zip(events[-1]["hotwire_readout"]["probes"], expected["probes"]):
        assert got["probe"] == want["probe"]
        for part in ("prompt", "generated"):
            np.testing.assert_allclose(got[part]["score"], want[part]["score"], atol=ATOL)
    assert sum("usage" in e and e["usage"] and not e["choices"] for e in events) == int(usage)
    assert events[-1]["id"] == events[0]["id"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_carries_its_generated_values_token_by_token(http, tiny_model, route):
    """Chunks carry the values computed since the chunk before (``hotwire_readout``: ``from``, ``probes``), in
    order and without a gap, the same values as the whole readout in the chunk before [DONE]."""
    body = {"model": str(tiny_model), "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
            "vllm_xargs": readout(("joy", 1), ("calm", 3), tokens="generated")}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    whole = events[-1]["hotwire_readout"]
    streamed = [[], []]
    for event in events[:-1]:
        delta = event.get("hotwire_readout")
        if delta is None:
            continue
        assert event["choices"] and delta["from"] == len(streamed[0])  # in order, no gap, no repeat
        for k, probe in enumerate(delta["probes"]):
            assert probe["probe"] == whole["probes"][k]["probe"] and list(probe) == ["probe", "generated"]
            streamed[k] += probe["generated"]["score"]
    print(f"{route}: {len(streamed[0])} of 48 generated tokens' values streamed before the readout's chunk")
    assert streamed[0], "no value arrived while the stream ran"
    for k in (0, 1):
        assert streamed[k] == whole["probes"][k]["generated"]["score"][:len(streamed[k])]


@pytest.mark.parametrize("extra, status, code, field", [
    ({"n": 2}, 400, "bad_readout", "n"),
    ({"prompt": ["one prompt", "and another"]}, 400, "bad_readout", "prompt"),
    ({"vllm_xargs": readout(("nope", 1))}, 400, "unknown_vector", "vllm_xargs.hotwire_readout.probes[0].id"),
    ({"vllm_xargs": readout(("joy", 1), ("joy", 2), ("calm", 0))}, 400, "bad_readout", "vllm_xargs.hotwire_readout.probes"),
    ({"vllm_xargs": {"hotwire_readout": '{"probes": [{"id": "joy", "layer": 1}], "tokens": "most"}'}}, 400,
     "bad_readout", "vllm_xargs.hotwire_readout.tokens"),
])
def test_a_readout_that_cannot_be_served_is_refused(http, tiny_model, extra, status, code, field):
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": readout(("joy", 1)), **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error.get("field")) == (code, field)


def test_a_readout_on_a_route_that_returns_none_is_refused(http, tiny_model):
    body = {"model": str(tiny_model), "input": "hello", "max_output_tokens": 2, "vllm_xargs": readout(("joy", 1))}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "readout_unsupported", response.text


def test_the_clients_and_the_cli_complete_with_steering_and_readout(http, server, tiny_model, capsys):
    """``HotwireClient.complete``, its async twin and ``hotwire complete`` send what the raw request sends and
    return its text, receipt and readout, typed; a refusal is the server's error."""
    import asyncio

    from hotwire_api import cli
    from hotwire_api.client import AsyncHotwireClient, HotwireClient
    from hotwire_api.errors import HotwireError

    body = {"model": str(tiny_model), "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "vllm_xargs": {"hotwire": json.dumps({"id": "calm", "layer": 1, "scale": 2.0}), **readout(("joy", 2))}}
    raw = http.post("/v1/completions", json=body)
    assert raw.status_code == 200, raw.text
    want = raw.json()
    steer, read = [{"id": "calm", "layer": 1, "scale": 2.0}], [{"id": "joy", "layer": 2}]

    def same(got) -> None:
        assert got.text == want["choices"][0]["text"] and got.receipt == raw.headers["x-hotwire-receipt"] == "calm@1:L1x2"
        assert got.completion_tokens == 4 and got.model == str(tiny_model)
        (probe,) = got.readout.probes
        assert probe.probe == "joy@1:L2" and len(probe.prompt.score) == want["usage"]["prompt_tokens"]
        for part in ("prompt", "generated"):
            np.testing.assert_allclose(getattr(probe, part).score, want["hotwire_readout"]["probes"][0][part]["score"],
                                       atol=ATOL)

    with HotwireClient(server.url) as client:
        same(client.complete("hello there", 4, steer=steer, read=read, tokens="all", temperature=0, ignore_eos=True))
        as_cli = client.complete("hello there", 4, steer=steer, read=read, tokens="all", temperature=0)
        plain = client.complete("hello there", 4, temperature=0)
        assert plain.receipt is None and plain.readout is None and plain.text
        with pytest.raises(HotwireError) as info:
            client.complete("hello", 2, read=[{"id": "nope", "layer": 1}])
        assert (info.value.status, info.value.code) == (400, "unknown_vector")

    async def complete_async():
        async with AsyncHotwireClient(server.url) as client:
            return await client.complete("hello there", 4, steer=json.dumps(steer), read=read, tokens="all",
                                         temperature=0, ignore_eos=True)

    same(asyncio.run(complete_async()))
    capsys.readouterr()
    assert cli.main(["--url", server.url, "complete", "hello there", "--max-tokens", "4", "--steer", "calm:1:2",
                     "--read", "joy:2", "--tokens", "all"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["receipt"] == "calm@1:L1x2" and printed["text"] == as_cli.text  # the CLI's temperature is 0
    (probe,) = printed["readout"]["probes"]
    assert probe["probe"] == "joy@1:L2"
    np.testing.assert_allclose(probe["generated"]["score"], as_cli.readout.probes[0].generated.score, atol=ATOL)


def _metric(http, line_start: str) -> float:
    """The value of the /metrics sample whose line starts with ``line_start`` (0 when there is none yet)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def monitors(http) -> Iterator[None]:
    """Monitors on joy@L1 (generated tokens, max; always flagged) and calm@L2 (the last prompt token; flagged below
    a threshold it never reaches), deleted afterwards: the module's other tests see no monitors."""
    added = [{"id": "joy-max", "probe": "joy", "layer": 1, "threshold": -1e9},
             {"id": "calm-prompt", "probe": "calm", "layer": 2, "bias": 0.5, "threshold": -1e9, "flag": "below",
              "scope": "prompt"}]
    for monitor in added:
        assert http.post("/steer/monitors", json=monitor).status_code == 201
    yield
    for monitor in added:
        http.delete(f"/steer/monitors/{monitor['id']}")
    assert http.get("/steer/monitors").json()["monitors"] == []


def test_monitors_read_every_request_as_its_probes_read_it_and_change_nothing_else(http, tiny_model, monitors):
    """A plain request under two monitors: the same tokens as without them, and each monitor's score what a readout
    of its probe gives (max over the generated tokens; the last prompt token's, plus bias); streamed and not; a
    steered request and one with a readout of its own too; /metrics counts them."""
    def body(**extra):
        return {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **extra}

    listed = http.get("/steer/monitors").json()
    assert listed["kept"] == "memory" and [m["id"] for m in listed["monitors"]] == ["joy-max", "calm-prompt"]
    flagged_before = _metric(http, 'hotwire_monitor_requests_total{flagged="true",monitor="joy-max"}')
    plain = http.post("/v1/completions", json=body())
    assert plain.status_code == 200, plain.text
    data = plain.json()
    assert "hotwire_readout" not in data and "x-hotwire-receipt" not in plain.headers
    by_monitor = {v["monitor"]: v for v in data["hotwire_monitors"]}
    assert by_monitor["joy-max"]["probe"] == "joy@1:L1" and by_monitor["calm-prompt"]["probe"] == "calm@1:L2"
    assert by_monitor["joy-max"]["flagged"] is True and by_monitor["calm-prompt"]["flagged"] is False

    http.delete("/steer/monitors/joy-max")  # (the fixture adds it back below)
    http.delete("/steer/monitors/calm-prompt")
    unmonitored = http.post("/v1/completions", json=body()).json()
    assert "hotwire_monitors" not in unmonitored
    assert unmonitored["choices"][0]["token_ids"] == data["choices"][0]["token_ids"]  # the monitors changed nothing
    read = http.post("/v1/completions", json=body(vllm_xargs=readout(("joy", 1), ("calm", 2), tokens="generated")))
    probes = read.json()["hotwire_readout"]["probes"]
    assert by_monitor["joy-max"]["score"] == pytest.approx(max(probes[0]["generated"]["score"]), abs=ATOL)
    assert by_monitor["calm-prompt"]["score"] == pytest.approx(probes[1]["generated"]["score"][0] + 0.5, abs=ATOL)
    for monitor in ({"id": "joy-max", "probe": "joy", "layer": 1, "threshold": -1e9},
                    {"id": "calm-prompt", "probe": "calm", "layer": 2, "bias": 0.5, "threshold": -1e9, "flag": "below",
                     "scope": "prompt"}):
        assert http.post("/steer/monitors", json=monitor).status_code == 201

    with http.stream("POST", "/v1/completions", json=body(stream=True)) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"] == []
    assert not any(e.get("usage") for e in events[:-1])  # the usage chunk admission asked for is not passed on
    for got, want in zip(events[-1]["hotwire_monitors"], data["hotwire_monitors"]):
        assert got["monitor"] == want["monitor"] and got["score"] == pytest.approx(want["score"], abs=ATOL)

    steered = http.post("/v1/completions", json=body(vllm_xargs={"hotwire": json.dumps({"id": "calm", "layer": 1,
                                                                                         "scale": 2.0})}))
    assert steered.headers["x-hotwire-receipt"] == "calm@1:L1x2" and len(steered.json()["hotwire_monitors"]) == 2
    assert _metric(http, 'hotwire_monitor_requests_total{flagged="true",monitor="joy-max"}') == flagged_before + 3
    assert _metric(http, 'hotwire_monitor_score_count{monitor="calm-prompt"}') >= 3

    from hotwire_api.client import HotwireClient

    with HotwireClient(str(http.base_url)) as client:  # the client's typed answer carries the verdicts
        typed = client.complete(PROMPT, 5, temperature=0, ignore_eos=True)
        assert [m.id for m in client.monitors()] == ["joy-max", "calm-prompt"]
        added = client.add_monitor({"id": "joy-max", "probe": "joy", "layer": 1, "threshold": 1e9}, replace=True)
        assert [m.threshold for m in added if m.id == "joy-max"] == [1e9]
        assert [v.flagged for v in client.complete(PROMPT, 5, temperature=0).monitors if v.monitor == "joy-max"] \
            == [False]
        client.delete_monitor("calm-prompt")
    assert [(v.monitor, v.flagged) for v in typed.monitors] == [("joy-max", True), ("calm-prompt", False)]
    assert typed.monitors[0].score == pytest.approx(by_monitor["joy-max"]["score"], abs=ATOL)
    from hotwire_api import cli

    assert cli.main(["--url", str(http.base_url), "monitors", "add", "calm-prompt", "--probe", "calm", "--layer", "2",
                     "--threshold=-1e9", "--bias", "0.5", "--flag", "below", "--scope", "prompt"]) == 0
    assert cli.main(["monitors", "delete", "nobody", "--url", str(http.base_url)]) == 1  # 404 unknown_monitor


def test_a_request_the_monitors_cannot_read_is_served_as_without_them(http, tiny_model, monitors):
    def skipped(reason):
        return _metric(http, f'hotwire_monitor_skipped_total{{reason="{reason}"}}')

    before = {reason: skipped(reason) for reason in ("n", "probe_limit", "route", "unavailable")}
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    two = http.post("/v1/completions", json={**body, "n": 2, "temperature": 1.0, "top_k": 1})  # (vLLM: n > 1 not greedy)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2 and "hotwire_monitors" not in two.json()
    batch = http.post("/v1/completions", json={**body, "prompt": ["one", "two"]})
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2 and "hotwire_monitors" not in batch.json()
    # the server reads 2 probes per request: the client's own readout is served, the monitors are not
    mine = http.post("/v1/completions", json={**body, "vllm_xargs": readout(("joy", 3), tokens="prompt")})
    assert mine.status_code == 200 and "hotwire_monitors" not in mine.json()
    assert list(mine.json()["hotwire_readout"]["probes"][0]) == ["probe", "bias", "prompt"]
    responses = http.post("/v1/responses", json={"model": str(tiny_model), "input": "hello", "max_output_tokens": 2})
    assert responses.status_code == 200, responses.text
    assert skipped("n") == before["n"] + 2 and skipped("probe_limit") == before["probe_limit"] + 1
    assert skipped("route") == before["route"] + 1

    # a monitor whose probe is deleted: requests are served without monitors until it is back
    assert http.post("/steer/vectors", json={"id": "gone", "layers": {"1": [1.0] * HIDDEN}}).status_code == 201
    assert http.delete("/steer/monitors/calm-prompt").status_code == 204
    assert http.post("/steer/monitors", json={"id": "m", "probe": "gone", "layer": 1, "threshold": 0}).status_code == 201
    assert http.delete("/steer/vectors/gone").status_code in (202, 204)
    served = http.post("/v1/completions", json=body)
    assert served.status_code == 200 and "hotwire_monitors" not in served.json()
    assert skipped("unavailable") == before["unavailable"] + 1
    assert http.delete("/steer/monitors/m").status_code == 204
    assert http.post("/steer/monitors", json={"id": "calm-prompt", "probe": "calm", "layer": 2, "threshold": 0}
                     ).status_code == 201


@pytest.mark.parametrize("monitor, replace, status, code, field", [
    ({"id": "joy-max", "probe": "joy", "layer": 1, "threshold": 0}, False, 409, "exists", "id"),
    ({"id": "joy-max", "probe": "nope", "layer": 1, "threshold": 0}, True, 400, "unknown_vector", "probe"),
    ({"id": "joy-max", "probe": "joy", "layer": 9, "threshold": 0}, True, 400, "layer_out_of_range", "layer"),
    ({"id": "x", "probe": "joy", "layer": 1, "threshold": 0}, False, 400, "bad_readout", None),  # a third: over 2
    ({"id": "x", "probe": "joy", "layer": 1}, False, 400, "bad_request", "threshold"),
    ({"id": "x", "probe": "joy", "layer": 1, "threshold": 0, "scope": "all"}, False, 400, "bad_request", "scope"),
    ({"id": "joy-max", "probe": "joy", "layer": 2, "threshold": 0}, True, 200, None, None),
])
def test_a_monitor_that_cannot_read_every_request_is_refused(http, monitors, monitor, replace, status, code, field):
    response = http.post("/steer/monitors", json=monitor, params={"replace": str(replace).lower()})
    assert response.status_code == status, response.text
    if code is not None:
        assert (response.json()["error"]["code"], response.json()["error"].get("field")) == (code, field)
    else:
        assert {"id": "joy-max", "layer": 2} in [{"id": m["id"], "layer": m["layer"]} for m in response.json()["monitors"]]
    assert http.delete("/steer/monitors/x").status_code == 404
    assert http.delete("/steer/monitors/x").json()["error"]["code"] == "unknown_monitor"


def test_gated_steering_through_vllm_serve_steers_where_its_condition_holds(http, server, tiny_model):
    """A condition that always holds steers as the ungated entry does, one that never holds leaves the request
    plain; each response names what fired (a stream too, in the chunk before [DONE]), and the receipt the condition.
    What cannot return the receipt is refused."""
    def complete(spec, **extra):
        xargs = {"hotwire": json.dumps(spec)} if spec else {}
        body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "return_token_ids": True, "vllm_xargs": xargs, **extra}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response

    entry = {"id": "calm", "layer": 3, "scale": 6.0}
    steered, plain = complete(entry).json(), complete(None).json()
    always = complete({**entry, "when": {"id": "joy", "layer": 1, "above": -1e30}})
    never = complete({**entry, "when": {"id": "joy", "layer": 1, "below": -1e30}})
    assert always.headers["x-hotwire-receipt"] == "calm@1:L3x6,when=joy@1:L1>-1e+30"
    assert always.json()["choices"][0]["logprobs"] == steered["choices"][0]["logprobs"]
    assert never.json()["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
    assert steered["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]
    P = len(PROMPT)
    assert always.json()["hotwire_gate"] == {"condition": "joy@1:L1", "fired": True, "position": 0,
                                             "positions_held": P + 5, "prompt_tokens": P, "latch": False}
    assert never.json()["hotwire_gate"]["fired"] is False and "hotwire_readout" not in never.json()

    gated = {"hotwire": json.dumps({**entry, "when": {"id": "joy", "layer": 1, "above": -1e30}})}
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "vllm_xargs": gated}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["choices"] == [] and events[-1]["hotwire_gate"]["positions_held"] == P + 5
    assert not any("hotwire_readout" in e for e in events)
    for extra, route in (({"n": 2}, "/v1/completions"), ({}, "/v1/responses")):
        body = {"model": str(tiny_model), "max_tokens": 2, "vllm_xargs": gated, **extra,
                **({"prompt": PROMPT} if route == "/v1/completions" else {"input": "hi"})}
        response = http.post(route, json=body)
        assert response.status_code == 400 and response.json()["error"]["code"] == "gate_unsupported", response.text
    from hotwire_api.client import HotwireClient

    with HotwireClient(server.url) as client:
        out = client.complete(PROMPT, 6, steer={**entry, "when": {"id": "joy", "layer": 1, "below": -1e30}},
                              temperature=0, ignore_eos=True)
    assert out.gate is not None and not out.gate.fired and out.receipt.endswith(",when=joy@1:L1<-1e+30")
