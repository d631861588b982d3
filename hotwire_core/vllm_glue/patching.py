"""How hotwire patches vLLM: methods wrapped once (idempotent), patches applied when their vLLM module is imported,
and the settings every hook reads."""

from __future__ import annotations

import functools
import importlib.abc
import sys
from types import ModuleType
from typing import Any, Callable

from ..settings import Settings

__all__ = ["PatchOnImport", "settings", "wrap"]

_SETTINGS: Settings | None = None


def settings() -> Settings:
    """hotwire's settings in this process, read from the environment once."""
    global _SETTINGS
    if _SETTINGS is None:
        _SETTINGS = Settings.from_env()
    return _SETTINGS


def wrap(cls: type | ModuleType, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``cls.name`` (a class's method or a module's function) by ``make(original)``, once: a second call
    leaves hotwire's wrapper as it is."""
    original = cls.__dict__[name]
    if getattr(original, "_hotwire", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._hotwire = True
    setattr(cls, name, wrapped)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies ``patches[name](module)`` right after the module ``name`` finishes executing."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]):
        self._patches = patches

    def find_spec(self, name, path=None, target=None):
        if name not in self._patches:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module, _patch=self._patches[name]):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None
