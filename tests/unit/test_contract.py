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


def test_the_api_server_reads_vector_metadata_in_the_engines_shape() -> None:
    """The engine builds ``contract.VectorMeta``; the API server validates it as ``models.VectorMeta`` (its OpenAPI
    schema): one set of fields, so neither side can add or drop one alone."""
    from hotwire_api.models import VectorMeta

    assert set(VectorMeta.model_fields) == set(contract.VectorMeta.__annotations__)


def test_steer_items_cross_pickle_as_themselves_and_msgpack_as_lists() -> None:
    """Bindings ride to the workers in vLLM's scheduler output (pickled: ``shm_broadcast.MessageQueue``); a list
    from msgpack unpacks the same way, so the worker reads either."""
    import pickle

    import msgspec

    item = contract.SteerItem(layer=2, slot=5, scale=1.5, rel=0.0, gated=1)
    config: contract.Config = {"p": [item], "d": []}
    assert pickle.loads(pickle.dumps(config)) == config
    assert type(pickle.loads(pickle.dumps(item))) is contract.SteerItem
    (layer, slot, scale, rel, gated), = msgspec.msgpack.decode(msgspec.msgpack.encode(config))["p"]
    assert (layer, slot, scale, rel, gated) == (2, 5, 1.5, 0.0, 1)


def test_the_api_models_read_the_engine_results_field_for_field() -> None:
    """Each ``hotwire_api.models`` class that validates an engine result has the result's fields, and only those
    the API server adds besides (data parallelism's ``engine(s)``, the cache's ``age_ms``, the registry)."""
    from hotwire_api import models

    def keys(result: type) -> set[str]:
        return set(result.__annotations__) - {"ok"}

    assert set(models.SlotStats.model_fields) == keys(contract.StatsResult) | {"engines", "age_ms", "registry"}
    assert set(models.SlotRow.model_fields) == keys(contract.SlotRow) | {"engine"}
    assert set(models.ModelSteering.model_fields) == keys(contract.ModelView) - {"dtype"}  # the API shows no dtype
