"""The wire names of hotwire's RPCs are a public contract (``collective_rpc("hotwire_check", ...)`` in offline
code, the API server's calls): ``hotwire_core.contract`` defines them once, the tests use its constants, and this
test pins them to the table in docs/architecture.md so that a rename cannot pass unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

from hotwire_core import contract

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_engine_rpc_names_are_the_documented_ones() -> None:
    table = DOC.read_text().split("## RPC contract", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(hotwire_\w+)` \|", table, re.MULTILINE))
    assert documented == set(contract.ENGINE_METHODS)
    assert {contract.REGISTER, contract.CHECK, contract.STATS} <= documented


def test_every_rpc_name_carries_the_prefix_the_engine_core_answers() -> None:
    for name in contract.ENGINE_METHODS | contract.WORKER_METHODS:
        assert name.startswith(contract.PREFIX)
        assert (contract.engine_method(name) is not None) is (name in contract.ENGINE_METHODS)
