"""The engine core (``vllm.v1.engine.core.EngineCore``): the controller is made once the workers loaded the model,
admission runs in ``add_request``, a steered request is salted in vLLM's input thread before its blocks are
hashed, and ``hotwire_*`` RPCs are answered here."""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from typing import Any

from .. import contract
from ..admission import ModelInfo, Refusal
from ..controller import SteeringController, WaitForRows
from ..error_codes import ErrorCode
from ..settings import format_layers
from ..spec import SPEC_KEY
from . import compat
from .patching import settings, wrap
from .requests import VLLM_REQUESTS, prompt_length, steering_args

__all__ = ["model_info", "patch_engine_core"]

logger = logging.getLogger(__name__)


# Settings the engine core and every worker must share: the core fills bank rows and entry configs the workers'
# buffers were sized by.
_SHARED = (("slots", "HOTWIRE_SLOTS"), ("max_stack", "HOTWIRE_MAX_STACK"))


def settings_mismatch(results: list[contract.WorkerInfo]) -> str | None:
    """Why the workers' settings (``hotwire_worker_info``) cannot serve this engine core's, or None. Each process
    reads its own environment; a launcher that sets it per process (Ray workers on other nodes) could differ."""
    core = settings()
    for key, name in _SHARED:
        theirs = sorted({r[key] for r in results} - {getattr(core, key)})
        if theirs:
            return (f"{name} is {getattr(core, key)} in the engine core but {', '.join(map(str, theirs))} in its "
                    f"workers: the workers' buffers must fit what the engine core fills; set {name} alike in every "
                    "process's environment")
    return None


def model_info(results: list[contract.WorkerInfo]) -> ModelInfo:
    first = results[0]
    layers = frozenset(l for r in results for l in r["layers"])
    mismatch = settings_mismatch(results)
    steerable = all(r["steerable"] for r in results) and bool(layers) and mismatch is None
    reason = mismatch or "; ".join(sorted({r["reason"] for r in results if r["reason"]}))
    if not steerable and not reason:  # every rank has decoder layers, none of them listed
        reason = f"HOTWIRE_LAYERS={format_layers(settings().layers or frozenset())} selects no layer hotwire can hook"
    norm = all(r["norm"] for r in results)
    # Every rank captures its own layers, all with the same number of rows (a rank without layers has none).
    capture_rows = min((r.get("capture_rows", 0) for r in results if r.get("layers")), default=0)
    readout_probes = min((r.get("readout_probes", 0) for r in results if r.get("layers")), default=0)
    # A condition is decided on the rank that hooks its layer: gates need every rank to hold every layer (no
    # pipeline parallelism).
    same_layers = all(set(r["layers"]) == layers for r in results)
    gates = tuple(g for g in ("token", "latch") if same_layers and all(g in r.get("gates", ()) for r in results))
    readout_layers = frozenset(l for r in results for l in r.get("readout_layers", ()))
    asked = settings().readout_layers
    if readout_probes and asked is not None and not asked <= readout_layers:
        logger.warning("hotwire: HOTWIRE_READOUT_LAYERS names layers %s that hotwire does not hook; probes there are "
                       "refused (readable: %s)", format_layers(asked - readout_layers),
                       format_layers(readout_layers) or "none")
    return ModelInfo(steerable, reason, first["n_layers"], first["hidden_size"], first["dtype"], layers, norm,
                     capture_rows, readout_probes, gates, readout_layers)


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


def patch_engine_core(module: Any) -> None:
    cls = module.EngineCore
    busy_loop = module.EngineCoreProc
    aborted = module.RequestStatus.FINISHED_ABORTED

    # vLLM loads general plugins inside EngineCore.__init__, so __init__ itself cannot be wrapped for the engine
    # being built; _initialize_kv_caches runs later in that __init__, after the workers loaded the model.
    def make_init_kv(original):
        def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
            result = original(self, vllm_config, *args, **kwargs)
            info = model_info(self.model_executor.collective_rpc(contract.WORKER_INFO))
            self.hotwire = SteeringController(info, settings(), vllm_config.model_config.model, VLLM_REQUESTS)
            # The busy loop keeps stepping while a store write is under way (the scheduler's has_requests) and
            # answers a utility call's Future when it is done; an in-process engine answers its caller at once.
            self.hotwire.changes.deferring = isinstance(self, busy_loop)
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
            if request.abort_immediately:  # added only to be aborted at once (KV-connector cleanup): never held
                return original(self, request, request_wave)
            self.hotwire.on_refused = functools.partial(_send_refusal, self, in_caller=False)
            # A request id vLLM holds already is a streaming-input session's next chunk (or its end marker).
            session = self.scheduler.requests.get(request.request_id)
            update = session is not None or request.request_id in self.hotwire.deferred
            if not update and self.hotwire.session_ended(request.request_id, final=not request.resumable):
                # More input (or the end marker) of a session a refusal ended: an error again, so that vLLM's
                # client, which keeps a streaming request open past a chunk's error, finishes it
                _send_refusal(self, request, Refusal(400, ErrorCode.SESSION_ENDED, "this streaming-input session was ended "
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
                    self.hotwire.defer(request, exc.resolved, exc.rows)
                    return
                if not isinstance(exc, Refusal):
                    logger.exception("hotwire: admission of %s failed", request.request_id)
                    exc = Refusal(500, ErrorCode.INTERNAL, f"steering admission failed: {exc}")
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
            compat.drop_frontend_block_hashes(request)  # hashed with the user's salt
            req, wave = original(self, request)
            setattr(req, contract.USER_SALT_ATTR, user_salt)
            return req, wave

        return preprocess_add_request

    def make_rpc(original):
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            name = contract.engine_method(method)
            if name is None:
                return original(self, method, timeout, args, kwargs)
            answer = self.hotwire.answer(name, args, kwargs or {})
            if not isinstance(answer, Future):
                return [answer]
            self.scheduler.hotwire = self.hotwire  # (before any request): its has_requests keeps the loop stepping
            listed: Future = Future()  # vLLM answers the call once it is done (_invoke_utility_method)
            answer.add_done_callback(lambda done: listed.set_result([done.result()]))
            return listed

        return collective_rpc

    wrap(cls, "_initialize_kv_caches", make_init_kv)
    wrap(cls, "add_request", make_add)
    wrap(cls, "preprocess_add_request", make_preprocess)
    wrap(cls, "collective_rpc", make_rpc)

