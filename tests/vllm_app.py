"""vLLM's FastAPI app builder, its CLI parser and its auth middleware, wherever the installed release keeps them
(0.29 moved them under ``vllm.entrypoints.launchers``, 0.33 the parser to ``vllm.entrypoints.common``): for the
tests that build vLLM's real app without an engine."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["app_module", "authentication_middleware", "build_app"]


def _first(name: str, *modules: str) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {modules} has {name}")


def app_module() -> Any:
    """The module holding vLLM's ``build_app``; importing it is what marks a process as vLLM's API server."""
    for module in ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError("this vLLM has no known app builder")


def build_app(argv: list[str]) -> Any:
    """vLLM's app for ``vllm serve ARGV`` (serving "generate"), built as ``vllm serve`` builds it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = _first("make_arg_parser", "vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                             "vllm.entrypoints.openai.cli_args")
    return app_module().build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(argv), ("generate",))


def authentication_middleware() -> type:
    """The middleware behind ``--api-key``."""
    return _first("AuthenticationMiddleware", "vllm.entrypoints.serve.middleware.authenticate",
                  "vllm.entrypoints.serve.utils.server_utils")
