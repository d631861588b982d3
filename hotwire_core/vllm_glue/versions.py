"""The vLLM releases hotwire runs on: every release from 0.25.1 (the reference, where the GPU figures were measured)
through 0.34.0, the newest whose source the hooks were checked against. Outside that range hotwire hooks nothing:
hooks written for one release can crash another, or steer it wrongly without a sign."""

from __future__ import annotations

import functools
import re

__all__ = ["NEWEST_VLLM", "REFERENCE_VLLM", "SUPPORTED_VLLM", "inactive_reason", "installed_version", "unsupported_version"]

REFERENCE_VLLM = "0.25.1"
NEWEST_VLLM = "0.34.0"
SUPPORTED_VLLM = f">={REFERENCE_VLLM},<={NEWEST_VLLM}"  # as pip writes it (pyproject's `gpu` extra says the same)


def _release(version: str) -> tuple[int, ...] | None:
    """``"0.28.1+cpu"`` -> ``(0, 28, 1)``; None for a pre-release, a dev build or anything unparsable (an
    unreleased vLLM may have changed anything)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(\+[\w.]+)?", version.strip())
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


@functools.lru_cache(maxsize=8)  # asked per steered request (hotwire_api.engine): a pure function of the string
def unsupported_version(version: str) -> str | None:
    """Why hotwire stays out of vLLM ``version`` (None: a release in the supported range; a local tag such as
    ``+cpu`` does not count)."""
    release = _release(version)
    if release is not None and _release(REFERENCE_VLLM) <= release <= _release(NEWEST_VLLM):
        return None
    from .. import __version__

    return f"vLLM {version} is installed; hotwire {__version__} supports vLLM {REFERENCE_VLLM} to {NEWEST_VLLM}"


def installed_version() -> str:
    """The installed vLLM's ``__version__`` ("unknown" where it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def inactive_reason() -> str | None:
    """:func:`unsupported_version` of the installed vLLM."""
    return unsupported_version(installed_version())
