"""Where the supported vLLM releases (0.25.1 to 0.33.0) differ under hotwire's hooks: each difference named once,
and told from what the installed vLLM has (its classes' methods and signatures, its config's fields), never from
its version string. Differences the hooks absorb without a branch (new keyword arguments, new return types passed
through) are not listed here; ``docs/vllm-versions.md`` has the full table."""

from __future__ import annotations

import inspect
import typing
from typing import Any

__all__ = [
    "API_SERVER_MODULES",
    "finish_requests_returns_requests",
    "promotes_blocked_requests_only",
    "unsound_features",
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
