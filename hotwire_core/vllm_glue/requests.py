"""vLLM's requests as hotwire reads and changes them: ``Request`` (the scheduler's) and ``EngineCoreRequest`` (what
reaches the engine core), for the controller (:data:`VLLM_REQUESTS`, its ``EngineRequests``), and ``NewRequestData``
(a step's new request, in the workers: :func:`steering_args`, :func:`prompt_length`)."""

from __future__ import annotations

import copy
from typing import Any

from ..contract import USER_SALT_ATTR
from ..spec import SPEC_KEY

__all__ = ["VLLM_REQUESTS", "VllmRequests", "extra_args", "prompt_length", "steering_args"]


def extra_args(request: Any) -> dict | None:
    """A request's ``SamplingParams.extra_args`` (None for a pooling request, whose ``sampling_params`` is None)."""
    return request.sampling_params.extra_args if request.sampling_params is not None else None


def steering_args(request: Any) -> dict | None:
    """A vLLM request's ``extra_args`` if they hold a steering spec (``SPEC_KEY``), else None."""
    extra = extra_args(request)
    return extra if extra and SPEC_KEY in extra else None


def prompt_length(request: Any) -> int:
    """Prompt tokens of a vLLM ``Request``, ``EngineCoreRequest`` or ``NewRequestData`` (token ids, or the rows
    of ``prompt_embeds`` when there are none)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    embeds = getattr(request, "prompt_embeds", None)
    return 0 if embeds is None else int(embeds.shape[0])


class VllmRequests:
    """``hotwire_core.engine_requests.EngineRequests`` for vLLM's ``Request`` and ``EngineCoreRequest``."""

    @staticmethod
    def request_id(request: Any) -> str:
        return request.request_id

    extra_args = staticmethod(extra_args)
    steering_args = staticmethod(steering_args)
    prompt_length = staticmethod(prompt_length)

    @staticmethod
    def set_extra(request: Any, key: str, value: Any) -> None:
        params = copy.copy(request.sampling_params)
        params.extra_args = {**params.extra_args, key: value}
        request.sampling_params = params

    @staticmethod
    def user_salt(request: Any) -> str | None:
        # Set where vLLM's input thread salted the request for hotwire (vllm_glue.engine_core).
        return getattr(request, USER_SALT_ATTR, request.cache_salt)

    @staticmethod
    def set_cache_salt(request: Any, salt: str) -> None:
        if request.cache_salt != salt:  # hashed without it (or with another): hash again
            request.cache_salt = salt
            request.block_hashes.clear()
            request.update_block_hashes()

    @staticmethod
    def expects_more_input(request: Any) -> bool:
        return bool(request.resumable)


VLLM_REQUESTS = VllmRequests()
