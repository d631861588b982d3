"""Every error code hotwire answers with, in one type. The control plane renders a code as the ``code`` of its JSON
error (a ``StrEnum`` member serialises as its value), docs/usage.md ("Error codes") lists them, and callers compare
``exc.code`` against these members instead of spelling the strings."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ErrorCode", "known_code"]


class ErrorCode(StrEnum):
    # A steering spec the engine cannot honour.
    BAD_SPEC = "bad_spec"
    UNKNOWN_VECTOR = "unknown_vector"
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    NO_ROW_FOR_LAYER = "no_row_for_layer"
    TOO_MANY_ENTRIES = "too_many_entries"
    TOO_MANY_ROWS = "too_many_rows"
    NORM_DISABLED = "norm_disabled"
    TOO_STRONG = "too_strong"
    VERSION_GONE = "version_gone"
    # A request that may not carry steering, or not this way.
    RESERVED_SALT = "reserved_salt"
    RESERVED_FIELD = "reserved_field"
    STEERING_UNSUPPORTED = "steering_unsupported"
    NOT_ADMITTED = "not_admitted"
    STEERING_CHANGED = "steering_changed"
    SESSION_ENDED = "session_ended"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    # A registration (or export) the server cannot take.
    BAD_ID = "bad_id"
    BAD_FILE = "bad_file"
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    BAD_DATA = "bad_data"
    BAD_LAYERS = "bad_layers"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"
    BAD_BODY = "bad_body"
    BAD_REQUEST = "bad_request"
    BAD_HOOK = "bad_hook"
    BAD_FEATURE = "bad_feature"
    NOT_EXPORTABLE = "not_exportable"
    EXISTS = "exists"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    # The bank of steering rows.
    SLOTS_EXHAUSTED = "slots_exhausted"
    SLOTS_BUSY = "slots_busy"
    # A tenant's quotas (HOTWIRE_TENANT_*, hotwire_api.tenancy).
    QUOTA_EXCEEDED = "quota_exceeded"
    # Vector extraction (POST /steer/vectors/extract) and the captures it runs.
    BAD_CAPTURE = "bad_capture"
    CAPTURE_WITH_STEERING = "capture_with_steering"
    CAPTURE_BUSY = "capture_busy"
    CAPTURE_OFF = "capture_off"
    BAD_POSITION = "bad_position"
    EMPTY_EXAMPLE = "empty_example"
    EXAMPLE_TOO_LONG = "example_too_long"
    TOO_MANY_EXAMPLES = "too_many_examples"
    # Readout of the residual stream onto probes.
    BAD_READOUT = "bad_readout"
    READOUT_OFF = "readout_off"
    READOUT_LOST = "readout_lost"
    READOUT_UNSUPPORTED = "readout_unsupported"
    GATE_UNSUPPORTED = "gate_unsupported"
    UNKNOWN_MONITOR = "unknown_monitor"
    # The server itself.
    STORE_FAILED = "store_failed"
    ENGINES_DISAGREE = "engines_disagree"
    INTERNAL = "internal"
    UNKNOWN_METHOD = "unknown_method"
    BAD_ENGINE_RESULT = "bad_engine_result"
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    MODEL_NOT_STEERABLE = "model_not_steerable"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    HOTWIRE_INACTIVE = "hotwire_inactive"
    KEYS_UNAVAILABLE = "keys_unavailable"
    # Keys managed over HTTP (/steer/keys).
    KEYS_OFF = "keys_off"
    UNKNOWN_KEY = "unknown_key"
    LAST_ADMIN = "last_admin"


_BY_VALUE = {code.value: code for code in ErrorCode}


def known_code(code: str) -> ErrorCode | str:
    """``code`` as its member when hotwire knows it; a code from elsewhere (a proxy's answer, a newer server) stays
    the string it came as."""
    return _BY_VALUE.get(code, code)
