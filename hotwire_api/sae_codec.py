"""A sparse-autoencoder feature as a steering vector: the decoder row ``W_dec[feature]`` of an SAE saved in
SAELens' layout (``SAE.save_model``: ``cfg.json`` and ``sae_weights.safetensors``).

``cfg.json`` gives ``d_in``, ``d_sae`` and the hook point, ``metadata.hook_name`` (SAELens 6) or ``hook_name``
(earlier versions), a TransformerLens name. Of those only the residual stream between two blocks is "after a
decoder layer": ``blocks.L.hook_resid_post`` is after layer L, ``blocks.L.hook_resid_pre`` after layer L - 1
(``blocks.0.hook_resid_pre`` is the embeddings' output, before any layer); others (``hook_resid_mid``,
attention or MLP outputs, ``hook_z``) are refused. ``W_dec`` is ``[d_sae, d_in]``: row ``feature`` is the
feature's direction, taken as stored (F32, F16 or BF16).

Only the safetensors header (JSON) and the one row are read: the file may be large (d_sae x d_in values), and
the client reads a local SAE folder the same way without loading it whole.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

from hotwire_api.codec import SAFETENSORS_DTYPES, VectorPayload, finish_payload
from hotwire_api.errors import HotwireError
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import short_repr
from hotwire_core.vector_bits import ITEMSIZE

__all__ = ["CFG_FILE", "WEIGHTS_FILE", "bytes_reader", "decode_sae", "hook_layer", "parse_feature", "read_sae_folder"]

CFG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"  # sae_lens.constants
_HOOK_RE = re.compile(r"blocks\.([0-9]{1,6})\.hook_resid_(pre|post)")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

Read = Callable[[int, int], bytes]  # (offset, length) -> the file's bytes there (fewer at its end)


def _bad(field: str, message: str, code: ErrorCode = ErrorCode.BAD_FILE) -> HotwireError:
    return HotwireError(400, code, message, field)


def hook_layer(hook_name: str) -> int:
    """hotwire's layer of a TransformerLens residual hook point: the decoder layer it comes after."""
    match = _HOOK_RE.fullmatch(hook_name)
    if match is None:
        raise _bad(
            "sae_cfg",
            f"the SAE reads hook point {hook_name!r}, which is not the residual stream between decoder layers; hotwire "
            "steers after decoder layer L: an SAE on blocks.L.hook_resid_post (or blocks.L+1.hook_resid_pre)",
            ErrorCode.BAD_HOOK,
        )
    block = int(match.group(1))
    if match.group(2) == "post":
        return block
    if block == 0:
        raise _bad("sae_cfg", "the SAE reads blocks.0.hook_resid_pre, the embeddings before any decoder layer; hotwire "
                   "steers after decoder layers only", ErrorCode.BAD_HOOK)
    return block - 1


def _config(raw: bytes | str) -> tuple[str, int, int]:
    """(hook name, d_in, d_sae) of a SAELens ``cfg.json``."""
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad("sae_cfg", f"is not JSON; send the SAE's {CFG_FILE}") from None
    if not isinstance(cfg, dict):
        raise _bad("sae_cfg", f"must be a JSON object (SAELens' {CFG_FILE})")
    metadata = cfg.get("metadata")
    hook = metadata.get("hook_name") if isinstance(metadata, dict) else None
    hook = hook if hook is not None else cfg.get("hook_name")
    if not isinstance(hook, str):
        raise _bad("sae_cfg", "names no hook point (metadata.hook_name, or hook_name in SAELens before 6)")
    sizes = []
    for key in ("d_in", "d_sae"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad("sae_cfg", f"{key} must be a positive integer, got {short_repr(value)}")
        sizes.append(value)
    return hook, sizes[0], sizes[1]


def parse_feature(value: object) -> int:
    """A feature index from a form field or an argument."""
    try:
        feature = int(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else -1
    except ValueError:
        feature = -1
    if feature < 0:
        raise _bad("feature", f"must be a feature index (a non-negative integer), got {short_repr(value)}",
                   ErrorCode.BAD_FEATURE)
    return feature


def _decoder_row(read: Read, size: int, d_in: int, d_sae: int, feature: int) -> tuple[bytes, str]:
    """``W_dec[feature]`` of a safetensors file of ``size`` bytes, and its dtype."""
    not_safetensors = f"is not a safetensors file; send the SAE's {WEIGHTS_FILE}"
    if size < 8:
        raise _bad("file", not_safetensors)
    (length,) = struct.unpack("<Q", read(0, 8))
    if length > min(size - 8, _MAX_HEADER):
        raise _bad("file", not_safetensors)
    try:
        header = json.loads(read(8, length))
    except (ValueError, RecursionError):
        raise _bad("file", not_safetensors) from None
    if not isinstance(header, dict):
        raise _bad("file", not_safetensors)
    entry = header.get("W_dec")
    if not isinstance(entry, dict):
        names = [short_repr(name) for name in sorted(header)[:8]]
        raise _bad("file", f"holds no W_dec tensor (the SAE decoder, [d_sae, d_in]); tensors: {names}")
    dtype = SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise _bad("file", f"W_dec is {entry.get('dtype')}; hotwire takes F32, F16 or BF16", ErrorCode.BAD_DTYPE)
    if entry.get("shape") != [d_sae, d_in]:
        raise _bad("file", f"W_dec has shape {short_repr(entry.get('shape'))}, but cfg.json's d_sae and d_in make "
                   f"[{d_sae}, {d_in}]", ErrorCode.BAD_SHAPE)
    offsets = entry.get("data_offsets")
    row_bytes = d_in * ITEMSIZE[dtype]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or offsets[1] - offsets[0] != d_sae * row_bytes or offsets[0] < 0 or 8 + length + offsets[1] > size):
        raise _bad("file", "W_dec's data_offsets do not match its shape or lie beyond the file's end")
    if feature >= d_sae:
        raise _bad("feature", f"is {feature}, but the SAE has d_sae = {d_sae} features (0-{d_sae - 1})",
                   ErrorCode.BAD_FEATURE)
    return read(8 + length + offsets[0] + feature * row_bytes, row_bytes), dtype


def decode_sae(cfg: bytes | str, weights: Read, size: int, feature: int) -> VectorPayload:
    """The row of ``feature`` as a one-row vector for the layer its hook point follows."""
    hook, d_in, d_sae = _config(cfg)
    layer = hook_layer(hook)
    data, dtype = _decoder_row(weights, size, d_in, d_sae, feature)
    return finish_payload(data, dtype, (1, d_in), (layer,), "file", "sae")


def read_sae_folder(folder: str | Path, feature: int) -> VectorPayload:
    """:func:`decode_sae` of a local SAELens folder, reading only the header and the row of ``sae_weights``."""
    folder = Path(folder)
    weights = folder / WEIGHTS_FILE
    cfg = (folder / CFG_FILE).read_bytes()
    with weights.open("rb") as f:
        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return decode_sae(cfg, read, weights.stat().st_size, parse_feature(feature))


def bytes_reader(raw: bytes) -> Read:
    """A :data:`Read` over bytes in memory (an upload)."""
    return lambda offset, length: raw[offset:offset + length]

