"""Control vectors as GGUF files, in (``decode_gguf``) and out (``encode_gguf``), and a registered vector as a
safetensors file that registers again unchanged (``encode_safetensors``).

The GGUF layout is the one llama.cpp's cvector-generator and repeng's ``ControlVector.export_gguf`` write:
``general.architecture = "controlvector"``, ``controlvector.model_hint`` and ``controlvector.layer_count``, and
one 1-D F32 tensor ``direction.N`` of width n_embd per layer. llama.cpp's loader (common.cpp,
``common_control_vector_load_one``) adds ``direction.N`` to the output of block N counting from 0 (``build_cvec``
after the feed-forward residual add: ``l_out``), which is hotwire's "after decoder layer N"; repeng writes its
0-based layer index as N (the output of ``model.layers[N]``). So N is taken as hotwire's layer as it is.

Reading: the file is parsed, never executed. Its header is first walked here with every count and length checked
against the bytes that are there, because ``gguf.GGUFReader`` trusts them (an array claiming 2**60 entries past
the end of the body loops without end); then ``gguf.GGUFReader`` reads it.
"""

from __future__ import annotations

import json
import re
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np

from hotwire_api.codec import SAFETENSORS_DTYPES, VectorPayload, finish_payload
from hotwire_api.errors import HotwireError
from hotwire_core.error_codes import ErrorCode
from hotwire_core.vector_bits import ITEMSIZE, as_bits, as_float32

__all__ = ["decode_gguf", "encode_gguf", "encode_safetensors", "is_gguf"]

ARCH = "controlvector"
_DIRECTION_RE = re.compile(r"direction\.([0-9]{1,6})")
_SCALAR_SIZES = {
    gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.UINT16: 2,
    gguf.GGUFValueType.INT16: 2, gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.INT32: 4,
    gguf.GGUFValueType.FLOAT32: 4, gguf.GGUFValueType.BOOL: 1, gguf.GGUFValueType.UINT64: 8,
    gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8,
}

_SAFETENSORS_NAMES = {ours: theirs for theirs, ours in SAFETENSORS_DTYPES.items()}


def _bad(message: str, code: ErrorCode = ErrorCode.BAD_FILE, field: str = "file") -> HotwireError:
    return HotwireError(400, code, message, field)


def is_gguf(raw: bytes) -> bool:
    """Whether ``raw`` starts as a GGUF file does (a safetensors file starts with its header's length instead)."""
    return raw[:4] == b"GGUF"


# A control vector holds a few metadata keys and one tensor per layer. gguf's reader builds several numpy views per
# key, tensor and array entry, so counts beyond these bounds (which no control vector needs) are refused before it
# runs: a 64 MB file of tiny array entries would otherwise cost it gigabytes and minutes.
MAX_KEYS, MAX_ARRAY_ENTRIES, MAX_TENSORS = 64, 1024, 1024


def _walk_header(raw: bytes) -> None:
    """Check that every count and length of the GGUF header fits in ``raw``, and the counts in the bounds above;
    raises 400 ``bad_file``."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n > len(raw) - pos:
            raise _bad("is cut short: its GGUF header claims more bytes than the file has")
        pos += n
        return raw[pos - n:pos]

    def string() -> None:
        take(struct.unpack("<Q", take(8))[0])

    def value(vtype: int, depth: int) -> None:
        if vtype in _SCALAR_SIZES:
            take(_SCALAR_SIZES[vtype])
        elif vtype == gguf.GGUFValueType.STRING:
            string()
        elif vtype == gguf.GGUFValueType.ARRAY and depth < 2:
            itype, count = struct.unpack("<IQ", take(12))
            if count * _SCALAR_SIZES.get(itype, 8) > len(raw) - pos:  # every entry takes at least 8 bytes
                raise _bad("is cut short: its GGUF header claims more bytes than the file has")
            if count > MAX_ARRAY_ENTRIES:
                raise _bad(f"holds a GGUF metadata array of {count} entries; a control vector needs none over "
                           f"{MAX_ARRAY_ENTRIES}")
            if itype in _SCALAR_SIZES:
                take(_SCALAR_SIZES[itype] * count)
            else:
                for _ in range(count):
                    value(itype, depth + 1)
        else:
            raise _bad(f"holds a GGUF metadata value of unknown type {vtype}")

    _, version = struct.unpack("<4sI", take(8))
    if version & 0xFFFF == 0:
        raise _bad("is a big-endian GGUF file; llama.cpp and repeng write little-endian ones, which hotwire reads")
    if version not in (2, 3):
        raise _bad(f"is GGUF version {version}; hotwire reads versions 2 and 3")
    n_tensors, n_kv = struct.unpack("<QQ", take(16))
    if n_kv > MAX_KEYS or n_tensors > MAX_TENSORS:
        raise _bad(f"holds {n_kv} metadata keys and {n_tensors} tensors; a control vector has at most {MAX_KEYS} "
                   f"keys and one tensor per layer (at most {MAX_TENSORS})")
    for _ in range(n_kv):
        string()
        value(struct.unpack("<I", take(4))[0], 0)
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack("<I", take(4))
        if n_dims > 4:
            raise _bad(f"holds a tensor of {n_dims} dimensions; GGUF tensors have at most 4")
        take(8 * n_dims + 4 + 8)


def _text(reader: gguf.GGUFReader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types != [gguf.GGUFValueType.STRING]:
        raise _bad(f"has {key} of type {field.types[0].name}; it must be a string")
    return bytes(field.parts[-1]).decode("utf-8", errors="replace")


def decode_gguf(raw: bytes) -> VectorPayload:
    """A control-vector GGUF as float32 rows, one per layer it names (``direction.N`` -> layer N), in layer order.
    Several tensors naming one layer (``direction.5`` and ``direction.05``) are summed in file order, as llama.cpp
    sums them. ``controlvector.model_hint`` and ``controlvector.layer_count`` are not required: llama.cpp's loader
    reads neither, and the hint names the model in words that differ between tools (llama.cpp's architecture,
    transformers' model_type); the width and the layers are checked against the served model instead."""
    _walk_header(raw)
    rows: dict[int, np.ndarray] = {}
    with tempfile.TemporaryFile() as spool:  # GGUFReader maps a file; the body never leaves this process
        spool.write(raw)
        spool.flush()
        try:
            reader = gguf.GGUFReader(spool)
        except (ValueError, KeyError, IndexError, OverflowError) as exc:
            raise _bad(f"is not a readable GGUF file ({exc})") from None
        arch = _text(reader, "general.architecture")
        if arch != ARCH:
            raise _bad(
                f"is a GGUF file of general.architecture {arch!r}, not a control vector ({ARCH!r}, as llama.cpp's "
                "cvector-generator and repeng's export_gguf write)"
            )
        if not reader.tensors:
            raise _bad("holds no direction tensors")
        width = None
        for tensor in reader.tensors:
            match = _DIRECTION_RE.fullmatch(tensor.name)
            if match is None:
                raise _bad(f"holds tensor {tensor.name!r}; a control vector holds only direction.N tensors (N: the layer)")
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise _bad(f"tensor {tensor.name} is {tensor.tensor_type.name}; direction tensors must be F32 (llama.cpp "
                           "reads no other type)", ErrorCode.BAD_DTYPE)
            shape = [int(d) for d in tensor.shape]
            if len(shape) != 1 or tensor.data.size != shape[0]:
                raise _bad(f"tensor {tensor.name} has shape {shape}; direction tensors are 1-D [n_embd]",
                           ErrorCode.BAD_SHAPE)
            if width is not None and shape[0] != width:
                raise _bad(f"tensor {tensor.name} has {shape[0]} values but the others have {width}; all directions "
                           "need the model's hidden size", ErrorCode.BAD_SHAPE)
            width = shape[0]
            row = np.asarray(tensor.data, dtype="<f4").copy()
            layer = int(match.group(1))
            if layer in rows:
                rows[layer] += row  # float32 addition in file order: llama.cpp's sum
            else:
                rows[layer] = row
    layers = tuple(sorted(rows))
    data = np.stack([rows[layer] for layer in layers]).astype("<f4").tobytes()
    return finish_payload(data, "float32", (len(layers), width), layers, "file", "gguf")


def encode_gguf(payload: VectorPayload, name: str, model_hint: str, n_layers: int) -> bytes:
    """``payload`` (a registered vector's rows) as a control-vector GGUF: ``direction.N`` for each row's layer N,
    as float32 (the one type llama.cpp reads; float16 and bfloat16 values are exact in it). ``n_layers``: the
    model's, naming the rows of a vector registered without ``layers``. Raises 400 ``not_exportable`` for what the
    format cannot carry: a ``[hidden]`` vector (GGUF names its layers) and a row for layer 0 (llama.cpp refuses
    ``direction.0``)."""
    if len(payload.shape) == 1:
        raise _bad(
            "is a [hidden] vector, usable at any layer; a GGUF control vector names the layers it steers: register "
            "it with layers (one row per layer), or export format=safetensors", ErrorCode.NOT_EXPORTABLE, "format",
        )
    layers = payload.layers if payload.layers is not None else tuple(range(n_layers))
    if 0 in layers:
        raise _bad(
            "has a row for layer 0, which llama.cpp's control-vector loader refuses (direction.0); register it "
            "without layer 0 to export it as GGUF, or export format=safetensors", ErrorCode.NOT_EXPORTABLE, "format",
        )
    rows = as_float32(as_bits(payload.data, payload.dtype), payload.dtype).reshape(payload.shape).astype("<f4")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "vector.gguf"
        writer = gguf.GGUFWriter(path, ARCH)
        writer.add_name(name)
        writer.add_string(f"{ARCH}.model_hint", model_hint)
        writer.add_int32(f"{ARCH}.layer_count", len(layers))  # the count of directions, as both writers mean it
        for layer, row in zip(layers, rows):
            writer.add_tensor(f"direction.{layer}", np.ascontiguousarray(row))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def encode_safetensors(payload: VectorPayload) -> bytes:
    """``payload`` as a safetensors file that registers to the same vector (dtype, shape, layers, bytes): one
    tensor ``vector`` without layers, else one 1-D tensor per layer named by its index."""
    if payload.layers is None:
        tensors = [("vector", list(payload.shape), payload.data)]
    else:
        size = payload.shape[-1] * ITEMSIZE[payload.dtype]
        tensors = [(str(layer), [payload.shape[-1]], payload.data[i * size:(i + 1) * size])
                   for i, layer in enumerate(payload.layers)]
    header: dict[str, object] = {}
    offset = 0
    for name, shape, data in tensors:
        header[name] = {"dtype": _SAFETENSORS_NAMES[payload.dtype], "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(data for _, _, data in tensors)
