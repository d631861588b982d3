"""vLLM 0.25.1 glue: serve hotwire from a plain ``vllm serve`` (the only vLLM-version-specific module of
hotwire_api).

vLLM has no endpoint-plugin group. The ``hotwire_api`` general plugin (:func:`register`, run in every vLLM
process) calls :func:`install`. In the API server that wraps ``vllm.entrypoints.serve.register_vllm_serve_api_routers``,
which ``build_app`` imports at call time right after creating the FastAPI app and setting ``app.state.args``,
so every app it builds gets hotwire attached. Being the first middleware ``build_app`` adds, admission is the
innermost: vLLM's HTTP metrics, CORS, ``--api-key`` auth (``/v1`` only), scaling middleware and any
``--middleware`` all run before it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import multiprocessing
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from hotwire_core.settings import default_store_root

_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_SERVE_MODULE = "vllm.entrypoints.serve"
_HOOK = "register_vllm_serve_api_routers"
_MARK = "__hotwire_attached__"


def is_api_server_process() -> bool:
    """True in a process that may build vLLM's FastAPI app.

    vLLM names its child processes: ``ApiServer_<i>`` (``--api-server-count > 1``), ``EngineCore[_DP<i>]``,
    ``VllmWorker-<rank>``. The main process is an API server when vLLM's API-server module is loaded there:
    ``vllm serve`` imports it before loading plugins, ``python -m vllm.entrypoints.openai.api_server`` runs it
    as ``__main__``. Offline ``LLM`` scripts load neither.
    """
    name = multiprocessing.current_process().name
    if name.startswith("ApiServer"):
        return True
    if name != "MainProcess":
        return False
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return _API_SERVER_MODULE in sys.modules or getattr(main_spec, "name", None) == _API_SERVER_MODULE


def is_first_api_server() -> bool:
    """True in the API server that speaks for all of them: ``ApiServer_0`` when vLLM runs several, else the lone
    one (see :func:`is_api_server_process` for vLLM's process names)."""
    name = multiprocessing.current_process().name
    return not name.startswith("ApiServer_") or name == "ApiServer_0"


def install() -> bool:
    """Make vLLM's app builder attach hotwire; returns whether the hook is in place. Does nothing outside the
    API server, and nothing the second time."""
    if not is_api_server_process():
        return False
    serve = importlib.import_module(_SERVE_MODULE)
    original = getattr(serve, _HOOK)
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def register_hotwire_and_routers(app: Any) -> None:
        from hotwire_api.server import attach

        attach(app)  # first, so that vLLM's HTTP metrics middleware also sees admission refusals
        original(app)

    setattr(register_hotwire_and_routers, _MARK, True)
    setattr(serve, _HOOK, register_hotwire_and_routers)
    return True


def register() -> None:
    """vLLM general-plugin entry point ``hotwire_api``: in the API server, mount the HTTP control plane and turn
    the vector store on by default (the engine processes it spawns later inherit the setting)."""
    if install():
        os.environ.setdefault("HOTWIRE_STORE", default_store_root())


PerEngineRPC = Callable[[str, tuple, slice], Awaitable[list[Any]]]


def per_engine_rpc(client: Any) -> PerEngineRPC | None:
    """With data parallelism behind one API server (internal load balancing), vLLM 0.25.1 sends a
    ``collective_rpc`` to every engine core this server drives but returns only the first one's answer
    (``DPLBAsyncMPClient.call_utility_async``). This returns ``rpc(method, args, which)``: the answers of the
    engine cores ``which`` selects (a slice of them in the order vLLM keeps them), each a list over its workers.
    None when ``client`` (an ``AsyncLLM``) drives one engine core."""
    core = getattr(client, "engine_core", None)
    engines = getattr(core, "core_engines", None)
    call = getattr(core, "_call_utility_async", None)
    if call is None or not isinstance(engines, list) or len(engines) < 2:
        return None

    async def rpc(method: str, args: tuple, which: slice = slice(None)) -> list[Any]:
        return list(await asyncio.gather(*(call("collective_rpc", method, None, args, None, engine=e) for e in engines[which])))

    return rpc
