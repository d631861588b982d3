"""Control-plane settings, read once from the environment when hotwire is attached to an app."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hotwire_api.fleet.config import registry_url
from hotwire_core.settings import flag_env

DEFAULT_MAX_UPLOAD_MB = 64.0


@dataclass(frozen=True)
class Settings:
    """``max_upload_bytes``: ``HOTWIRE_MAX_UPLOAD_MB`` (default 64); ``lenient``: ``HOTWIRE_LENIENT=1``
    serves bad steering requests unsteered instead of refusing them; ``api_key``: ``HOTWIRE_API_KEY``,
    which guards ``/steer/*`` in place of vLLM's ``--api-key``; ``registry_url``: ``HOTWIRE_REGISTRY``'s Redis URL
    (None: each engine's embedded registry; see ``hotwire_api.fleet``)."""

    max_upload_bytes: int = int(DEFAULT_MAX_UPLOAD_MB * 1024 * 1024)
    lenient: bool = False
    api_key: str | None = None
    registry_url: str | None = field(default=None, repr=False)  # may hold a password
    # POST /steer/vectors/extract: examples per extraction (positive and negative together), tokens per example
    extract_max_examples: int = 512
    extract_max_tokens: int = 4096

    @classmethod
    def from_env(cls) -> Settings:
        raw_mb = os.environ.get("HOTWIRE_MAX_UPLOAD_MB", "").strip()
        try:
            mb = float(raw_mb) if raw_mb else DEFAULT_MAX_UPLOAD_MB
        except ValueError:
            mb = math.nan
        if not math.isfinite(mb) or mb <= 0:
            raise ValueError(f"HOTWIRE_MAX_UPLOAD_MB must be a positive number of megabytes, got {raw_mb!r}")
        lenient = flag_env("HOTWIRE_LENIENT", False)
        return cls(int(mb * 1024 * 1024), lenient, os.environ.get("HOTWIRE_API_KEY") or None, registry_url(),
                   _positive_int("HOTWIRE_EXTRACT_MAX_EXAMPLES", 512), _positive_int("HOTWIRE_EXTRACT_MAX_TOKENS", 4096))


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)
