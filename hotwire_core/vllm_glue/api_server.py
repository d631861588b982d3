"""vLLM's API server, as hotwire's control plane needs it: which process this is (vLLM's process names), the app
builder's hook where the control plane attaches (the callback is hotwire_api's: the core never imports it), the
guard on every request the API server's engine client adds, and how that client reaches each data-parallel engine
core. Imports no vLLM code until asked to hook."""

from __future__ import annotations

import asyncio
import functools
import importlib
import multiprocessing
import sys
from collections.abc import Awaitable, Mapping
from typing import Any, Callable, Protocol

from .compat import API_SERVER_MODULES
from .patching import wrap

__all__ = [
    "PerEngineRPC", "attach_to_app_builder", "cli_api_keys", "engine_client", "guard_engine_requests",
    "is_api_server_process", "is_first_api_server", "per_engine_rpc", "served_model_type", "served_port_and_model",
]

def is_api_server_process() -> bool:
    """True in a process that may build vLLM's FastAPI app.

    vLLM names its child processes: ``ApiServer_<i>`` (``--api-server-count > 1``), ``EngineCore[_DP<i>]``,
    ``VllmWorker-<rank>``. The main process is an API server when one of vLLM's API-server modules
    (:data:`compat.API_SERVER_MODULES`) is loaded there: ``vllm serve`` imports it before loading plugins,
    ``python -m vllm.entrypoints.openai.api_server`` runs it as ``__main__``. Offline ``LLM`` scripts load none.
    """
    name = multiprocessing.current_process().name
    if name.startswith("ApiServer"):
        return True
    if name != "MainProcess":
        return False
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main_spec, "name", None) in API_SERVER_MODULES or any(m in sys.modules for m in API_SERVER_MODULES)


_SERVE_MODULE = "vllm.entrypoints.serve"
_HOOK = "register_vllm_serve_api_routers"
_MARK = "__hotwire_attached__"


def attach_to_app_builder(attach: Callable[[Any], None]) -> None:
    """Make every FastAPI app vLLM builds call ``attach(app)`` before vLLM adds its own routers and middleware.

    vLLM's app builder (``openai.api_server.build_app``, 0.29+: ``launchers.app.build_app`` through
    ``register_api_routers``) imports ``vllm.entrypoints.serve.register_vllm_serve_api_routers`` at call time,
    right after creating the app and setting ``app.state.args``; hotwire wraps it. Being the first middleware ``build_app``
    adds, whatever ``attach`` adds is innermost: vLLM's HTTP metrics, CORS, ``--api-key`` auth (``/v1`` only),
    scaling middleware and any ``--middleware`` all run before it. Raises ImportError or AttributeError where
    this vLLM has no such hook; a second call changes nothing."""
    serve = importlib.import_module(_SERVE_MODULE)
    original = getattr(serve, _HOOK)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def register_hotwire_and_routers(app: Any) -> None:
        attach(app)  # first, so that vLLM's HTTP metrics middleware also sees admission refusals
        original(app)

    setattr(register_hotwire_and_routers, _MARK, True)
    setattr(serve, _HOOK, register_hotwire_and_routers)


_ENGINE_CLIENT_MODULE = "vllm.v1.engine.async_llm"  # AsyncLLM: the engine client of every API server
_GUARD: list[Callable[[Mapping[str, Any] | None], None]] = []


def guard_engine_requests(check: Callable[[Mapping[str, Any] | None], None]) -> None:
    """Run ``check(extra_args)`` on every request this process's engine client adds, before it goes to the engine:
    whatever route built it. ``extra_args``: the request's ``SamplingParams.extra_args`` (None for pooling
    requests and for requests without any). An exception ``check`` raises refuses the request as vLLM's own input
    checks do (vLLM's handlers answer a ``ValueError`` with 400, or an error event in a stream). ``AsyncLLM.add_request``
    is where ``generate``, ``encode`` and beam search's steps all pass. The last ``check`` given is the one run."""
    _GUARD[:] = [check]
    client = importlib.import_module(_ENGINE_CLIENT_MODULE).AsyncLLM

    def make_add_request(original):
        async def add_request(self, request_id, prompt, params, *args, **kwargs):
            _GUARD[0](getattr(params, "extra_args", None))
            return await original(self, request_id, prompt, params, *args, **kwargs)

        return add_request

    wrap(client, "add_request", make_add_request)


def is_first_api_server() -> bool:
    """True in the API server that speaks for all of them: ``ApiServer_0`` when vLLM runs several, else the lone
    one (see :func:`is_api_server_process` for vLLM's process names)."""
    name = multiprocessing.current_process().name
    return not name.startswith("ApiServer_") or name == "ApiServer_0"


class PerEngineRPC(Protocol):
    """``rpc(method, args, which, failures)``: see :func:`per_engine_rpc`."""

    def __call__(self, method: str, args: tuple, which: slice = ..., failures: bool = ...) -> Awaitable[list[Any]]: ...


def per_engine_rpc(client: Any) -> PerEngineRPC | None:
    """With data parallelism behind one API server (internal load balancing), vLLM 0.25.1 sends a
    ``collective_rpc`` to every engine core this server drives but returns only the first one's answer
    (``DPLBAsyncMPClient.call_utility_async``). This returns ``rpc(method, args, which, failures)``: the answers
    of the engine cores ``which`` selects (a slice of them in the order vLLM keeps them), each a list over its
    workers; with ``failures`` the exception of an engine core that failed stands in for its answer, else it is
    raised. None when ``client`` (an ``AsyncLLM``) drives one engine core."""
    core = getattr(client, "engine_core", None)
    engines = getattr(core, "core_engines", None)
    call = getattr(core, "_call_utility_async", None)
    if call is None or not isinstance(engines, list) or len(engines) < 2:
        return None

    async def rpc(method: str, args: tuple, which: slice = slice(None), failures: bool = False) -> list[Any]:
        calls = (call("collective_rpc", method, None, args, None, engine=e) for e in engines[which])
        return list(await asyncio.gather(*calls, return_exceptions=failures))

    return rpc


def served_model_type(client: Any) -> str:
    """The served model's transformers ``model_type`` (``AsyncLLM.model_config.hf_config``), "" when unknown."""
    hf_config = getattr(getattr(client, "model_config", None), "hf_config", None)
    return str(getattr(hf_config, "model_type", "") or "")


def engine_client(app: Any) -> Any | None:
    """The engine client (``AsyncLLM``) of a vLLM app: ``app.state.engine_client``, which ``init_app_state`` sets
    once the engine runs; None before."""
    return getattr(app.state, "engine_client", None)


def served_port_and_model(app: Any) -> tuple[int | None, str | None]:
    """The ``--port`` and the model (``app.state.args``) a vLLM app serves; None where not set."""
    args = getattr(getattr(app, "state", None), "args", None)
    return getattr(args, "port", None), getattr(args, "model", None)


def cli_api_keys(app: Any) -> list[str]:
    """The keys of vLLM's ``--api-key`` (``app.state.args.api_key``: a list in 0.25.1, a string in older
    releases); empty when not given."""
    keys = getattr(getattr(app.state, "args", None), "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    return list(keys or ())
