"""Worker side: persistent steering buffers, the requests' config rows, and the per-step fill.

Buffers are allocated once at model load, before torch.compile and CUDA-graph capture, and never reallocated:
graphs read them by address. Per step the only host work is writing one config index per token
(``token_cfg``); the per-request config table, and ``layer_on`` (which layers any live config steers), change
only when a request is added or removed. What a step changes arrives as a :class:`Step`, which the glue makes from
vLLM's scheduler output (``vllm_glue.runners.step_of``). The hook on each layer is :mod:`.steer_hook`'s, the
host-to-device copies :mod:`.uploader`'s, the table's rows :mod:`.config_rows`'.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import torch
from torch import nn

from .bindings import BankWrite
from .capture import WorkerCapture  # its capture_op registers torch.ops.hotwire.capture_
from .readout_worker import WorkerReadout  # its readout_op registers torch.ops.hotwire.read_
from .contract import Config, SteerItem, WorkerInfo
from .config_rows import ConfigRows
from .ops import CAPTURE, IDLE, READ, STEER
from .settings import Settings
from .steer_hook import HOOK_NAME, SteerHook
from .stream_read import READER_NAME, StreamReader
from .uploader import Uploader

__all__ = ["CONFIG_ROWS_PER_BATCH_SLOT", "Step", "WorkerSteering"]

CONFIG_ROWS_PER_BATCH_SLOT = 2  # requests with config rows per --max-num-seqs slot (see WorkerSteering)


@dataclass(frozen=True)
class Step:
    """What one scheduler step changes for a worker's steering."""

    removed: Iterable[str]  # requests the runner dropped: finished (and, in V2, preempted)
    new: Sequence[tuple[str, int, Config | None]] = ()  # new requests: (id, prompt length, its binding or None)
    writes: Sequence[BankWrite] = ()  # bank rows to load before this step
    rebinds: Mapping[str, Config] = field(default_factory=dict)  # preempted requests whose rows moved
    preempted: bool = False  # the step preempted requests
    finished: Iterable[str] = ()  # requests vLLM finished (captures are taken then; V2's ``removed`` adds preempted)
    captures: Sequence[tuple[str, int, dict]] = ()  # new capture requests: (id, prompt length, CAPTURE_KEY's value)
    readouts: Sequence[tuple[str, int, dict, list]] = ()  # new readout requests: (id, prompt length, args, probe rows)


class WorkerSteering:
    """Steering state of one worker (one TP/PP rank)."""

    def __init__(
        self,
        layers: dict[int, nn.Module],
        n_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
        max_reqs: int,
        settings: Settings,
        allreduce_rms_fusion: bool = False,
        steerable: bool | None = None,
        reason: str | None = None,
        whole_stream: Collection[int] = (),
        in_residual: Collection[int] = (),
        speculative: bool = False,
        read_points: Mapping[int, nn.Module] | None = None,
    ):
        """``layers``: the modules to hook on this rank, by global index; ``whole_stream``: those of them that return
        the whole residual stream in ``hidden_states`` (see :class:`SteerHook`); ``in_residual``: those steered in
        ``residual`` although the rest are steered in ``hidden_states`` (``vllm_glue.layers.MODEL_ADD``).
        ``steerable``: whether the model has layers hotwire can hook (default: whether ``layers`` is non-empty; a
        pipeline rank that ``HOTWIRE_LAYERS`` leaves without a hooked layer is still steerable). ``reason``: why it
        is not steerable, where not for want of layers. ``speculative``: the engine verifies drafts (a latched gate
        is then refused: ``hotwire_core.gates``).
        ``read_points``: for a hooked layer, the norm whose ``residual`` output is the stream after it, where capture
        and readout read it (:mod:`hotwire_core.stream_read`); the others are read at their output."""
        self.layers, self.n_layers, self.hidden_size = layers, n_layers, hidden_size
        self.steerable = bool(layers) if steerable is None else steerable
        self.reason = reason or "no decoder layer with the (positions, hidden_states, residual) contract"
        self.target = "residual" if allreduce_rms_fusion else "hidden"
        # Norm-relative steering is always possible when steering the residual (hidden is read anyway).
        self.norm = settings.norm or self.target == "residual"
        self.dtype, self.device, self.settings = dtype, device, settings
        # Row 0 means "no steer"; a steered request holds up to two rows (prefill, decode). Room for twice the
        # requests a batch holds: V1 keeps the rows of preempted requests while others run in their place.
        k, n_cfg = settings.max_stack, 2 * CONFIG_ROWS_PER_BATCH_SLOT * max_reqs + 1
        self._uploader = Uploader(device)
        self.capture = (WorkerCapture(layers, n_layers, hidden_size, device, max_tokens, settings.capture_rows,
                                      self._uploader) if settings.capture and layers else None)
        with torch.device(device):
            self.buffers = {
                "bank": torch.zeros(settings.slots + 1, hidden_size, dtype=dtype),
                "inv_norm": torch.zeros(settings.slots + 1, dtype=torch.float32),
                "token_cfg": torch.zeros(max_tokens, dtype=torch.int32),
                "layer_on": torch.zeros(n_layers, dtype=torch.int32),
                "cfg_slot": torch.zeros(n_cfg, n_layers, k, dtype=torch.int32),
                "cfg_scale": torch.zeros(n_cfg, n_layers, k, dtype=torch.float32),
                "cfg_rel": torch.zeros(n_cfg, n_layers, k, dtype=torch.float32),
            }
        # Gated steering rides on the readout op, which decides the condition; only the opaque op reads it in order.
        gates = settings.readout and bool(layers) and settings.impl == "op"
        self.gate_modes = ["token"] + ([] if speculative else ["latch"]) if gates else []
        readable = settings.readout_layers
        self.read_layers = sorted(i for i in layers if readable is None or i in readable) if settings.readout else []
        self.readout = (WorkerReadout(self.read_layers, n_layers, device, max_tokens, settings.readout_probes, n_cfg - 1,
                                      self._uploader, gates) if settings.readout and layers else None)
        if gates:
            self.buffers["cfg_gate"] = torch.zeros(n_cfg, n_layers, k, dtype=torch.int32, device=device)
        if self.capture is not None:
            self.buffers["token_cap"] = self.capture.token_cap
        if self.readout is not None:
            self.buffers["token_read"], self.buffers["read_slot"] = self.readout.token_read, self.readout.read_slot
            self.buffers.update(self.readout.gates or {})
        for index, module in layers.items():
            reads = self.capture is not None or index in self.read_layers
            reader = StreamReader(self.buffers, index, read=index in self.read_layers) if reads else None
            point = (read_points or {}).get(index) if reads else None
            if point is not None:
                point.add_module(READER_NAME, reader)
            target = "residual" if index in in_residual else self.target
            hook = SteerHook(self.buffers, index, settings.impl, target, self.norm, index in whole_stream,
                             reader if point is None else None)
            module.add_module(HOOK_NAME, hook)
        self.config_rows = ConfigRows(n_cfg, n_layers)
        self._line_of: dict[str, int] = {}  # steered req_id -> its line in _lines
        self._lines = np.zeros((8, 3), np.int64)  # per steered request: (prefill row, decode row, prompt len); line 0: none
        self._free_lines = list(range(len(self._lines) - 1, 0, -1))
        self._layer_on = np.zeros(n_layers, np.int32)  # what layer_on holds on the device
        self._dirty = 0  # token_cfg[:_dirty] may be non-zero on the device
        self._staging = np.zeros(max_tokens, dtype=np.int32)
        self._uploaded = np.zeros(0, np.int32)  # what token_cfg[:len] holds on the device since the last copy
        self._epoch = 0  # bumped whenever the set of steered requests changes
        self._rows_key: tuple[str, ...] = ()
        self._rows_epoch = -1
        self._rows = np.zeros((0, 3), np.int64)
        self._batch_steered = False
        self._steady_rows: np.ndarray | None = None  # the batch rows whose token_cfg stays put (all decoding)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            steerable=self.steerable,
            reason="" if self.steerable else self.reason,
            layers=sorted(self.layers),
            n_layers=self.n_layers,
            hidden_size=self.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."),
            norm=self.norm,
            slots=self.settings.slots,
            max_stack=self.settings.max_stack,
            capture_rows=self.capture.rows if self.capture is not None else 0,
            readout_probes=self.readout.k if self.readout is not None else 0,
            readout_layers=self.read_layers,
            gates=self.gate_modes,
        )

    # -- request lifecycle -----------------------------------------------------------------------------------

    def on_step(self, step: Step) -> None:
        """Apply the controller's bank writes, drop removed requests, and add the new ones."""
        epoch = self._epoch
        capture = self.capture
        if capture is not None and (capture.live or step.captures):
            capture.on_step(step.finished, step.captures)
        if step.writes:
            self._apply_writes(step.writes)
        readout = self.readout
        if readout is not None and (readout.live or step.readouts):
            readout.on_step(step.finished, step.readouts, step.rebinds)
        if step.preempted:
            # V1 keeps a preempted request's rows; resumed, it recomputes its prompt in the same batch slot.
            self._steady_rows = None
        for req_id in step.removed:
            self._remove(req_id)
        new = []
        for req_id, prompt_len, config in step.new:
            if config is not None:
                new.append((req_id, prompt_len, config))
            elif req_id in self._line_of:  # an id sent again without a binding: its old rows must not linger
                self._remove(req_id)
        if step.rebinds:  # preempted requests whose rows moved before they resumed (V1 keeps them; V2 re-adds them)
            added = {req_id for req_id, _, _ in step.new}
            new += [(r, self.request_rows(r)[2], config) for r, config in step.rebinds.items()
                    if r in self._line_of and r not in added]
        if new:
            self._add(new)
        if self._epoch != epoch:
            self._sync_layer_on()

    def request_rows(self, req_id: str) -> tuple[int, int, int] | None:
        """``(prefill row, decode row, prompt length)`` of a steered request; None for one that is not."""
        line = self._line_of.get(req_id)
        return None if line is None else tuple(int(x) for x in self._lines[line])

    def _apply_writes(self, writes: Sequence[BankWrite]) -> None:
        slots = torch.tensor([w.slot for w in writes], dtype=torch.long)
        rows = torch.stack([w.row.to(self.dtype) for w in writes])  # vectors may be registered in other dtypes
        inv = torch.tensor([w.inv_norm for w in writes], dtype=torch.float32)
        idx = self._uploader.to_device(slots)
        self.buffers["bank"].index_copy_(0, idx, self._uploader.to_device(rows))
        self.buffers["inv_norm"].index_copy_(0, idx, self._uploader.to_device(inv))

    def _remove(self, req_id: str) -> None:
        line = self._line_of.pop(req_id, None)
        if line is not None:
            self._epoch += 1
            for row in self._lines[line, :2]:
                if row:
                    self.config_rows.release(int(row))
            self._lines[line] = 0
            self._free_lines.append(line)

    def _sync_layer_on(self) -> None:
        """Switch on exactly the layers some live config steers: at the others the op returns after one load.

        A superset of the layers the scheduled tokens steer is always correct (the op then checks each token's
        own entries), so this follows admissions and removals rather than every step."""
        on = (self.config_rows.layer_users > 0).astype(np.int32)
        if not np.array_equal(on, self._layer_on):
            self._layer_on = on
            self._uploader.copy_(self.buffers["layer_on"], torch.from_numpy(on))

    def _add(self, new: list[tuple[str, int, Config]]) -> None:
        """Give each new request its config rows: a config already live is shared, a new one is written to the
        device (all of this step's in one copy)."""
        fresh: list[tuple[int, list[SteerItem]]] = []
        for req_id, prompt_len, config in new:
            self._remove(req_id)  # a re-added (preempted or streaming) request starts clean
            pair = [0, 0]
            for i, phase in enumerate(("p", "d")):
                items = config.get(phase) or []
                if items:
                    pair[i], created = self.config_rows.acquire(items)
                    if created:
                        fresh.append((pair[i], items))
            if pair == [0, 0]:
                continue
            if not self._free_lines:
                grown = len(self._lines)
                self._lines = np.concatenate([self._lines, np.zeros_like(self._lines)])
                self._free_lines = list(range(len(self._lines) - 1, grown - 1, -1))
            line = self._free_lines.pop()
            self._lines[line] = (pair[0], pair[1], prompt_len)
            self._line_of[req_id] = line
            self._epoch += 1
        if fresh:
            self._write_rows(fresh)

    def _write_rows(self, fresh: list[tuple[int, list[SteerItem]]]) -> None:
        """Write config rows ``(row, items)`` to ``cfg_slot`` / ``cfg_scale`` / ``cfg_rel`` (and ``cfg_gate``, with
        gates) with one host-to-device copy: the row ids and the tables travel as one int32 array (the float tables
        as their bits), split on the device."""
        k, n, n_tables = self.settings.max_stack, len(fresh), 4 if "cfg_gate" in self.buffers else 3
        packed = np.zeros((n, 1 + n_tables * self.n_layers * k), np.int32)
        packed[:, 0] = [row for row, _ in fresh]
        tables = packed[:, 1:].reshape(n, n_tables, self.n_layers, k)
        slot, scale, rel = tables[:, 0], tables[:, 1].view(np.float32), tables[:, 2].view(np.float32)
        for i, (_, items) in enumerate(fresh):
            used = [0] * self.n_layers
            for layer, s, sc, rl, *gated in items:  # a SteerItem, or the list msgpack makes of one
                layer = int(layer)
                j = used[layer]
                slot[i, layer, j], scale[i, layer, j], rel[i, layer, j] = int(s), sc, rl
                if gated and gated[0]:
                    if n_tables < 4:
                        raise ValueError("a gated entry reached a worker without gates (HOTWIRE_READOUT is off here)")
                    tables[i, 3, layer, j] = 1
                used[layer] += 1
        device = self._uploader.to_device(torch.from_numpy(packed))
        idx = device[:, 0].long()
        on_device = device[:, 1:].view(n, n_tables, self.n_layers, k)
        self.buffers["cfg_slot"].index_copy_(0, idx, on_device[:, 0])
        self.buffers["cfg_scale"].index_copy_(0, idx, on_device[:, 1].view(torch.float32))
        self.buffers["cfg_rel"].index_copy_(0, idx, on_device[:, 2].view(torch.float32))
        if n_tables == 4:
            self.buffers["cfg_gate"].index_copy_(0, idx, on_device[:, 3])

    def step_kinds(self, scheduled: Collection[str]) -> int:
        """Which of hotwire's ops the scheduled requests need (``ops.STEER``, ``READ``, ``CAPTURE``): a steering
        config (for prefill or decode), a readout or gate, a capture. ``ops.GATE`` covers it for the step."""
        kinds = IDLE
        capture = self.capture  # attribute checks first: this runs every step, and nobody captures in most
        if capture is not None and capture.live and capture.scheduled(scheduled):
            kinds |= CAPTURE
        readout = self.readout
        if readout is not None and readout.live and readout.scheduled(scheduled):
            kinds |= READ
        if self._steers_any(scheduled):
            kinds |= STEER
        return kinds

    def _steers_any(self, scheduled: Collection[str]) -> bool:
        steered = self._line_of
        if len(steered) <= len(scheduled):  # walk the smaller of the two
            return any(req_id in scheduled for req_id in steered)
        return any(req_id in steered for req_id in scheduled)

    # -- per-step fill ---------------------------------------------------------------------------------------

    def _batch_rows(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[n_reqs, 3]`` (prefill row, decode row, prompt len) per batch row; rebuilt only when the batch or
        the set of steered requests changed (decode steps usually repeat the previous batch)."""
        key = tuple(req_ids)
        if key != self._rows_key or self._rows_epoch != self._epoch:
            lines = np.fromiter(map(self._line_of.get, key, repeat(0, len(key))), np.intp, len(key))
            self._rows = self._lines[lines]
            self._batch_steered = bool(lines.any())
            self._rows_key, self._rows_epoch = key, self._epoch
        return self._rows

    @property
    def clean(self) -> bool:
        """No request is steered or captures, and ``token_cfg`` / ``token_cap`` hold zeros: ``fill`` has nothing to do."""
        return (not self._line_of and not self._dirty and (self.capture is None or self.capture.clean)
                and (self.readout is None or self.readout.clean))

    def fill(self, req_ids: Sequence[str], num_scheduled: np.ndarray, num_computed: np.ndarray, num_tokens: int,
             positions: torch.Tensor | None = None) -> None:
        """Write ``token_cfg`` for a batch laid out request by request in ``req_ids`` order; ``num_tokens`` is the
        sum of ``num_scheduled`` (both runners have it at hand; summing it here was about 40% of a steady step's fill).
        ``positions``: the tokens' positions on the device where ``num_computed`` may count drafts the last step
        rejected (asynchronous scheduling with speculation; ``vllm_glue.speculation``): readouts and gates take
        theirs from it. Steering needs only which tokens are past the prompt, which such a count never misplaces
        (a request drafts only once its prompt is computed).

        A token at position ``p`` of a request with prompt length ``P`` uses the prefill config when ``p < P``
        and the decode config otherwise. Steps with no steered request leave a clean buffer untouched."""
        capture = self.capture
        if capture is not None and (capture.live or capture.dirty):
            capture.fill(req_ids, num_scheduled, num_computed, num_tokens)
        readout = self.readout
        if readout is not None and not readout.clean:
            readout.fill(req_ids, num_scheduled, num_computed, num_tokens, positions)
        if not self._line_of and not self._dirty:
            return
        rows = self._batch_rows(req_ids)
        if not self._batch_steered and not self._dirty:
            return
        n = num_tokens
        if n == len(rows) and rows is self._steady_rows:
            return  # same batch, one token each, all past their prompts last step: positions only grow
        # Per request (vectorised): the config of its first token this step, repeated over its tokens.
        computed = np.asarray(num_computed, np.int64)
        in_prompt = computed < rows[:, 2]
        per_request = np.where(in_prompt, rows[:, 0], rows[:, 1])
        length = max(n, self._dirty)
        host = self._staging[:length]
        host[n:] = 0
        if n == len(rows):  # one token per request
            host[:n] = per_request
        else:
            host[:n] = np.repeat(per_request, num_scheduled)
            # Rare: tokens that run past the prompt in one step (a resumed request recomputing its output).
            for i in np.flatnonzero(in_prompt & (computed + num_scheduled > rows[:, 2])):
                start = int(num_scheduled[:i].sum())
                host[start + rows[i, 2] - computed[i] : start + num_scheduled[i]] = rows[i, 1]
        self._steady_rows = rows if n == len(rows) == length and not in_prompt.any() else None
        if length == len(self._uploaded) and np.array_equal(host, self._uploaded):
            return  # the device already holds exactly this
        self._uploaded = host.copy()
        self._uploader.copy_(self.buffers["token_cfg"][:length], torch.from_numpy(self._uploaded))
        self._dirty = n if host[:n].any() else 0
