"""Worker side of readout: which tokens of the batch the readout op projects for which request (``token_read``,
written before each forward in which a readout runs), the requests' probe rows (``read_slot``), the values copied
out of ``out`` after each forward, and the readouts of finished requests, kept until the caller takes them
(``hotwire_take_readouts``). See docs/architecture.md, "Readout".

A readout request (``contract.READOUT_ARGS_KEY`` in its ``extra_args`` and ``"r"`` in its binding, both set by the
controller: ``readout_admission``) gets a row when the worker first sees it. The values a forward wrote are
gathered and copied to pinned host memory by a copy issued at the next step's fill, before the forward that
could overwrite them, and read once that copy is done: the hot path never waits on the device. A finished request's
reader retires: it keeps its row until the copies holding its values arrive (a later step's fill sees them), and
only then is its readout kept for the caller, so a step in which readers finish does not wait for the forward still
running (with asynchronous scheduling, every such step would). Only a take asked to wait waits: for the copies of the
readouts it hands out, and for the device where a reader is still live (asked before the worker heard it finished);
one asked not to (the API server's, under load) answers ``pending`` instead.

A step's host work is done for the whole batch at once, with no work per request: each reader's row indexes arrays
of what ``fill`` needs (first position read, end, probe layers), and the values that arrive land in a buffer of the
last ``DEPTH`` values per row, which joins the row's list of chunks when it is full or read.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .contract import ReadoutArgs, SteerItem, TakeReadoutsResult
from .handouts import Handouts
from .ops import GATE_BELOW, GATE_COSINE, GATE_LATCH, GATE_PROMPT, NEVER
from .readout_op import set_output

__all__ = ["WorkerReadout"]

DEPTH = 32  # values a row's buffer holds before they join its chunks


@dataclass
class _Reader:
    tag: str
    row: int
    args: ReadoutArgs
    prompt_len: int
    chunks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (positions, values [m, K, 2])
    taken: bool = False  # handed out before the worker heard that its request finished (``take``)


@dataclass
class _Copy:
    """The values one forward wrote for the read tokens, on their way to the host."""

    event: Any  # a CUDA event recorded after the copy (None on a CPU)
    host: torch.Tensor  # [m, K, 2]: each read token's dot products at its probes' layers, and its norm there
    rows: np.ndarray  # [m]: each read token's readout row (a request's tokens together, in order)
    positions: np.ndarray | torch.Tensor  # [m]: each one's position in its request (a tensor: copied from the device)
    within: np.ndarray  # [m]: each one's index among its request's tokens in the step
    seq: int  # copies are numbered in the order they are issued, from 1


def _record_event(cuda: bool) -> Any:
    """An event recorded on the current stream after the copies issued so far (None on a CPU: copies are done)."""
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _to_pinned(device: torch.Tensor) -> torch.Tensor:
    """A copy of ``device`` in pinned host memory, issued on the stream (read it once the copy's event is done)."""
    return torch.empty(device.shape, dtype=device.dtype, pin_memory=True).copy_(device, non_blocking=True)


class WorkerReadout:
    def __init__(self, layers: Collection[int], n_layers: int, device: torch.device, max_tokens: int,
                 max_probes: int, rows: int, uploader: Any, gates: bool = False):
        """``gates``: allocate the buffers of gated steering (``hotwire_core.gates``), which the ops then take."""
        self.layers, self.rows, self.k = frozenset(layers), rows, max_probes
        with torch.device(device):
            self.token_read = torch.zeros(max_tokens, dtype=torch.int32)
            self.read_slot = torch.zeros(rows + 1, n_layers, max_probes, dtype=torch.int32)  # row 0: nobody reads
            self.out = torch.zeros(n_layers, max_tokens, max_probes + 1, dtype=torch.float32)
            # Per row: its condition (ops.GATE_* columns; layer -1: none) and threshold, bias, probe's inverse norm.
            self.gates = {"token_pos": torch.zeros(max_tokens, dtype=torch.int32),
                          "token_hit": torch.zeros(max_tokens, dtype=torch.int32),
                          "gate_row": torch.full((rows + 1, 8), -1, dtype=torch.int32),
                          "gate_f": torch.zeros(rows + 1, 4, dtype=torch.float32)} if gates else None
        set_output(self.out)
        self._cuda = self.out.is_cuda
        self._uploader = uploader
        self._free = list(range(rows, 0, -1))
        self.live: dict[str, _Reader] = {}  # req_id -> its readout
        self._row_of: dict[str, int] = {}  # req_id -> its reader's row
        self._reader_at: list[_Reader | None] = [None] * (rows + 1)
        # Per row: first position read, positions read are below end, each probe's layer (0 past the last probe),
        # whether this rank hooks it, positions below settled are computed for good (num_computed_tokens).
        self._start, self._end, self._settled = (np.zeros(rows + 1, np.int64) for _ in range(3))
        self._layers, self._held = np.zeros((rows + 1, max_probes), np.int64), np.zeros((rows + 1, max_probes), bool)
        self._buf_pos = np.zeros((rows + 1, DEPTH), np.int32)
        self._buf_val = np.zeros((rows + 1, DEPTH, max_probes, 2), np.float32)
        self._fill = np.zeros(rows + 1, np.int64)  # values in each row's buffer
        self.done = Handouts(2 * rows)  # finished ones, until taken
        self._staging = np.zeros(max_tokens, np.int32)
        self._read: tuple[np.ndarray, ...] | None = None  # the last forward's read tokens (fill's gather, rows, ...)
        self._copies: list[_Copy] = []
        self._issued = self._arrived = 0  # the last copy issued, the last handed to its readers
        self._last_copy = np.zeros(rows + 1, np.int64)  # per row: the last copy that holds values of it
        self._retiring: dict[str, _Reader] = {}  # tag -> a finished request's reader, until its copies arrive
        self.dirty = 0  # token_read[:dirty] may be non-zero on the device
        self._gated = 0  # live readers with a condition: token_pos is written while there are any

    @property
    def clean(self) -> bool:
        """Nobody reads, nothing is on its way out and ``token_read`` holds zeros: ``fill`` has nothing to do."""
        return not self.live and not self.dirty and self._read is None and not self._copies

    def scheduled(self, scheduled: Collection[str]) -> bool:
        """Whether a reading request is in the step (the gate must then be open)."""
        return any(req_id in scheduled for req_id in self.live)

    def on_step(self, finished: Iterable[str], new: Sequence[tuple[str, int, ReadoutArgs, list[SteerItem]]],
                rebinds: Mapping[str, Any]) -> None:
        """Finish the readouts of ``finished`` requests, give new ones (``(id, prompt length, args, probe rows)``)
        their rows, and rewrite the rows of resumed requests whose probes moved in the bank (``rebinds``: id ->
        binding config). A request seen again (V2 re-adds a preempted one) keeps its row and its values."""
        ended = [req_id for req_id in finished if req_id in self.live]
        if ended:
            self._flush()  # issues the last forward's copy: it may hold values of the finished requests
            for req_id in ended:
                self._retire(req_id)
            self._settle()
        writes = []
        for req_id, prompt_len, args, items in new:
            if req_id in self.live:
                writes.append((self.live[req_id].row, items))
                continue
            if not self._free and self._retiring:  # rows held by retiring readers: wait for their copies
                self._flush(math.inf)
            if not self._free:  # as many rows as config rows: this should not happen
                self.done.put(args["tag"], {"error": f"all {self.rows} readout rows of this worker are in use"})
                continue
            reader = _Reader(args["tag"], self._free.pop(), args, prompt_len)
            row, probes = reader.row, [probe["layer"] for probe in args["probes"]]
            self._start[row] = 0 if args["tokens"] in ("prompt", "all") else max(prompt_len - 1, 0)
            self._end[row] = prompt_len if args["tokens"] == "prompt" else 1 << 62
            self._layers[row], self._held[row] = 0, False
            self._layers[row, : len(probes)] = probes
            self._held[row, : len(probes)] = [layer in self.layers for layer in probes]
            self._settled[row] = self._fill[row] = 0
            self.live[req_id], self._row_of[req_id], self._reader_at[row] = reader, row, reader
            writes.append((reader.row, items))
            if self.gates is not None:
                self._write_gate(reader)
        for req_id, config in rebinds.items():
            if req_id in self.live and config.get("r"):
                writes.append((self.live[req_id].row, config["r"]))
        if writes:
            self._write_rows(writes)

    def _write_gate(self, reader: _Reader) -> None:
        """Give a new reader's row its condition, or none (rows are reused)."""
        ints, floats = np.full(8, -1, np.int32), np.zeros(4, np.float32)
        gate = reader.args.get("gate")
        if gate is not None:
            probe = reader.args["probes"][gate["probe"]]
            flags = sum(bit for bit, on in ((GATE_BELOW, gate["below"]), (GATE_LATCH, gate["latch"]),
                                            (GATE_COSINE, gate["cosine"]), (GATE_PROMPT, gate["prompt"])) if on)
            ints[:5] = (probe["layer"], gate["probe"], flags, NEVER, reader.prompt_len)
            floats[:3] = (gate["threshold"], probe["bias"], 1.0 / max(probe["norm"], 1e-30))
            self._gated += 1
        self._uploader.copy_(self.gates["gate_row"][reader.row], torch.from_numpy(ints))
        self._uploader.copy_(self.gates["gate_f"][reader.row], torch.from_numpy(floats))

    def _write_rows(self, writes: list[tuple[int, list[SteerItem]]]) -> None:
        table = np.zeros((len(writes), *self.read_slot.shape[1:]), np.int32)
        for i, (_, items) in enumerate(writes):
            for k, item in enumerate(items):
                table[i, int(item[0]), k] = int(item[1])
        idx = self._uploader.to_device(torch.tensor([row for row, _ in writes], dtype=torch.long))
        self.read_slot.index_copy_(0, idx, self._uploader.to_device(torch.from_numpy(table)))

    def fill(self, req_ids: Sequence[str], num_scheduled: np.ndarray, num_computed: np.ndarray, num_tokens: int,
             device_positions: torch.Tensor | None = None) -> None:
        """Send the last forward's values on their way out, then write ``token_read`` for this batch (laid out
        request by request in ``req_ids`` order). ``device_positions``: the batch's true positions where
        ``num_computed`` may count rejected drafts (``Steering.fill``): which tokens are read still follows from
        ``num_computed`` (every token of a decoding request is), their positions come from the device."""
        self._flush()
        length = max(num_tokens, self.dirty)
        host = self._staging[:length]
        host[:] = 0
        read = self._batch_reads(req_ids, num_scheduled, num_computed, device_positions is None) if self.live else None
        self._read = None
        if read is not None:
            tokens, positions, rows, within = read
            host[tokens] = rows
            if device_positions is not None:
                positions = device_positions[self._uploader.to_device(torch.from_numpy(tokens))].to(torch.int32)
            # Where in ``out`` each read token's probes are (dot product, norm), for the gather in _flush.
            _, n_tokens, width = self.out.shape
            base = (self._layers[rows] * n_tokens + tokens[:, None]) * width
            self._read = (np.stack((base + np.arange(self.k), base + self.k), axis=-1), rows, positions, within)
        self._uploader.copy_(self.token_read[:length], torch.from_numpy(host.copy()))
        if self._gated and read is not None:
            if device_positions is not None:
                self.gates["token_pos"][:num_tokens].copy_(device_positions[:num_tokens])
            else:
                at = np.zeros(num_tokens, np.int32)
                at[tokens] = positions
                self._uploader.copy_(self.gates["token_pos"][:num_tokens], torch.from_numpy(at))
        self.dirty = num_tokens if read is not None else 0

    def _batch_reads(self, req_ids: Sequence[str], num_scheduled: np.ndarray, num_computed: np.ndarray,
                     settles: bool = True) -> tuple | None:
        """The batch's read tokens, vectorised over its requests: ``(token indices, their positions, their readout
        rows, their indices among their request's tokens in the step)``; None when none of them is read.
        ``settles``: ``num_computed`` is exact, and so where each row's settled positions end (else ``_store`` sets
        that from the positions that arrive)."""
        found = np.array([self._row_of.get(req_id, 0) for req_id in req_ids], np.int64)
        which = np.flatnonzero(found)
        if not which.size:
            return None
        rows = found[which]
        first = np.asarray(num_computed, np.int64)[which]
        count = np.asarray(num_scheduled, np.int64)[which]
        offset = (np.cumsum(num_scheduled) - num_scheduled)[which]
        if settles:
            self._settled[rows] = first
        lo = np.maximum(first, self._start[rows])
        n = np.maximum(np.minimum(first + count, self._end[rows]) - lo, 0)
        total = int(n.sum())
        if not total:
            return None
        ends = np.cumsum(n)
        within = np.arange(total) - np.repeat(ends - n, n)  # each read token's index among its request's reads
        positions = (np.repeat(lo, n) + within).astype(np.int32)
        return np.repeat(offset - first, n) + positions, positions, np.repeat(rows, n), within

    def _flush(self, until: float = 0) -> None:
        """Issue the copy of the last forward's values (stream-ordered after it), then hand the values of every copy
        that has arrived, waiting for those up to copy ``until`` (``math.inf``: every one), to their readers, and
        release the retiring readers whose copies have all arrived."""
        if self._read is not None:
            where, rows, positions, within = self._read
            self._read = None
            # Only each token's probes at their layers leave the device: [m, K, 2] (dot products, norms).
            gathered = self.out.view(-1)[self._uploader.to_device(torch.from_numpy(where))]
            if self._cuda:
                host = _to_pinned(gathered)
                if isinstance(positions, torch.Tensor):
                    positions = _to_pinned(positions)
            else:
                host = gathered
            self._issued += 1
            self._last_copy[rows] = self._issued
            self._copies.append(_Copy(_record_event(self._cuda), host, rows, positions, within, self._issued))
        while self._copies and (self._copies[0].seq <= until or self._copies[0].event is None
                                or self._copies[0].event.query()):
            copy = self._copies.pop(0)
            if copy.event is not None:
                copy.event.synchronize()
            # [m, K, 2]: NaN where this rank lacks the layer (a row's probes stay as they are until it is freed)
            held = self._held[copy.rows][..., None]
            positions = copy.positions
            if isinstance(positions, torch.Tensor):
                positions = positions.numpy()
                # Settled: below a row's first position in that forward (no draft before it can be rejected any more).
                first = copy.within == 0
                self._settled[copy.rows[first]] = positions[first]
            self._store(copy.rows, positions, copy.within, np.where(held, copy.host.numpy(), np.float32(np.nan)))
            self._arrived = copy.seq
        if self._retiring:
            self._settle()

    def _store(self, rows: np.ndarray, positions: np.ndarray, within: np.ndarray, values: np.ndarray) -> None:
        """Put one forward's values in their rows' buffers, a full buffer first joining its row's chunks (and a
        request's tokens more than a buffer holds, a prompt's, straight to its chunks)."""
        counts = np.bincount(rows, minlength=len(self._fill))
        keep = None
        for row in np.flatnonzero(self._fill + counts > DEPTH).tolist():
            self._spill(row)
            if counts[row] > DEPTH:
                mine = rows == row
                self._reader_at[row].chunks.append((positions[mine], values[mine]))
                keep = ~mine if keep is None else keep & ~mine
        if keep is not None:
            rows, positions, within, values = rows[keep], positions[keep], within[keep], values[keep]
            counts = np.bincount(rows, minlength=len(self._fill))
        slots = self._fill[rows] + within
        self._buf_pos[rows, slots], self._buf_val[rows, slots] = positions, values
        self._fill += counts

    def _spill(self, row: int) -> None:
        """Move the row's buffer to its reader's chunks."""
        fill = int(self._fill[row])
        if fill:
            self._reader_at[row].chunks.append((self._buf_pos[row, :fill].copy(), self._buf_val[row, :fill].copy()))
            self._fill[row] = 0

    def _result(self, reader: _Reader, lo: float = 0, hi: float = float("inf")) -> dict:
        """The values of positions ``lo <= position < hi`` read so far."""
        self._spill(reader.row)
        if reader.chunks:
            positions = np.concatenate([p for p, _ in reader.chunks])
            values = np.concatenate([v for _, v in reader.chunks])
        else:
            positions, values = np.zeros(0, np.int32), np.zeros((0, self.k, 2), np.float32)
        values = values[:, : len(reader.args["probes"])]
        # A position computed again (a preempted request recomputes its tokens) keeps its latest value.
        order = np.argsort(positions, kind="stable")
        positions, values = positions[order], values[order]
        latest = np.append(positions[1:] != positions[:-1], True) & (positions >= lo) & (positions < hi)
        held = [k for k, probe in enumerate(reader.args["probes"]) if probe["layer"] in self.layers]
        return {"args": reader.args, "prompt_len": reader.prompt_len, "held": held, "positions": np.ascontiguousarray(positions[latest]).tobytes(),
                "values": np.ascontiguousarray(values[latest], np.float32).tobytes()}

    def _retire(self, req_id: str) -> None:
        """A finished request's reader stops reading; it keeps its row until its copies arrive (``_settle``)."""
        reader = self.live.pop(req_id)
        del self._row_of[req_id]
        if "gate" in reader.args:
            self._gated -= 1
        self._retiring[reader.tag] = reader

    def _settle(self) -> None:
        """Keep the readouts of retiring readers whose copies have all arrived for the caller, and free their rows."""
        for tag, reader in list(self._retiring.items()):
            if self._last_copy[reader.row] <= self._arrived:
                del self._retiring[tag]
                if not reader.taken:
                    self.done.put(tag, self._result(reader))
                self._reader_at[reader.row], self._fill[reader.row] = None, 0
                self._free.append(reader.row)

    def take(self, tags: Iterable[str], wait: bool = True) -> TakeReadoutsResult:
        """The readouts of ``tags``, each handed out once (``contract.TakeReadoutsResult``). As with captures, vLLM
        tells the workers that a request finished only in the step after it finished, which an idle engine may run
        after the caller asks: a live request's readout is handed out as it stands, with every forward run so far
        (the caller, who has the request's output, cuts it to the tokens it got). ``wait`` False: where one of the
        tags' values is still on its way from the device (under load, the forward the engine core runs meanwhile
        wrote it), nothing is handed out and the answer says ``pending``, so that the engine core's loop, which
        serves the take between two steps, does not wait for that forward: the caller asks again."""
        wanted = set(tags)
        if not wait:
            self._flush()  # issues the last forward's copy; keeps what arrived, waiting for none
            rows = [r.row for r in (*self._retiring.values(), *self.live.values()) if r.tag in wanted and not r.taken]
            if rows and int(self._last_copy[rows].max()) > self._arrived:
                return TakeReadoutsResult(ok=True, readouts={}, pending=True)
        retiring = [self._retiring[tag].row for tag in wanted if tag in self._retiring and not self._retiring[tag].taken]
        if retiring:  # finished: wait only for the copies that hold their values (none for one handed out early)
            self._flush(int(self._last_copy[retiring].max()))
        out = self.done.take(wanted)
        early = [reader for reader in self.live.values() if reader.tag in wanted and reader.tag not in out and not reader.taken]
        if early and wait:  # (not waiting: their copies have all arrived)
            if self._cuda:
                torch.cuda.synchronize(self.out.device)  # the forward that wrote the last token may still be running
            self._flush(math.inf)
        for reader in early:
            out[reader.tag] = self._result(reader)
            reader.taken = True
        return TakeReadoutsResult(ok=True, readouts=out)

    def peek(self, since: Mapping[str, int]) -> TakeReadoutsResult:
        """A streamed readout's values so far, left in place (``hotwire_peek_readouts``): per tag, its generated
        tokens from ``since[tag]`` on, up to the last position computed for good (not a draft a verification may
        reject), as far as their copies have arrived: no wait on the device."""
        self._flush()
        out = {}
        for reader in self.live.values():
            first = since.get(reader.tag)
            if first is not None and not reader.taken:
                out[reader.tag] = self._result(reader, reader.prompt_len - 1 + first, int(self._settled[reader.row]))
        return TakeReadoutsResult(ok=True, readouts=out)
