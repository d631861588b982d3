"""hotwire_core.settings: environment parsing, store folders, compile fingerprint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hotwire_core import __version__
from hotwire_core.env import Flag, Float, Int, Layers, Text, variables
from hotwire_core.settings import Settings, default_store_root, format_layers, middle_layer, parse_layers

ENV = ("HOTWIRE_SLOTS", "HOTWIRE_MAX_STACK", "HOTWIRE_IMPL", "HOTWIRE_STORE", "HOTWIRE_VECTORS", "HOTWIRE_IDLE_GRAPHS",
       "HOTWIRE_LAYERS", "HOTWIRE_PDL", "HOTWIRE_NORM", "HOTWIRE_MAX_ROWS", "HOTWIRE_MAX_WAIT_S")


@pytest.fixture
def env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(env):
    assert Settings.from_env() == Settings(slots=256, max_stack=4, impl="op", store=None, preload=None)


def test_values(env):
    env.setenv("HOTWIRE_SLOTS", "17")
    env.setenv("HOTWIRE_MAX_STACK", "16")
    env.setenv("HOTWIRE_IMPL", "inductor")
    env.setenv("HOTWIRE_STORE", "/tmp/st")
    env.setenv("HOTWIRE_VECTORS", "/tmp/vecs")
    assert Settings.from_env() == Settings(17, 16, "inductor", "/tmp/st", "/tmp/vecs")


@pytest.mark.parametrize("name,default", [("HOTWIRE_NORM", False), ("HOTWIRE_IDLE_GRAPHS", True), ("HOTWIRE_PDL", True)])
def test_flags_take_the_usual_spellings(env, name, default):
    field = {"HOTWIRE_NORM": "norm", "HOTWIRE_IDLE_GRAPHS": "idle_graphs", "HOTWIRE_PDL": "pdl"}[name]
    assert getattr(Settings.from_env(), field) is default
    for value, expected in (("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                            ("0", False), ("False", False), ("no", False), ("OFF", False), ("", default)):  # fmt: skip
        env.setenv(name, value)
        assert getattr(Settings.from_env(), field) is expected, value


def test_empty_strings_mean_unset(env):
    for name in ENV:
        env.setenv(name, "")
    env.setenv("HOTWIRE_IMPL", "op")
    assert Settings.from_env() == Settings(256, 4, "op", None, None)


@pytest.mark.parametrize(
    "name,value,msg",
    [
        ("HOTWIRE_SLOTS", "0", "must be in [1, 65536]"),
        ("HOTWIRE_SLOTS", "65537", "must be in [1, 65536]"),
        ("HOTWIRE_SLOTS", "-3", "must be in"),
        ("HOTWIRE_SLOTS", "lots", "is not an integer"),
        ("HOTWIRE_SLOTS", "1.5", "is not an integer"),
        ("HOTWIRE_MAX_STACK", "0", "must be in [1, 16]"),
        ("HOTWIRE_MAX_STACK", "17", "must be in [1, 16]"),
        ("HOTWIRE_IMPL", "triton", "must be 'op' or 'inductor'"),
        ("HOTWIRE_IMPL", "", "must be 'op' or 'inductor'"),
        ("HOTWIRE_IDLE_GRAPHS", "2", "must be 1 or 0"),
        ("HOTWIRE_IDLE_GRAPHS", "enabled", "must be 1 or 0"),
        ("HOTWIRE_PDL", "2", "must be 1 or 0"),
        ("HOTWIRE_NORM", "y", "must be 1 or 0"),
        ("HOTWIRE_LAYERS", "8-x", "'8-x' is not a layer index or a range"),
        ("HOTWIRE_LAYERS", "3,,4", "'' is not a layer index"),
        ("HOTWIRE_LAYERS", "9-3", "'9-3' is not a range of layers in [0, 65536)"),
        ("HOTWIRE_LAYERS", "0-2000000000", "is not a range of layers in [0, 65536)"),
        ("HOTWIRE_LAYERS", "-2", "'-2' is not a layer index"),
        ("HOTWIRE_MAX_ROWS", "0", "must be in [1, 65536]"),
        ("HOTWIRE_MAX_ROWS", "many", "is not an integer"),
        ("HOTWIRE_MAX_ROWS", "257", "HOTWIRE_MAX_ROWS=257 is more than the bank holds (HOTWIRE_SLOTS=256): set it to "
                                    "at most 256, or raise HOTWIRE_SLOTS"),
        ("HOTWIRE_MAX_WAIT_S", "-1", "must be in [0, 86400]"),
        ("HOTWIRE_MAX_WAIT_S", "86401", "must be in [0, 86400]"),
        ("HOTWIRE_MAX_WAIT_S", "2.5", "is not an integer"),
    ],
)
def test_bad_values(env, name, value, msg):
    env.setenv(name, value)
    with pytest.raises(ValueError) as info:
        Settings.from_env()
    assert name in str(info.value) and msg in str(info.value)


@pytest.mark.parametrize("name,value", [("HOTWIRE_SLOTS", "1"), ("HOTWIRE_SLOTS", "65536"), ("HOTWIRE_MAX_STACK", "1")])
def test_bounds_inclusive(env, name, value):
    env.setenv(name, value)
    s = Settings.from_env()
    assert getattr(s, "slots" if name == "HOTWIRE_SLOTS" else "max_stack") == int(value)


def test_row_cap_and_wait_limit(env):
    s = Settings.from_env()
    assert (s.max_rows, s.max_wait_s) == (None, 30)
    env.setenv("HOTWIRE_SLOTS", "512")
    env.setenv("HOTWIRE_MAX_ROWS", "512")  # the whole bank is allowed
    env.setenv("HOTWIRE_MAX_WAIT_S", "0")  # no wait at all
    s = Settings.from_env()
    assert (s.max_rows, s.max_wait_s, s.rows_per_request(36)) == (512, 0, 512)
    assert s.compile_fingerprint() == Settings(512, 4, "op", None, None).compile_fingerprint()  # not in the graph


@pytest.mark.parametrize("slots,layers,rows", [
    (256, 36, 64),  # a quarter of the default bank: one vector at every layer of a 36-layer model fits
    (256, 64, 64),  # and of a 64-layer one
    (256, 80, 80),  # a deeper model: one row per layer still fits
    (4096, 36, 1024),
    (8, 4, 4),
    (3, 4, 3),  # never more than the bank
    (2, 0, 1),  # a model nothing can steer
])  # fmt: skip
def test_default_row_cap_is_a_quarter_of_the_bank_but_at_least_a_row_per_layer(slots, layers, rows):
    assert Settings(slots, 4, "op", None, None).rows_per_request(layers) == rows
    assert Settings(slots, 4, "op", None, None, max_rows=1).rows_per_request(layers) == 1


def test_store_dir_per_model(tmp_path):
    s = Settings(8, 4, "op", str(tmp_path), None)
    a = s.store_dir("Qwen/Qwen3-0.6B")
    assert a == s.store_dir("Qwen/Qwen3-0.6B")  # stable
    assert a.parent == tmp_path
    assert a.name.startswith("Qwen_Qwen3-0.6B-") and len(a.name.rsplit("-", 1)[1]) == 8
    others = {s.store_dir(m) for m in ("Qwen/Qwen3-1.7B", "/models/Qwen/Qwen3-0.6B", "Qwen_Qwen3-0.6B", "qwen/qwen3-0.6b")}
    assert a not in others and len(others) == 4  # same slug, different model: the digest separates them
    long = s.store_dir("/very/" + "x" * 200)
    assert len(long.name) == 48 + 1 + 8


def test_store_dir_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    d = Settings(8, 4, "op", "~/st", None).store_dir("m")
    assert str(d).startswith(str(tmp_path / "st"))


@pytest.mark.parametrize("store", [None, "off", "OFF", "Off"])
def test_store_dir_off(store):
    assert Settings(8, 4, "op", store, None).store_dir("m") is None


def test_fingerprint():
    base = Settings(8, 4, "op", None, None)
    fp = base.compile_fingerprint()
    assert __version__ in fp
    assert Settings(9, 4, "op", None, None).compile_fingerprint() != fp
    assert Settings(8, 5, "op", None, None).compile_fingerprint() != fp
    assert Settings(8, 4, "inductor", None, None).compile_fingerprint() != fp
    # the store and preload folders do not change the graph, nor do idle graph variants (captured, never cached)
    assert Settings(8, 4, "op", "/x", "/y").compile_fingerprint() == fp
    assert Settings(8, 4, "op", None, None, idle_graphs=False).compile_fingerprint() == fp
    assert Settings(8, 4, "op", None, None, pdl=False).compile_fingerprint() == fp  # a launch attribute only
    # the hooked layers do change it: each hook is an op in the graph
    assert Settings(8, 4, "op", None, None, layers=frozenset({1, 2})).compile_fingerprint() != fp
    assert Settings(8, 4, "op", None, None, layers=frozenset({1, 2})).compile_fingerprint() != Settings(
        8, 4, "op", None, None, layers=frozenset({1, 3})).compile_fingerprint()
    # and so do the layers the readout op runs at, where it is compiled in
    reading = Settings(8, 4, "op", None, None, readout=True)
    fewer = Settings(8, 4, "op", None, None, readout=True, readout_layers=frozenset({2}))
    assert len({reading.compile_fingerprint(), fewer.compile_fingerprint(), fp}) == 3
    assert Settings(8, 4, "op", None, None, readout_layers=frozenset({2})).compile_fingerprint() == fp


@pytest.mark.parametrize("text,layers,canonical", [
    ("8", {8}, "8"),
    ("8-11", {8, 9, 10, 11}, "8-11"),
    (" 0-2, 5 ,7-7", {0, 1, 2, 5, 7}, "0-2,5,7"),
    ("4,3,2", {2, 3, 4}, "2-4"),
])
def test_layers_parse_and_format(text, layers, canonical):
    assert parse_layers(text) == frozenset(layers)
    assert format_layers(parse_layers(text)) == canonical
    assert parse_layers(canonical) == frozenset(layers)


def test_layers_env(env):
    assert Settings.from_env().layers is None  # every layer
    env.setenv("HOTWIRE_LAYERS", "14-21")
    assert Settings.from_env().layers == frozenset(range(14, 22))


def test_idle_graphs_switch(env):
    assert Settings.from_env().idle_graphs
    env.setenv("HOTWIRE_IDLE_GRAPHS", "0")
    assert not Settings.from_env().idle_graphs


def test_default_store_root(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Path(default_store_root()) == tmp_path / "hotwire" / "store"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Path(default_store_root()) == tmp_path / "home" / ".cache" / "hotwire" / "store"


def test_middle_layer_is_the_hooked_one_nearest_the_middle():
    assert middle_layer("0-35", 36) == 18
    assert middle_layer(None, 36) == middle_layer("", 36) == 18  # the server did not say: every layer
    assert middle_layer("0-2", 36) == 2
    assert middle_layer("16,20", 36) == 16  # a tie goes to the lower layer


def test_pdl_switch(env):
    assert Settings.from_env().pdl
    env.setenv("HOTWIRE_PDL", "0")
    assert not Settings.from_env().pdl


@pytest.mark.parametrize("method", ["compile_factors", "compute_hash"])
def test_compile_cache_key_follows_hotwire_sources(monkeypatch, method):
    """vLLM's compile-cache key (``VllmConfig.compile_factors``, a dict vLLM hashes, from 0.34; ``compute_hash``, a
    string, before) mixes in the op sources, so a changed op never reuses graphs compiled with the old one."""
    from types import SimpleNamespace

    from hotwire_core.vllm_glue import config as glue_config

    own = {"compile_factors": {"model": "vllm's own factors"}, "compute_hash": "vllm's own key"}[method]

    def key(source_digest: str):
        monkeypatch.setattr(glue_config, "source_digest", lambda: source_digest)
        config = type("VllmConfig", (), {method: lambda self, include_version=True: own})
        glue_config.patch_config(SimpleNamespace(VllmConfig=config))
        return getattr(config(), method)()

    assert key("ops-v1") == key("ops-v1") != key("ops-v2")
    assert key("ops-v1") != own
    if method == "compile_factors":  # vLLM's own factors are all kept
        assert key("ops-v1").items() >= own.items()
    monkeypatch.undo()
    digest = glue_config.source_digest()
    assert len(digest) == 16 and digest == glue_config.source_digest()


def _documented(doc: str, heading: str) -> set[str]:
    table = (Path(__file__).resolve().parents[2] / "docs" / doc).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(HOTWIRE_\w+)` \|", table, re.MULTILINE))


def test_every_setting_is_declared_once_and_documented():
    """Each process side declares its variables on its settings dataclass (``hotwire_core.env.setting``); the
    engine's and the API server's are the table in docs/deployment.md, a fleet's the one in docs/fleet.md."""
    from hotwire_api.fleet.config import FleetConfig
    from hotwire_api.settings import Settings as ApiSettings

    engine, api, fleet = (frozenset(v.name for v in variables(cls).values())
                          for cls in (Settings, ApiSettings, FleetConfig))
    assert len(engine) == len(variables(Settings)) and len(api) == len(variables(ApiSettings))
    assert engine | api == _documented("deployment.md", "## Environment")
    assert fleet | {"HOTWIRE_REGISTRY"} == _documented("fleet.md", "| setting | default | meaning |")
    assert all(var.doc for cls in (Settings, ApiSettings, FleetConfig) for var in variables(cls).values())


@pytest.mark.parametrize(
    "var,raw,message",
    [
        (Float("X", lo=0.05, hi=60, doc="."), "0", "X must be a number from 0.05 to 60, got '0'"),
        (Float("X", lo=0.05, hi=60, doc="."), "nan", "X must be a number from 0.05 to 60, got 'nan'"),
        (Float("X", lo=0, lo_open=True, doc="."), "0", "X must be a number above 0, got '0'"),
        (Float("X", lo=0, lo_open=True, doc="."), "inf", "X must be a number above 0, got 'inf'"),
        (Int("X", lo=10, hi=20, doc="."), "9", "X=9 must be in [10, 20]"),
        (Flag("X", doc="."), "maybe", "X='maybe' must be 1 or 0"),
        (Layers("X", doc="."), "1-", "X='1-': '1-' is not a layer index or a range"),
    ],
)
def test_each_kind_of_value_refuses_what_it_cannot_read(var, raw, message):
    with pytest.raises(ValueError) as info:
        var.read({"X": raw})
    assert str(info.value).startswith(message)


def test_unset_or_empty_is_the_default_and_to_converts():
    mb = Float("X", default=64.0, lo=0, lo_open=True, to=lambda v: int(v * 2**20), doc=".")
    assert mb.read({}) == mb.read({"X": " "}) == 64 * 2**20 and mb.read({"X": "0.5"}) == 2**19
    assert Text("X", doc=".").read({"X": ""}) is None and Layers("X", doc=".").read({}) is None
    assert Flag("X", default=True, doc=".").read({"X": " OFF "}) is False


def test_api_and_fleet_settings_read_the_given_environment():
    from hotwire_api.fleet.config import FleetConfig
    from hotwire_api.settings import Settings as ApiSettings

    api = ApiSettings.from_env({"HOTWIRE_CATALOG_REFRESH_MS": "3600000", "HOTWIRE_REGISTRY": "local"})
    assert api.catalog_refresh_s == 3600.0 and api.registry_url is None
    assert ApiSettings.from_env({}).catalog_refresh_s == 0.2
    with pytest.raises(ValueError, match=r"HOTWIRE_CATALOG_REFRESH_MS=5 must be in \[10, 3600000\]"):
        ApiSettings.from_env({"HOTWIRE_CATALOG_REFRESH_MS": "5"})
    with pytest.raises(ValueError, match="HOTWIRE_REGISTRY must be 'local' or a redis://"):
        ApiSettings.from_env({"HOTWIRE_REGISTRY": "http://h/"})
    fleet = FleetConfig.from_env("redis://h/0", {"HOTWIRE_FLEET_HEARTBEAT_S": "10", "HOTWIRE_RETAIN_S": "5",
                                                 "HOTWIRE_REGISTRY_STREAM_MAXLEN": "1e3", "HOTWIRE_REPLICA_URL": "u"})
    assert (fleet.heartbeat_s, fleet.restart_settle_s, fleet.restart_limit_s) == (10.0, 20.0, 40.0)
    assert (fleet.retain_s, fleet.stream_maxlen, fleet.replica_url, fleet.replica_id) == (5, 1000, "u", None)
