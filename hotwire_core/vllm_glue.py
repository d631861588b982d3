"""Every vLLM-0.25.1-specific hook of hotwire_core, in one place.

Patches are applied when their vLLM module is imported (or at once if it already is), so a process only pays
for the modules it uses: the API server never imports the worker code. A new vLLM version means revisiting
this file (and ``hotwire_api/mount.py``, ``hotwire_api/vllm_process.py``) only.

| vLLM symbol | why |
|---|---|
| ``VllmConfig.compute_hash`` | compile/AOT caches never mix graphs built with and without (this) hotwire |
| ``EngineCore._initialize_kv_caches`` | create the controller once the workers have loaded the model |
| ``EngineCore.add_request`` | admission: bind versions and slots, salt the prefix cache, or refuse; a streaming-input chunk keeps its session's binding |
| ``EngineCore.preprocess_add_request`` | give a steered request its cache salt before vLLM hashes its blocks (input thread) |
| ``EngineCore.collective_rpc`` | answer ``hotwire_*`` RPCs in the engine core |
| ``Scheduler._free_request`` | release a finished/aborted request's pins |
| ``Scheduler._preempt_request`` / ``_is_blocked_waiting_status`` / ``_try_promote_blocked_waiting_request`` | a preempted request unpins; it waits until it can pin again |
| ``Scheduler.schedule`` | admit requests deferred for slots; bank writes ride on the ``SchedulerOutput`` |
| ``Scheduler.has_requests`` / ``finish_requests`` | deferred requests keep an unpaused engine stepping; aborts drop them (abort-all reports them) |
| ``Scheduler._update_request_as_session`` | a session's next chunk gets the session's binding back |
| ``Worker.load_model`` | allocate buffers and hook decoder layers before compile and capture |
| ``WorkerBase.hotwire_worker_info`` / ``hotwire_graph_sets`` | what this rank could hook, for the controller; which graph set it serves |
| V1 ``GPUModelRunner.execute_model`` / ``_model_forward`` | lifecycle, gate; per-step fill before (FULL graph) forward |
| V2 ``GPUModelRunner.execute_model`` / ``prepare_inputs`` | lifecycle (preempted = removed), gate; fill before ``run_fullgraph`` |
| V1 ``GPUModelRunner._warmup_and_capture``, V2 ``ModelCudaGraphManager.capture`` | capture each graph gate-closed (idle) and open |
| ``CUDAGraphWrapper._all_instances`` / ``concrete_cudagraph_entries`` / ``__init__`` / ``clear_graphs``, V2 ``CudaGraphManager.run_fullgraph`` | replay the variant the gate names |
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.util
import logging
import multiprocessing
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from . import contract, ops
from .admission import ModelInfo, Refusal
from .controller import SteeringController, WaitForRows, prompt_length, steering_args
from .ops import GATE
from .settings import Settings, format_layers
from .spec import SPEC_KEY

logger = logging.getLogger(__name__)
_SETTINGS: Settings | None = None


def settings() -> Settings:
    global _SETTINGS
    if _SETTINGS is None:
        _SETTINGS = Settings.from_env()
    return _SETTINGS


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    original = cls.__dict__[name]
    if getattr(original, "_hotwire", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._hotwire = True
    setattr(cls, name, wrapped)


# -- compile cache ---------------------------------------------------------------------------------------------


def _source_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("ops.py", "triton_steer.py", "runtime.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _patch_config(module: Any) -> None:
    fingerprint = f"{settings().compile_fingerprint()};src={_source_digest()}"

    def make(original):
        def compute_hash(self):
            return hashlib.sha256(f"{original(self)}|{fingerprint}".encode()).hexdigest()[:10]

        return compute_hash

    _wrap(module.VllmConfig, "compute_hash", make)


# -- engine core -----------------------------------------------------------------------------------------------


def _model_info(results: list[dict]) -> ModelInfo:
    first = results[0]
    layers = frozenset(l for r in results for l in r.get("layers", ()))
    steerable = all(r["steerable"] for r in results) and bool(layers)
    reason = "; ".join(sorted({r["reason"] for r in results if r["reason"]}))
    if not steerable and not reason:  # every rank has decoder layers, none of them listed
        reason = f"HOTWIRE_LAYERS={format_layers(settings().layers or frozenset())} selects no layer hotwire can hook"
    norm = all(r.get("norm", False) for r in results)
    return ModelInfo(steerable, reason, first["n_layers"], first["hidden_size"], first["dtype"], layers, norm)


def _send_refusal(engine: Any, request: Any, exc: Refusal, in_caller: bool = True) -> None:
    """Finish a request the engine will not serve with an error (vLLM reports it as a failed request).

    An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no output queue: a refusal at
    ``add_request`` raises to the caller; one found later, in the scheduler (``in_caller=False``), is logged.
    The controller keeps the refusal for the API server that ticketed the request: it answers the client with it."""
    logger.warning("hotwire: refused request %s: %s", request.request_id, exc.message)
    controller = getattr(engine, "hotwire", None)
    if controller is not None:
        controller.note_refusal(request, exc)
    send_error = getattr(engine, "_send_error_outputs_to_client", None)
    if send_error is not None:
        send_error([request.request_id], request.client_index)
    elif in_caller:
        raise ValueError(f"hotwire: {exc.message}")


def _patch_engine_core(module: Any) -> None:
    cls = module.EngineCore
    aborted = module.RequestStatus.FINISHED_ABORTED

    # vLLM loads general plugins inside EngineCore.__init__, so __init__ itself cannot be wrapped for the engine
    # being built; _initialize_kv_caches runs later in that __init__, after the workers loaded the model.
    def make_init_kv(original):
        def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
            result = original(self, vllm_config, *args, **kwargs)
            info = _model_info(self.model_executor.collective_rpc(contract.WORKER_INFO))
            self.hotwire = SteeringController(info, settings(), vllm_config.model_config.model)
            if info.steerable:
                logger.info("hotwire: steering ready on layers %s (%d of %d), %d bank slots",
                            format_layers(info.layers), len(info.layers), info.n_layers, settings().slots)
            else:
                logger.warning("hotwire: this model cannot be steered (%s); steered requests will be refused", info.reason)
            return result

        return _initialize_kv_caches

    def make_add(original):
        def add_request(self, request, request_wave=0):
            self.scheduler.hotwire = self.hotwire  # the scheduler is built after the controller
            self.hotwire.on_refused = functools.partial(_send_refusal, self, in_caller=False)
            # A request id vLLM holds already is a streaming-input session's next chunk (or its end marker).
            session = self.scheduler.requests.get(request.request_id)
            update = session is not None or request.request_id in self.hotwire.deferred
            if not update and self.hotwire.session_ended(request.request_id, final=not request.resumable):
                # More input (or the end marker) of a session a refusal ended: an error again, so that vLLM's
                # client, which keeps a streaming request open past a chunk's error, finishes it
                _send_refusal(self, request, Refusal(400, "session_ended", "this streaming-input session was ended "
                                                     "by an earlier refusal; start a new request"))  # fmt: skip
                return
            try:
                if update:
                    self.hotwire.admit_update(request, session)
                else:
                    self.hotwire.admit(request)
            except Exception as exc:  # a bad request must never take the engine down
                if not update and isinstance(exc, WaitForRows):
                    # It fits once running requests release their rows: wait, like any queued request.
                    self.hotwire.defer(request, exc.resolved)
                    return
                if not isinstance(exc, Refusal):
                    logger.exception("hotwire: admission of %s failed", request.request_id)
                    exc = Refusal(500, "internal", f"steering admission failed: {exc}")
                if session is not None:  # the refusal ends the session
                    self.scheduler.finish_requests(request.request_id, aborted)
                if request.resumable:  # a session: more chunks and its end marker are still to come
                    self.hotwire.note_ended_session(request.request_id)
                _send_refusal(self, request, exc)
                return
            return original(self, request, request_wave)

        return add_request

    def make_preprocess(original):
        def preprocess_add_request(self, request):
            # vLLM's input thread: hash a steered request's prompt blocks with hotwire's cache salt from the
            # start (admission checks it, and hashes again only if the registry changed in between).
            controller = getattr(self, "hotwire", None)
            extra = steering_args(request)
            if controller is None or extra is None:
                return original(self, request)
            user_salt = request.cache_salt
            try:
                salt = controller.cache_salt_for(extra[SPEC_KEY], user_salt, prompt_length(request))
            except Exception:  # never fail a request here: admission decides and says why
                logger.exception("hotwire: cache salt of %s", request.request_id)
                salt = None
            if salt is None:
                return original(self, request)
            request.cache_salt = salt
            req, wave = original(self, request)
            setattr(req, contract.USER_SALT_ATTR, user_salt)
            return req, wave

        return preprocess_add_request

    def make_rpc(original):
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            name = contract.engine_method(method)
            if name is not None:
                return [self.hotwire.answer(name, args, kwargs or {})]
            return original(self, method, timeout, args, kwargs)

        return collective_rpc

    _wrap(cls, "_initialize_kv_caches", make_init_kv)
    _wrap(cls, "add_request", make_add)
    _wrap(cls, "preprocess_add_request", make_preprocess)
    _wrap(cls, "collective_rpc", make_rpc)


def _patch_scheduler(module: Any) -> None:
    cls = module.Scheduler
    unpaused = module.PauseState.UNPAUSED

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            controller = getattr(self, "hotwire", None)
            if controller is not None and controller.deferred:
                for request in controller.admit_deferred():
                    self.add_request(request)
            output = original(self, *args, **kwargs)
            # Checked after vLLM's schedule: resuming a preempted request inside it may reload rows.
            if controller is not None and controller.step_payload_pending:
                writes = controller.take_writes()
                if writes:
                    setattr(output, contract.WRITES_ATTR, writes)
                rebinds = controller.take_rebinds()
                if rebinds:
                    setattr(output, contract.REBINDS_ATTR, rebinds)
            return output

        return schedule

    def make_free(original):
        def _free_request(self, request, *args, **kwargs):
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.release(request.request_id)
            return original(self, request, *args, **kwargs)

        return _free_request

    def make_has_requests(original):
        def has_requests(self):
            # Deferred requests are work: the engine must keep stepping to admit them. Like vLLM's own waiting
            # requests, not while it is paused (a pause completes once nothing counts as work).
            controller = getattr(self, "hotwire", None)
            deferred = controller is not None and controller.deferred and self.pause_state == unpaused
            return original(self) or bool(deferred)

        return has_requests

    def make_finish(original):
        def finish_requests(self, request_ids, finished_status):
            controller = getattr(self, "hotwire", None)
            dropped = controller.drop_deferred(request_ids) if controller is not None else []
            finished = original(self, request_ids, finished_status)
            if request_ids is None:  # pause(abort), shutdown: vLLM sends an abort output for each one it returns
                finished = [*finished, *((r.request_id, r.client_index) for r in dropped)]
            return finished

        return finish_requests

    def make_update_session(original):
        def _update_request_as_session(self, session, update):
            result = original(self, session, update)
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.keep_binding(session)
            return result

        return _update_request_as_session

    def make_preempt(original):
        def _preempt_request(self, request, *args, **kwargs):
            result = original(self, request, *args, **kwargs)
            controller = getattr(self, "hotwire", None)
            if controller is not None:
                controller.suspend(request.request_id)
            return result

        return _preempt_request

    # A preempted request is "blocked" in the waiting queue until it can pin its rows again: the scheduler then
    # skips it (as it skips one waiting for remote KV) and retries it every step.
    preempted = module.RequestStatus.PREEMPTED
    is_blocked = cls.__dict__["_is_blocked_waiting_status"].__func__
    if not getattr(is_blocked, "_hotwire", False):
        def _is_blocked_waiting_status(status):
            return status == preempted or is_blocked(status)

        _is_blocked_waiting_status._hotwire = True
        cls._is_blocked_waiting_status = staticmethod(functools.wraps(is_blocked)(_is_blocked_waiting_status))

    def make_promote(original):
        def _try_promote_blocked_waiting_request(self, request):
            if request.status != preempted:
                return original(self, request)
            controller = getattr(self, "hotwire", None)
            return controller is None or controller.resume(request)

        return _try_promote_blocked_waiting_request

    _wrap(cls, "schedule", make_schedule)
    _wrap(cls, "_free_request", make_free)
    _wrap(cls, "_preempt_request", make_preempt)
    _wrap(cls, "_try_promote_blocked_waiting_request", make_promote)
    _wrap(cls, "has_requests", make_has_requests)
    _wrap(cls, "finish_requests", make_finish)
    _wrap(cls, "_update_request_as_session", make_update_session)


# -- workers ---------------------------------------------------------------------------------------------------


_V2_IDLE_GRAPHS = "_hotwire_idle_graphs"  # the V2 model manager's attribute holding its idle FULL graphs


def _patch_worker_base(module: Any) -> None:
    def hotwire_worker_info(self) -> dict:
        steering = getattr(self.model_runner, "hotwire", None)
        if steering is None:
            return {"steerable": False, "reason": "hotwire did not attach to the model", "layers": [], "n_layers": 0,
                    "hidden_size": 0, "dtype": ""}
        return steering.info()

    def hotwire_graph_sets(self) -> dict:
        """Which CUDA graph set this rank has in place now, for verify and the GPU tests: ``holders`` (every
        ``CUDAGraphWrapper`` and V2 FULL-graph manager holding idle graphs), how many of them serve their idle
        set (``serving_idle``), and the graphs in each set."""
        counts = dict.fromkeys(("holders", "serving_idle", "idle_graphs", "steered_graphs"), 0)
        if _GRAPH_SETS is not None:
            _GRAPH_SETS.count_into(counts)
        manager = getattr(self.model_runner, "cudagraph_manager", None)  # V2's FULL graphs (V1 has none)
        idle_full = getattr(manager, _V2_IDLE_GRAPHS, None)
        if idle_full:  # run_fullgraph replays them whenever the gate is closed
            counts["holders"] += 1
            counts["serving_idle"] += not GATE.open
            counts["idle_graphs"] += len(idle_full)
            counts["steered_graphs"] += len(manager.graphs)
        return {"split": GATE.split, "gate_open": GATE.open, **counts}

    setattr(module.WorkerBase, contract.WORKER_INFO, hotwire_worker_info)
    setattr(module.WorkerBase, contract.GRAPH_SETS, hotwire_graph_sets)


def _attach(worker: Any) -> None:
    import torch

    from .runtime import WorkerSteering, find_decoder_layers, select_layers

    runner = worker.model_runner
    model = runner.get_model()
    found, n_layers = find_decoder_layers(model)
    model_config = worker.vllm_config.model_config
    unsupported = _unsupported_setup(worker.vllm_config)
    if unsupported:
        logger.warning("hotwire: steering is off: %s", unsupported)
        found = {}
    elif not found:
        logger.warning("hotwire: %s has no steerable decoder layers; steering is off", type(model).__name__)
    if not found:
        n_layers = model_config.get_num_layers(worker.vllm_config.parallel_config)
    layers = select_layers(found, n_layers, settings().layers) if found else found
    device = torch.device(worker.device) if hasattr(worker, "device") else torch.device("cpu")
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
        reason=unsupported,
    )
    GATE.split = _idle_graphs_possible(worker.vllm_config) and bool(layers)
    ops.PDL = _pdl_possible(device)
    if layers and settings().impl == "op" and device.type == "cuda":
        logger.info("hotwire: steering kernel launched %s", "as a programmatic dependent launch" if ops.PDL else "plainly")


def _unsupported_setup(vllm_config: Any) -> str | None:
    """Why hotwire cannot steer correctly under this configuration, or None. DBO micro-batching runs the model on
    slices of the batch, whose tokens would read ``token_cfg`` from its start."""
    if vllm_config.parallel_config.use_ubatching:
        return ("micro-batching (DBO: --enable-dbo, or ubatch_size > 1) runs the model on slices of the batch, "
                "which hotwire cannot steer")
    return None


def _pdl_possible(device: Any) -> bool:
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
    """Idle graph variants need the opaque op (traced torch ops cannot be switched off) and vLLM's own
    ``CUDAGraphWrapper``: the breakable wrapper keeps graphs of its own (micro-batching: see _unsupported_setup)."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return (
        settings().idle_graphs
        and settings().impl == "op"
        and not is_breakable_cudagraph_enabled()
    )


def _patch_worker(module: Any) -> None:
    def make(original):
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _attach(self)
            return result

        return load_model

    _wrap(module.Worker, "load_model", make)


def _patch_v1_runner(module: Any) -> None:
    cls = module.GPUModelRunner

    def make_execute(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None:
                # V1 keeps preempted requests (resumed without new data): only finished ones go.
                steering.on_step(scheduler_output, scheduler_output.finished_req_ids)
                _set_gate(steering, scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_forward(original):
        def _model_forward(self, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None and not steering.clean:
                batch = self.input_batch
                n = batch.num_reqs
                qsl = self.query_start_loc.np[: n + 1]
                steering.fill(batch.req_ids[:n], qsl[1:] - qsl[:-1], batch.num_computed_tokens_cpu[:n], int(qsl[n]))
            return original(self, *args, **kwargs)

        return _model_forward

    _wrap(cls, "execute_model", make_execute)
    _wrap(cls, "_model_forward", make_forward)
    _wrap(cls, "_warmup_and_capture", _capture_both_variants)


def _patch_v2_runner(module: Any) -> None:
    cls = module.GPUModelRunner

    def make_execute(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None and not kwargs.get("dummy_run", False):
                # V2 drops preempted requests and re-adds them as new ones when they resume.
                removed = scheduler_output.finished_req_ids
                if scheduler_output.preempted_req_ids:
                    removed = removed | set(scheduler_output.preempted_req_ids)
                steering.on_step(scheduler_output, removed)
                _set_gate(steering, scheduler_output)
            elif steering is not None and GATE.split:
                GATE.open = False  # a dummy step: every token is padding
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_prepare(original):
        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            batch = original(self, scheduler_output, *args, **kwargs)
            steering = getattr(self, "hotwire", None)
            if steering is not None:
                steering.fill(batch.req_ids, batch.num_scheduled_tokens, batch.num_computed_tokens_np, batch.num_tokens)
            return batch

        return prepare_inputs

    _wrap(cls, "execute_model", make_execute)
    _wrap(cls, "prepare_inputs", make_prepare)


# -- idle graph variants (see ops.Gate) ------------------------------------------------------------------------


def _set_gate(steering: Any, scheduler_output: Any) -> None:
    # A step that schedules nothing (it only frees finished requests) runs no forward: the gate stays put, so
    # that the graph sets are not swapped out and back around it.
    if GATE.split and scheduler_output.num_scheduled_tokens:
        GATE.open = steering.steers_any(scheduler_output.num_scheduled_tokens)


@contextmanager
def _gate_closed() -> Iterator[None]:
    GATE.open = False
    if _GRAPH_SETS is not None:
        # Even if a dummy step closed the gate already: captures must land in the bare idle dicts, not in the
        # sets that serve unsteered steps (those may be completed with steered graphs).
        _GRAPH_SETS.put_in_place(False, capturing=True)
    try:
        yield
    finally:
        GATE.open = True


def _capture_both_variants(original: Callable) -> Callable:
    """Capture (and warm up) the idle variant first, then the steered one: until the steered variant exists,
    a closed gate must find no graph to fall back on (see ``_GraphSets``)."""

    def capture(self, *args, **kwargs):
        if GATE.split:
            with _gate_closed():
                original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return capture


class _WrapperSets:
    """One wrapper's two graph sets: ``steered`` (vLLM's own entries dict) and ``idle``, plus the dict it serves
    unsteered steps from: the idle set completed with graphs captured only steered."""

    __slots__ = ("steered", "idle", "serving_idle", "_sizes")

    def __init__(self, steered: dict):
        self.steered, self.idle = steered, {}
        self.serving_idle: dict = self.idle
        self._sizes: tuple[int, int] | None = None

    def holds(self, entries: dict) -> bool:
        return entries is self.steered or entries is self.idle or entries is self.serving_idle

    def for_idle_steps(self) -> dict:
        sizes = (len(self.steered), len(self.idle))
        if sizes != self._sizes:  # graphs are captured at startup only; ``clear`` resets this
            missing = self.steered.keys() - self.idle.keys()
            self.serving_idle = {**self.idle, **{d: self.steered[d] for d in missing}} if missing else self.idle
            self._sizes = sizes
        return self.serving_idle

    def clear(self) -> None:
        for entries in (self.steered, self.idle, self.serving_idle):
            entries.clear()
        self._sizes = None


class _GraphSets:
    """The two graph sets of every ``CUDAGraphWrapper`` (the V1 FULL graph, every piecewise graph) in this
    process. When the gate moves, each wrapper gets the set the gate names as its ``concrete_cudagraph_entries``,
    so a graph replay costs hotwire nothing.

    Unsteered steps may replay a graph captured only steered (e.g. a drafter's, captured outside hotwire's
    capture hook): steered graphs serve unsteered steps correctly, the reverse never happens. While capturing
    with the gate closed, a wrapper gets its bare idle dict, so that new graphs land there."""

    def __init__(self, wrapper_class: type):
        self._instances = wrapper_class._all_instances  # vLLM's WeakSet of every wrapper in this process

    @staticmethod
    def sets_of(wrapper: Any) -> _WrapperSets:
        own = wrapper.__dict__
        current, sets = own["concrete_cudagraph_entries"], own.get("_hotwire_sets")
        if sets is None or not sets.holds(current):
            # First sight, or vLLM put in a new dict to drop its graphs (elastic EP): both sets start over.
            sets = own["_hotwire_sets"] = _WrapperSets(current)
        return sets

    def put_in_place(self, gate_open: bool, capturing: bool = False) -> None:
        for wrapper in list(self._instances):
            sets = self.sets_of(wrapper)
            if gate_open:
                wrapper.concrete_cudagraph_entries = sets.steered
            else:
                wrapper.concrete_cudagraph_entries = sets.idle if capturing else sets.for_idle_steps()

    def count_into(self, counts: dict[str, int]) -> None:
        """Add the wrappers holding idle graphs to ``counts`` (see ``hotwire_graph_sets``)."""
        for wrapper in list(self._instances):
            sets = wrapper.__dict__.get("_hotwire_sets")
            if sets is None or not sets.idle:
                continue
            counts["holders"] += 1
            counts["serving_idle"] += wrapper.concrete_cudagraph_entries is not sets.steered
            counts["idle_graphs"] += sum(e.cudagraph is not None for e in sets.idle.values())
            counts["steered_graphs"] += sum(e.cudagraph is not None for e in sets.steered.values())


_GRAPH_SETS: _GraphSets | None = None


def _patch_cuda_graph_wrapper(module: Any) -> None:
    global _GRAPH_SETS
    _GRAPH_SETS = _GraphSets(module.CUDAGraphWrapper)
    GATE.on_change = _GRAPH_SETS.put_in_place

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if not GATE.open:
                # Made while the gate is closed (vLLM compiles inside a capture pass after elastic EP resets its
                # compiled graphs): what it captures now is idle, and must not become its steered set.
                self.concrete_cudagraph_entries = _GraphSets.sets_of(self).idle

        return __init__

    def make_clear(original):
        def clear_graphs(self):
            original(self)
            if "_hotwire_sets" in self.__dict__:
                self._hotwire_sets.clear()

        return clear_graphs

    _wrap(module.CUDAGraphWrapper, "__init__", make_init)
    _wrap(module.CUDAGraphWrapper, "clear_graphs", make_clear)


def _patch_v2_cudagraphs(module: Any) -> None:
    """V2 keeps FULL graphs in ``CudaGraphManager.graphs``: the model's manager (not the speculators', whose
    drafter has no hotwire op) gets a second dict for the idle variant, in place while the gate is closed."""

    @contextmanager
    def idle_graphs(manager: Any) -> Iterator[None]:
        steered, manager.graphs = manager.graphs, manager.__dict__.setdefault(_V2_IDLE_GRAPHS, {})
        try:
            yield
        finally:
            manager.graphs = steered

    def make_capture(original):
        def capture(self, *args, **kwargs):
            if GATE.open:
                return original(self, *args, **kwargs)
            with idle_graphs(self):
                return original(self, *args, **kwargs)

        return _capture_both_variants(capture)

    def make_run(original):
        def run_fullgraph(self, desc):
            if GATE.open or desc not in getattr(self, _V2_IDLE_GRAPHS, {}):
                return original(self, desc)
            with idle_graphs(self):
                return original(self, desc)

        return run_fullgraph

    _wrap(module.ModelCudaGraphManager, "capture", make_capture)
    _wrap(module.CudaGraphManager, "run_fullgraph", make_run)


# -- install ---------------------------------------------------------------------------------------------------

_PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.config.vllm": _patch_config,
    "vllm.v1.engine.core": _patch_engine_core,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "vllm.v1.worker.worker_base": _patch_worker_base,
    "vllm.v1.worker.gpu_worker": _patch_worker,
    "vllm.v1.worker.gpu_model_runner": _patch_v1_runner,
    "vllm.v1.worker.gpu.model_runner": _patch_v2_runner,
    "vllm.compilation.cuda_graph": _patch_cuda_graph_wrapper,
    "vllm.v1.worker.gpu.cudagraph_utils": _patch_v2_cudagraphs,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies a patch right after its target module finishes executing."""

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module, _name=name):
                    _exec(module)
                    _PATCHES[_name](module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


_INSTALLED = False

SUPPORTED_VLLM = ("0.25.1",)  # the vLLM releases these hooks are written for and proven on


def unsupported_version(version: str) -> str | None:
    """Why hotwire stays out of vLLM ``version`` (None: a supported release; a local tag such as ``+cpu`` does not
    count). Hooks written for one release can crash another, or steer it wrongly without a sign."""
    if version.split("+", 1)[0] in SUPPORTED_VLLM:
        return None
    from . import __version__

    return f"vLLM {version} is installed; hotwire {__version__} supports vLLM {', '.join(SUPPORTED_VLLM)} only"


def inactive_reason() -> str | None:
    """:func:`unsupported_version` of the installed vLLM."""
    import vllm

    return unsupported_version(str(getattr(vllm, "__version__", "unknown")))


def _log_through_vllm() -> None:
    """Where nothing handles log records (no handler on the root logger, as in vLLM's processes), hotwire's go out
    through vLLM's handler, with its format and ``VLLM_LOGGING_LEVEL``: Python's defaults would drop the INFO
    lines and print warnings bare. An application that configured logging keeps its own setup. vLLM's plugin
    loader has imported ``vllm.logger`` (which sets up that handler) before it calls hotwire."""
    if "vllm.logger" not in sys.modules or logging.getLogger().handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for name in ("hotwire_core", "hotwire_api"):
        ours = logging.getLogger(name)
        if not ours.handlers:
            ours.setLevel(vllm_logger.level)
            for handler in vllm_logger.handlers:
                ours.addHandler(handler)


def install() -> None:
    """Install every hook in this process (idempotent, imports nothing heavy, never touches CUDA)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _log_through_vllm()
    reason = inactive_reason()
    if reason is not None:  # said once per server: by its first process (the others are its children)
        log = logger.warning if multiprocessing.parent_process() is None else logger.debug
        log("hotwire is inactive: %s. Nothing is hooked; hotwire's HTTP routes and steered requests are answered "
            "503 where its control plane attaches to vLLM's app. Install a supported vLLM, or uninstall hotwire-vllm.",
            reason)
        return
    ops.register_ops()
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport())
