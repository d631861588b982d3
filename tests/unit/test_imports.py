"""The packages' import structure, read from their sources: no import cycle. (The layering rules, e.g. that
hotwire_core never imports hotwire_api, are import-linter contracts: test_import_contracts.py. import-linter 2.1 has
no contract against cycles, hence this check.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hotwire_core", "hotwire_api")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions, relative imports made absolute."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # ``from pkg import module``
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imports_form_no_cycle() -> None:
    """Module-level and function-level imports alike. An import of a module's own package is left out: Python
    imports every package before its modules anyway, and the package's plugin entry point imports them back."""
    modules = {_module_name(path): path for package in PACKAGES for path in _sources(package)}
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name and not name.startswith(m + ".")}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, [*trail, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])
