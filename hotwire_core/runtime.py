"""Worker side: persistent steering buffers, the per-layer hook, and the per-step fill.

Buffers are allocated once at model load, before torch.compile and CUDA-graph capture, and never reallocated:
graphs read them by address. Per step the only host work is writing one config index per token
(``token_cfg``); the per-request config table, and ``layer_on`` (which layers any live config steers), change
only when a request is added or removed.
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import repeat
from typing import Any, Collection, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from . import ops
from .capture import WorkerCapture  # its capture_op registers torch.ops.hotwire.capture_
from .contract import BINDING_KEY, REBINDS_ATTR, WRITES_ATTR
from .controller import prompt_length
from .settings import Settings, format_layers

logger = logging.getLogger(__name__)

CONFIG_ROWS_PER_BATCH_SLOT = 2  # requests with config rows per --max-num-seqs slot (see WorkerSteering)


def select_layers(found: dict[int, nn.Module], n_layers: int, allowed: frozenset[int] | None) -> dict[int, nn.Module]:
    """The layers of ``found`` to hook: those in ``allowed`` (``HOTWIRE_LAYERS``; None: all). A layer the model
    does not have is a configuration error, raised at start rather than refused on every request."""
    if allowed is None:
        return found
    missing = sorted(layer for layer in allowed if layer >= n_layers)
    if missing:
        raise ValueError(
            f"HOTWIRE_LAYERS={format_layers(allowed)} names layer {missing[0]}, but the model has {n_layers} decoder "
            f"layers (0-{n_layers - 1}); fix HOTWIRE_LAYERS or unset it to steer every layer"
        )
    return {index: module for index, module in found.items() if index in allowed}


class SteerHook(nn.Module):
    """Applies steering to one layer's output. Holds the shared buffers as (non-persistent) module buffers so
    torch.compile lifts them as fixed-address graph inputs.

    The residual stream after a layer that returns ``(hidden, residual)`` is ``hidden + residual``, so the
    steering may go into either. Where it goes decides what the compiled graph looks like around it:

    * ``"hidden"`` (the default): the op touches only ``hidden``, a matmul output that is in
      memory anyway. ``residual`` stays a value Inductor may keep in registers, exactly as without hotwire, so
      unsteered tokens come out bit-identical to vLLM without the plugin. Norm-relative entries need ``residual``
      too; with ``HOTWIRE_NORM=1`` the op reads it, and Inductor then writes it out in the model dtype, which
      moves plain tokens by rounding. So norm mode is opt-in.
    * ``"residual"`` (only when vLLM's all-reduce + RMSNorm fusion pass is on: tensor parallel > 1 on Hopper or
      Blackwell with FlashInfer): keeps that fusion, whose pattern ``all_reduce(hidden) ->
      fused_add_rms_norm(hidden, residual)`` an op on ``hidden`` would break. Reading ``residual`` costs
      bit-identity (above), which that fusion gives up anyway.

    A layer that returns the whole stream in ``hidden`` (``whole_stream``; its ``residual`` is a stale value the
    model drops) is steered like one that returns ``(hidden, None)``.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], layer: int, impl: str, target: str, norm: bool,
                 whole_stream: bool = False):
        super().__init__()
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.layer, self.impl, self.target, self.norm = layer, impl, target, norm
        self.whole_stream = whole_stream
        # HOTWIRE_CAPTURE: the capture op after the steering (hotwire_core.capture). It reads the whole stream,
        # residual included, which costs plain tokens bit-identity in bf16 graphs as norm mode does.
        self.capture = "token_cap" in buffers

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is None or self.whole_stream:  # the whole stream is in hidden
            target, other = hidden, None
        elif self.target == "hidden":
            target, other = hidden, (residual if self.norm else None)
        else:
            target, other = residual, hidden
        args = (self.token_cfg, self.layer_on, self.cfg_slot, self.cfg_scale, self.cfg_rel, self.bank, self.inv_norm, self.layer)
        if self.impl == "inductor":
            target = ops.steer_torch(target, other, *args, use_norm=self.norm)
        else:
            torch.ops.hotwire.steer_(target, other, *args)
        if self.capture:  # the stream is target + the other of (hidden, residual), if the layer returns both
            partner = None if residual is None or self.whole_stream else (residual if self.target == "hidden" else hidden)
            torch.ops.hotwire.capture_(target, partner, self.token_cap, self.layer)
        if residual is None or self.whole_stream:
            return target, residual
        return (target, residual) if self.target == "hidden" else (hidden, target)


def wrap_layer_class(cls: type) -> None:
    """Patch ``cls.forward`` once so instances that carry a ``hotwire_steer`` hook apply it to their output."""
    if "_hotwire_wrapped" in cls.__dict__:
        return
    original = cls.forward

    def forward(self, positions, hidden_states, residual, *args, **kwargs):
        out = original(self, positions, hidden_states, residual, *args, **kwargs)
        hook = self._modules.get("hotwire_steer")
        return out if hook is None else hook(*out)

    forward.__doc__ = original.__doc__
    cls._hotwire_wrapped = original
    cls.forward = forward


class _Uploader:
    """Host-to-device copies that neither stall the CPU on the GPU nor pin memory per copy: values are staged in
    a pinned ring, and a region of it is written again only once the copy that read it has run (an event per
    copy; the CPU waits only if the ring comes round before the GPU got there). On a CPU device: plain copies."""

    ALIGN = 64

    def __init__(self, device: torch.device, ring_bytes: int = 1 << 22):
        self.device = device
        self.cuda = device.type == "cuda"
        self._ring = torch.empty(ring_bytes if self.cuda else 0, dtype=torch.uint8, pin_memory=self.cuda)
        self._head = 0
        # Per copy the GPU may not have run yet: (event, start, end) of its ring region, or (event, 0, 0) and the
        # pinned copy of its own to keep alive.
        self._inflight: deque[tuple[Any, int, int, torch.Tensor | None]] = deque()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A new device tensor holding ``host``'s values (for ``index_copy_`` sources)."""
        if not self.cuda:
            return host
        staged, region = self._stage(host)
        out = staged.to(self.device, non_blocking=True)
        self._record(region)
        return out

    def copy_(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """``dst.copy_(host)``, one host-to-device copy straight into ``dst``."""
        if not self.cuda:
            dst.copy_(host)
            return
        staged, region = self._stage(host)
        dst.copy_(staged, non_blocking=True)
        self._record(region)

    def _stage(self, host: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, torch.Tensor | None]]:
        """A pinned copy of ``host`` and what keeps it valid until the GPU read it: ``(start, end, None)`` in the
        ring, or ``(0, 0, copy)`` for a copy of its own."""
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()
        size = -(-host.numel() * host.element_size() // self.ALIGN) * self.ALIGN
        if size > len(self._ring):  # larger than the ring (a big batch of bank writes): a pinned copy of its own
            pinned = host.pin_memory()
            return pinned, (0, 0, pinned)
        start = self._head if self._head + size <= len(self._ring) else 0
        end = self._head = start + size
        for event, a, b, _ in self._inflight:
            if a < end and start < b:  # the ring came round to a copy the GPU has not run yet
                event.synchronize()
        staged = self._ring[start : start + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        return staged.copy_(host), (start, end, None)

    def _record(self, region: tuple[int, int, torch.Tensor | None]) -> None:
        event = torch.cuda.Event()
        event.record()
        self._inflight.append((event, *region))


class ConfigRows:
    """Which rows of the device's config table (``cfg_slot`` / ``cfg_scale`` / ``cfg_rel``) hold which per-phase
    config. Requests with the same config share its row (refcounted), so admitting one whose config is live
    already writes nothing to the device. Row 0 is "no steer" and never handed out."""

    def __init__(self, n_rows: int, n_layers: int):
        self.n_rows = n_rows
        self._free = list(range(n_rows - 1, 0, -1))
        self._row_of: dict[tuple, int] = {}  # config items -> its row
        self._key_of: dict[int, tuple] = {}
        self._users: dict[int, int] = {}  # row -> requests (phases) using it
        self._layers: dict[int, np.ndarray] = {}  # row -> the layers it steers (bool [n_layers])
        self.layer_users = np.zeros(n_layers, np.int64)  # live rows steering each layer

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._users)

    def acquire(self, items: Sequence[Sequence[float]]) -> tuple[int, bool]:
        """The row holding config ``items`` (``[layer, slot, scale, rel]`` each), and whether it is new (then the
        caller writes it to the device)."""
        key = tuple(map(tuple, items))
        row = self._row_of.get(key)
        if row is not None:
            self._users[row] += 1
            return row, False
        if not self._free:
            raise RuntimeError(
                f"hotwire: all {self.n_rows - 1} steering config rows hold configs of running or preempted steered "
                "requests; this should not happen (please report it), and a larger --max-num-seqs makes room"
            )
        row = self._free.pop()
        layers = np.zeros(len(self.layer_users), bool)
        layers[[int(item[0]) for item in items]] = True
        self._row_of[key], self._key_of[row], self._users[row], self._layers[row] = row, key, 1, layers
        self.layer_users += layers
        return row, True

    def release(self, row: int) -> None:
        self._users[row] -= 1
        if not self._users[row]:
            del self._users[row], self._row_of[self._key_of.pop(row)]
            self.layer_users -= self._layers.pop(row)
            self._free.append(row)


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
    ):
        """``layers``: the modules to hook on this rank, by global index; ``whole_stream``: those of them that return
        the whole residual stream in ``hidden_states`` (see :class:`SteerHook`). ``steerable``: whether the model has
        layers hotwire can hook (default: whether ``layers`` is non-empty; a pipeline rank that ``HOTWIRE_LAYERS``
        leaves without a hooked layer is still steerable). ``reason``: why it is not steerable, where not for want
        of layers."""
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
        self._uploader = _Uploader(device)
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
        if self.capture is not None:
            self.buffers["token_cap"] = self.capture.token_cap
        for index, module in layers.items():
            wrap_layer_class(type(module))
            hook = SteerHook(self.buffers, index, settings.impl, self.target, self.norm, index in whole_stream)
            module.add_module("hotwire_steer", hook)
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

    def info(self) -> dict:
        return {
            "steerable": self.steerable,
            "reason": "" if self.steerable else self.reason,
            "layers": sorted(self.layers),
            "n_layers": self.n_layers,
            "hidden_size": self.hidden_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "norm": self.norm,
            "capture_rows": self.capture.rows if self.capture is not None else 0,
        }

    # -- request lifecycle -----------------------------------------------------------------------------------

    def on_step(self, scheduler_output: Any, removed: Iterable[str]) -> None:
        """Apply the controller's bank writes, drop removed requests, and add the new ones."""
        epoch = self._epoch
        capture = self.capture
        if capture is not None and (capture.live or scheduler_output.scheduled_new_reqs):
            capture.on_step(scheduler_output)
        writes = getattr(scheduler_output, WRITES_ATTR, None)
        if writes:
            self._apply_writes(writes)
        if getattr(scheduler_output, "preempted_req_ids", None):
            # V1 keeps a preempted request's rows; resumed, it recomputes its prompt in the same batch slot.
            self._steady_rows = None
        for req_id in removed:
            self._remove(req_id)
        new = []
        for r in scheduler_output.scheduled_new_reqs:
            extra = r.sampling_params.extra_args if r.sampling_params is not None else None
            if extra and BINDING_KEY in extra:
                new.append((r.req_id, prompt_length(r), extra[BINDING_KEY]))
            elif r.req_id in self._line_of:  # an id sent again without a binding: its old rows must not linger
                self._remove(r.req_id)
        rebinds = getattr(scheduler_output, REBINDS_ATTR, None)
        if rebinds:  # preempted requests whose rows moved before they resumed (V1 keeps them; V2 re-adds them)
            added = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            new += [(r, self.request_rows(r)[2], config) for r, config in rebinds.items()
                    if r in self._line_of and r not in added]
        if new:
            self._add(new)
        if self._epoch != epoch:
            self._sync_layer_on()

    def request_rows(self, req_id: str) -> tuple[int, int, int] | None:
        """``(prefill row, decode row, prompt length)`` of a steered request; None for one that is not."""
        line = self._line_of.get(req_id)
        return None if line is None else tuple(int(x) for x in self._lines[line])

    def _apply_writes(self, writes: Sequence[Any]) -> None:
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

    def _add(self, new: list[tuple[str, int, dict]]) -> None:
        """Give each new request its config rows: a config already live is shared, a new one is written to the
        device (all of this step's in one copy)."""
        fresh: list[tuple[int, list]] = []
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

    def _write_rows(self, fresh: list[tuple[int, list]]) -> None:
        """Write config rows ``(row, [layer, slot, scale, rel] items)`` to ``cfg_slot`` / ``cfg_scale`` /
        ``cfg_rel`` with one host-to-device copy: the row ids and the three tables travel as one int32 array
        (the float tables as their bits), split on the device."""
        k, n = self.settings.max_stack, len(fresh)
        packed = np.zeros((n, 1 + 3 * self.n_layers * k), np.int32)
        packed[:, 0] = [row for row, _ in fresh]
        slot, scale, rel = (packed[:, 1:].reshape(n, 3, self.n_layers, k)[:, i] for i in range(3))
        scale, rel = scale.view(np.float32), rel.view(np.float32)
        for i, (_, items) in enumerate(fresh):
            used = [0] * self.n_layers
            for layer, s, sc, rl in items:
                layer = int(layer)
                j = used[layer]
                slot[i, layer, j], scale[i, layer, j], rel[i, layer, j] = int(s), sc, rl
                used[layer] += 1
        device = self._uploader.to_device(torch.from_numpy(packed))
        idx = device[:, 0].long()
        tables = device[:, 1:].view(n, 3, self.n_layers, k)
        self.buffers["cfg_slot"].index_copy_(0, idx, tables[:, 0])
        self.buffers["cfg_scale"].index_copy_(0, idx, tables[:, 1].view(torch.float32))
        self.buffers["cfg_rel"].index_copy_(0, idx, tables[:, 2].view(torch.float32))

    def steers_any(self, scheduled: Collection[str]) -> bool:
        """Whether any scheduled request has a steering config (for prefill or decode) or captures: the step's
        ``ops.GATE``."""
        capture = self.capture  # attribute checks first: this runs every step, and nobody captures in most
        if capture is not None and capture.live and capture.scheduled(scheduled):
            return True
        steered = self._line_of
        if not steered:
            return False
        if len(steered) <= len(scheduled):
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
        return not self._line_of and not self._dirty and (self.capture is None or self.capture.clean)

    def fill(self, req_ids: Sequence[str], num_scheduled: np.ndarray, num_computed: np.ndarray, num_tokens: int) -> None:
        """Write ``token_cfg`` for a batch laid out request by request in ``req_ids`` order; ``num_tokens`` is the
        sum of ``num_scheduled`` (both runners have it at hand; summing it here was about 40% of a steady step's fill).

        A token at position ``p`` of a request with prompt length ``P`` uses the prefill config when ``p < P``
        and the decode config otherwise. Steps with no steered request leave a clean buffer untouched."""
        capture = self.capture
        if capture is not None and (capture.live or capture.dirty):
            capture.fill(req_ids, num_scheduled, num_computed, num_tokens)
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
