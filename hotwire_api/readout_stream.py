"""A streamed readout token by token: while a stream that reads its generated tokens is open, its values are taken
from the workers as they are computed (``hotwire_peek_readouts``, left in place there), and each chunk of the
stream carries those that arrived since the one before. One peek every :data:`INTERVAL_S` serves every open stream
of this API server; none while no stream is open. The readout's own chunk before ``[DONE]`` still carries the
whole readout, the authoritative one (``hotwire_api.answer``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_core.readout_results import generated_so_far

__all__ = ["INTERVAL_S", "ReadoutStreams", "StreamedReadout"]

logger = logging.getLogger(__name__)

INTERVAL_S = 0.02


@dataclass
class StreamedReadout:
    """One open stream's values: ``next`` is the first generated token not yet taken, ``arrived`` what was taken
    and not yet sent."""

    next: int = 0
    arrived: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)  # (first token, probes)

    def pop(self) -> dict[str, Any] | None:
        """What arrived since the last chunk, as one ``hotwire_readout`` delta: ``{"from": j, "probes": [{"probe",
        "generated": {"score", "cosine"}}]}`` for generated tokens ``j`` on; None when nothing did."""
        if not self.arrived:
            return None
        first = self.arrived[0][0]
        probes = [{"probe": p["probe"], "generated": {"score": [], "cosine": []}} for p in self.arrived[0][1]]
        for _, more in self.arrived:
            for mine, theirs in zip(probes, more):
                mine["generated"]["score"] += theirs["generated"]["score"]
                mine["generated"]["cosine"] += theirs["generated"]["cosine"]
        self.arrived = []
        return {"from": first, "probes": probes}


class ReadoutStreams:
    """The open streams of one API server and the task that takes their values (see the module docstring)."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.open: dict[str, StreamedReadout] = {}  # tag -> its values
        self._task: asyncio.Task[None] | None = None

    def start(self, engine: HotwireEngine, tag: str) -> StreamedReadout:
        stream = self.open.setdefault(tag, StreamedReadout())
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run(engine))
        return stream

    def stop(self, tag: str) -> None:
        self.open.pop(tag, None)

    async def _run(self, engine: HotwireEngine) -> None:
        while self.open:
            await asyncio.sleep(self.interval_s)
            since = {tag: stream.next for tag, stream in self.open.items()}
            if not since:
                break
            try:
                answers = await engine.peek_readouts(since)
            except HotwireError as exc:  # the stream's own end says whether its readout can be had
                logger.debug("hotwire: streamed readouts not taken this time: %s", exc.message)
                continue
            for tag, stream in list(self.open.items()):
                with contextlib.suppress(KeyError, ValueError):  # a rank's answer of another shape: the end says
                    found = generated_so_far(answers, tag, stream.next) if tag in since else None
                    if found:
                        stream.arrived.append((stream.next, found))
                        stream.next += len(found[0]["generated"]["score"])
