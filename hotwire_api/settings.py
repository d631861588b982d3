"""Control-plane settings, read once from the environment when hotwire is attached to an app (parsed by
``hotwire_core.env``; a fleet's own settings are ``hotwire_api.fleet.config.FleetConfig``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hotwire_api.fleet.config import REGISTRY
from hotwire_core.env import Flag, Float, Int, Text, load, setting
from hotwire_core.tenant_limits import TENANT_LIMITS, TenantLimits

DEFAULT_MAX_UPLOAD_MB = 64.0
API_KEY = Text("HOTWIRE_API_KEY", doc="guards /steer/* in place of vLLM's --api-key")  # the CLI's default too


@dataclass(frozen=True)
class Settings:
    max_upload_bytes: int = setting(Float("HOTWIRE_MAX_UPLOAD_MB", default=DEFAULT_MAX_UPLOAD_MB, lo_open=True,
                                          to=lambda mb: int(mb * 1024 * 1024),
                                          doc="the largest registration upload, in megabytes"))
    lenient: bool = setting(Flag("HOTWIRE_LENIENT", default=False,
                                 doc="serve bad steering requests unsteered instead of refusing them"))
    api_key: str | None = setting(API_KEY)
    keys_file: str | None = setting(Text("HOTWIRE_KEYS_FILE", doc="API keys with roles (read, steer, admin) for "
                                         "/steer/* and steering, read again when it changes; hotwire keys edits it"))
    fleet_keys: bool = setting(Flag("HOTWIRE_FLEET_KEYS", default=False,
                                    doc="keep the API keys with roles in the fleet's Redis (HOTWIRE_REGISTRY) instead "
                                        "of a keys file: one set of keys for every replica"))
    registry_url: str | None = setting(REGISTRY, repr=False)  # may hold a password
    catalog_refresh_s: float = setting(Int("HOTWIRE_CATALOG_REFRESH_MS", default=200, lo=10, hi=3_600_000,
                                           to=lambda ms: ms / 1000,
                                           doc="how often the catalog asks the engine whether vectors changed"))
    extract_max_examples: int = setting(Int("HOTWIRE_EXTRACT_MAX_EXAMPLES", default=512, lo=1, hi=1 << 20,
                                            doc="examples per extraction, positive and negative together"))
    tenant_vectors: int = setting(Int("HOTWIRE_TENANT_VECTORS", default=256, lo=1, hi=1 << 20,
                                      doc="vectors one tenant may hold registered (keys with a tenant)"))
    tenant_bytes: int = setting(Float("HOTWIRE_TENANT_MB", default=256.0, lo_open=True,
                                      to=lambda mb: int(mb * 1024 * 1024),
                                      doc="megabytes of vectors one tenant may hold registered"))
    tenant_per_minute: int = setting(Int("HOTWIRE_TENANT_REGISTRATIONS_PER_MIN", default=60, lo=1, hi=1 << 20,
                                         doc="registrations (uploads and extractions) one tenant may make per minute "
                                             "(in a fleet, on every replica together)"))
    tenant_limits: Mapping[str, TenantLimits] | None = setting(TENANT_LIMITS)
    extract_max_tokens: int = setting(Int("HOTWIRE_EXTRACT_MAX_TOKENS", default=4096, lo=1, hi=1 << 24,
                                          doc="tokens per extraction example"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        return load(cls, env)
