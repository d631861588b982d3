"""The compile cache: vLLM's ``VllmConfig.compute_hash`` mixes in hotwire's settings and op sources, so graphs
compiled without hotwire (or with another hotwire) are never reused with it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .patching import settings, wrap

__all__ = ["patch_config", "source_digest"]


def source_digest() -> str:
    here = Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in ("ops.py", "triton_steer.py", "runtime.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def patch_config(module: Any) -> None:
    fingerprint = f"{settings().compile_fingerprint()};src={source_digest()}"

    def make(original):
        def compute_hash(self):
            return hashlib.sha256(f"{original(self)}|{fingerprint}".encode()).hexdigest()[:10]

        return compute_hash

    wrap(module.VllmConfig, "compute_hash", make)


# -- engine core -----------------------------------------------------------------------------------------------
