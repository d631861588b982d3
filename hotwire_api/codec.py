"""Decode a vector upload (safetensors or JSON) into the bytes, dtype, shape and layers that ``hotwire_register``
takes, checking everything that can be checked without the model.

Accepted formats (shapes ``[hidden]``, ``[n_layers, hidden]`` or ``[len(layers), hidden]``):

* multipart form (``hotwire_api.forms``): ``id``, ``file`` (safetensors with one tensor, or 1-D tensors named by
  layer index ``"10"``, ``"12"``...), optional ``layers`` (``10,12`` or ``[10, 12]``) naming the rows of a single
  tensor; or ``file`` a control-vector GGUF (``hotwire_api.gguf_codec``), or an SAE feature
  (``hotwire_api.sae_codec``);
* JSON ``{"id", "data": <base64 little-endian>, "dtype", "shape", "layers"?}``;
* JSON ``{"id", "layers": {"<layer>": [floats...]}}`` (stored as float32).

Only safetensors, GGUF and JSON are parsed: bytes from the network never reach pickle or ``torch.load``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import re
from collections.abc import AsyncIterable, Mapping
from typing import Any, Literal

import numpy as np
import safetensors
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, field_validator, model_validator

from hotwire_api.errors import HotwireError
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import VECTOR_ID_RE, short_repr
from hotwire_core.vector_bits import ITEMSIZE, as_bits, non_finite

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' names -> ours
_LAYER_NAME_RE = re.compile(r"[0-9]{1,6}")
ID_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, not starting with . or -"
CONVERT_HINT = (
    "convert it first, e.g. safetensors.torch.save_file({'vector': tensor.contiguous()}, 'vector.safetensors')"
)


@dataclasses.dataclass(frozen=True)
class VectorPayload:
    """What ``hotwire_register`` takes after the id: row-major little-endian ``data`` of ``dtype`` and
    ``shape``; ``layers`` names the rows (None: one row per model layer, or one row usable at any layer)."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]
    layers: tuple[int, ...] | None
    # The request field the values came from ("data", "file" or "layers"): the engine's checks name the base64
    # upload's fields (data, shape, dtype), and the answer should name what the client sent.
    source: str = dataclasses.field(default="data", compare=False)
    # The file format the values came in ("gguf", "sae"; "" for the others): registration checks those against
    # the served model before the engine does, to name the tensors the file holds (hotwire_api.forms).
    kind: str = dataclasses.field(default="", compare=False)


def _bad(field: str | None, message: str, code: ErrorCode) -> HotwireError:
    return HotwireError(400, code, message, field)


def too_large(limit: int) -> HotwireError:
    """The 413 for a body over ``limit`` bytes."""
    return HotwireError(
        413,
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the upload is larger than HOTWIRE_MAX_UPLOAD_MB ({limit / 2**20:g} MB); send float16/bfloat16 or only "
        "the layers you steer, or raise HOTWIRE_MAX_UPLOAD_MB on the server",
    )


async def read_limited(chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """Join ``chunks``, failing with 413 as soon as more than ``limit`` bytes have arrived."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            raise too_large(limit)
    return bytes(buf)


def validate_id(value: object) -> str:
    """A vector id: 1-64 characters of ``A-Z a-z 0-9 . _ -``, the first no dot or dash."""
    if value is None or value == "":
        raise _bad("id", f"is required: name the vector ({ID_RULE})", ErrorCode.BAD_ID)
    if not isinstance(value, str) or not VECTOR_ID_RE.fullmatch(value):
        raise _bad("id", f"must be {ID_RULE}, got {short_repr(value)}", ErrorCode.BAD_ID)
    return value


def parse_layer_list(value: object, field: str = "layers") -> tuple[int, ...] | None:
    """Layer indices from a JSON list or a form string (``10,12`` or ``[10, 12]``); None when absent."""
    if value is None or value == "":
        return None
    parsed = value
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = json.loads(text) if text.startswith("[") else [int(part) for part in text.split(",")]
        except (ValueError, RecursionError):
            raise _bad(field, f"must be layer indices like 10,12 or [10, 12], got {short_repr(value)}",
                       ErrorCode.BAD_LAYERS) from None
    if (
        not isinstance(parsed, list)
        or not parsed
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in parsed)
    ):
        raise _bad(field, f"must be a non-empty list of non-negative layer indices, got {short_repr(value)}",
                   ErrorCode.BAD_LAYERS)
    if len(set(parsed)) != len(parsed):
        raise _bad(field, f"lists a layer twice: {parsed}", ErrorCode.BAD_LAYERS)
    return tuple(parsed)


def _dtype(value: object, field: str) -> str:
    if not isinstance(value, str) or value not in ITEMSIZE:
        raise _bad(field, f"unsupported dtype {short_repr(value)}; use one of {', '.join(ITEMSIZE)}",
                   ErrorCode.BAD_DTYPE)
    return value


def _shape(value: object, field: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) not in (1, 2)
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
    ):
        raise _bad(
            field,
            f"shape must be [hidden], [n_layers, hidden] or [len(layers), hidden] with positive sizes, got {short_repr(value)}",
            ErrorCode.BAD_SHAPE,
        )
    return tuple(value)


def _check_finite(data: bytes, dtype: str, width: int, field: str) -> None:
    bad = non_finite(as_bits(data, dtype), dtype)
    if bad.size:
        row, col = divmod(int(bad[0]), width)
        raise _bad(
            field,
            f"holds {bad.size} NaN or infinite values (first at row {row}, column {col}); every value must be finite",
            ErrorCode.NOT_FINITE,
        )


def finish_payload(
    data: bytes, dtype: str, shape: tuple[int, ...], layers: tuple[int, ...] | None, field: str, kind: str = ""
) -> VectorPayload:
    """The payload of decoded values, after the checks every format shares (size, layers against rows, finite)."""
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if len(data) != expected:
        raise _bad(field, f"has {len(data)} bytes but shape {list(shape)} of {dtype} needs {expected}",
                   ErrorCode.BAD_DATA)
    if layers is not None:
        if len(shape) == 1:
            if len(layers) != 1:
                raise _bad(
                    "layers",
                    f"names {len(layers)} layers but the vector is 1-D; send a [len(layers), hidden] tensor, "
                    "or omit layers to use the vector at any layer",
                    ErrorCode.BAD_LAYERS,
                )
            shape = (1, shape[0])
        elif shape[0] != len(layers):
            raise _bad("layers", f"names {len(layers)} layers but the tensor has {shape[0]} rows", ErrorCode.BAD_LAYERS)
    _check_finite(data, dtype, shape[-1], field)
    return VectorPayload(data, dtype, shape, layers, field, kind)


def decode_safetensors(raw: bytes, layers: tuple[int, ...] | None = None, field: str = "file") -> VectorPayload:
    """A safetensors file holding one tensor (``layers`` optionally naming its rows), or 1-D tensors named
    by layer index."""
    try:
        tensors = safetensors.deserialize(raw)
    except Exception as exc:  # safetensors raises its own SafetensorError and, for some inputs, others
        raise _bad(
            field,
            f"is not a safetensors file ({exc}); the API reads safetensors, GGUF control vectors or JSON only, never pickles: {CONVERT_HINT}",
            ErrorCode.BAD_FILE,
        ) from None
    if not tensors:
        raise _bad(field, "holds no tensors", ErrorCode.BAD_FILE)

    def dtype_of(name: str, info: Mapping[str, object]) -> str:
        dtype = SAFETENSORS_DTYPES.get(str(info["dtype"]))
        if dtype is None:
            raise _bad(
                field,
                f"tensor {name!r} has dtype {info['dtype']}; use float32 (F32), float16 (F16) or bfloat16 (BF16)",
                ErrorCode.BAD_DTYPE,
            )
        return dtype

    if all(_LAYER_NAME_RE.fullmatch(name) for name, _ in tensors):
        if layers is not None:
            raise _bad("layers", "must be omitted: the file names its tensors by layer index", ErrorCode.BAD_LAYERS)
        rows = sorted((int(name), name, info) for name, info in tensors)
        if len({layer for layer, _, _ in rows}) != len(rows):
            raise _bad(field, f"names a layer twice: {[name for _, name, _ in rows]}", ErrorCode.BAD_LAYERS)
        _, first_name, first = rows[0]
        dtype, hidden_shape = dtype_of(first_name, first), list(first["shape"])
        for _, name, info in rows:
            if dtype_of(name, info) != dtype:
                raise _bad(field, f"tensor {name!r} has dtype {info['dtype']}; all layers need one dtype",
                           ErrorCode.BAD_DTYPE)
            if len(info["shape"]) != 1 or list(info["shape"]) != hidden_shape:
                raise _bad(
                    field,
                    f"tensor {name!r} has shape {info['shape']}; tensors named by layer must all be 1-D "
                    f"[hidden] of one size ({first_name!r} is {hidden_shape})",
                    ErrorCode.BAD_SHAPE,
                )
        data = b"".join(bytes(info["data"]) for _, _, info in rows)
        shape = _shape([len(rows), *hidden_shape], field)
        return finish_payload(data, dtype, shape, tuple(layer for layer, _, _ in rows), field)

    if len(tensors) != 1:
        names = sorted(name for name, _ in tensors)
        raise _bad(
            field,
            f"holds {len(tensors)} tensors {names[:8]}; send one tensor, or name each 1-D tensor by its layer index "
            '("10", "12", ...)',
            ErrorCode.BAD_FILE,
        )
    name, info = tensors[0]
    dtype = dtype_of(name, info)
    return finish_payload(bytes(info["data"]), dtype, _shape(list(info["shape"]), field), layers, field)


def _decode_layer_lists(rows: Mapping[str, object]) -> VectorPayload:
    if not rows:
        raise _bad("layers", "is empty: give at least one layer", ErrorCode.BAD_LAYERS)
    arrays: dict[int, np.ndarray] = {}
    for key, values in rows.items():
        field = f"layers.{key}"
        if not _LAYER_NAME_RE.fullmatch(key):
            raise _bad("layers", f'keys must be layer indices like "10", got {short_repr(key)}', ErrorCode.BAD_LAYERS)
        if int(key) in arrays:
            raise _bad("layers", f"names layer {int(key)} twice", ErrorCode.BAD_LAYERS)
        if (
            not isinstance(values, list)
            or not values
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values)
        ):
            raise _bad(field, "must be a non-empty list of numbers", ErrorCode.BAD_DATA)
        try:
            with np.errstate(over="ignore"):
                row = np.asarray(values, dtype=np.float64).astype("<f4")
        except OverflowError:  # an integer beyond float64
            raise _bad(field, "holds an integer too large for a float; every value must be finite",
                       ErrorCode.NOT_FINITE) from None
        if not np.isfinite(row).all():
            index = int(np.flatnonzero(~np.isfinite(row))[0])
            raise _bad(field, f"value {index} is NaN or infinite in float32; every value must be finite",
                       ErrorCode.NOT_FINITE)
        if arrays and row.size != next(iter(arrays.values())).size:
            first = next(iter(rows))
            raise _bad(
                field,
                f"has {row.size} values but layers.{first} has {next(iter(arrays.values())).size}; "
                "every layer needs hidden_size values",
                ErrorCode.BAD_SHAPE,
            )
        arrays[int(key)] = row
    layers = tuple(sorted(arrays))
    data = np.stack([arrays[layer] for layer in layers]).tobytes()
    return finish_payload(data, "float32", (len(layers), arrays[layers[0]].size), layers, "layers")


class RegisterVectorJSON(BaseModel):
    """JSON body of ``POST /steer/vectors``: either base64 ``data`` with ``dtype`` and ``shape`` (``layers``
    optionally naming the rows), or per-layer float lists in ``layers`` (stored as float32).

    The one definition of that body: its fields are the OpenAPI schema, and its validators are the checks
    registration runs (:func:`decode_json`), each refusal naming its field and error code."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=f"^{VECTOR_ID_RE.pattern}$")
    # check_data decodes it once and keeps the bytes (the schema is the base64 string).
    data: SkipValidation[str | None] = Field(None, description="Base64 of the raw little-endian values, row-major.")
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    shape: list[int] | None = Field(None, description="[hidden], [n_layers, hidden] or [len(layers), hidden].")
    # Checked by check_layers alone: pydantic would copy every float list of a large upload once more.
    layers: SkipValidation[list[int] | dict[str, list[float]] | None] = Field(
        None, description='Layer indices naming the rows of `data`, or {"<layer>": [floats...]}.'
    )

    @model_validator(mode="before")
    @classmethod
    def check_object(cls, obj: Any) -> Any:
        if not isinstance(obj, dict):
            raise _bad(None, "the body must be a JSON object", ErrorCode.BAD_BODY)
        for name in obj:
            if name == "replace":
                raise _bad(name, "is a query parameter, not a body field: POST /steer/vectors?replace=true",
                           ErrorCode.BAD_BODY)
            if name not in cls.model_fields:
                raise _bad(name, f"unknown field; allowed: {', '.join(cls.model_fields)}", ErrorCode.BAD_BODY)
        validate_id(obj.get("id"))
        if isinstance(obj.get("layers"), dict):
            for name in ("data", "dtype", "shape"):
                if name in obj:
                    raise _bad(name, 'cannot be combined with per-layer float lists; send {"id", "layers": '
                               '{"<layer>": [...]}} or {"id", "data", "dtype", "shape", "layers"?}', ErrorCode.BAD_BODY)
            return obj
        for name in ("data", "dtype", "shape"):
            if name not in obj:
                raise _bad(name, 'is required: send base64 "data" with "dtype" and "shape", or per-layer float lists '
                           'as "layers": {"<layer>": [...]}', ErrorCode.BAD_BODY)
        return obj

    @field_validator("data", mode="before")
    @classmethod
    def check_data(cls, value: Any) -> Any:
        try:
            if not isinstance(value, str):
                raise ValueError
            return base64.b64decode(value, validate=True)
        except (ValueError, binascii.Error):
            raise _bad("data", "must be a base64 string of the raw little-endian values", ErrorCode.BAD_DATA) from None

    @field_validator("dtype", mode="before")
    @classmethod
    def check_dtype(cls, value: Any) -> Any:
        return _dtype(value, "dtype")

    @field_validator("shape", mode="before")
    @classmethod
    def check_shape(cls, value: Any) -> Any:
        return list(_shape(value, "shape"))

    @field_validator("layers", mode="before")
    @classmethod
    def check_layers(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return _decode_layer_lists(value)
        if isinstance(value, str):  # a form field's text form; JSON has lists
            raise _bad("layers", f"must be a list of layer indices like [10, 12] or per-layer float lists, got "
                       f"{short_repr(value)}", ErrorCode.BAD_LAYERS)
        layers = parse_layer_list(value)
        return None if layers is None else list(layers)

    def payload(self) -> VectorPayload:
        if isinstance(self.layers, VectorPayload):  # per-layer float lists, decoded by check_layers
            return self.layers
        layers = None if self.layers is None else tuple(self.layers)
        return finish_payload(self.data, self.dtype, tuple(self.shape), layers, "data")


def decode_json(obj: object) -> tuple[str, VectorPayload]:
    """A JSON upload, validated by :class:`RegisterVectorJSON`."""
    try:
        body = RegisterVectorJSON.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        error = first.get("ctx", {}).get("error")
        if isinstance(error, HotwireError):
            raise error from None
        field = ".".join(str(part) for part in first["loc"]) or None
        raise _bad(field, first["msg"], ErrorCode.BAD_BODY) from None
    return body.id, body.payload()
