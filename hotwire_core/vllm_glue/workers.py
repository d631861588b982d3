"""The workers (``vllm.v1.worker``): after ``Worker.load_model`` hotwire allocates its buffers and hooks the decoder
layers (before compile and graph capture); ``WorkerBase`` answers the RPCs that reach every rank."""

from __future__ import annotations

import logging
from typing import Any

from .. import contract, ops
from ..ops import GATE
from . import compat, graphs, runners
from .patching import settings, wrap

__all__ = ["patch_worker", "patch_worker_base", "pdl_possible", "unsupported_setup"]

logger = logging.getLogger(__name__)


def patch_worker_base(module: Any) -> None:
    def hotwire_worker_info(self) -> contract.WorkerInfo:
        steering = getattr(self.model_runner, "hotwire", None)
        if steering is None:
            return contract.WorkerInfo(steerable=False, reason="hotwire did not attach to the model", layers=[],
                                       n_layers=0, hidden_size=0, dtype="", norm=False, slots=settings().slots,
                                       max_stack=settings().max_stack, capture_rows=0, readout_probes=0,
                                       readout_layers=[], gates=[])
        return steering.info()

    def hotwire_graph_sets(self) -> dict:
        return graphs.graph_set_counts(self.model_runner)

    def hotwire_take_captures(self, tags: list[str]) -> dict:
        steering = getattr(self.model_runner, "hotwire", None)
        capture = steering.capture if steering is not None else None
        return capture.take(tags) if capture is not None else contract.TakeCapturesResult(ok=True, captures={})

    def hotwire_take_readouts(self, tags: list[str], wait: bool = True) -> dict:
        steering = getattr(self.model_runner, "hotwire", None)
        readout = steering.readout if steering is not None else None
        return readout.take(tags, wait) if readout is not None else contract.TakeReadoutsResult(ok=True, readouts={})

    def hotwire_peek_readouts(self, since: dict[str, int]) -> dict:
        steering = getattr(self.model_runner, "hotwire", None)
        readout = steering.readout if steering is not None else None
        return readout.peek(since) if readout is not None else contract.TakeReadoutsResult(ok=True, readouts={})

    setattr(module.WorkerBase, contract.WORKER_INFO, hotwire_worker_info)
    setattr(module.WorkerBase, contract.PEEK_READOUTS, hotwire_peek_readouts)
    setattr(module.WorkerBase, contract.TAKE_READOUTS, hotwire_take_readouts)
    setattr(module.WorkerBase, contract.TAKE_CAPTURES, hotwire_take_captures)
    setattr(module.WorkerBase, contract.GRAPH_SETS, hotwire_graph_sets)


def _attach(worker: Any) -> None:
    import torch

    from ..runtime import WorkerSteering
    from ..steer_hook import select_layers
    from .layers import (adds_last_layer_itself, find_decoder_layers, read_points, stream_in_hidden,
                         why_not_steerable, wrap_layer_class, wrap_norm_class)

    runner = worker.model_runner
    model = runner.get_model()
    found, n_layers = find_decoder_layers(model)
    model_config = worker.vllm_config.model_config
    reason = unsupported_setup(worker.vllm_config) or runners.unhooked_runner(runner)
    if reason:
        logger.warning("hotwire: steering is off: %s", reason)
        found = {}
    elif not found:
        reason = why_not_steerable(model)
        logger.warning("hotwire: %s cannot be steered: %s; steering is off", type(model).__name__, reason)
    if not found:  # the whole model's count: get_num_layers would give this pipeline stage's
        n_layers = model_config.get_total_num_hidden_layers()
    layers = select_layers(found, n_layers, settings().layers) if found else found
    device = torch.device(worker.device) if hasattr(worker, "device") else torch.device("cpu")
    for layer in layers.values():
        wrap_layer_class(type(layer))  # its forward calls the hook WorkerSteering adds
    points = read_points(found) if settings().capture or settings().readout else {}
    for norm in points.values():
        wrap_norm_class(type(norm))  # its forward calls the reader WorkerSteering adds (stream_read)
    runner.hotwire = WorkerSteering(
        layers,
        n_layers,
        model_config.get_hidden_size(),
        model_config.dtype,
        device,
        runner.max_num_tokens,
        runner.max_num_reqs,
        settings(),
        bool(worker.vllm_config.compilation_config.pass_config.fuse_allreduce_rms),
        steerable=bool(found),
        reason=reason,
        whole_stream={index for index, layer in layers.items() if stream_in_hidden(type(layer))},
        in_residual={n_layers - 1} & layers.keys() if layers and adds_last_layer_itself(model) else set(),
        speculative=worker.vllm_config.speculative_config is not None,
        read_points={index: norm for index, norm in points.items() if index in layers},
    )
    steering = runner.hotwire
    GATE.configure(_idle_graphs_possible(worker.vllm_config) and bool(layers), read=steering.readout is not None,
                   capture=steering.capture is not None)
    ops.PDL = pdl_possible(device)
    if layers and settings().impl == "op" and device.type == "cuda":
        logger.info("hotwire: kernels launched %s", "as programmatic dependent launches" if ops.PDL else "plainly")


def unsupported_setup(vllm_config: Any) -> str | None:
    """Why hotwire cannot steer correctly under this configuration (:func:`compat.unsound_features`), or None."""
    return "; ".join(compat.unsound_features(vllm_config)) or None


def pdl_possible(device: Any) -> bool:
    """``HOTWIRE_PDL`` on an NVIDIA GPU of compute capability 9.0+ (ROCm reports its GPUs as "cuda" devices with
    capabilities of its own, and has no ``griddepcontrol``)."""
    import torch

    return (
        settings().pdl
        and device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _idle_graphs_possible(vllm_config: Any) -> bool:
    """Graph variants need the opaque op (traced torch ops cannot be switched off) and vLLM's own
    ``CUDAGraphWrapper``: the breakable wrapper keeps graphs of its own, and would replay an idle capture for a
    steered step (micro-batching: see unsupported_setup)."""
    return (
        settings().idle_graphs
        and settings().impl == "op"
        and not compat.breakable_cudagraphs_enabled(vllm_config)
    )


def patch_worker(module: Any) -> None:
    def make(original):
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _attach(self)
            return result

        return load_model

    wrap(module.Worker, "load_model", make)
