"""hotwire_core: per-request activation steering inside vLLM 0.25.1.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point ``hotwire`` (see
``register``). The offline Python API lives in :mod:`hotwire_core.offline`; the architecture is described in
``docs/architecture.md``.
"""

__version__ = "0.2.0"


def register() -> None:
    """vLLM general-plugin entry point: in the API server, mount the HTTP control plane and turn the vector store
    on by default (the engine processes it spawns inherit the setting); everywhere, install the engine hooks."""
    import os

    from .settings import default_store_root

    try:
        from hotwire_api import mount
    except ImportError:  # the control plane is optional for offline use
        mount = None
    if mount is not None and mount.install():
        os.environ.setdefault("HOTWIRE_STORE", default_store_root())

    from . import vllm_glue

    vllm_glue.install()
