"""The compile cache: vLLM's compile-cache key (``VllmConfig.compile_factors``, up to 0.33 ``compute_hash``) mixes in
hotwire's settings and op sources, so graphs compiled without hotwire (or with another hotwire) are never reused
with it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from . import compat
from .patching import settings, wrap

__all__ = ["patch_config", "source_digest"]


def source_digest() -> str:
    """A digest of the sources whose code lands in compiled graphs: the op, the hook, the layers' patched forward."""
    here = Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in ("ops.py", "triton_steer.py", "steer_hook.py", "vllm_glue/layers.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def patch_config(module: Any) -> None:
    fingerprint = f"{settings().compile_fingerprint()};src={source_digest()}"

    def make_factors(original):
        def compile_factors(self, *args, **kwargs):
            return {**original(self, *args, **kwargs), "hotwire": fingerprint}

        return compile_factors

    def make_hash(original):
        def compute_hash(self, *args, **kwargs):  # 0.30+: include_version
            return hashlib.sha256(f"{original(self, *args, **kwargs)}|{fingerprint}".encode()).hexdigest()[:10]

        return compute_hash

    if compat.config_hashes_factors(module.VllmConfig):
        wrap(module.VllmConfig, "compile_factors", make_factors)
    else:
        wrap(module.VllmConfig, "compute_hash", make_hash)
