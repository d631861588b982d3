"""Quotas of named tenants above or below everyone's (``HOTWIRE_TENANT_LIMITS``): a JSON object from tenant to the
limits it overrides, e.g. ``{"acme": {"vectors": 1024, "mb": 512, "registrations_per_min": 600, "rows": 64}}``.
Read by the engine core (``rows``: the bank rows its vectors may pin at once, ``slots.SlotCache``) and by the API
server (the rest: ``hotwire_api.quotas``); a limit a tenant does not name is everyone's (``HOTWIRE_TENANT_ROWS``,
``HOTWIRE_TENANT_VECTORS``, ``HOTWIRE_TENANT_MB``, ``HOTWIRE_TENANT_REGISTRATIONS_PER_MIN``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .env import Parsed
from .spec import TENANT_RE

__all__ = ["LIMITS_VAR", "TENANT_LIMITS", "TenantLimits", "parse_tenant_limits"]

LIMITS_VAR = "HOTWIRE_TENANT_LIMITS"
_BOUNDS = {"vectors": 1 << 20, "mb": float(1 << 20), "registrations_per_min": 1 << 20, "rows": 1 << 16}


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's overrides; None: everyone's limit."""

    vectors: int | None = None
    mb: float | None = None
    registrations_per_min: int | None = None
    rows: int | None = None


def parse_tenant_limits(raw: str) -> Mapping[str, TenantLimits]:
    """``HOTWIRE_TENANT_LIMITS``'s value as limits by tenant; ValueError saying what is wrong and where."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{LIMITS_VAR} is not JSON ({exc.msg} at character {exc.pos}): give an object such as "
                         '{"acme": {"vectors": 1024, "rows": 64}}') from None
    if not isinstance(value, dict):
        raise ValueError(f"{LIMITS_VAR} must be a JSON object from tenant to its limits")
    out = {}
    for tenant, limits in value.items():
        if not TENANT_RE.fullmatch(tenant):
            raise ValueError(f"{LIMITS_VAR}: {tenant!r} is not a tenant name (1-32 letters, digits, '_' or '-', "
                             "starting with a letter or digit)")
        if not isinstance(limits, dict) or not limits:
            raise ValueError(f"{LIMITS_VAR}.{tenant} must be an object naming one or more of {', '.join(_BOUNDS)}")
        for name, number in limits.items():
            if name not in _BOUNDS:
                raise ValueError(f"{LIMITS_VAR}.{tenant}: {name!r} is not a limit; the limits are {', '.join(_BOUNDS)}")
            whole = name != "mb"
            if (isinstance(number, bool) or not isinstance(number, (int, float)) or (whole and number != int(number))
                    or not math.isfinite(number) or not 0 < number <= _BOUNDS[name]):
                raise ValueError(f"{LIMITS_VAR}.{tenant}.{name} must be a {'whole ' if whole else ''}number above 0 "
                                 f"and at most {_BOUNDS[name]:g}, not {number!r}")
        out[tenant] = TenantLimits(**{k: (int(v) if k != "mb" else float(v)) for k, v in limits.items()})
    return out


TENANT_LIMITS = Parsed(LIMITS_VAR, parse_with=parse_tenant_limits,
                       doc="named tenants' own quotas, a JSON object from tenant to any of vectors, mb, "
                           "registrations_per_min and rows (see tenant_limits)")
