"""Worker side of activation capture: which tokens of the batch add their residual stream to which accumulator row
(``token_cap``, written before each forward in which a capture runs), and the captures of finished requests, kept
until the caller takes them (``hotwire_take_captures``). See docs/architecture.md, "Capture".

A capture request (``contract.CAPTURE_KEY`` in its ``extra_args``, admitted by the controller:
``capture_admission``; the glue's ``runners.step_of`` passes it on) gets an accumulator row when the worker first sees it; ``last`` gives the row to its last prompt token, ``mean`` to every
prompt token. Each rank keeps the layers it hooks (with pipeline parallelism each holds its own).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .capture_op import set_accumulator
from .contract import TakeCapturesResult
from .handouts import Handouts



@dataclass
class _Live:
    tag: str
    row: int
    layers: list[int]  # the requested layers this rank hooks
    mean: bool
    prompt_len: int
    tokens: int = 0  # prompt tokens given the row since the prompt was (re)started
    taken: bool = False  # handed out before the worker heard that its request finished (``take``)

    @property
    def wanted(self) -> int:
        """Prompt tokens the capture needs: all of them for ``mean``, the last one for ``last``."""
        return self.prompt_len if self.mean else 1

    @property
    def complete(self) -> bool:
        return self.tokens == self.wanted


class WorkerCapture:
    def __init__(self, layers: Collection[int], n_layers: int, hidden_size: int, device: torch.device,
                 max_tokens: int, rows: int, uploader: Any):
        self.layers, self.rows, self.hidden_size = frozenset(layers), rows, hidden_size
        with torch.device(device):
            self.token_cap = torch.zeros(max_tokens, dtype=torch.int32)
            # Row 0 collects the tokens nobody captures (see capture_op); it is never read.
            self.acc = torch.zeros(n_layers, rows + 1, hidden_size, dtype=torch.float32)
        set_accumulator(self.acc)
        self._uploader = uploader
        self._free = list(range(rows, 0, -1))
        self.live: dict[str, _Live] = {}  # req_id -> its capture (read by WorkerSteering's per-step checks)
        self.done = Handouts(2 * rows)  # finished ones, until taken
        self._staging = np.zeros(max_tokens, np.int32)
        self.dirty = 0  # token_cap[:dirty] may be non-zero on the device

    @property
    def clean(self) -> bool:
        """Nothing is captured and ``token_cap`` holds zeros: ``fill`` has nothing to do."""
        return not self.live and not self.dirty

    def scheduled(self, scheduled: Collection[str]) -> bool:
        """Whether a capturing request is in the step (the gate must then be open)."""
        return any(req_id in scheduled for req_id in self.live)

    def on_step(self, finished: Iterable[str], captures: Sequence[tuple[str, int, dict]]) -> None:
        """Finish the captures of ``finished`` requests, then give new capture requests (``(id, prompt length,
        CAPTURE_KEY's value)``) their rows. A request seen again (V2 re-adds a preempted one) keeps its row; its
        prompt restarts, and so does its sum (``fill``)."""
        for req_id in finished:
            if req_id in self.live:
                self._finish(req_id)
        for req_id, prompt_len, args in captures:
            if req_id in self.live:
                continue
            if not self._free:  # the controller admits at most `rows` captures: this should not happen
                self.done.put(args["tag"], {"error": f"all {self.rows} capture rows of this worker are in use"})
                continue
            layers = sorted(self.layers.intersection(args["layers"]))
            self.live[req_id] = _Live(args["tag"], self._free.pop(), layers, args["position"] == "mean", prompt_len)

    def fill(self, req_ids: Sequence[str], num_scheduled: np.ndarray, num_computed: np.ndarray, num_tokens: int) -> None:
        """Write ``token_cap`` for the batch (laid out request by request in ``req_ids`` order)."""
        length = max(num_tokens, self.dirty)
        host = self._staging[:length]
        host[:] = 0
        if self.live:
            index = {req_id: i for i, req_id in enumerate(req_ids) if req_id in self.live}
            starts = np.cumsum(num_scheduled) - num_scheduled
            restart = []
            for req_id, i in index.items():
                live = self.live[req_id]
                first, count, start = int(num_computed[i]), int(num_scheduled[i]), int(starts[i])
                if first == 0:  # the prompt (re)starts: a preempted request recomputes it
                    live.tokens = 0
                    restart.append(live.row)
                last = live.prompt_len - 1
                if live.mean:
                    end = min(first + count, live.prompt_len)
                    if end > first:
                        host[start : start + end - first] = live.row
                        live.tokens += end - first
                elif first <= last < first + count:
                    host[start + last - first] = live.row
                    live.tokens = 1
            if restart:
                self.acc.index_fill_(1, self._uploader.to_device(torch.tensor(restart, dtype=torch.long)), 0.0)
        self._uploader.copy_(self.token_cap[:length], torch.from_numpy(host.copy()))
        self.dirty = num_tokens if host[:num_tokens].any() else 0

    def _result(self, live: _Live) -> dict:
        if not live.complete:
            return {"error": f"the capture saw {live.tokens} of the {live.wanted} prompt "
                             "tokens it needs (the request was aborted, or part of its prompt was not computed)"}
        sums = self.acc[live.layers, live.row].cpu().numpy() if live.layers else np.zeros((0, self.hidden_size))
        return {"layers": live.layers, "tokens": live.tokens, "data": np.ascontiguousarray(sums, np.float32).tobytes()}

    def _finish(self, req_id: str) -> None:
        live = self.live.pop(req_id)
        if not live.taken:
            self.done.put(live.tag, self._result(live))
        self.acc[:, live.row].zero_()
        self._free.append(live.row)

    def take(self, tags: Iterable[str]) -> TakeCapturesResult:
        """The captures of ``tags``, each handed out once (``contract.TakeCapturesResult``). vLLM tells the workers
        that a request finished only in the step after it finished, and with nothing else to run that step can come
        after the caller, who has the request's output, asks: a capture whose prompt is complete is handed out
        then (its row stays held until the worker hears of the finish)."""
        wanted = set(tags)
        out = self.done.take(wanted)
        early = [live for live in self.live.values()
                 if live.tag in wanted and live.tag not in out and not live.taken and live.complete]
        if early and self.acc.is_cuda:
            torch.cuda.synchronize(self.acc.device)  # the forward that added the last token may still be running
        for live in early:
            out[live.tag] = self._result(live)
            live.taken = True
        return TakeCapturesResult(ok=True, captures=out)
