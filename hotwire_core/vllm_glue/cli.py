"""vLLM's command line (``vllm.entrypoints.cli.main``), run unchanged by ``hotwire_api.vllm_cli``."""

from __future__ import annotations

__all__ = ["run_vllm_cli"]


def run_vllm_cli() -> int | None:
    """vLLM's ``vllm`` command on ``sys.argv``. Imports vLLM: whatever must precede that runs first."""
    from vllm.entrypoints.cli.main import main

    return main()
