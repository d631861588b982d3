"""The multipart registration form (``POST /steer/vectors``): which format its ``file`` part holds, and the checks
of a file's layers and width against the served model, in the words of that format.

Fields: ``id``; ``file``: safetensors, a control-vector GGUF (told apart by its ``GGUF`` magic) or, with
``sae_cfg`` (the SAE's ``cfg.json``, a file part or a field) and ``feature`` (an index), SAELens'
``sae_weights.safetensors``; ``layers`` names the rows of a single safetensors tensor (GGUF and SAE files name
their own layers).
"""

from __future__ import annotations

from collections.abc import Mapping

from hotwire_api.codec import VectorPayload, decode_safetensors, parse_layer_list, validate_id
from hotwire_api.errors import HotwireError
from hotwire_api.gguf_codec import decode_gguf, is_gguf
from hotwire_api.sae_codec import CFG_FILE, WEIGHTS_FILE, bytes_reader, decode_sae, parse_feature
from hotwire_core.error_codes import ErrorCode

__all__ = ["FORM_FIELDS", "check_fits", "decode_form"]

FORM_FIELDS = ("id", "file", "layers", "sae_cfg", "feature")


def _bad(field: str | None, message: str, code: ErrorCode) -> HotwireError:
    return HotwireError(400, code, message, field)


def decode_form(fields: Mapping[str, str | bytes]) -> tuple[str, VectorPayload]:
    """A multipart upload's id and vector."""
    for name in fields:
        if name not in FORM_FIELDS:
            raise _bad(name, f"unknown form field; send {', '.join(FORM_FIELDS)}", ErrorCode.BAD_BODY)
    raw = fields.get("file")
    if not isinstance(raw, bytes):
        raise _bad("file", "is required: attach the .safetensors or .gguf file as a file part named 'file'",
                   ErrorCode.BAD_FILE)
    for name in ("id", "layers", "feature"):
        if isinstance(fields.get(name), bytes):
            raise _bad(name, "must be a form field, not a file", ErrorCode.BAD_BODY)
    vector_id = validate_id(fields.get("id"))
    layers = fields.get("layers")
    if "sae_cfg" in fields or "feature" in fields:
        if "sae_cfg" not in fields or "feature" not in fields:
            missing = "sae_cfg" if "sae_cfg" not in fields else "feature"
            raise _bad(missing, f"is required for an SAE feature: send file={WEIGHTS_FILE}, sae_cfg={CFG_FILE} and "
                       "feature=<index>", ErrorCode.BAD_BODY)
        if layers is not None:
            raise _bad("layers", "must be omitted: an SAE feature's layer comes from its hook point",
                       ErrorCode.BAD_LAYERS)
        feature = parse_feature(fields["feature"])
        return vector_id, decode_sae(fields["sae_cfg"], bytes_reader(raw), len(raw), feature)
    if is_gguf(raw):
        if layers is not None:
            raise _bad("layers", "must be omitted: a GGUF control vector names its layers (direction.N)",
                       ErrorCode.BAD_LAYERS)
        return vector_id, decode_gguf(raw)
    return vector_id, decode_safetensors(raw, parse_layer_list(layers))


def check_fits(payload: VectorPayload, n_layers: int, hidden_size: int) -> None:
    """Refuse a GGUF or SAE file made for another model: its width or a layer the served model lacks (400). Other
    payloads are left to the engine's checks."""
    width, layers = payload.shape[-1], payload.layers or ()
    beyond = [layer for layer in layers if layer >= n_layers]
    if payload.kind == "gguf":
        if width != hidden_size:
            raise _bad("file", f"holds directions of {width} values, but the served model's hidden size (n_embd) is "
                       f"{hidden_size}: the control vector was made for another model", ErrorCode.BAD_SHAPE)
        if beyond:
            names = ", ".join(f"direction.{layer}" for layer in beyond[:8])
            raise _bad("file", f"names layers the served model lacks ({names}): it has {n_layers} decoder layers, "
                       f"direction.0 to direction.{n_layers - 1}; the control vector was made for another model",
                       ErrorCode.LAYER_OUT_OF_RANGE)
    elif payload.kind == "sae":
        if width != hidden_size:
            raise _bad("file", f"is an SAE of d_in {width}, but the served model's hidden size is {hidden_size}: the "
                       "SAE was trained on another model", ErrorCode.BAD_SHAPE)
        if beyond:
            raise _bad("sae_cfg", f"the SAE's hook point comes after decoder layer {beyond[0]}, but the served model "
                       f"has {n_layers} decoder layers (0-{n_layers - 1})", ErrorCode.LAYER_OUT_OF_RANGE)
