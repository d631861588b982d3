"""``GET /steer/usage``: what each tenant holds and uses now beside its quotas (``hotwire_api.quotas``, the bank's
``HOTWIRE_TENANT_ROWS``, and a tenant's own in ``HOTWIRE_TENANT_LIMITS``): a tenant's key reads its own, the
operator's every tenant's."""

from __future__ import annotations

from collections import Counter

from fastapi import Request

from hotwire_api.auth import require, tenancy
from hotwire_api.engine import HotwireEngine
from hotwire_api.keys import Role
from hotwire_api.models import TenantUsage, UsageList
from hotwire_api.quotas import Quotas, size_of
from hotwire_api.stats_cache import STATS
from hotwire_api.steer_router import steer_router
from hotwire_core.spec import tenant_of

__all__ = ["router"]

router = steer_router("The engine is not running, or cannot be steered; `registry_unavailable` in a fleet whose "
                      "Redis does not answer.")


@router.get("/usage", response_model=UsageList, summary="Each tenant's vectors, registrations and pinned rows, "
            "beside its quotas", dependencies=[require(Role.STEER)])
async def usage(request: Request) -> UsageList:
    engine = HotwireEngine.of(request.app)
    vectors, (stats, _) = await engine.vectors(), await STATS.get(engine, 0)
    held, size, pinned = Counter[str](), Counter[str](), Counter[str]()
    for meta in vectors:
        held[tenant_of(meta.id)] += 1
        size[tenant_of(meta.id)] += size_of(meta.dtype, meta.shape)
    for row in stats.rows:
        pinned[tenant_of(row.id)] += row.refcount > 0
    caller = tenancy(request).tenant
    tenants = [caller] if caller is not None else sorted(t for t in {*held, *pinned} if t)
    quotas: Quotas = request.app.state.hotwire_quotas
    fleet = request.app.state.hotwire_registry.fleet_store()

    def limits(tenant: str) -> dict[str, int]:
        vectors, nbytes, per_minute = quotas.limits(tenant)
        return {"vectors": vectors, "bytes": nbytes, "registrations_per_minute": per_minute,
                "rows": stats.tenant_shares.get(tenant, stats.tenant_rows)}

    return UsageList(tenants=[TenantUsage(tenant=t, vectors=held[t], bytes=size[t], pinned_rows=pinned[t],
                                          registrations_last_minute=await quotas.recent(t, fleet), limits=limits(t))
                              for t in tenants])
