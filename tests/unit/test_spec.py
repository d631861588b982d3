"""hotwire_core.spec: parsing, canonical form and error fields of steering specs."""

from __future__ import annotations

import json

import pytest
import torch

from hotwire_core.spec import (
    MAX_ENTRIES,
    SPEC_KEY,
    Phase,
    SpecError,
    SteeringEntry,
    build_spec,
    canonical_spec,
    parse_spec,
)

BASE = {"id": "happy", "layer": 3, "scale": 2.5}


def entry(**over):
    out = dict(BASE)
    out.update(over)
    return out


def spec_error(value) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(value)
    return info.value


# -- accepted forms ------------------------------------------------------------------------------------------


def test_single_object():
    (e,) = parse_spec({"id": "happy", "layer": 10, "scale": 4.0})
    assert e == SteeringEntry("happy", (10,), 4.0, Phase.ALL, False)


def test_list_of_objects_keeps_order():
    entries = parse_spec([{"id": "b", "layer": 1, "scale": 1}, {"id": "a", "layer": 2, "scale": -3}])
    assert [e.vector_id for e in entries] == ["b", "a"]
    assert entries[1].scale == -3.0 and isinstance(entries[1].scale, float)


def test_json_string_object_and_list():
    assert parse_spec(json.dumps(BASE)) == parse_spec(BASE)
    assert parse_spec(json.dumps([BASE, BASE])) == parse_spec([BASE, BASE])
    assert len(parse_spec(json.dumps([BASE, BASE]))) == 2


def test_layer_list_is_sorted():
    (e,) = parse_spec(entry(layer=[12, 3, 7]))
    assert e.layers == (3, 7, 12)


def test_layer_zero_and_int_scale():
    (e,) = parse_spec(entry(layer=0, scale=0))
    assert e.layers == (0,) and e.scale == 0.0


def test_flags():
    (d,) = parse_spec(entry(decode_only=True))
    (p,) = parse_spec(entry(prefill_only=True))
    (n,) = parse_spec(entry(norm=True, decode_only=False, prefill_only=False))
    assert d.phase is Phase.DECODE and not d.norm
    assert p.phase is Phase.PREFILL
    assert n.phase is Phase.ALL and n.norm


def test_id_charset_and_max_length():
    (e,) = parse_spec(entry(id="A-z_0.9"))
    assert e.vector_id == "A-z_0.9"
    (e,) = parse_spec(entry(id="x" * 64))
    assert e.vector_id == "x" * 64


def test_max_entries_accepted():
    assert len(parse_spec([BASE] * MAX_ENTRIES)) == MAX_ENTRIES


# -- canonical form ------------------------------------------------------------------------------------------


def test_canonical_stable_across_key_order_and_forms():
    a = {"id": "happy", "layer": [12, 10], "scale": 4, "decode_only": True}
    b = {"decode_only": True, "scale": 4.0, "layer": [10, 12], "id": "happy", "prefill_only": False, "norm": False}
    ca = canonical_spec(parse_spec(a))
    assert ca == canonical_spec(parse_spec(b))
    assert ca == canonical_spec(parse_spec(json.dumps(b)))
    assert ca == canonical_spec(parse_spec([a]))
    assert ca == '[{"decode_only":true,"id":"happy","layer":[10,12],"scale":4.0}]'


def test_canonical_differs_for_different_specs():
    base = canonical_spec(parse_spec(BASE))
    for other in (entry(scale=2.6), entry(layer=4), entry(id="sad"), entry(norm=True), entry(decode_only=True),
                  entry(prefill_only=True), entry(layer=[3, 4])):
        assert canonical_spec(parse_spec(other)) != base, other


def test_canonical_keeps_entry_order():
    a, b = entry(id="a"), entry(id="b")
    assert canonical_spec(parse_spec([a, b])) != canonical_spec(parse_spec([b, a]))


def test_to_json_round_trip():
    entries = parse_spec([entry(decode_only=True, norm=True), entry(id="x", layer=[5, 1], prefill_only=True)])
    assert parse_spec([e.to_json() for e in entries]) == entries


def test_build_spec_round_trip():
    s = build_spec({"id": "happy", "layer": 10, "scale": 4.0})
    assert s == '[{"id":"happy","layer":[10],"scale":4.0}]'
    assert parse_spec(s) == (SteeringEntry("happy", (10,), 4.0),)
    two = build_spec(entry(norm=True), entry(id="b", layer=[2, 1], decode_only=True))
    assert build_spec(*json.loads(two)) == two
    assert parse_spec(two)[1] == SteeringEntry("b", (1, 2), 2.5, Phase.DECODE, False)


def test_build_spec_validates():
    with pytest.raises(SpecError) as info:
        build_spec(BASE, entry(scale="x"))
    assert info.value.field == "hotwire[1].scale"


# -- rejections ----------------------------------------------------------------------------------------------


def test_bad_json():
    err = spec_error('{"id": "a",')
    assert err.field == SPEC_KEY and "not valid JSON" in err.message
    assert str(err).startswith("hotwire: ")


@pytest.mark.parametrize("value", [42, 1.5, None, True, '"a string"', "3", "null"])
def test_not_object_or_list(value):
    assert spec_error(value).field == SPEC_KEY


def test_empty_list():
    err = spec_error([])
    assert err.field == SPEC_KEY and "empty" in err.message
    assert spec_error("[]").field == SPEC_KEY


def test_list_entry_not_object():
    assert spec_error([BASE, 5]).field == "hotwire[1]"
    assert spec_error([[BASE]]).field == "hotwire[0]"


def test_unknown_field():
    assert spec_error(entry(bogus=1)).field == "hotwire.bogus"
    assert spec_error([BASE, entry(zzz=1, aaa=2)]).field == "hotwire[1].aaa"


@pytest.mark.parametrize("missing", ["id", "layer", "scale"])
def test_missing_required(missing):
    raw = dict(BASE)
    del raw[missing]
    assert spec_error(raw).field == f"hotwire.{missing}"
    err = spec_error([BASE, BASE, raw])
    assert err.field == f"hotwire[2].{missing}" and "required" in err.message


@pytest.mark.parametrize("bad", ["", "x" * 65, "has space", "slash/id/x", "/id", "id/", "é", "a:b", 5, None, ["a"]])
def test_bad_id(bad):
    assert spec_error([BASE, entry(id=bad)]).field == "hotwire[1].id"


def test_id_with_trailing_newline_rejected():
    assert spec_error(entry(id="abc\n")).field == "hotwire.id"


@pytest.mark.parametrize("bad", [-1, [1, -2], True, [False], 1.0, "3", [], [1, 1], [2, "x"], None])
def test_bad_layer(bad):
    assert spec_error([BASE, entry(layer=bad)]).field == "hotwire[1].layer"


def test_duplicate_layer_message():
    assert "twice" in spec_error(entry(layer=[4, 2, 4])).message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), True, False, "1.0", None, [1.0]])
def test_bad_scale(bad):
    assert spec_error([BASE, entry(scale=bad)]).field == "hotwire[1].scale"


def test_nan_inf_scale_from_json_string():
    # Python's json accepts the NaN / Infinity / 1e400 extensions: they must still be refused.
    for literal in ("NaN", "Infinity", "-Infinity", "1e400"):
        err = spec_error('{"id": "a", "layer": 1, "scale": %s}' % literal)
        assert err.field == "hotwire.scale", literal


def test_huge_int_scale_is_spec_error():
    err = spec_error('{"id": "a", "layer": 1, "scale": %s}' % ("9" * 400))
    assert err.field == "hotwire.scale" and "too large for a float (about 2**1329)" in err.message
    # a dict spec (offline) is not limited by JSON's digit count: still a spec error, not a ValueError of its own
    assert spec_error({"id": "a", "layer": 1, "scale": 10**5000}).field == "hotwire.scale"


def test_scale_outside_float32_is_spec_error():
    # the per-token scale table is float32: 1e39 would silently become inf there
    for literal in ("1e39", "-1e39", "3.5e38"):
        err = spec_error('{"id": "a", "layer": 1, "scale": %s}' % literal)
        assert err.field == "hotwire.scale" and "float32" in err.message, literal
    assert parse_spec('{"id": "a", "layer": 1, "scale": -3.4e38}')[0].scale == -3.4e38
    # the edge is where float32 rounds to inf: 2**128 - 2**103 (3.4028235677973366e38) and above are refused
    import math

    edge = 2.0**128 - 2.0**103
    for value in (edge, -edge):
        assert "float32" in spec_error('{"id": "a", "layer": 1, "scale": %r}' % value).message
    below = math.nextafter(edge, 0)
    assert parse_spec('{"id": "a", "layer": 1, "scale": %r}' % below)[0].scale == 3.4028235e38


def test_scales_that_steer_alike_canonicalise_alike():
    """The scale table is float32: a scale is taken as its float32 value, written with the fewest digits."""
    import numpy as np

    as_float32 = build_spec({"id": "a", "layer": 1, "scale": np.float32(0.1)})
    assert as_float32 == build_spec({"id": "a", "layer": 1, "scale": 0.1}) == '[{"id":"a","layer":[1],"scale":0.1}]'
    # digits float32 cannot hold are dropped: 0.1 + 1e-12 is float32's 0.1 too
    assert parse_spec('{"id": "a", "layer": 1, "scale": 0.100000000001}')[0].scale == 0.1
    assert parse_spec('{"id": "a", "layer": 1, "scale": 0.123456789}')[0].scale == 0.12345679
    # float32's largest value canonicalises to 3.4028235e38, a little above it as a float64: still accepted
    biggest = parse_spec('{"id": "a", "layer": 1, "scale": 3.4028234663852886e38}')[0]
    assert biggest.scale == 3.4028235e38 and parse_spec(canonical_spec((biggest,))) == (biggest,)
    # -0.0, and a negative scale float32 cannot tell from 0, steer as 0 does
    for literal in ("-0.0", "-1e-46", "0.0"):
        assert build_spec({"id": "a", "layer": 1, "scale": float(literal)}) == '[{"id":"a","layer":[1],"scale":0.0}]'


def test_large_int_scale_within_float_range_is_accepted():
    # 2**53 and above are not exact as floats, but they are finite numbers like 1e20: same value, same entry
    assert parse_spec('{"id": "a", "layer": 1, "scale": 100000000000000000000}') == parse_spec(
        '{"id": "a", "layer": 1, "scale": 1e20}'
    )


@pytest.mark.parametrize(
    "text,words",
    [
        ("[" * 30_000 + "]" * 30_000, "nests too deeply"),  # deeper than Python's stack
        ('{"id": "a", "layer": 1, "scale": %s}' % ("9" * 5000), "too many digits"),  # Python's int-string limit
    ],
)
def test_json_python_cannot_read_is_spec_error(text, words):
    """Not a ValueError/RecursionError escaping to the engine: a spec error naming the field, so a 400."""
    err = spec_error(text)
    assert err.field == SPEC_KEY and words in err.message


def test_decode_and_prefill_only_exclusive():
    err = spec_error([BASE, entry(decode_only=True, prefill_only=True)])
    assert err.field == "hotwire[1].decode_only" and "exclude" in err.message


@pytest.mark.parametrize("flag", ["decode_only", "prefill_only", "norm"])
@pytest.mark.parametrize("bad", [1, 0, "true", None])
def test_non_bool_flags(flag, bad):
    assert spec_error([BASE, entry(**{flag: bad})]).field == f"hotwire[1].{flag}"


def test_too_many_entries():
    err = spec_error([BASE] * (MAX_ENTRIES + 1))
    assert err.field == SPEC_KEY and str(MAX_ENTRIES) in err.message


def test_first_error_wins():
    err = spec_error([BASE, entry(scale="x"), entry(id="")])
    assert err.field == "hotwire[1].scale"


def test_spec_error_is_value_error():
    err = spec_error({})
    assert isinstance(err, ValueError)
    assert err.field == "hotwire.id"


def test_build_spec_takes_numpy_and_torch_numbers():
    import numpy as np

    assert build_spec({"id": "a", "layer": np.int64(3), "scale": np.float32(2)}) == '[{"id":"a","layer":[3],"scale":2.0}]'
    assert build_spec({"id": "a", "layer": np.array([3, 1]), "scale": torch.tensor(2.5)}) == (
        '[{"id":"a","layer":[1,3],"scale":2.5}]'
    )
    assert build_spec({"id": "a", "layer": (1, 2), "scale": 1}) == build_spec({"id": "a", "layer": range(1, 3), "scale": 1})
    for bad in (
        {"layer": np.array([True])},
        {"layer": [torch.tensor(True)]},  # a bool tensor has __index__, but it is not a layer
        {"layer": [np.True_, 2]},
        {"layer": torch.tensor([1.5])},
        {"scale": np.array([1.0, 2.0])},
    ):
        with pytest.raises(SpecError):
            build_spec({"id": "a", "layer": 1, "scale": 1.0, **bad})


def test_a_spec_longer_than_the_limit_is_refused_before_parsing():
    from hotwire_core.spec import MAX_SPEC_CHARS

    padded = json.dumps(BASE) + " " * MAX_SPEC_CHARS
    err = spec_error(padded)
    assert err.field == SPEC_KEY and f"at most {MAX_SPEC_CHARS}" in err.message
    assert parse_spec(json.dumps(BASE) + " " * (MAX_SPEC_CHARS - len(json.dumps(BASE))))[0].vector_id == "happy"


def test_only_short_specs_and_salts_are_cached():
    """The caches keep their keys, which clients choose: a padded spec or a long cache salt is computed, not kept."""
    from hotwire_core import admission, spec as spec_module

    spec_module._parse_cached.cache_clear()
    admission._salt.cache_clear()
    short = json.dumps(BASE)
    long = short + " " * 5000  # valid, but past the cached length
    assert parse_spec(long) == parse_spec(short)
    assert spec_module._parse_cached.cache_info().currsize == 1

    class Vector:
        sha256 = "ab" * 32

    resolved = [(e, Vector()) for e in parse_spec(short)]
    salts = {admission.cache_salt(salt, resolved, 3) for salt in (None, "u", "x" * 10_000)}
    assert len(salts) == 3 and admission._salt.cache_info().currsize == 2


@pytest.mark.parametrize("bad", [".", "..", "...", ".hidden", "-flag", "", "a" * 65, "a/b/c", "../a", "a/..", "a b"])
def test_ids_that_could_name_other_files_are_refused(bad):
    assert spec_error(entry(id=bad)).field == "hotwire.id"


@pytest.mark.parametrize("good", ["_healthcheck", "a..b", "v1.2-x_", "_.."])
def test_ids_with_inner_dots_are_fine(good):
    assert parse_spec(entry(id=good))[0].vector_id == good


def test_errors_quote_what_a_client_sent_briefly():
    """A refusal may be kept (the engine keeps refusals per ticket) and is sent back: it must not echo megabytes."""
    huge = [0.5] * 100_000
    err = spec_error(entry(layer=huge))
    assert len(err.message) < 300 and "characters)" in err.message
    err = spec_error({**BASE, "x" * 100_000: 1})
    assert len(err.field) < 100
