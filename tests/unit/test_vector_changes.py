"""``hotwire_core.vector_changes``: where the engine core runs its busy loop, a registration's store write happens
off its thread and the registration takes effect, in arrival order with every other change, once it is done."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from test_controller import HIDDEN, ctrl, raw, vec


def deferring(tmp_path):
    c = ctrl(store=str(tmp_path))
    c.changes.deferring = True
    return c


def settle(c, *answers: Future | dict, timeout: float = 10.0) -> list[dict]:
    """Pump as the engine core's loop would, between steps, until every answer is in (a dict: answered at once)."""
    deadline = time.monotonic() + timeout
    while not all(isinstance(a, dict) or a.done() for a in answers):
        assert time.monotonic() < deadline, "a change was never answered"
        c.changes.pump()
        time.sleep(0.001)
    assert not c.changes.pending
    return [a if isinstance(a, dict) else a.result() for a in answers]


@pytest.fixture
def held_writes(monkeypatch):
    """Store writes wait until the test lets them go (``release.set()``)."""
    release, original = threading.Event(), Path.write_bytes

    def write_bytes(path, data):
        assert release.wait(10), "the test never let the write go"
        return original(path, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    return release


def test_a_registration_takes_effect_and_is_answered_once_its_store_write_is_done(tmp_path, held_writes):
    c = deferring(tmp_path)
    answer = c.register("a", raw(vec(HIDDEN, seed=1)), "float32", [HIDDEN])
    assert isinstance(answer, Future) and c.changes.pending
    c.changes.pump()
    assert not answer.done() and c.registry.current("a") is None and c.list()["vectors"] == []  # not yet answered
    held_writes.set()
    (out,) = settle(c, answer)
    assert out["ok"] and out["created"] and out["vector"]["version"] == 1
    assert c.registry.current("a").version == 1 and [s.vector_id for s in c.store.load()] == ["a"]


def test_changes_take_effect_in_the_order_they_came(tmp_path, held_writes):
    c = deferring(tmp_path)
    first = c.register("a", raw(vec(HIDDEN, seed=1)), "float32", [HIDDEN])
    again = c.register("a", raw(vec(HIDDEN, seed=2)), "float32", [HIDDEN], None, True)
    gone = c.unregister("a")
    other = c.register("b", raw(vec(HIDDEN, seed=3)), "float32", [HIDDEN])
    assert all(isinstance(x, Future) for x in (first, again, gone, other))
    held_writes.set()
    out = settle(c, first, again, gone, other)
    assert [o["ok"] for o in out] == [True] * 4
    assert (out[0]["vector"]["version"], out[1]["vector"]["version"], out[2]["version"]) == (1, 2, 2)
    assert c.registry.current("a") is None and c.registry.current("b").version == 1
    assert {s.vector_id for s in c.store.load()} == {"b"} and c.store.last_versions()["a"] == 2


def test_a_store_that_cannot_be_written_answers_store_failed_and_changes_nothing(tmp_path, monkeypatch):
    c = deferring(tmp_path)

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    (out,) = settle(c, c.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN]))
    assert (out["ok"], out["status"], out["code"]) == (False, 500, "store_failed") and "No space" in out["error"]
    assert c.registry.current("a") is None and c.list()["vectors"] == []


def test_what_needs_no_store_write_is_answered_at_once(tmp_path):
    c = deferring(tmp_path)
    refused = c.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN + 1])  # a bad shape: nothing to write
    assert not isinstance(refused, Future) and refused["ok"] is False
    unknown = c.unregister("nothing")  # nothing queued before it
    assert not isinstance(unknown, Future) and unknown["code"] == "unknown_vector"
    off = ctrl(store="off")
    off.changes.deferring = True
    assert off.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN])["ok"] is True


def test_without_a_busy_loop_the_store_is_written_in_the_call(tmp_path):
    c = ctrl(store=str(tmp_path))  # deferring False: an in-process engine, the tests' controllers
    out = c.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN])
    assert isinstance(out, dict) and out["ok"] and not c.changes.pending
    assert [s.vector_id for s in c.store.load()] == ["a"]


def test_the_engine_cores_rpc_hands_vllm_a_future_of_its_answer_and_shows_the_scheduler_the_wait(tmp_path):
    """vLLM's ``EngineCore.collective_rpc`` with hotwire's hook: a registration that writes the store is a Future
    of ``[answer]`` (vLLM answers the utility call when it is done), and the scheduler, which may not have seen a
    request yet, knows the controller, so that its ``has_requests`` keeps the loop stepping until then."""
    from test_controller import _engine_with_hotwires_hooks

    from hotwire_core import contract

    engine, _, _ = _engine_with_hotwires_hooks()
    engine.hotwire = deferring(tmp_path)
    listed = engine.collective_rpc(contract.REGISTER, args=("a", raw(vec(HIDDEN)), "float32", [HIDDEN]))
    assert isinstance(listed, Future) and engine.scheduler.hotwire is engine.hotwire
    settle(engine.hotwire, listed)
    (out,) = listed.result()
    assert out["ok"] and out["vector"]["id"] == "a"


def test_without_a_thread_to_write_with_the_change_is_written_in_the_loop_and_answered_once(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    def no_thread(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(ThreadPoolExecutor, "submit", no_thread)
    c = deferring(tmp_path)
    (out,) = settle(c, c.register("a", raw(vec(HIDDEN)), "float32", [HIDDEN]))
    assert out["ok"] and c.registry.current("a").version == 1 and [s.vector_id for s in c.store.load()] == ["a"]
