"""``hotwire_api.readout_takes``: requests whose responses end together take their readouts in one round trip
(through a real vllm serve: tests/integration/test_readout_http.py)."""

from __future__ import annotations

import asyncio

import pytest

from hotwire_api.errors import HotwireError
from hotwire_api.readout_takes import ReadoutTakes


class Workers:
    """Answers ``take_readouts`` as the workers do: each tag asked for, once; counts the round trips."""

    def __init__(self, fail: bool = False):
        self.calls: list[list[str]] = []
        self.fail = fail

    async def take_readouts(self, tags: list[str], wait: bool = True) -> list[dict]:
        self.calls.append(sorted(tags))
        await asyncio.sleep(0.01)
        if self.fail:
            raise HotwireError(503, "engine_unavailable", "the engine did not answer")
        return [{"ok": True, "readouts": {tag: {"tag": tag} for tag in tags}}]


def test_responses_ending_together_take_their_readouts_in_one_round_trip() -> None:
    async def scenario():
        takes, workers = ReadoutTakes(min_interval_s=0), Workers()
        first = await asyncio.gather(*(takes.take(workers, f"t{i}") for i in range(8)))
        # while one take is on its way, the responses ending meanwhile wait for the next
        later = asyncio.ensure_future(takes.take(workers, "a"))
        await asyncio.sleep(0.002)
        more = await asyncio.gather(later, takes.take(workers, "b"), takes.take(workers, "c"))
        return workers.calls, first, more

    calls, first, more = asyncio.run(scenario())
    assert calls == [[f"t{i}" for i in range(8)], ["a"], ["b", "c"]]
    assert all("t3" in answers[0]["readouts"] for answers in first)


def test_a_failed_take_fails_its_batch_and_a_cancelled_wait_harms_no_one() -> None:
    async def scenario():
        takes = ReadoutTakes(min_interval_s=0)
        with pytest.raises(HotwireError):
            await takes.take(Workers(fail=True), "x")
        workers = Workers()
        left = asyncio.ensure_future(takes.take(workers, "gone"))
        stays = asyncio.ensure_future(takes.take(workers, "stays"))
        await asyncio.sleep(0)
        left.cancel()
        return await stays

    assert "stays" in asyncio.run(scenario())[0]["readouts"]


def test_takes_start_at_most_once_an_interval_and_at_once_after_a_quiet_spell() -> None:
    """Under load the responses ending within the interval after a take share the next one; a take after a quiet
    spell does not wait."""

    async def scenario():
        loop = asyncio.get_running_loop()
        takes, workers = ReadoutTakes(min_interval_s=0.1), Workers()
        started = loop.time()
        await takes.take(workers, "first")  # nothing before it: at once (the workers take 10 ms)
        alone = loop.time() - started
        waits = [asyncio.ensure_future(takes.take(workers, "a"))]
        await asyncio.sleep(0.05)  # within the interval: joins "a"
        waits.append(asyncio.ensure_future(takes.take(workers, "b")))
        await asyncio.gather(*waits)
        batched = loop.time() - started
        await asyncio.sleep(0.2)
        quiet = loop.time()
        await takes.take(workers, "later")
        return workers.calls, alone, batched, loop.time() - quiet

    calls, alone, batched, after_quiet = asyncio.run(scenario())
    assert calls == [["first"], ["a", "b"], ["later"]]
    assert alone < 0.05 and batched >= 0.1 and after_quiet < 0.05


class PendingWorkers:
    """Two workers answering ``take_readouts`` as ``ReadoutWorker.take`` does: not asked to wait, the second says
    ``pending`` (handing out nothing) until its values have arrived, here at its third answer; each tag handed out
    once by each worker."""

    def __init__(self):
        self.asked: list[bool] = []  # wait, per round trip
        self.kept = [{"t": {"rank": 0}}, {"t": {"rank": 1}}]

    async def take_readouts(self, tags: list[str], wait: bool = True) -> list[dict]:
        self.asked.append(wait)
        answers = []
        for rank, kept in enumerate(self.kept):
            if rank == 1 and not wait and len(self.asked) < 3:
                answers.append({"ok": True, "readouts": {}, "pending": True})
            else:
                answers.append({"ok": True, "readouts": {t: kept.pop(t) for t in tags if t in kept}})
        return answers


def test_a_pending_worker_is_asked_again_and_the_answers_handed_out_are_kept() -> None:
    """The engine core's loop never waits for the device on a take: a worker whose values are on their way answers
    ``pending`` and is asked again; the answer of a worker that handed its values out stands."""
    workers = PendingWorkers()
    answers = asyncio.run(ReadoutTakes(min_interval_s=0).take(workers, "t"))
    assert workers.asked == [False, False, False]
    assert [a["readouts"] for a in answers] == [{"t": {"rank": 0}}, {"t": {"rank": 1}}]


def test_a_take_waits_for_the_device_once_its_workers_stayed_pending(monkeypatch) -> None:
    """An engine that stopped stepping (nothing more to run) still hands a finished request's values out: after
    ``WAIT_AFTER_S`` the take asks the workers to wait."""
    from hotwire_api import readout_takes

    monkeypatch.setattr(readout_takes, "WAIT_AFTER_S", 0.0)
    workers = PendingWorkers()
    answers = asyncio.run(ReadoutTakes(min_interval_s=0).take(workers, "t"))
    assert workers.asked == [True] and answers[1]["readouts"] == {"t": {"rank": 1}}
