"""What vLLM 0.25.1's CPU backend needs in its environment, defined once for the demo, ``verify``, the tests and
the benchmarks (``scripts/test.sh`` sets the same for the shell; a unit test holds the two together).

``VLLM_CPU_KVCACHE_SPACE`` is the KV cache in GiB: without it the engine stops at start with vLLM's "Available
memory ... less than desired". ``TORCHINDUCTOR_VEC_ISA_OK`` skips Inductor's vector-ISA probe at every start.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["CPU_ENV", "with_cpu_env"]

CPU_ENV: Mapping[str, str] = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}


def with_cpu_env(env: Mapping[str, str], kv_cache_gib: int = 1) -> dict[str, str]:
    """``env`` plus the CPU backend's settings it lacks (a value ``env`` has wins), with a KV cache of
    ``kv_cache_gib`` unless ``env`` names one."""
    return {**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **env}
