"""Request features with steering, against a real ``vllm serve`` (vLLM 0.25.1, tiny float32 model; CPU in CI): each
is steered as the spec says, or refused with a clear 4xx; never served unsteered.

- ``n > 1`` (streamed too) and a list of prompts: every child is steered alike (greedy: as the same request with
  ``n=1``; seeded: child ``i`` as the ``n=1`` request with seed ``seed + i``, vLLM's ``ParentRequest`` rule), one
  receipt, usage and the engine's count of steered requests consistent. ``best_of`` is no field of vLLM 0.25.1's
  requests (ignored, as for any request).
- ``prompt_logprobs`` / ``echo``: the prompt steered as transformers with a hook computes it, or plain with
  ``decode_only``.
- structured output (``structured_outputs`` regex and JSON schema): the output obeys the grammar and is the steered
  model's greedy choice under the same grammar (transformers with a hook, masked by xgrammar as vLLM masks it).
- ``stop`` strings: the steered text cut at the stop string.
- ``/v1/responses``: steered exactly as chat with the same message (test_server.py: apart from plain, streamed).
- beam search spelled other than JSON ``true``, and the pooling routes: 400 ``steering_unsupported``
  (test_hardening.py: beam search with ``true``, ``/v1/embeddings``, ``/pooling`` and the token route).

One server for the module, with ``--enforce-eager`` on the CPU (as test_server.py).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import hf_reference
from server_fixture import VllmServer, max_diff

pytestmark = pytest.mark.integration

HIDDEN = 256
PROMPT = "The quick brown fox jumps over"
RECEIPT = "x-hotwire-receipt"
# JSON without free whitespace: a random model otherwise fills it with whitespace up to max_tokens
SERVER_ARGS = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
               *([] if torch.cuda.is_available() else ["--enforce-eager"])]
VECTOR = np.random.default_rng(7).standard_normal(HIDDEN).astype(np.float32)
ENTRY = {"id": "feat", "layer": [1, 2], "scale": 2.0}
# float32 vLLM on the CPU against transformers (test_engine.py); the steering moves logprobs far more
HF_TOLERANCE = 2e-3
SAME = 1e-4  # one server, other batch shapes: float32 rounding


def spec(**flags: Any) -> str:
    return json.dumps({**ENTRY, **flags})


def steering() -> list[tuple[int, torch.Tensor, float, bool]]:
    """``ENTRY`` as transformers hook entries."""
    return [(layer, torch.from_numpy(VECTOR), ENTRY["scale"], False) for layer in ENTRY["layer"]]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[VllmServer]:
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("vllm-serve"), {}, SERVER_ARGS)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        data = base64.b64encode(VECTOR.tobytes()).decode()
        response = client.post("/steer/vectors", json={"id": "feat", "data": data, "dtype": "float32", "shape": [HIDDEN]})
        assert response.status_code == 201, response.text
        yield client


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def hf(tiny_model):
    return hf_reference.load(tiny_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def completion(model: str, hotwire: str | None = None, **params: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, **params}  # fmt: skip
    if hotwire is not None:
        body["vllm_xargs"] = {"hotwire": hotwire}
    return body


def answer(response: httpx.Response, receipt: str | None = "feat@1:L1+2x2") -> dict[str, Any]:
    """A 200 with choices, and ``receipt`` (None: none, the request was plain)."""
    assert response.status_code == 200, response.text
    assert response.headers.get(RECEIPT) == receipt, response.headers
    body = response.json()
    assert body["choices"], body
    return body


def choice_logprobs(choice: dict[str, Any]) -> list[float]:
    return choice["logprobs"]["token_logprobs"]


def steered_count(http: httpx.Client) -> int:
    return http.get("/steer/slots").json()["steered_requests"]


# -- n > 1 -----------------------------------------------------------------------------------------------------


def test_every_greedy_child_of_n_is_steered_like_n_1(http, model):
    """vLLM 0.25.1 refuses ``n > 1`` with temperature 0 ("n must be 1 when using greedy sampling"): ``top_k: 1``
    samples greedily all the same."""
    greedy = {"temperature": 1.0, "top_k": 1}
    plain = answer(http.post("/v1/completions", json=completion(model, **greedy)), None)["choices"][0]
    one = answer(http.post("/v1/completions", json=completion(model, spec(), **greedy)))["choices"][0]
    assert max_diff(choice_logprobs(one), choice_logprobs(plain)) > 1e-2
    before = steered_count(http)
    many = answer(http.post("/v1/completions", json=completion(model, spec(), n=3, **greedy)))
    assert steered_count(http) == before + 3  # every child was admitted steered in the engine
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for child in many["choices"]:
        assert child["token_ids"] == one["token_ids"]
        assert max_diff(choice_logprobs(child), choice_logprobs(one)) < SAME
    assert many["usage"]["prompt_tokens"] == len(many["choices"][0]["prompt_token_ids"])
    assert many["usage"]["completion_tokens"] == 3 * len(one["token_ids"])
    # streamed: each child's tokens, in events by index
    streamed = http.post("/v1/completions", json=completion(model, spec(), n=2, stream=True, **greedy))
    assert streamed.status_code == 200 and streamed.headers[RECEIPT] == "feat@1:L1+2x2"
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                tokens[choice["index"]] += choice.get("token_ids") or []
    assert tokens == {0: one["token_ids"], 1: one["token_ids"]}
    # several prompts in one request: each its own engine request, each steered
    other = answer(http.post("/v1/completions", json=completion(model, spec(), prompt="Hello world, this is", **greedy)))
    batch = answer(http.post("/v1/completions", json=completion(model, spec(), prompt=[PROMPT, "Hello world, this is"],
                                                                **greedy)))
    for got, alone in zip(batch["choices"], (one, other["choices"][0]), strict=True):
        assert max_diff(choice_logprobs(got), choice_logprobs(alone)) < SAME
    # best_of is not a field of vLLM 0.25.1's requests: it is ignored, the one choice steered
    best = answer(http.post("/v1/completions", json=completion(model, spec(), best_of=3, **greedy)))
    (choice,) = best["choices"]
    assert max_diff(choice_logprobs(choice), choice_logprobs(one)) < SAME
    # chat fans out the same way
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **greedy,
            "logprobs": True, "vllm_xargs": {"hotwire": spec()}}  # fmt: skip
    chat_one = answer(http.post("/v1/chat/completions", json=chat))["choices"][0]
    for child in answer(http.post("/v1/chat/completions", json={**chat, "n": 2}))["choices"]:
        assert max_diff([t["logprob"] for t in child["logprobs"]["content"]],
                        [t["logprob"] for t in chat_one["logprobs"]["content"]]) < SAME


def test_every_seeded_child_of_n_is_steered_like_its_own_seed(http, model, hf, tokenizer):
    """vLLM gives child ``i`` of a seeded request the seed ``seed + i``: each child equals the ``n=1`` steered request
    with that seed, and differs from the plain one. The prompt side (prompt_logprobs) is steered as transformers
    computes it."""
    params = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    many = answer(http.post("/v1/completions", json=completion(model, spec(), n=3, seed=11, prompt_logprobs=0, **params)))
    assert len({tuple(c["token_ids"]) for c in many["choices"]}) > 1, "the children did not sample apart"
    for i, child in enumerate(many["choices"]):
        alone = answer(http.post("/v1/completions", json=completion(model, spec(), seed=11 + i, **params)))["choices"][0]
        assert child["token_ids"] == alone["token_ids"], i
        assert max_diff(choice_logprobs(child), choice_logprobs(alone)) < SAME, i
        plain = answer(http.post("/v1/completions", json=completion(model, seed=11 + i, **params)), None)
        plain = plain["choices"][0]
        assert plain["token_ids"] != child["token_ids"] or max_diff(choice_logprobs(plain), choice_logprobs(child)) > 1e-2
    ids = many["choices"][0]["prompt_token_ids"]
    expected = hf_reference.prompt_logprobs(hf, ids, steering())
    assert max_diff(prompt_side(many["choices"][0], ids), expected.tolist()) < HF_TOLERANCE


# -- prompt_logprobs and echo ----------------------------------------------------------------------------------


def prompt_side(choice: dict[str, Any], ids: list[int]) -> list[float]:
    """The logprob of each prompt token after the first, from a choice's ``prompt_logprobs``."""
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])]


@pytest.mark.parametrize("phase", ["both", "prefill_only", "decode_only"])
def test_prompt_logprobs_and_echo_show_the_prompt_steered_as_the_spec_says(http, model, hf, phase):
    flags = {} if phase == "both" else {phase: True}
    hotwire, receipt = spec(**flags), "feat@1:L1+2x2" + "".join(f",{flag}" for flag in flags)
    response = answer(http.post("/v1/completions", json=completion(model, hotwire, prompt_logprobs=0, max_tokens=2)),
                      receipt)
    assert response["choices"][0]["logprobs"] is not None
    ids = response["choices"][0]["prompt_token_ids"]
    plain_expected = hf_reference.prompt_logprobs(hf, ids).tolist()
    steered_expected = hf_reference.prompt_logprobs(hf, ids, steering()).tolist()
    assert max_diff(steered_expected, plain_expected) > 10 * HF_TOLERANCE  # the steering is visible on the prompt
    expected = plain_expected if phase == "decode_only" else steered_expected
    got = prompt_side(response["choices"][0], ids)
    assert max_diff(got, expected) < HF_TOLERANCE
    # echo with logprobs: the prompt's logprobs lead the choice's, then the generated tokens'
    echoed = answer(http.post("/v1/completions", json=completion(model, hotwire, echo=True, max_tokens=2)), receipt)
    (choice,) = echoed["choices"]
    lps = choice_logprobs(choice)
    assert lps[0] is None and len(lps) == len(ids) + 2
    assert max_diff(lps[1:len(ids)], expected) < HF_TOLERANCE
    assert max_diff(lps[len(ids):], choice_logprobs(response["choices"][0])) < SAME
    # echo without generation (max_tokens 0): the prompt alone, as steered
    prompt_only = answer(http.post("/v1/completions", json=completion(model, hotwire, echo=True, max_tokens=0)), receipt)
    assert max_diff(choice_logprobs(prompt_only["choices"][0])[1:], expected) < HF_TOLERANCE


# -- structured output -----------------------------------------------------------------------------------------

REGEX = r"(fox|dog|cat) [a-z]{3,10}\."
SCHEMA = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog", "cat"]},
                                           "name": {"type": "string", "maxLength": 8}},
          "required": ["animal", "name"], "additionalProperties": False}  # fmt: skip


def grammar_reference(hf, tokenizer, ids: list[int], kind: str, grammar: Any, steer: list, max_tokens: int
                      ) -> tuple[list[int], list[float]]:
    """Greedy decoding under the grammar as vLLM's xgrammar backend masks it (structured_output/backend_xgrammar.py:
    the tokenizer's xgrammar info over the model's vocabulary; JSON without free whitespace, as the server is set),
    with the steered transformers forward: the tokens and their logprobs, which vLLM takes after the mask
    (renormalised over the allowed tokens)."""
    import xgrammar as xgr

    vocab = hf.config.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    if kind == "regex":
        compiled = compiler.compile_regex(grammar)
    else:
        compiled = compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    logprobs: list[float] = []
    while len(out) < max_tokens and not matcher.is_terminated():
        row = hf_reference.logprobs(hf, ids + out, steer)[-1].clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row[None], bitmask)
        row = torch.log_softmax(row, dim=-1)
        token = int(row.argmax())
        assert matcher.accept_token(token)
        out.append(token)
        logprobs.append(float(row[token]))
    return out, logprobs


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_structured_output_obeys_the_grammar_and_is_the_steered_choice(http, model, hf, tokenizer, kind):
    grammar = REGEX if kind == "regex" else SCHEMA
    body = completion(model, structured_outputs={kind: grammar}, max_tokens=40)
    steered = answer(http.post("/v1/completions", json={**body, "vllm_xargs": {"hotwire": spec()}}))["choices"][0]
    plain = answer(http.post("/v1/completions", json=body), None)["choices"][0]
    for choice in (steered, plain):
        assert choice["finish_reason"] == "stop", choice
        if kind == "regex":
            assert re.fullmatch(REGEX, choice["text"]), choice["text"]
        else:
            value = json.loads(choice["text"])
            assert set(value) == {"animal", "name"} and value["animal"] in ("fox", "dog", "cat")
            assert isinstance(value["name"], str) and len(value["name"]) <= 8
    ids = steered["prompt_token_ids"]
    for choice, steer in ((steered, steering()), (plain, [])):
        tokens, logprobs = grammar_reference(hf, tokenizer, ids, kind, grammar, steer, 40)
        assert choice["token_ids"] == tokens, (choice["text"], tokenizer.decode(tokens))
        assert max_diff(choice_logprobs(choice), logprobs) < HF_TOLERANCE
    assert steered["token_ids"] != plain["token_ids"] or max_diff(choice_logprobs(steered), choice_logprobs(plain)) > 1e-2


# -- stop strings ----------------------------------------------------------------------------------------------


def test_stop_strings_cut_the_steered_text(http, model):
    params = {"max_tokens": 24, "ignore_eos": True}
    full = answer(http.post("/v1/completions", json=completion(model, spec(), **params)))["choices"][0]
    plain = answer(http.post("/v1/completions", json=completion(model, **params)), None)["choices"][0]
    text = full["text"]
    # a stop string first found where the steered text has already left the plain one
    start = next(i for i in range(len(text)) if text[: i + 1] != plain["text"][: i + 1]) + 1
    stop = next(text[i:i + 3] for i in range(start, len(text) - 3) if text.index(text[i:i + 3]) == i and text[i:i + 3].strip())
    at = text.index(stop)
    cut = answer(http.post("/v1/completions", json=completion(model, spec(), stop=[stop], **params)))["choices"][0]
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == (text[:at], "stop", stop)
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]
    kept = completion(model, spec(), stop=[stop], include_stop_str_in_output=True, **params)
    assert answer(http.post("/v1/completions", json=kept))["choices"][0]["text"] == text[: at + len(stop)]
    # streamed, the same text
    events = http.post("/v1/completions", json={**completion(model, spec(), stop=[stop], stream=True, **params)})
    assert events.status_code == 200 and events.headers[RECEIPT] == "feat@1:L1+2x2"
    chunks = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == text[:at]
    # the plain request does not produce it there
    plain_cut = answer(http.post("/v1/completions", json=completion(model, stop=[stop], **params)), None)
    assert plain_cut["choices"][0]["text"] != text[:at]


# -- /v1/responses ---------------------------------------------------------------------------------------------


def test_a_steered_response_is_the_steered_chat(http, model):
    """test_server.py shows /v1/responses steered apart from plain; here it is steered exactly as chat with the same
    message is."""
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "vllm_xargs": {"hotwire": spec()}}  # fmt: skip
    chat_lps = [t["logprob"] for t in answer(http.post("/v1/chat/completions", json=chat))["choices"][0]["logprobs"]["content"]]
    body = {"model": model, "input": PROMPT, "max_output_tokens": 6, "temperature": 0, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"], "vllm_xargs": {"hotwire": spec()}}  # fmt: skip
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200 and response.headers[RECEIPT] == "feat@1:L1+2x2", response.text
    (message,) = [item for item in response.json()["output"] if item["type"] == "message"]
    lps = [t["logprob"] for part in message["content"] for t in part["logprobs"]]
    assert len(lps) == 6 and max_diff(lps, chat_lps) < SAME


# -- refused ---------------------------------------------------------------------------------------------------


def refusal(response: httpx.Response, code: str = "steering_unsupported") -> dict[str, Any]:
    assert response.status_code == 400, f"{response.status_code} {response.text[:300]}"
    assert RECEIPT not in response.headers
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


@pytest.mark.parametrize("value", ["true", 1, "yes"])
def test_beam_search_spelled_other_than_true_is_refused_by_name(http, model, value):
    """vLLM reads these as true (pydantic's lax bool) and runs beam search, which drops the steering."""
    body = completion(model, spec(), use_beam_search=value, n=2, logprobs=None)
    error = refusal(http.post("/v1/completions", json=body))
    assert "beam search" in error["message"] and error["field"] == "use_beam_search"
    plain = http.post("/v1/completions", json={**body, "vllm_xargs": {}})
    assert plain.status_code == 200 and len(plain.json()["choices"]) == 2  # vLLM ran beam search


POOLING = [
    ("/classify", {"input": PROMPT}),
    ("/score", {"text_1": PROMPT, "text_2": "a lazy dog"}),
    ("/v1/score", {"text_1": PROMPT, "text_2": "a lazy dog"}),
    ("/rerank", {"query": PROMPT, "documents": ["a lazy dog"]}),
    ("/v1/rerank", {"query": PROMPT, "documents": ["a lazy dog"]}),
    ("/v2/rerank", {"query": PROMPT, "documents": ["a lazy dog"]}),
]


@pytest.mark.parametrize("path,body", POOLING, ids=[p for p, _ in POOLING])
def test_pooling_routes_refuse_steering(http, model, path, body):
    """A generate model serves no pooling task: vLLM 0.25.1 does not mount these routes for it (a plain request
    gets its 404). A steered one gets hotwire's 400 naming the route, whatever vLLM would do with it."""
    plain = http.post(path, json={"model": model, **body})
    assert 400 <= plain.status_code < 500, f"{plain.status_code} {plain.text[:300]}"
    error = refusal(http.post(path, json={"model": model, **body, "vllm_xargs": {"hotwire": spec()}}))
    assert path in error["message"]
