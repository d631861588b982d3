"""Every piece of hotwire's knowledge of vLLM, in one package: the hooks into the engine, the views the rest of
hotwire reads vLLM's objects through, and the version gate. Nothing outside it imports vLLM (pyproject.toml's
import-linter contracts).

Patches are applied when their vLLM module is imported (or at once if it already is), so a process only pays for
the modules it uses: the API server never imports the worker code. Where vLLM releases differ, :mod:`.compat`
names each difference once and detects it from what the installed vLLM has (signatures, attributes), not from
version strings; the version gate (:func:`inactive_reason`) keeps hotwire out of releases it was not proven on.

| module | vLLM symbols | why |
|---|---|---|
| :mod:`.config` | ``VllmConfig.compile_factors`` (0.25.1-0.33: ``compute_hash``) | compile/AOT caches never mix graphs built with and without (this) hotwire |
| :mod:`.engine_core` | ``EngineCore._initialize_kv_caches`` / ``add_request`` / ``preprocess_add_request`` / ``collective_rpc`` | the controller; admission; the cache salt before vLLM hashes blocks; ``hotwire_*`` RPCs |
| :mod:`.scheduler` | ``Scheduler.schedule`` / ``_free_request`` / ``_preempt_request`` / blocked-waiting promotion / ``has_requests`` / ``finish_requests`` / ``_update_request_as_session`` | deferred requests, bank writes on the ``SchedulerOutput``, pins, preemption, sessions |
| :mod:`.workers` | ``Worker.load_model``, ``WorkerBase`` | buffers and layer hooks before compile and capture; what a rank could hook |
| :mod:`.layers` | the models' ``*DecoderLayer`` classes | which layers have the steering contract, where their output holds the residual stream; their ``forward`` calls the hook |
| :mod:`.requests` | ``Request``, ``EngineCoreRequest``, ``NewRequestData`` | the controller reads and changes requests through it (``EngineRequests``) |
| :mod:`.runners` | V1 ``GPUModelRunner.execute_model`` / ``_model_forward`` (0.25.1-0.33), V2 ``execute_model`` / ``prepare_inputs``, ``SchedulerOutput`` | request lifecycle (a step's changes as the worker's ``Step``), gate, per-token fill; a runner without them is unsteerable |
| :mod:`.speculation` | V1 ``sample_tokens`` / ``propose_draft_token_ids`` / ``_get_prompt_logprobs_dict``, ``use_async_spec_decode``, ``positions`` | prompt logprobs from the target's hidden states kept before a model drafter runs (vLLM #53488); true positions under asynchronous speculation |
| :mod:`.graphs` | V1 ``_warmup_and_capture``, ``CUDAGraphWrapper``, V2 ``ModelCudaGraphManager.capture`` / ``CudaGraphManager.run_fullgraph`` | graph variants: a set per mix of hotwire ops, idle first |
| :mod:`.shm_broadcast` | ``MessageQueue.ReadTimeoutWithWarnings.timeout_ms`` (releases without ``SHM_READER_RECHECK_INTERVAL_MS``) | a worker waiting for its next command looks at the ring every 5 s: a dropped notification no longer parks it (vLLM PR #45224's fix) |
| :mod:`.api_server` | the API server's process names and app builder, ``AsyncLLM.add_request``, the data-parallel client, ``app.state`` | where hotwire's control plane attaches and guards what reaches the engine (the callbacks are hotwire_api's) |
| :mod:`.offline` | ``LLM``, ``SamplingParams``, ``LoRARequest``, ``RequestOutput``, ``LLMEngine``'s configs | the self-test (``hotwire_core.verify``) and the plugin-free runner |
| :mod:`.cli` | ``vllm.entrypoints.cli.main`` | the ``vllm`` command of ``hotwire_api.vllm_cli`` |
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import Any, Callable

from .. import capture_op, ops
from .config import patch_config
from .engine_core import patch_engine_core
from .graphs import patch_cuda_graph_wrapper, patch_v2_cudagraphs
from .patching import PatchOnImport
from .runners import patch_v1_runner, patch_v2_runner
from .scheduler import patch_scheduler
from .shm_broadcast import patch_shm_broadcast
from .versions import SUPPORTED_VLLM, inactive_reason, unsupported_version
from .workers import patch_worker, patch_worker_base

__all__ = ["PATCHES", "SUPPORTED_VLLM", "inactive_reason", "install", "installed", "unsupported_version"]

logger = logging.getLogger(__name__)

PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.config.vllm": patch_config,
    "vllm.v1.engine.core": patch_engine_core,
    "vllm.v1.core.sched.scheduler": patch_scheduler,
    "vllm.v1.worker.worker_base": patch_worker_base,
    "vllm.v1.worker.gpu_worker": patch_worker,
    "vllm.v1.worker.gpu_model_runner": patch_v1_runner,
    "vllm.v1.worker.gpu.model_runner": patch_v2_runner,
    "vllm.compilation.cuda_graph": patch_cuda_graph_wrapper,
    "vllm.v1.worker.gpu.cudagraph_utils": patch_v2_cudagraphs,
    "vllm.distributed.device_communicators.shm_broadcast": patch_shm_broadcast,
}

_INSTALLED = False


def _log_through_vllm() -> None:
    """Where nothing handles log records (no handler on the root logger, as in vLLM's processes), hotwire's go out
    through vLLM's logger, with its handler, format and ``VLLM_LOGGING_LEVEL``: Python's defaults would drop the
    INFO lines and print warnings bare. hotwire's loggers become children of ``vllm``'s rather than copies of its
    handlers, because vLLM 0.32+ sets its handler up when an engine or server starts, after plugins may have
    loaded. An application that configured logging keeps its own setup."""
    if "vllm.logger" not in sys.modules or logging.getLogger().handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for name in ("hotwire_core", "hotwire_api"):
        ours = logging.getLogger(name)
        if not ours.handlers and ours.level == logging.NOTSET:
            ours.parent = vllm_logger


def installed() -> bool:
    """Whether :func:`install` ran in this process (vLLM loaded the ``hotwire`` plugin here): importing this
    package hooks nothing."""
    return _INSTALLED


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
    capture_op.register_capture_op()
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, PatchOnImport(PATCHES))
