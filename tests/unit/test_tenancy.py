"""Tenants: how a tenant's key names vectors (``hotwire_api.tenancy``), its quotas (``hotwire_api.quotas``) and keys
with a tenant (``hotwire_api.keys``). Against a real ``vllm serve``: tests/integration/test_tenants.py; the bank's
share per tenant: tests/unit/test_controller.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from hotwire_api.errors import HotwireError
from hotwire_api.json_file import LOOK_S
from hotwire_api.keys import KeyRing, KeysFileError, Role, add_key, read_keys, revoke_key, rotate_key
from hotwire_api.models import VectorMeta
from hotwire_api.quotas import Quotas
from hotwire_api.settings import Settings
from hotwire_api.tenancy import OPERATOR, Tenancy
from hotwire_core.readout_spec import parse_readout
from hotwire_core.settings import Settings as CoreSettings
from hotwire_core.slots import RowKey, SlotCache
from hotwire_core.tenant_limits import parse_tenant_limits
from hotwire_core.spec import VECTOR_ID_RE, parse_spec, tenant_of

ACME = Tenancy("acme")
HELD = {"acme/calm", "calm", "pub", "beta/calm", "beta/secret"}


def exists(vector_id: str) -> bool:
    return vector_id in HELD


def test_ids_hold_at_most_one_tenant() -> None:
    assert tenant_of("acme/calm") == "acme" and tenant_of("calm") == ""
    for good in ("calm", "acme/calm", "a-b_c/x.y"):
        assert VECTOR_ID_RE.fullmatch(good)
    for bad in ("a/b/c", "/calm", "acme/", "a.b/calm", "-a/calm", "acme/.x"):
        assert not VECTOR_ID_RE.fullmatch(bad), bad


def test_a_tenant_names_its_own_vectors_first_then_the_shared_ones() -> None:
    assert ACME.named("calm", exists) == "acme/calm"  # its own shadows the shared calm
    assert ACME.named("pub", exists) == "pub"
    assert ACME.named("secret", exists) == "acme/secret"  # beta's: unknown to acme, as any unknown name
    assert ACME.named("nothing", exists) == "acme/nothing"
    assert OPERATOR.named("beta/secret", exists) == "beta/secret"
    for other in ("beta/secret", "beta/nothing"):  # refused alike, whether or not it exists
        with pytest.raises(HotwireError) as info:
            ACME.named(other, exists)
        assert (info.value.status, info.value.code) == (400, "bad_id")
        assert info.value.message == f"a tenant's vector is named by [A-Za-z0-9_][A-Za-z0-9._-]{{0,63}} (its tenant is the key's), got {other!r}"


def test_paths_reach_another_tenants_vector_only_with_the_operators_key() -> None:
    assert OPERATOR.addressed("calm", "beta", exists) == "beta/calm"
    assert OPERATOR.addressed("calm", None, exists) == "calm"
    assert ACME.addressed("calm", None, exists) == ACME.addressed("calm", "acme", exists) == "acme/calm"
    assert ACME.addressed("calm", "beta", exists) is None and ACME.addressed("nothing", "beta", exists) is None


def test_a_tenants_spec_and_readout_are_renamed_for_the_engine() -> None:
    spec = json.dumps([{"id": "calm", "layer": 1, "scale": 2.0},
                       {"id": "pub", "layer": [2, 3], "scale": -1.0, "when": {"id": "calm", "layer": 0, "above": 0.5}}])
    entries = parse_spec(ACME.spec(spec, exists))
    assert [e.vector_id for e in entries] == ["acme/calm", "pub"] and entries[1].when.vector_id == "acme/calm"
    assert entries[1].layers == (2, 3) and entries[1].scale == -1.0 and entries[1].when.threshold == 0.5
    readout = json.dumps({"probes": [{"id": "calm", "layer": 1, "bias": 0.5}, {"id": "pub", "layer": 2}],
                          "tokens": "all"})
    read = parse_readout(ACME.readout(readout, exists), 8)
    assert [(p.vector_id, p.layer, p.bias) for p in read.probes] == [("acme/calm", 1, 0.5), ("pub", 2, 0.0)]
    assert read.tokens == "all"
    for left in ({"id": "calm"}, "{not json", json.dumps({"id": "calm"})):  # for admission to refuse as it does
        assert ACME.spec(left, exists) == left and ACME.readout(left, exists) == left
    assert OPERATOR.spec(spec, exists) is spec


def test_what_a_tenant_gets_back_is_in_its_names() -> None:
    assert ACME.localize("acme/calm@2:L1x4;pub@1:L2x-1,when=acme/calm@2:L0>0.5") == \
        "calm@2:L1x4;pub@1:L2x-1,when=calm@2:L0>0.5"
    assert ACME.localize("unknown steering vector 'acme/nothing'") == "unknown steering vector 'nothing'"
    assert ACME.localize("xacme/calm") == "xacme/calm"  # another name that ends like the prefix is left alone
    assert OPERATOR.localize("acme/calm") == "acme/calm"
    metas = [_meta(i) for i in ("acme/calm", "calm", "beta/calm")]
    assert [(m.id, m.tenant) for m in ACME.vectors(metas)] == [("calm", "acme"), ("calm", None)]
    assert [(m.id, m.tenant) for m in OPERATOR.vectors(metas)] == [("acme/calm", "acme"), ("calm", None),
                                                                     ("beta/calm", "beta")]


def _meta(vector_id: str, rows: int = 1) -> VectorMeta:
    return VectorMeta(id=vector_id, version=1, sha256="0" * 64, dtype="float32", shape=[rows, 256], layers=None,
                      norms={}, created_at=0.0)


def _register(quotas: Quotas, vector_id: str, nbytes: int, held: list[VectorMeta]) -> None:
    async def vectors(tenant: str) -> list[VectorMeta]:
        return held

    async def register() -> None:
        async with quotas.registering(vector_id, nbytes, vectors):
            pass

    asyncio.run(register())


def test_quotas_refuse_past_a_tenants_vectors_bytes_and_rate(monkeypatch) -> None:
    quotas = Quotas(Settings(tenant_vectors=2, tenant_bytes=4096, tenant_per_minute=3))
    held = [_meta("acme/a"), _meta("acme/b"), _meta("beta/a", rows=3)]
    with pytest.raises(HotwireError) as info:
        _register(quotas, "acme/c", 1024, held)
    assert (info.value.status, info.value.code) == (429, "quota_exceeded")
    assert "holds 2 vectors" in info.value.message and "HOTWIRE_TENANT_VECTORS=2" in info.value.message
    _register(quotas, "acme/a", 1024, held)  # a replacement takes the place of the version it replaces
    with pytest.raises(HotwireError) as info:
        _register(quotas, "beta/b", 2048, held)  # 3,072 held + 2,048 > 4,096
    assert info.value.code == "quota_exceeded" and "HOTWIRE_TENANT_MB" in info.value.message
    _register(quotas, "calm", 1 << 30, held)  # shared vectors have no quota
    _register(quotas, "acme/a", 1024, held)
    clock = [1000.0]
    monkeypatch.setattr("hotwire_api.quotas.time.monotonic", lambda: clock[0])
    quotas = Quotas(Settings(tenant_per_minute=2))
    _register(quotas, "acme/a", 1, [])
    clock[0] += 30
    _register(quotas, "acme/a", 1, [])
    with pytest.raises(HotwireError) as info:
        _register(quotas, "acme/a", 1, [])
    assert "2 registrations in the last minute" in info.value.message and "retry in 30 s" in info.value.message
    _register(quotas, "beta/a", 1, [])  # another tenant's count is its own
    clock[0] += 30.5
    _register(quotas, "acme/a", 1, [])  # the first one is a minute old


async def _none(tenant: str) -> list[VectorMeta]:
    return []


def test_a_registration_that_fails_is_not_counted() -> None:
    quotas = Quotas(Settings(tenant_per_minute=1))

    async def refused() -> None:
        async with quotas.registering("acme/a", 1, _none):
            raise RuntimeError("the engine refused it")

    with pytest.raises(RuntimeError):
        asyncio.run(refused())
    _register(quotas, "acme/a", 1, [])


def test_quotas_ask_the_engine_for_the_tenants_vectors_alone() -> None:
    """The engine core answers a listing in its loop: a quota check asks for its tenant's namespace only."""
    quotas, asked = Quotas(Settings()), []

    async def held(tenant: str) -> list[VectorMeta]:
        asked.append(tenant)
        return []

    async def register_and_check() -> None:
        async with quotas.registering("acme/a", 1, held):
            pass
        await quotas.admissible("beta/b", held)

    asyncio.run(register_and_check())
    assert asked == ["acme", "beta"]


def test_keys_carry_a_tenant_through_every_edit(tmp_path) -> None:
    path = tmp_path / "keys.json"
    add_key(path, "ops", Role.ADMIN)
    acme = add_key(path, "acme-admin", Role.ADMIN, "acme")
    ring = KeyRing(path)
    assert ring.identify(acme).tenant == "acme"
    rotated = rotate_key(path, "acme-admin")
    time.sleep(LOOK_S)  # another process's edit: in force within LOOK_S
    assert ring.identify(rotated).tenant == "acme" and ring.identify(acme) is None
    with pytest.raises(KeysFileError) as info:
        add_key(path, "x", Role.STEER, "no/slash")
    assert info.value.code == "bad_request" and "tenant 'no/slash'" in str(info.value)
    # a tenant's admin key is not the operator's: the last operator admin still may not go
    with pytest.raises(KeysFileError) as info:
        revoke_key(path, "ops", keep_an_admin=True)
    assert info.value.code == "last_admin"
    revoke_key(path, "acme-admin", keep_an_admin=True)
    text = json.loads(path.read_text())
    text["keys"].append({**text["keys"][0], "name": "moved", "sha256": "1" * 64})
    path.write_text(json.dumps(text))
    ring.refresh()
    text["keys"][-1]["tenant"] = "beta"
    path.write_text(json.dumps(text, indent=1))
    ring.refresh()
    changes = [c[:2] for c in ring.changes]
    assert ("key_added", "moved") in changes and changes[-1] == ("key_tenant_changed", "moved")
    assert [k.tenant for k in read_keys(path)] == [None, "beta"]


def test_registrations_of_one_tenant_at_once_each_see_the_one_before() -> None:
    """The vectors held are read inside the tenant's turn: 5 registrations sent at once by a tenant one vector
    short of its quota make 1 vector, not 5."""
    quotas = Quotas(Settings(tenant_vectors=3))
    held = [_meta("acme/a"), _meta("acme/b")]

    async def vectors(tenant: str) -> list[VectorMeta]:
        await asyncio.sleep(0)  # an engine round trip
        return list(held)

    async def register(k: int) -> str:
        try:
            async with quotas.registering(f"acme/n{k}", 1024, vectors):
                await asyncio.sleep(0.01)
                held.append(_meta(f"acme/n{k}"))
            return "ok"
        except HotwireError as exc:
            return exc.code

    async def burst() -> list[str]:
        return await asyncio.gather(*(register(k) for k in range(5)))

    assert sorted(asyncio.run(burst())) == ["ok"] + ["quota_exceeded"] * 4

    async def admissible(vector_id: str) -> None:
        await quotas.admissible(vector_id, vectors)

    with pytest.raises(HotwireError) as info:  # an extraction is refused before its captures
        asyncio.run(admissible("acme/n9"))
    assert info.value.code == "quota_exceeded"
    asyncio.run(admissible("acme/a"))  # a replacement
    asyncio.run(admissible("calm"))


def test_a_named_tenants_own_limits_replace_everyones() -> None:
    limits = parse_tenant_limits('{"acme": {"vectors": 3, "mb": 0.00390625, "registrations_per_min": 1}}')
    quotas = Quotas(Settings(tenant_vectors=2, tenant_bytes=1 << 20, tenant_per_minute=5, tenant_limits=limits))
    assert quotas.limits("acme") == (3, 4096, 1) and quotas.limits("beta") == (2, 1 << 20, 5)
    held = [_meta("acme/a"), _meta("acme/b"), _meta("beta/a"), _meta("beta/b")]
    _register(quotas, "acme/c", 1024, held)  # a third vector: acme's own quota
    with pytest.raises(HotwireError) as info:
        _register(quotas, "beta/c", 1024, held)  # everyone's
    assert "HOTWIRE_TENANT_VECTORS=2" in info.value.message
    with pytest.raises(HotwireError) as info:
        _register(quotas, "acme/c", 1024, held)  # its second registration this minute
    assert "HOTWIRE_TENANT_LIMITS.acme.registrations_per_min=1" in info.value.message
    quotas = Quotas(Settings(tenant_limits=limits))
    with pytest.raises(HotwireError) as info:
        _register(quotas, "acme/c", 3000, held)  # 2,048 held + 3,000 > 4,096
    assert "HOTWIRE_TENANT_LIMITS.acme.mb" in info.value.message


@pytest.mark.parametrize("raw, says", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"a/b": {"rows": 1}}', "not a tenant name"),
    ('{"acme": {}}', "one or more of"), ('{"acme": {"slots": 1}}', "'slots' is not a limit"),
    ('{"acme": {"rows": 0}}', "from 1 to"), ('{"acme": {"vectors": 1.5}}', "whole number"),
    ('{"acme": {"rows": Infinity}}', "whole number"), ('{"acme": {"mb": NaN}}', "number"),
    ('{"acme": {"rows": 1}, "acme": {"rows": 2}}', "'acme' twice"),
    ('{"acme": {"mb": true}}', "number"), ('{"acme": {"rows": 70000}}', "from 1 to 65536"),
])
def test_bad_tenant_limits_stop_the_start_with_the_reason(raw, says) -> None:
    with pytest.raises(ValueError, match="HOTWIRE_TENANT_LIMITS") as info:
        CoreSettings.from_env({"HOTWIRE_TENANT_LIMITS": raw})
    assert says in str(info.value)


def test_a_named_tenants_share_of_the_bank() -> None:
    settings = CoreSettings.from_env({"HOTWIRE_SLOTS": "16", "HOTWIRE_TENANT_LIMITS": '{"acme": {"rows": 12}, '
                                      '"beta": {"rows": 1}, "gamma": {"vectors": 9}}'})
    assert settings.rows_per_tenant(2) == 8 and settings.rows_per_tenant(2, "acme") == 12
    assert settings.rows_per_tenant(2, "beta") == 4  # never less than one request may pin (a quarter of the bank)
    assert settings.tenant_shares(2) == {"acme": 12, "beta": 4}
    slots = SlotCache(16, settings.rows_per_tenant(2), settings.tenant_shares(2))
    slots.acquire([RowKey(f"acme/v{i}", 1, 0) for i in range(12)])  # past everyone's 8: acme's own 12
    full = slots.over_share([RowKey("acme/w", 1, 0)])
    assert full is not None and full.limit == 12 and "HOTWIRE_TENANT_LIMITS" in str(full)
    slots.acquire([RowKey(f"beta/v{i}", 1, 0) for i in range(4)])
    assert slots.over_share([RowKey("beta/w", 1, 0)]).limit == 4
