"""Quotas of named tenants above or below everyone's (``HOTWIRE_TENANT_LIMITS``): a JSON object from tenant to the
limits it overrides, e.g. ``{"acme": {"vectors": 1024, "mb": 512, "registrations_per_min": 600, "rows": 64}}``.
Read by the engine core (``rows``: the bank rows its vectors may pin at once, ``slots.SlotCache``, which reports the
shares in its stats) and by the API server (the rest: ``hotwire_api.quotas``); a limit a tenant does not name is
everyone's (``HOTWIRE_TENANT_ROWS``, ``HOTWIRE_TENANT_VECTORS``, ``HOTWIRE_TENANT_MB``,
``HOTWIRE_TENANT_REGISTRATIONS_PER_MIN``)."""

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
_FLOOR = {"vectors": 1, "mb": 1 / 1024, "registrations_per_min": 1, "rows": 1}  # mb: at least a kilobyte


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's overrides; None: everyone's limit."""

    vectors: int | None = None
    mb: float | None = None
    registrations_per_min: int | None = None
    rows: int | None = None

    @property
    def bytes(self) -> int | None:
        return None if self.mb is None else int(self.mb * 1024 * 1024)


def _no_repeats(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose names are all different (a tenant or limit named twice is a mistake, not an override)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        repeated = next(name for i, (name, _) in enumerate(pairs) if name in dict(pairs[:i]))
        raise ValueError(f"{LIMITS_VAR} names {repeated!r} twice: give it once")
    return out


def parse_tenant_limits(raw: str) -> Mapping[str, TenantLimits]:
    """``HOTWIRE_TENANT_LIMITS``'s value as limits by tenant; ValueError saying what is wrong and where."""
    try:
        value = json.loads(raw, object_pairs_hook=_no_repeats) if raw.strip() else {}
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
            if (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)
                    or (whole and number != int(number)) or not _FLOOR[name] <= number <= _BOUNDS[name]):
                raise ValueError(f"{LIMITS_VAR}.{tenant}.{name} must be a {'whole ' if whole else ''}number from "
                                 f"{_FLOOR[name]:g} to {_BOUNDS[name]:g}, not {number!r}")
        out[tenant] = TenantLimits(**{k: (int(v) if k != "mb" else float(v)) for k, v in limits.items()})
    return out


TENANT_LIMITS = Parsed(LIMITS_VAR, parse_with=parse_tenant_limits,
                       doc="named tenants' own quotas, a JSON object from tenant to any of vectors, mb, "
                           "registrations_per_min and rows (see tenant_limits)")
