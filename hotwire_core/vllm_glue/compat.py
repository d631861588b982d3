"""Where the supported vLLM releases (0.25.1 to 0.34.0) differ under hotwire's hooks: each difference named once,
and told from what the installed vLLM has (its classes' methods and signatures, its config's fields), never from
its version string. Differences the hooks absorb without a branch (new keyword arguments, new return types passed
through) are not listed here; ``docs/vllm-versions.md`` has the full table."""

from __future__ import annotations

import inspect
import typing
from typing import Any

__all__ = [
    "API_SERVER_MODULES",
    "breakable_cudagraphs_enabled",
    "config_hashes_factors",
    "drop_frontend_block_hashes",
    "finish_requests_returns_requests",
    "promotes_blocked_requests_only",
    "unsound_features",
    "uses_v2_model_runner",
]

# The modules whose presence in the main process marks vLLM's API server: ``vllm serve`` imports the first
# (0.25.1-0.28) or the launchers (0.29+, where ``openai/api_server.py`` is a shim nothing imports);
# ``python -m vllm.entrypoints.openai.api_server`` runs the first as ``__main__`` in every release.
API_SERVER_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.app",
)


def finish_requests_returns_requests(scheduler_class: type) -> bool:
    """``Scheduler.finish_requests`` returns the ``Request`` objects it finished (0.26+), not ``(request_id,
    client_index)`` pairs (0.25.1); an abort-all reports deferred requests the same way. Read from the return
    annotation (a live object: the scheduler module does not postpone annotations)."""
    annotation = inspect.signature(scheduler_class.finish_requests).return_annotation
    if isinstance(annotation, str):  # postponed after all: the pairs are written ``tuple[...]``
        return "tuple" not in annotation
    (element,) = typing.get_args(annotation) or (Any,)
    return typing.get_origin(element) is not tuple and element is not tuple


def promotes_blocked_requests_only(scheduler_class: type) -> bool:
    """True where the scheduler asks ``_try_promote_blocked_waiting_request`` about requests whose status
    ``_is_blocked_waiting_status`` calls blocked, and skips them when it says no (0.25.1-0.30); False where it asks
    ``_handle_blocked_waiting_request`` about every waiting request (0.31+). Raises when neither exists: a
    preempted request could then resume without its rows."""
    if "_try_promote_blocked_waiting_request" in vars(scheduler_class):
        return True
    if "_handle_blocked_waiting_request" in vars(scheduler_class):
        return False
    raise AttributeError(f"{scheduler_class.__qualname__} has neither _try_promote_blocked_waiting_request nor "
                         "_handle_blocked_waiting_request: hotwire cannot hold a preempted request until its rows "
                         "are back")


def config_hashes_factors(config_class: type) -> bool:
    """True where vLLM keys its compile caches by ``VllmConfig.compile_factors()``, a dict it hashes (0.34+); False
    where by the string ``VllmConfig.compute_hash()`` returns (0.25.1-0.33). Raises when neither exists: graphs
    compiled without hotwire could then be reused with it."""
    if "compile_factors" in vars(config_class):
        return True
    if "compute_hash" in vars(config_class):
        return False
    raise AttributeError(f"{config_class.__qualname__} has neither compile_factors nor compute_hash: hotwire cannot "
                         "keep vLLM's compile caches apart from graphs built without it")


def breakable_cudagraphs_enabled(vllm_config: Any) -> bool:
    """Whether this engine captures breakable CUDA graphs. Up to 0.33 vLLM writes its choice into the environment
    (``VLLM_USE_BREAKABLE_CUDAGRAPH``), which ``is_breakable_cudagraph_enabled()`` reads; 0.34 keeps it in
    ``compilation_config.use_breakable_cudagraph`` (auto-enabled for some architectures without touching the
    environment), which the function reads when given the config."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    if inspect.signature(is_breakable_cudagraph_enabled).parameters:
        return is_breakable_cudagraph_enabled(vllm_config.compilation_config)
    return is_breakable_cudagraph_enabled()


def drop_frontend_block_hashes(request: Any) -> None:
    """From 0.34 a frontend (vLLM's Rust one) may send a request's prompt block hashes along
    (``EngineCoreRequest.block_hashes``), computed with the cache salt it knew; the engine then keeps them instead
    of hashing. hotwire salts a steered request in the engine, so its blocks must be hashed there."""
    if getattr(request, "block_hashes", None) is not None:
        request.block_hashes = None


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether this engine runs vLLM's V2 model runner: its config says (0.25.1-0.33); 0.34 has no other (V1 and
    the ``use_v2_model_runner`` property are gone)."""
    return getattr(vllm_config, "use_v2_model_runner", True)


def unsound_features(vllm_config: Any) -> list[str]:
    """The features of this configuration under which hotwire cannot steer correctly, each with why. Fields a
    release lacks count as off."""
    found = []
    parallel = vllm_config.parallel_config
    if getattr(parallel, "use_ubatching", False):
        found.append("micro-batching (DBO: --enable-dbo, or ubatch_size > 1) runs the model on slices of the batch, "
                     "which hotwire cannot steer")
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        found.append("prefill context parallelism splits each prompt's tokens over ranks, and hotwire's per-token "
                     "steering has not been proven under that split")
    if getattr(getattr(vllm_config, "speculative_config", None), "enable_adaptive_verification", False):
        found.append("adaptive draft verification decides on the GPU how many tokens each request runs, so the host "
                     "cannot place per-token steering")
    if getattr(getattr(vllm_config, "cache_config", None), "kv_sharing_fast_prefill", False):
        found.append("KV-sharing fast prefill runs the later layers on a subset of the tokens, so steering rows "
                     "would not line up with them")
    return found
