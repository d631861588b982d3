"""hotwire_core: per-request activation steering inside vLLM 0.25.1.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point ``hotwire`` (see
``register``). The offline Python API lives in :mod:`hotwire_core.offline`; the architecture is described in
``docs/architecture.md``.
"""

__version__ = "0.2.0"


def register() -> None:
    """vLLM general-plugin entry point: install the engine hooks and, in the API server, the HTTP routes."""
    from . import vllm_glue

    vllm_glue.install()
    try:
        from hotwire_api import mount
    except ImportError:  # the control plane is optional for offline use
        return
    mount.install()
