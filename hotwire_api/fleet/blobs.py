"""A vector version as Redis keeps it: the safetensors bytes of one tensor ``vector`` (its rows, layers sorted,
as the engine's registry holds them) with ``dtype``, ``shape`` and ``layers`` in the file's metadata, stored
under its content hash (``hotwire_core.registry.content_sha256``, the hash receipts and cache salts use), so a
blob's key says what it holds and one hash means the same bytes on every replica."""

from __future__ import annotations

import json
from dataclasses import dataclass

import safetensors
import torch
from safetensors.torch import save as save_torch

from hotwire_api.codec import VectorPayload
from hotwire_api.errors import HotwireError
from hotwire_core.registry import DTYPES, RegistryError, content_sha256, decode_vector

__all__ = ["Checked", "check", "decode", "encode"]



@dataclass(frozen=True)
class Checked:
    """An upload checked against the served model: the payload the engine cores get (rows in layer order),
    its content hash, and its rows' norms (for an answer built without the engine)."""

    payload: VectorPayload
    sha256: str
    norms: dict[str, float]


def check(payload: VectorPayload, n_layers: int, hidden_size: int, model_dtype: str) -> Checked:
    """The engine's own checks (``hotwire_core.registry.decode_vector``), run in the API server before anything
    reaches Redis, so that the registry never holds a vector some replica's engine would refuse. Refusals name
    the upload's fields as ``HotwireEngine.register`` does."""
    layers = list(payload.layers) if payload.layers is not None else None
    try:
        rows, layers_t, norms = decode_vector(
            payload.data, payload.dtype, list(payload.shape), layers, n_layers, hidden_size, model_dtype
        )
    except RegistryError as exc:
        err = HotwireError.from_result(exc.to_result(), "the vector was refused")
        if err.field == "data" or (err.field in ("shape", "dtype") and payload.source != "data"):
            err.field = payload.source
        raise err from None
    sha = content_sha256(rows, payload.dtype, layers_t)
    data = rows.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    keys = ["*"] if layers_t is None else [str(layer) for layer in layers_t]
    return Checked(VectorPayload(data, payload.dtype, payload.shape, layers_t, payload.source), sha,
                   dict(zip(keys, norms)))


def encode(payload: VectorPayload) -> bytes:
    """The blob of a checked payload."""
    rows = len(payload.layers) if payload.layers is not None else 1
    hidden = payload.shape[-1]
    meta = {"dtype": payload.dtype, "shape": json.dumps(list(payload.shape)),
            "layers": json.dumps(None if payload.layers is None else list(payload.layers))}
    tensor = torch.frombuffer(bytearray(payload.data), dtype=DTYPES[payload.dtype]).reshape(rows, hidden)
    return save_torch({"vector": tensor}, metadata=meta)


def decode(blob: bytes) -> VectorPayload:
    """The payload a blob holds (ValueError if it is not one of hotwire's blobs)."""
    try:
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        meta = header["__metadata__"]
        ((_, tensor),) = safetensors.deserialize(blob)
        layers = json.loads(meta["layers"])
        return VectorPayload(bytes(tensor["data"]), meta["dtype"], tuple(json.loads(meta["shape"])),
                             None if layers is None else tuple(layers))
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"not a hotwire vector blob ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # safetensors' own error type
        raise ValueError(f"not a hotwire vector blob ({exc})") from None
