"""Decoding a registration's body (``POST /steer/vectors``) into the id and the vector, away from the event loop
when it is large.

Parsing tens of megabytes of JSON holds the interpreter for seconds (a 13 MB list of floats: 0.17 s on the
development CPU) and a thread would not help: the parser never lets go of the GIL. On the API server's event loop
that stalls every stream and ``/health``. So a body over :data:`INLINE_BYTES` is decoded by a fresh Python
process (``python -m hotwire_api.uploads``; about 0.2 s to start), at most :data:`DECODERS` at a time, which
returns the payload or the refusal; the memory a parse takes is given back when that process ends. Smaller
bodies, the usual case, are decoded in place. Either way the same checks run (``hotwire_api.codec``).
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from hotwire_api.codec import VectorPayload, decode_json
from hotwire_api.errors import HotwireError
from hotwire_api.forms import decode_form
from hotwire_core.error_codes import ErrorCode

__all__ = ["DECODERS", "INLINE_BYTES", "decode_upload"]

INLINE_BYTES = 1 << 20  # decoded in place up to this size: 1 MB of float lists parses in about 15 ms
DECODERS = 2  # decoding processes at a time; further large uploads wait for one
_SLOTS: asyncio.Semaphore | None = None
_LENGTH = struct.Struct(">Q")


async def decode_upload(content_type: str, body: bytes, limit: int) -> tuple[str, VectorPayload]:
    """The id and vector of a registration body (``content_type``: the request's whole Content-Type header, its
    media type multipart/form-data or application/json); raises :class:`HotwireError` for what it refuses."""
    if len(body) <= INLINE_BYTES:
        return await _decode(content_type, body, limit)
    global _SLOTS
    if _SLOTS is None:
        _SLOTS = asyncio.Semaphore(DECODERS)
    async with _SLOTS:
        return await _decode_in_a_process(content_type, body, limit)


async def _decode(content_type: str, body: bytes, limit: int) -> tuple[str, VectorPayload]:
    if content_type.partition(";")[0].strip().lower() == "multipart/form-data":
        return decode_form(await _form_fields(Headers({"content-type": content_type}), body, limit))
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise HotwireError(400, ErrorCode.BAD_BODY, f"the body is not valid JSON ({exc})") from None
    except RecursionError:
        raise HotwireError(400, ErrorCode.BAD_BODY, "the body nests too deeply to be read; see the registration format") from None
    return decode_json(obj)


async def _form_fields(headers: Headers, body: bytes, limit: int) -> dict[str, str | bytes]:
    async def chunks() -> AsyncIterator[bytes]:
        yield body

    try:
        form = await MultiPartParser(headers, chunks(), max_files=2, max_fields=8, max_part_size=limit).parse()
    except MultiPartException as exc:
        raise HotwireError(400, ErrorCode.BAD_BODY, f"malformed multipart body: {exc.message}") from None
    fields: dict[str, str | bytes] = {}
    try:
        for name, value in form.multi_items():
            if name in fields:
                raise HotwireError(400, ErrorCode.BAD_BODY, "is given twice", name)
            fields[name] = await value.read() if isinstance(value, UploadFile) else value
    finally:
        await form.close()
    return fields


def _frame(header: dict[str, Any], data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return _LENGTH.pack(len(encoded)) + encoded + data


def _unframe(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = _LENGTH.unpack_from(raw)
    start = _LENGTH.size + length
    return json.loads(raw[_LENGTH.size:start]), raw[start:]


async def _decode_in_a_process(content_type: str, body: bytes, limit: int) -> tuple[str, VectorPayload]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hotwire_api.uploads",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await proc.communicate(_frame({"content_type": content_type, "limit": limit}, body))
    finally:
        if proc.returncode is None:  # the request was cancelled (the client left): no orphan decoder
            proc.kill()
            await proc.wait()
    try:
        header, data = _unframe(out)
    except (struct.error, ValueError):
        raise HotwireError(500, ErrorCode.INTERNAL, f"the upload decoder process failed (exit {proc.returncode}): "
                           f"{err.decode(errors='replace')[-500:]}") from None
    if not header["ok"]:
        raise HotwireError(header["status"], header["code"], header["message"], header.get("field"))
    layers = header["layers"]
    return header["id"], VectorPayload(data, header["dtype"], tuple(header["shape"]),
                                       None if layers is None else tuple(layers), header["source"], header["kind"])


def _main() -> None:
    """The decoding process: one framed request on stdin, one framed answer on stdout."""
    request, body = _unframe(sys.stdin.buffer.read())
    try:
        vector_id, payload = asyncio.run(_decode(request["content_type"], body, request["limit"]))
    except HotwireError as exc:
        answer = _frame({"ok": False, "status": exc.status, "code": exc.code, "message": exc.message,
                         "field": exc.field}, b"")
    else:
        answer = _frame({"ok": True, "id": vector_id, "dtype": payload.dtype, "shape": list(payload.shape),
                         "layers": None if payload.layers is None else list(payload.layers),
                         "source": payload.source, "kind": payload.kind}, payload.data)
    sys.stdout.buffer.write(answer)


if __name__ == "__main__":
    _main()
