"""The vLLM releases hotwire runs on. Outside them hotwire hooks nothing: hooks written for one release can crash
another, or steer it wrongly without a sign."""

from __future__ import annotations

__all__ = ["SUPPORTED_VLLM", "inactive_reason", "unsupported_version"]

SUPPORTED_VLLM = ("0.25.1",)  # the vLLM releases these hooks are written for and proven on


def unsupported_version(version: str) -> str | None:
    """Why hotwire stays out of vLLM ``version`` (None: a supported release; a local tag such as ``+cpu`` does not
    count)."""
    if version.split("+", 1)[0] in SUPPORTED_VLLM:
        return None
    from .. import __version__

    return f"vLLM {version} is installed; hotwire {__version__} supports vLLM {', '.join(SUPPORTED_VLLM)} only"


def inactive_reason() -> str | None:
    """:func:`unsupported_version` of the installed vLLM."""
    import vllm

    return unsupported_version(str(getattr(vllm, "__version__", "unknown")))
