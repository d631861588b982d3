"""hotwire_core: per-request activation steering inside vLLM 0.25.1.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point ``hotwire`` (see
``register``); the HTTP control plane registers itself through its own entry point, ``hotwire_api``. The
offline Python API lives in :mod:`hotwire_core.offline`; the architecture is described in
``docs/architecture.md``.
"""

__version__ = "0.2.0"


def register() -> None:
    """vLLM general-plugin entry point ``hotwire``: install the engine hooks in this process."""
    from . import vllm_glue

    vllm_glue.install()
