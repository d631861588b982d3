"""hotwire_api.codec: every accepted upload format decodes to the right bytes/dtype/shape/layers; bad input
is refused with the right status, code and field."""

from __future__ import annotations

import asyncio
import base64
import math
import time

import numpy as np
import pytest
from safetensors.numpy import save as save_numpy

from hotwire_api.codec import (
    VectorPayload,
    decode_json,
    decode_safetensors,
    parse_layer_list,
    read_limited,
    validate_id,
)
from hotwire_api.errors import HotwireError
from hotwire_api.forms import decode_form

HIDDEN = 8


def _bf16(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes by truncation (exact for the values used here)."""
    return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()


def _refused(call, *args, status: int = 400) -> HotwireError:
    with pytest.raises(HotwireError) as info:
        call(*args)
    assert info.value.status == status, info.value
    return info.value


# ---- accepted formats round-trip --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(HIDDEN,), (3, HIDDEN)])
def test_json_base64_round_trips(dtype: str, shape: tuple[int, ...]) -> None:
    array = np.arange(math.prod(shape), dtype=dtype).reshape(shape) / 7
    body = {"id": "happy", "data": base64.b64encode(array.tobytes()).decode(), "dtype": dtype, "shape": list(shape)}
    vector_id, payload = decode_json(body)
    assert vector_id == "happy"
    assert payload == VectorPayload(array.tobytes(), dtype, shape, None) and payload.source == "data"


def test_json_base64_bfloat16_with_layers() -> None:
    raw = _bf16(np.ones((2, HIDDEN), np.float32) * 1.5)
    body = {
        "id": "a.b-c_1",
        "data": base64.b64encode(raw).decode(),
        "dtype": "bfloat16",
        "shape": [2, HIDDEN],
        "layers": [12, 3],
    }
    _, payload = decode_json(body)
    assert payload == VectorPayload(raw, "bfloat16", (2, HIDDEN), (12, 3))  # row order follows `layers`


def test_json_one_row_with_one_layer_becomes_a_layer_row() -> None:
    raw = np.ones(HIDDEN, np.float32).tobytes()
    _, payload = decode_json(
        {"id": "v", "data": base64.b64encode(raw).decode(), "dtype": "float32", "shape": [HIDDEN], "layers": [5]}
    )
    assert payload.shape == (1, HIDDEN) and payload.layers == (5,)


def test_json_per_layer_lists_round_trip_as_float32() -> None:
    rows = {"10": [0.5] * HIDDEN, "2": list(range(HIDDEN))}
    _, payload = decode_json({"id": "v", "layers": rows})
    expected = np.stack([np.arange(HIDDEN, dtype="<f4"), np.full(HIDDEN, 0.5, "<f4")]).tobytes()
    assert payload == VectorPayload(expected, "float32", (2, HIDDEN), (2, 10)) and payload.source == "layers"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_safetensors_single_tensor(dtype: str) -> None:
    array = np.linspace(-1, 1, 4 * HIDDEN, dtype=dtype).reshape(4, HIDDEN)
    payload = decode_safetensors(save_numpy({"steer": array}))
    assert payload == VectorPayload(array.tobytes(), dtype, (4, HIDDEN), None)


def test_safetensors_single_tensor_with_layers_form_field() -> None:
    array = np.ones((2, HIDDEN), np.float32)
    vector_id, payload = decode_form({"id": "v", "file": save_numpy({"x": array}), "layers": "7, 9"})
    assert vector_id == "v" and payload == VectorPayload(array.tobytes(), "float32", (2, HIDDEN), (7, 9))
    assert payload.source == "file"  # what an engine refusal of the values names


def test_safetensors_tensors_named_by_layer_stack_in_layer_order() -> None:
    rows = {"12": np.full(HIDDEN, 2, np.float16), "3": np.full(HIDDEN, 1, np.float16)}
    payload = decode_safetensors(save_numpy(rows))
    assert payload == VectorPayload(rows["3"].tobytes() + rows["12"].tobytes(), "float16", (2, HIDDEN), (3, 12))


def test_safetensors_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    tensor = torch.arange(HIDDEN, dtype=torch.bfloat16)
    payload = decode_safetensors(save({"v": tensor}))
    assert payload == VectorPayload(tensor.view(torch.int16).numpy().tobytes(), "bfloat16", (HIDDEN,), None)


@pytest.mark.parametrize("value,expected", [("1,2", (1, 2)), ("[4, 0]", (4, 0)), ([3], (3,)), ("", None), (None, None)])
def test_parse_layer_list(value: object, expected: tuple[int, ...] | None) -> None:
    assert parse_layer_list(value) == expected


def test_parse_layer_list_refuses_what_json_cannot_read() -> None:
    assert _refused(parse_layer_list, "[" * 100_000).code == "bad_layers"  # a RecursionError in json, not a 500


# ---- refusals ---------------------------------------------------------------------------------------------


def _json(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "id": "v",
        "data": base64.b64encode(np.ones(HIDDEN, "<f4").tobytes()).decode(),
        "dtype": "float32",
        "shape": [HIDDEN],
    }
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("bad_id", ["", "a b", "x" * 65, "naïve", "a/b/c", "abc\n", 7])
def test_bad_ids(bad_id: object) -> None:
    err = _refused(validate_id, bad_id)
    assert (err.field, err.code) == ("id", "bad_id")
    assert _refused(decode_json, _json(id=bad_id)).field == "id"


@pytest.mark.parametrize("dtype", ["float64", "int8", "F32", None, 3])
def test_bad_dtype(dtype: object) -> None:
    body = _json(dtype=dtype) if dtype is not None else {**_json(), "dtype": None}
    err = _refused(decode_json, body)
    assert (err.field, err.code) == ("dtype", "bad_dtype")


def test_safetensors_bad_dtype() -> None:
    err = _refused(decode_safetensors, save_numpy({"v": np.ones(HIDDEN, np.float64)}))
    assert (err.field, err.code) == ("file", "bad_dtype") and "F64" in err.message


@pytest.mark.parametrize("shape", [[], [2, 2, 2], [0], [-8], [HIDDEN, 0], "8", [True], [8.0]])
def test_bad_shape(shape: object) -> None:
    err = _refused(decode_json, _json(shape=shape))
    assert (err.field, err.code) == ("shape", "bad_shape")


def test_shape_and_data_size_disagree() -> None:
    err = _refused(decode_json, _json(shape=[2, HIDDEN]))
    assert (err.field, err.code) == ("data", "bad_data") and "needs 64" in err.message


def test_safetensors_3d_tensor_refused() -> None:
    err = _refused(decode_safetensors, save_numpy({"v": np.ones((2, 2, HIDDEN), np.float32)}))
    assert (err.field, err.code) == ("file", "bad_shape")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_non_finite_refused(bad: float, dtype: str) -> None:
    array = np.ones((2, HIDDEN), dtype)
    array[1, 3] = bad
    err = _refused(decode_json, _json(data=base64.b64encode(array.tobytes()).decode(), dtype=dtype, shape=[2, HIDDEN]))
    assert (err.field, err.code) == ("data", "not_finite") and "row 1, column 3" in err.message
    err = _refused(decode_safetensors, save_numpy({"v": array}))
    assert (err.field, err.code) == ("file", "not_finite")


@pytest.mark.parametrize("bits", [0x7FC0, 0x7F80, 0xFF80])  # NaN, +inf, -inf
def test_non_finite_bfloat16_refused(bits: int) -> None:
    raw = bytearray(_bf16(np.ones(HIDDEN, np.float32)))
    raw[4:6] = bits.to_bytes(2, "little")
    err = _refused(decode_json, _json(data=base64.b64encode(bytes(raw)).decode(), dtype="bfloat16"))
    assert err.code == "not_finite" and "column 2" in err.message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e39, 10**400])  # 1e39: float32; 10**400: float64
def test_non_finite_per_layer_list_refused(value: float) -> None:
    row = [0.0] * HIDDEN
    row[5] = value
    err = _refused(decode_json, {"id": "v", "layers": {"4": row}})
    assert (err.field, err.code) == ("layers.4", "not_finite")


@pytest.mark.parametrize(
    "layers,field",
    [
        ({"x": [1.0] * HIDDEN}, "layers"),
        ({"1": [1.0] * HIDDEN, "01": [1.0] * HIDDEN}, "layers"),
        ({"1": []}, "layers.1"),
        ({"1": ["a"] * HIDDEN}, "layers.1"),
        ({"1": [True] * HIDDEN}, "layers.1"),
        ({"1": [1.0] * HIDDEN, "2": [1.0] * (HIDDEN + 1)}, "layers.2"),
        ({}, "layers"),
    ],
)
def test_bad_per_layer_lists(layers: dict[str, object], field: str) -> None:
    assert _refused(decode_json, {"id": "v", "layers": layers}).field == field


def test_per_layer_lists_exclude_data_fields() -> None:
    err = _refused(decode_json, {"id": "v", "layers": {"1": [1.0] * HIDDEN}, "dtype": "float16"})
    assert err.field == "dtype"


@pytest.mark.parametrize(
    "layers,shape",
    [([1, 2], [HIDDEN]), ([1, 2, 3], [2, HIDDEN]), ([1, 1], [2, HIDDEN]), ([-1, 2], [2, HIDDEN]), ("a,b", [2, HIDDEN])],
)
def test_layers_disagree_with_shape(layers: object, shape: list[int]) -> None:
    data = base64.b64encode(np.ones(shape, "<f4").tobytes()).decode()
    err = _refused(decode_json, _json(data=data, shape=shape, layers=layers))
    assert (err.field, err.code) == ("layers", "bad_layers")


def test_json_structure_errors() -> None:
    assert _refused(decode_json, [1, 2]).code == "bad_body"
    assert _refused(decode_json, _json(extra=1)).field == "extra"
    misplaced = _refused(decode_json, _json(replace=True))
    assert misplaced.field == "replace" and "?replace=true" in misplaced.message
    assert _refused(decode_json, _json(data="***")).field == "data"
    assert _refused(decode_json, {"id": "v", "dtype": "float32", "shape": [HIDDEN]}).field == "data"


def test_not_safetensors_is_refused_with_a_conversion_hint() -> None:
    pickle_like = b"\x80\x04\x95" + b"\x00" * 64  # a pickle header, as in torch.save output
    err = _refused(decode_safetensors, pickle_like)
    assert (err.field, err.code) == ("file", "bad_file")
    assert "never pickles" in err.message and "save_file" in err.message


def test_safetensors_structure_errors() -> None:
    two = save_numpy({"a": np.ones(HIDDEN, np.float32), "b": np.ones(HIDDEN, np.float32)})
    assert "name each 1-D tensor" in _refused(decode_safetensors, two).message
    by_layer = save_numpy({"1": np.ones(HIDDEN, np.float32)})
    assert _refused(decode_safetensors, by_layer, (1,)).field == "layers"
    ragged = save_numpy({"1": np.ones(HIDDEN, np.float32), "2": np.ones(HIDDEN + 1, np.float32)})
    assert _refused(decode_safetensors, ragged).code == "bad_shape"
    mixed = save_numpy({"1": np.ones(HIDDEN, np.float32), "2": np.ones(HIDDEN, np.float16)})
    assert _refused(decode_safetensors, mixed).code == "bad_dtype"


def test_form_structure_errors() -> None:
    file = save_numpy({"v": np.ones(HIDDEN, np.float32)})
    assert _refused(decode_form, {"id": "v"}).field == "file"
    assert _refused(decode_form, {"id": "v", "file": "not bytes"}).field == "file"
    assert _refused(decode_form, {"file": file}).field == "id"
    assert _refused(decode_form, {"id": "v", "file": file, "scale": "2"}).field == "scale"
    assert _refused(decode_form, {"id": "v", "file": file, "layers": b"1"}).field == "layers"


# ---- size limit -------------------------------------------------------------------------------------------


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


def test_read_limited_accepts_up_to_the_limit() -> None:
    assert asyncio.run(read_limited(_chunks(b"ab", b"cd"), 4)) == b"abcd"


def test_read_limited_refuses_oversize_while_reading() -> None:
    consumed = []

    async def chunks():
        for part in (b"abc", b"def", b"never read"):
            consumed.append(part)
            yield part

    with pytest.raises(HotwireError) as info:
        asyncio.run(read_limited(chunks(), 4))
    assert (info.value.status, info.value.code) == (413, "payload_too_large")
    assert "HOTWIRE_MAX_UPLOAD_MB" in info.value.message
    assert consumed == [b"abc", b"def"]  # stopped as soon as the limit was passed


# ---- large uploads are decoded away from the event loop ---------------------------------------------------


def _float_lists(layers: int, hidden: int) -> bytes:
    import json

    rows = {str(i): np.random.default_rng(i).standard_normal(hidden).astype(np.float32).tolist() for i in range(layers)}
    return json.dumps({"id": "big", "layers": rows}).encode()


def test_a_large_upload_decodes_in_another_process_without_stalling_the_loop() -> None:
    """A 20 MB list of floats takes the parser a quarter second or more; the loop must keep turning meanwhile."""
    from hotwire_api import uploads

    body = _float_lists(240, 4096)
    assert len(body) > 10 * uploads.INLINE_BYTES

    async def scenario() -> tuple[tuple[str, VectorPayload], float]:
        gaps, done = [], asyncio.Event()

        async def ticker() -> None:
            last = asyncio.get_running_loop().time()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = asyncio.get_running_loop().time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        decoded = await uploads.decode_upload("application/json", body, 1 << 30)
        done.set()
        await tick
        return decoded, max(gaps)

    (vector_id, payload), worst_gap = asyncio.run(scenario())
    began = time.monotonic()
    inline_id, inline = asyncio.run(uploads._decode("application/json", body, 1 << 30))
    inline_s = time.monotonic() - began  # what the loop would stall decoding it itself
    assert (vector_id, payload) == (inline_id, inline) and payload.data == inline.data
    assert payload.layers == tuple(range(240)) and payload.source == "layers"
    # 0.1 s, or half the inline decode on a machine so busy that the ticker itself waits that long for a core
    limit = max(0.1, inline_s / 2)
    assert worst_gap < limit, f"the event loop stalled {worst_gap * 1000:.0f} ms (inline decode {inline_s * 1000:.0f} ms)"


def test_a_large_upload_is_refused_from_the_other_process_as_it_would_be_in_place() -> None:
    from hotwire_api import uploads

    bad = _float_lists(200, 4096).replace(b'"id": "big"', b'"id": ".."')
    for decode in (uploads.decode_upload, uploads._decode):
        with pytest.raises(HotwireError) as info:
            asyncio.run(decode("application/json", bad, 1 << 30))
        assert (info.value.status, info.value.code, info.value.field) == (400, "bad_id", "id")
    with pytest.raises(HotwireError) as info:
        asyncio.run(uploads.decode_upload("application/json", b"[" * (2 << 20), 1 << 30))
    assert (info.value.status, info.value.code) == (400, "bad_body")
    boundary = "xyz"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\nv\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"v.safetensors\"\r\n\r\n").encode()
    array = np.arange(300_000, dtype=np.float32)
    form += save_numpy({"x": array}) + f"\r\n--{boundary}--\r\n".encode()
    assert len(form) > uploads.INLINE_BYTES
    vector_id, payload = asyncio.run(uploads.decode_upload(f"multipart/form-data; boundary={boundary}", form, 1 << 30))
    assert vector_id == "v" and payload.data == array.tobytes() and payload.source == "file"


@pytest.mark.parametrize(
    ("body", "accepted"),
    [
        (_json(), True),
        (_json(layers=[3]), True),
        ({"id": "v", "layers": {"1": [1.0] * HIDDEN, "4": [0.5] * HIDDEN}}, True),
        (_json(id="-v"), False),
        (_json(dtype="float64"), False),
        (_json(shape="8"), False),
        (_json(data=7), False),
        (_json(extra=1), False),
        (_json(layers="3"), False),  # a JSON body's layers are a list (a form's may be a string)
    ],
)
def test_the_advertised_json_schema_is_what_registration_accepts(body, accepted) -> None:
    """The OpenAPI schema of the JSON registration body is RegisterVectorJSON's, and RegisterVectorJSON is what
    decode_json validates with: a body the schema refuses is refused, one registration accepts fits the schema."""
    import jsonschema
    from fastapi import FastAPI

    from hotwire_api.codec import RegisterVectorJSON
    from hotwire_api.routes import router

    app = FastAPI()
    app.include_router(router)
    advertised = app.openapi()["paths"]["/steer/vectors"]["post"]["requestBody"]["content"]["application/json"]
    schema = advertised["schema"]  # RegisterVectorJSON's, as FastAPI writes it (without the null defaults)
    assert schema["description"] == RegisterVectorJSON.model_json_schema()["description"]
    assert set(schema["properties"]) == set(RegisterVectorJSON.model_fields) and schema["additionalProperties"] is False
    fits = jsonschema.Draft202012Validator(schema).is_valid(body)
    assert fits == accepted
    if accepted:
        assert decode_json(body)[0] == "v"
    else:
        assert _refused(decode_json, body).status == 400
