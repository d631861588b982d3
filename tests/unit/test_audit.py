"""The audit trail's local keepers (``hotwire_api.audit``): a file, appended line by line, and memory. The fleet's
Redis stream is tested in test_fleet_registry.py, the routes that write and read the trail against a real
``vllm serve`` in tests/integration/test_roles.py."""

from __future__ import annotations

import os
import stat

from hotwire_api.audit import MEMORY_ENTRIES, AuditFile, AuditMemory, entry


def test_a_file_keeps_every_change_and_reads_newest_first(tmp_path) -> None:
    trail = AuditFile(tmp_path / "model" / "audit.jsonl")
    assert trail.read(10) == [] and trail.kept == f"file {trail.path}"
    trail.record(entry("ops", "register", "calm", 1, "a" * 64, "upload"))
    trail.record(entry("ops", "replace", "calm", 2, "b" * 64, "extract"))
    trail.record(entry("keys file", "key_added", "app"))
    with open(trail.path, "ab") as f:  # a crash mid-write leaves a torn last line: skipped, the rest read
        f.write(b'{"at": 1.0, "who": "o')
    read = trail.read(10)
    assert [(e.action, e.id, e.version, e.via) for e in read] == [
        ("key_added", "app", None, None), ("replace", "calm", 2, "extract"), ("register", "calm", 1, "upload")]
    assert read[1].sha256 == "b" * 64 and read[1].who == "ops" and read[1].replica == "local"
    assert [e.action for e in trail.read(1)] == ["key_added"]
    assert stat.S_IMODE(os.stat(trail.path).st_mode) == 0o600
    assert len(trail.path.read_text().splitlines()) == 4  # appended, never rewritten


def test_memory_keeps_the_last_changes() -> None:
    trail = AuditMemory()
    for n in range(MEMORY_ENTRIES + 5):
        trail.record(entry("ops", "register", f"v{n}", 1))
    read = trail.read(MEMORY_ENTRIES + 100)
    assert len(read) == MEMORY_ENTRIES and read[0].id == f"v{MEMORY_ENTRIES + 4}" and read[-1].id == "v5"
    assert trail.kept == "memory"
