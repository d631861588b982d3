"""Error codes are a public contract: ``hotwire_core.error_codes.ErrorCode`` lists every one, docs/usage.md ("Error
codes") documents the same set, and the code base raises and compares members, never the strings themselves."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from hotwire_api.errors import HotwireError
from hotwire_core.error_codes import ErrorCode, known_code
from hotwire_core.errors import EngineError

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_codes_are_the_members() -> None:
    table = (ROOT / "docs" / "usage.md").read_text().split("## Error codes", 1)[1].split("\n## ", 1)[0]
    cells = [re.sub(r"\(.*?\)", "", row.split("|")[2]) for row in table.strip().splitlines()[2:]]  # "(field `file`)"
    documented = {code for cell in cells for code in re.findall(r"`([a-z_]+)`", cell)}
    assert documented == {code.value for code in ErrorCode}


def test_no_module_spells_a_code_as_a_string() -> None:
    """A code written as a bare string (``exc.code == "slots_busy"``) escapes renames and typos; ``__all__`` lists
    name functions that share a code's spelling (``vectors.store_failed``)."""
    values = {code.value for code in ErrorCode}
    found = []
    for path in sorted([*(ROOT / "hotwire_core").rglob("*.py"), *(ROOT / "hotwire_api").rglob("*.py")]):
        if path.name == "error_codes.py":
            continue
        tree = ast.parse(path.read_text())
        exported = {id(node) for stmt in tree.body if isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
                    for node in ast.walk(stmt)}
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in values and id(node) not in exported]
    assert not found, found


def test_a_member_renders_as_its_string() -> None:
    error = HotwireError(503, ErrorCode.SLOTS_BUSY, "wait", "id")
    assert json.dumps(error.body()) == '{"error": {"message": "wait", "code": "slots_busy", "field": "id"}}'
    assert error.response().body == b'{"error":{"message":"wait","code":"slots_busy","field":"id"}}'
    assert error.headers() == {"Retry-After": "1"}
    assert f"{error.code}" == str(error.code) == "slots_busy"


def test_codes_read_off_the_wire_become_members_and_foreign_ones_stay_strings() -> None:
    again = EngineError.from_result(EngineError(410, ErrorCode.VERSION_GONE, "gone").to_result())
    assert again.code is ErrorCode.VERSION_GONE
    assert known_code("http_error") == "http_error" and not isinstance(known_code("http_error"), ErrorCode)
    assert EngineError.from_result({"ok": False}).code is ErrorCode.INTERNAL
