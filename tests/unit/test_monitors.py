"""Monitors (``hotwire_api.monitors``) and the split of a monitored readout (``hotwire_api.reading``): scores,
flags, the monitors file shared by API servers. Against a real vllm serve: tests/integration/test_readout_http.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
import multiprocessing
import time

import pydantic
import pytest

from hotwire_api import monitors
from hotwire_api.monitors import Monitor, MonitorBook, score_of
from hotwire_api.reading import Reading


def _read(probe: str, generated: list[float], prompt: list[float] | None = None) -> dict:
    out = {"probe": probe, "bias": 0.0, "generated": {"score": generated, "cosine": [0.0] * len(generated)}}
    if prompt is not None:
        out["prompt"] = {"score": prompt, "cosine": [0.0] * len(prompt)}
    return out


@pytest.mark.parametrize("fields, score, flagged", [
    ({"threshold": 2.5}, 3.0, True),  # max over the generated tokens, at or above
    ({"threshold": 3.0}, 3.0, True),
    ({"threshold": 3.01}, 3.0, False),
    ({"threshold": 1.0, "reduce": "mean"}, 1.0, True),
    ({"threshold": -1.0, "reduce": "min", "flag": "below"}, -1.0, True),
    ({"threshold": 0.5, "scope": "prompt"}, 1.0, True),  # the last prompt token: the first generated position
    ({"threshold": 0.5, "scope": "prompt", "flag": "below"}, 1.0, False),
])
def test_a_monitor_scores_a_request_and_flags_it_past_its_threshold(fields, score, flagged) -> None:
    monitor = Monitor(id="m", probe="v", layer=1, **fields)
    verdict = score_of(monitor, _read("v@1:L1", [1.0, 3.0, -1.0]))
    assert verdict.score == pytest.approx(score) and verdict.flagged is flagged and verdict.probe == "v@1:L1"
    assert score_of(monitor, _read("v@1:L1", [])) is None


def test_a_monitor_that_is_not_one_is_refused() -> None:
    for bad in ({"threshold": float("nan")}, {"threshold": 1, "scope": "all"}, {"threshold": 1, "layer": -1},
                {"threshold": 1, "extra": 1}, {}):
        with pytest.raises(pydantic.ValidationError):
            Monitor.model_validate({"id": "m", "probe": "v", "layer": 1, **bad})


def test_a_readout_splits_into_the_clients_part_and_the_monitors_verdicts() -> None:
    monitors = (Monitor(id="a", probe="v", layer=1, threshold=0), Monitor(id="b", probe="w", layer=2, threshold=9))
    readout = {"tokens": "all", "probes": [_read("u@1:L0", [0.5], [1.0, 2.0]), _read("v@1:L1", [1.0, 2.0]),
                                           _read("w@3:L2", [4.0])]}
    mine, verdicts = Reading("{}", "t", 1, "prompt", monitors).split(readout)
    assert mine == {"tokens": "prompt", "probes": [{"probe": "u@1:L0", "bias": 0.0,
                                                    "prompt": {"score": [1.0, 2.0], "cosine": [0.0, 0.0]}}]}
    assert [(v.monitor, v.score, v.flagged) for v in verdicts] == [("a", 2.0, True), ("b", 4.0, False)]
    mine, verdicts = Reading("{}", "t", 0, None, monitors).split({"tokens": "generated", "probes": readout["probes"][1:]})
    assert mine is None and len(verdicts) == 2


def test_a_request_flagged_by_several_monitors_is_logged_once_naming_each(caplog) -> None:
    monitors = (Monitor(id="a", probe="v", layer=1, threshold=0), Monitor(id="b", probe="w", layer=2, threshold=1),
                Monitor(id="c", probe="w", layer=2, threshold=-5, flag="below"))
    readout = {"tokens": "generated", "probes": [_read("v@1:L1", [2.0]), _read("w@3:L2", [4.0]), _read("w@3:L2", [4.0])]}
    with caplog.at_level("WARNING", logger="hotwire_api.reading"):
        Reading("{}", "tag-1", 0, None, monitors).split(readout)
    assert [r.getMessage() for r in caplog.records] == [
        "hotwire: a request was flagged by monitors a (score 2 >= threshold 0), b (score 4 >= threshold 1); readout tag-1"]


def _add(path, n: int) -> None:
    book = MonitorBook()
    book.path = path
    asyncio.run(book.edit(f"m{n}", Monitor(id=f"m{n}", probe="v", layer=1, threshold=n)))


def test_the_monitors_file_is_shared_by_every_api_server_and_edits_are_all_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(monitors, "LOOK_S", 1.0)
    path = tmp_path / "monitors.json"
    reader = MonitorBook()
    reader.path = path
    assert reader.current() == ()
    with multiprocessing.get_context("spawn").Pool(4) as pool:  # four API servers adding at once
        pool.starmap(_add, [(path, n) for n in range(12)])
    state = reader.state
    assert sorted(m.id for m in reader.current()) == sorted(f"m{n}" for n in range(12)) and reader.state > state
    assert asyncio.run(reader.edit("m3", None)).threshold == 3 and asyncio.run(reader.edit("m3", None)) is None
    assert len(reader.current()) == 11
    path.write_text("{")  # broken by hand: the last good monitors stay on
    time.sleep(monitors.LOOK_S)
    assert len(reader.current()) == 11
    path.write_text(json.dumps({"monitors": [{"id": "z", "probe": "v", "layer": 0, "threshold": 1}]}))
    assert len(reader.current()) == 11  # the file was looked at a moment ago: not again yet
    time.sleep(monitors.LOOK_S)
    assert [m.id for m in reader.current()] == ["z"]


def app_with(registry) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(hotwire_registry=registry))


def test_without_a_store_the_monitors_live_in_memory() -> None:
    from hotwire_api.vector_registry import LocalRegistry

    book = MonitorBook()
    asyncio.run(book.start(app_with(LocalRegistry())))  # no served model: no store folder
    assert book.path is None and book.kept == "memory"
    asyncio.run(book.edit("a", Monitor(id="a", probe="v", layer=1, threshold=0)))
    old = asyncio.run(book.edit("a", Monitor(id="a", probe="v", layer=2, threshold=0)))
    assert old.layer == 1 and [m.layer for m in book.current()] == [2]
