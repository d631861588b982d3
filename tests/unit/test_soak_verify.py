"""The pure verification logic of the soak (``benchmarks/soak``): receipts, marker choice and the verdict on a
response (no server)."""

import json
import sys

import numpy as np
import pytest
from benchmark_module import BENCHMARKS

# imported by name, not with benchmark_module.load: the dataclasses of a module need it in sys.modules
sys.path.insert(0, str(BENCHMARKS))
from soak.calibration import steerable_layers  # noqa: E402
from soak.markers import MarkerBook, choose_markers  # noqa: E402
from soak.report import summarize_ms  # noqa: E402
from soak.responses import (  # noqa: E402
    Content,
    Observation,
    error_code,
    read_chat_choice,
    read_completion_choice,
    read_event,
    runner_up,
    token_id,
)
from soak.steering import Entry, ReceiptEntry, Spec, parse_receipt, receipt_problem  # noqa: E402
from soak.verdicts import classify, judge_all, text_region  # noqa: E402

N = 4  # max_tokens of the synthetic responses
LAYER = 3
# markers: static id "s" owns 10 ("A"); churned id "c" owns 20 ("B"), 21 ("C"); "d" owns 30 ("D")
TEXTS = {10: "A", 20: "B", 21: "C", 30: "D"}
PLAIN = [5, 6, 7, 8]  # tokens that are no marker


def book() -> MarkerBook:
    b = MarkerBook(dict(TEXTS), {"s": [10], "c": [20, 21], "d": [30]})
    b.record("s", 1, 10)
    b.record("c", 1, 20)
    b.record("c", 2, 21)
    b.record("d", 4, 30)
    return b


def entry(vector_id: str, scale: float = 100.0, phase: str = "all") -> Entry:
    return Entry(vector_id, LAYER, scale, phase)


def observation(spec: Spec, receipt: str | None = None, tokens: list[int] | None = None, *,
                route: str = "completions", stream: bool = False, text: str = "", second: list | None = None,
                **fields) -> Observation:  # fmt: skip
    tokens = list(tokens or [])
    content = Content(tokens, second if second is not None else [None] * len(tokens), text,
                      complete=True, output_tokens=N if route == "responses" else None)  # fmt: skip
    fields = {"status": 200, **fields}
    return Observation(0, route, stream, spec, 0, start=1.0, end=2.0, receipt=receipt, content=content, **fields)


def verdict(obs: Observation, b: MarkerBook | None = None) -> tuple[str, str]:
    v = classify(obs, b or book(), N)
    return v.kind, v.reason


def single(vector_id: str = "c", scale: float = 100.0, phase: str = "all") -> Spec:
    kind = {"all": "single", "decode": "decode_only", "prefill": "prefill_only"}[phase]
    return Spec(kind, (entry(vector_id, scale, phase),))


# -- receipts ------------------------------------------------------------------------------------------------------


def test_parse_receipt_one_and_several_entries():
    (one,) = parse_receipt("happy@3:L3x41.5")
    assert one == ReceiptEntry("happy", 3, (3,), 41.5, frozenset())
    a, b = parse_receipt("a@1:L3x80;b.x-1@12:L1+2+10x-4e-05,norm,decode_only")
    assert (a.vector_id, a.version, a.layers, a.scale) == ("a", 1, (3,), 80.0)
    assert (b.vector_id, b.version, b.layers, b.scale) == ("b.x-1", 12, (1, 2, 10), -4e-05)
    assert b.flags == {"norm", "decode_only"}


@pytest.mark.parametrize("bad", ["", "a@x:L3x1", "a@1:3x1", "a@1:L3", "a@1:L3x1;", "a@1:L3x1,Norm", "a b@1:L3x1"])
def test_parse_receipt_refuses_what_does_not_read(bad):
    with pytest.raises(ValueError):
        parse_receipt(bad)


def test_receipt_problem_compares_ids_layers_float32_scale_and_flags():
    sent = [Entry("a", 3, 123.456789012, "decode")]
    assert receipt_problem(sent, parse_receipt("a@1:L3x123.457,decode_only")) is None  # 6 digits of float32
    assert "scale" in receipt_problem(sent, parse_receipt("a@1:L3x123.5,decode_only"))
    assert "layers" in receipt_problem(sent, parse_receipt("a@1:L2x123.457,decode_only"))
    assert "flags" in receipt_problem(sent, parse_receipt("a@1:L3x123.457"))
    assert "id" in receipt_problem(sent, parse_receipt("b@1:L3x123.457,decode_only"))
    assert "entries" in receipt_problem(sent, parse_receipt("a@1:L3x1;b@1:L3x1"))


def test_spec_wire_matches_hotwire_fields():
    spec = Spec("stacked", (Entry("a", 3, 2.0, as_list=True), Entry("b", 3, 1.0, "prefill")))
    assert json.loads(spec.wire()) == [{"id": "a", "layer": [3], "scale": 2.0},
                                       {"id": "b", "layer": 3, "scale": 1.0, "prefill_only": True}]  # fmt: skip
    assert json.loads(single("c").wire()) == {"id": "c", "layer": 3, "scale": 100.0}
    assert Spec("plain").wire() is None


# -- reading answers -----------------------------------------------------------------------------------------------


def test_token_ids_and_runner_up():
    assert token_id("token_id:42") == 42
    with pytest.raises(ValueError):
        token_id("hello")
    assert runner_up([("token_id:1", -0.1), ("token_id:2", -3.0), ("token_id:3", -1.0)]) == 3
    assert runner_up([("token_id:1", -0.1)]) is None


def test_read_completion_and_chat_chunks():
    content = Content()
    chunk = {"text": "AB", "logprobs": {"tokens": ["token_id:10", "token_id:20"],
                                        "top_logprobs": [{"token_id:10": -1, "token_id:20": -3},
                                                         {"token_id:20": -1, "token_id:10": -2}]}}  # fmt: skip
    assert read_completion_choice(chunk, content)
    assert (content.tokens, content.second, content.text) == ([10, 20], [20, 10], "AB")
    chat = Content()
    role_only = {"delta": {"role": "assistant", "content": ""}, "logprobs": None}
    assert not read_chat_choice(role_only, chat)
    tops = [{"token": "token_id:30", "logprob": -1.0}, {"token": "token_id:10", "logprob": -4.0}]
    item = {"token": "token_id:30", "logprob": -1.0, "top_logprobs": tops}
    assert read_chat_choice({"delta": {"content": "D"}, "logprobs": {"content": [item]}}, chat)
    assert (chat.tokens, chat.second, chat.text) == ([30], [10], "D")


def test_read_stream_events_of_each_route():
    content = Content()
    assert read_event("completions", None, json.dumps({"choices": [{"text": "A", "logprobs": None}]}), content)
    assert not read_event("completions", None, "[DONE]", content)
    assert content.complete and content.text == "A"

    failed = Content()
    explained = {"error": {"message": "unknown steering vector", "type": "unknown_vector", "param": "x", "code": 400}}
    read_event("chat", None, json.dumps(explained), failed)
    assert failed.error == ("unknown_vector", "unknown steering vector") and not failed.complete

    resp = Content()
    delta = {"type": "response.output_text.delta", "delta": "BB"}
    assert read_event("responses", "response.output_text.delta", json.dumps(delta), resp)
    done = {"type": "response.completed", "response": {"output": [], "usage": {"output_tokens": 2}}}
    read_event("responses", "response.completed", json.dumps(done), resp)
    assert (resp.text, resp.output_tokens, resp.complete) == ("BB", 2, True)


def test_error_codes_of_hotwire_and_vllm_bodies():
    hotwire = json.dumps({"error": {"message": "m", "code": "unknown_vector", "field": "f"}}).encode()
    vllm = json.dumps({"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}).encode()
    assert error_code(hotwire) == ("unknown_vector", "m")
    assert error_code(vllm) == ("BadRequestError", "m")
    assert error_code(b"Internal Server Error")[0] == "unparseable"


# -- markers -------------------------------------------------------------------------------------------------------


def test_choose_markers_is_prefix_and_suffix_free_and_avoids_exclusions():
    texts = {1: "a", 2: "ab", 3: "ba", 4: "c", 5: "cd", 6: "xy", 7: "q", 8: "e", 9: " e", 10: "zz"}
    norms = np.ones(11)
    norms[10] = 5.0  # far from the median norm
    chosen = choose_markers(texts, norms, excluded={7}, count=4, seed=0)
    picked = [texts[t] for t in chosen]
    # "ab", "ba" and "cd" clash with a single letter, "q" is excluded, " e" is not printable, "zz" too long a row
    assert set(picked) == {"a", "c", "e", "xy"}
    for x in picked:
        assert not any(y != x and (y.startswith(x) or y.endswith(x)) for y in picked)
    with pytest.raises(ValueError, match="marker tokens available"):
        choose_markers(texts, norms, excluded={7}, count=5, seed=0)


def test_text_region_reads_each_phase():
    b = book()
    assert text_region("BBBB", "all", N, b) == [20] * N
    assert text_region("BBBC", "all", N, b) == [None]
    assert text_region("xyBBB", "decode", N, b) == [20] * 3
    assert text_region("BBBB", "decode", N, b) == [None]  # token 0 steered too: not a decode_only answer
    assert text_region("Cxyz", "prefill", N, b) == [21]
    assert text_region("xyz", "prefill", N, b) == [None]


def test_marker_book_versions_and_absence():
    b = book()
    assert b.next_marker("c") == 20  # after version 2 (21) comes the pool's first again
    assert b.versions_with("c", 21) == [2]
    b.record("c", 2, 20)
    assert b.conflicts  # one version answered with two markers
    b.absent_from("d", 5.0)
    b.present_again("d", 5.2)
    assert b.was_absent(["s", "d"], 5.1, 9.0) and b.was_absent(["d"], 4.0, 5.0)
    assert not b.was_absent(["d"], 5.3, 9.0) and not b.was_absent(["s"], 0.0, 99.0)


# -- verdicts ------------------------------------------------------------------------------------------------------


def test_steered_answers_that_are_right():
    assert verdict(observation(single("c"), "c@2:L3x100", [21] * N)) == ("ok", "")
    assert verdict(observation(single("c", phase="decode"), "c@1:L3x100,decode_only", [5, 20, 20, 20])) == ("ok", "")
    assert verdict(observation(single("c", phase="prefill"), "c@1:L3x100,prefill_only", [20, 5, 6, 7])) == ("ok", "")
    stacked = Spec("stacked", (entry("s", 200.0), entry("c", 100.0)))
    assert verdict(observation(stacked, "s@1:L3x200;c@2:L3x100", [10] * N, second=[21] * N)) == ("ok", "")
    responses = observation(single("d"), "d@4:L3x100", route="responses", text="DDDD")
    assert verdict(responses) == ("ok", "")
    assert verdict(observation(Spec("plain"), None, PLAIN)) == ("ok", "")


def test_receipt_naming_an_older_version_than_what_steered():
    kind, reason = verdict(observation(single("c"), "c@1:L3x100", [21] * N))
    assert (kind, reason) == ("receipt_mismatch", "all: content of another version")
    # the stacked runner-up too
    stacked = Spec("stacked", (entry("s", 200.0), entry("c", 100.0)))
    assert verdict(observation(stacked, "s@1:L3x200;c@1:L3x100", [10] * N, second=[21] * N))[0] == "receipt_mismatch"
    # text route
    assert verdict(observation(single("c"), "c@2:L3x100", route="responses", text="BBBB"))[0] == "receipt_mismatch"


def test_wrong_vector_foreign_marker_or_unsteered():
    assert verdict(observation(single("c"), "c@2:L3x100", [30] * N)) == ("wrong_vector", "all: another id's marker")
    assert verdict(observation(single("c"), "c@2:L3x100", PLAIN)) == ("wrong_vector", "all: unsteered content")
    assert verdict(observation(single("c"), "c@2:L3x100", [21, 21, 5, 21]))[0] == "wrong_vector"
    plain_marked = observation(Spec("plain"), None, [30, 30, 5, 30])
    assert verdict(plain_marked) == ("wrong_vector", "plain request shows a marker")
    assert verdict(observation(Spec("plain"), None, [30, 5, 6, 7]))[0] == "ok"  # one token: numerics, not steering
    assert verdict(observation(single("d"), "d@4:L3x100", route="responses", text="something"))[0] == "wrong_vector"
    assert verdict(observation(Spec("plain"), route="responses", text="xxDDDD"))[0] == "wrong_vector"


def test_a_tenants_book_names_its_own_ids_plainly_and_judges_another_tenants_marker_wrong():
    from soak.tenants import tenant_book

    combined = MarkerBook(dict(TEXTS), {"t0/s": [10], "t1/s": [20], "t0/c": [21], "t1/c": [30]})
    mine = tenant_book(combined, "t0")
    assert mine.pools == {"s": [10], "t1/s": [20], "c": [21], "t1/c": [30]} and mine.owner[20] == "t1/s"
    mine.record("s", 1, 10)
    assert verdict(observation(single("s"), "s@1:L3x100", [10] * N), mine)[0] == "ok"
    leak = classify(observation(single("s"), "s@1:L3x100", [20] * N), mine, N)  # t1's s in t0's response
    assert (leak.kind, leak.reason) == ("wrong_vector", "all: another id's marker") and "t1/s" in leak.detail
    assert verdict(observation(Spec("plain"), None, [30] * N), mine) == ("wrong_vector", "plain request shows a marker")


def test_phase_leaks():
    decode = observation(single("c", phase="decode"), "c@1:L3x100,decode_only", [20] * N)
    assert verdict(decode) == ("wrong_phase", "decode_only steered the other phase too")
    prefill = observation(single("c", phase="prefill"), "c@1:L3x100,prefill_only", [20] * N)
    assert verdict(prefill)[0] == "wrong_phase"


def test_receipt_problems_with_right_content():
    assert verdict(observation(single("c"), None, [21] * N)) == ("receipt_mismatch", "no receipt on a steered answer")
    other_scale = observation(single("c"), "c@2:L3x99", [21] * N)
    assert verdict(other_scale) == ("receipt_mismatch", "receipt differs from the request")
    assert verdict(observation(single("c"), "c@9:L3x100", [21] * N))[1] == "receipt names a version never registered"
    assert verdict(observation(single("c"), "c@2:L3x100,decode_only", [21] * N))[0] == "receipt_mismatch"
    assert verdict(observation(Spec("plain"), "c@2:L3x100", PLAIN))[0] == "receipt_mismatch"
    # no receipt and content of another id: the content decides
    assert verdict(observation(single("c"), None, [30] * N))[0] == "wrong_vector"


def test_transport_and_size_verdicts():
    b = book()
    b.absent_from("c", 1.5)
    b.present_again("c", 1.6)
    refused = observation(single("c"), status=400, error_code="unknown_vector")
    assert verdict(refused, b)[0] == "refused_expected"
    assert verdict(refused)[0] == "http_error"  # its id was never away
    bare_500 = observation(single("c"), status=500, error_code="InternalServerError")
    assert verdict(bare_500) == ("http_error", "500:InternalServerError")
    assert verdict(observation(single("c"), status=429, error_code="slots_exhausted"))[0] == "rejected_429"
    dropped = observation(single("c"), failure=("dropped", "ReadError after the headers", ""))
    assert verdict(dropped) == ("dropped", "ReadError after the headers")
    empty = observation(single("c"), "c@2:L3x100", [], route="chat", stream=True)
    assert verdict(empty) == ("silent_empty", "200 with no generated token")
    empty.content.complete = False
    assert verdict(empty) == ("silent_empty", "stream ended with no output and no error event")
    cut = observation(single("c"), "c@2:L3x100", [21] * 2, stream=True)
    cut.content.complete = False
    assert verdict(cut)[0] == "dropped"
    cut.content.complete = True
    assert verdict(cut)[0] == "truncated"
    errored = observation(single("c"), "c@2:L3x100", stream=True)
    errored.content.error = ("unknown_vector", "deleted")
    assert verdict(errored) == ("stream_error", "unknown_vector")


def test_judge_all_counts_and_keeps_examples():
    observations = [observation(single("c"), "c@2:L3x100", [21] * N), observation(single("c"), "c@1:L3x100", [21] * N)]
    judged = judge_all(observations, book(), N)
    assert judged["kinds"] == {"ok": 1, "receipt_mismatch": 1}
    (shown,) = judged["examples"]["receipt_mismatch"]
    assert shown["receipt"] == "c@1:L3x100" and shown["tokens_as"] == ["C"] * N


def test_summarize_ms():
    assert summarize_ms([]) == {"n": 0, "p50": None, "p99": None, "max": None}
    assert summarize_ms([0.001, 0.003]) == {"n": 2, "p50": 2.0, "p99": 2.98, "max": 3.0}


def test_steerable_layers():
    assert steerable_layers("0-3") == {0, 1, 2, 3}
    assert steerable_layers("8,10,12-14") == {8, 10, 12, 13, 14}


def test_client_processes_run_each_job_apart_and_hand_back_results_in_order():
    import asyncio

    from soak.processes import in_processes, process_count

    assert [process_count(n) for n in (1, 64, 65, 256)] == [1, 1, 2, 4] and process_count(256, 3) == 3
    done = asyncio.run(in_processes([(asyncio.sleep, (0.3, "a")), (asyncio.sleep, (0.2, "b"))]))
    assert [result for result, _ in done] == ["a", "b"]
    assert all(0 <= busy < 0.9 for _, busy in done)  # asleep, not busy
    with pytest.raises(TypeError):  # a job's failure is the caller's
        asyncio.run(in_processes([(asyncio.sleep, ("not a delay",))]))
