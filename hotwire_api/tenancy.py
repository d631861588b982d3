"""Namespaces: what vectors a caller sees, and under which names.

A key of ``HOTWIRE_KEYS_FILE`` may belong to a tenant (``hotwire_api.keys``). The engine knows a tenant's vector
``calm`` as ``acme/calm`` (``hotwire_core.spec.VECTOR_ID_RE``) and every other id as a shared one. A tenant's key
names its own vectors and the shared ones by their plain names, its own first: it registers, replaces, deletes and
extracts only its own, never sees or names another tenant's (an id with a slash is refused alike whether or not it
exists, and a plain name that is neither its own nor shared is unknown, as any unknown name is), and every id,
receipt and message it gets back is written in its names. A key without a tenant (the operator's, and every key
of a server without a keys file) sees every namespace under the engine's full ids.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotwire_api.audit import VECTOR_ACTIONS, AuditPage
from hotwire_api.errors import HotwireError
from hotwire_api.models import FleetView, RegistryStatus, ReplicaState, SlotStats, VectorMeta
from hotwire_core.error_codes import ErrorCode
from hotwire_core.readout_spec import parse_readout
from hotwire_core.spec import NAME_RE, SpecError, canonical_spec, parse_spec, tenant_of

__all__ = ["OPERATOR", "Tenancy"]

_ANY_PROBES = 1 << 16  # a readout is parsed here only to rename its probes; its own limits are checked after


@dataclass(frozen=True)
class Tenancy:
    """One caller's view: ``tenant`` None for the operator's."""

    tenant: str | None

    @property
    def _prefix(self) -> str:
        return f"{self.tenant}/"

    def sees(self, vector_id: str) -> bool:
        return self.tenant is None or tenant_of(vector_id) in ("", self.tenant)

    def shown(self, vector_id: str) -> str:
        """``vector_id`` as this caller names it."""
        return vector_id.removeprefix(self._prefix) if self.tenant is not None else vector_id

    def owned(self, name: str, field: str = "id") -> str:
        """The engine's id of this caller's vector ``name``: where it registers, replaces and deletes."""
        if self.tenant is None:
            return name
        if not NAME_RE.fullmatch(name):
            raise HotwireError(400, ErrorCode.BAD_ID, f"a tenant's vector is named by {NAME_RE.pattern} (its tenant is "
                               f"the key's), got {name[:80]!r}", field)
        return self._prefix + name

    def named(self, name: str, exists: Callable[[str], bool], field: str = "id") -> str:
        """The engine's id of the vector this caller means by ``name``: its own, else a shared one; its own id when
        neither exists (the refusal then names ``name``, as for any unknown vector)."""
        if self.tenant is None:
            return name
        own = self.owned(name, field)
        return name if not exists(own) and exists(name) else own

    def addressed(self, name: str, tenant: str | None, exists: Callable[[str], bool]) -> str | None:
        """The engine's id of the vector a route's path names as ``name`` with ``?tenant=`` (the operator's way to
        a tenant's vector); None when this caller may not see it (another tenant's, whether or not it exists)."""
        if self.tenant is None:
            return f"{tenant}/{name}" if tenant else name
        if tenant not in (None, self.tenant):
            return None
        return self.named(name, exists)

    def localize(self, text: str) -> str:
        """A receipt or message as this caller names the vectors in it."""
        if self.tenant is None:
            return text
        return re.sub(rf"(?<![A-Za-z0-9_.-]){re.escape(self._prefix)}", "", text)

    def error(self, exc: HotwireError) -> HotwireError:
        if self.tenant is None:
            return exc
        return HotwireError(exc.status, exc.code, self.localize(exc.message), exc.field)

    def spec(self, value: Any, exists: Callable[[str], bool]) -> Any:
        """A steering spec with its ids and conditions' ids made the engine's; one that does not parse is left for
        admission to refuse."""
        if self.tenant is None or not isinstance(value, str):
            return value
        try:
            entries = parse_spec(value)
        except SpecError:
            return value
        renamed = []
        for i, e in enumerate(entries):
            when = e.when and dataclasses.replace(e.when, vector_id=self.named(e.when.vector_id, exists,
                                                                                 f"vllm_xargs.hotwire[{i}].when.id"))
            renamed.append(dataclasses.replace(e, vector_id=self.named(e.vector_id, exists, f"vllm_xargs.hotwire[{i}].id"),
                                               when=when))
        return canonical_spec(tuple(renamed))

    def readout(self, value: Any, exists: Callable[[str], bool]) -> Any:
        """A readout with its probes' ids made the engine's (one that does not parse: left for admission)."""
        if self.tenant is None or not isinstance(value, str):
            return value
        try:
            spec = parse_readout(value, _ANY_PROBES)
        except SpecError:
            return value
        probes = tuple(dataclasses.replace(p, vector_id=self.named(p.vector_id, exists,
                                                                   f"vllm_xargs.hotwire_readout.probes[{k}].id"))
                       for k, p in enumerate(spec.probes))
        return json.dumps(dataclasses.replace(spec, probes=probes).to_json(), separators=(",", ":"))

    # What the /steer routes answer, cut to what this caller sees and in its names.

    def meta(self, meta: VectorMeta) -> VectorMeta:
        tenant = tenant_of(meta.id) or None
        return meta.model_copy(update={"id": self.shown(meta.id), "tenant": tenant})

    def vectors(self, metas: list[VectorMeta]) -> list[VectorMeta]:
        return [self.meta(m) for m in metas if self.sees(m.id)]

    def slots(self, stats: SlotStats, visible: int) -> SlotStats:
        """The bank's rows of vectors this caller sees and ``visible``, the count of vectors it sees; nothing that
        moves when another tenant registers (the registry's event position). The bank's totals are the bank's."""
        if self.tenant is None:
            return stats
        rows = [row.model_copy(update={"id": self.shown(row.id)}) for row in stats.rows if self.sees(row.id)]
        shares = {t: n for t, n in stats.tenant_shares.items() if t == self.tenant}
        return stats.model_copy(update={"rows": rows, "vectors": visible, "tenant_shares": shares,
                                        "registry": stats.registry and self._registry(stats.registry)})

    def fleet(self, view: FleetView) -> FleetView:
        if self.tenant is None:
            return view
        declared = set(ReplicaState.model_fields)  # a heartbeat's other fields (event positions) are left out
        replicas = [ReplicaState.model_validate(r.model_dump(include=declared) | {
            "vectors": [v.model_copy(update={"id": self.shown(v.id)}) for v in r.vectors if self.sees(v.id)],
            "pinned_rows": [p.model_copy(update={"id": self.shown(p.id)}) for p in r.pinned_rows if self.sees(p.id)],
        }) for r in view.replicas]
        vectors = [v.model_copy(update={"id": self.shown(v.id)}) for v in view.vectors if self.sees(v.id)]
        return view.model_copy(update={"replicas": replicas, "vectors": vectors,
                                       "registry": self._registry(view.registry)})

    @staticmethod
    def _registry(status: RegistryStatus) -> RegistryStatus:
        return status.model_copy(update={"position": None, "events_applied": 0, "seeded": 0})

    def audit(self, page: AuditPage, limit: int) -> AuditPage:
        """A tenant's admins read the changes to its own vectors; the operator's, every change."""
        if self.tenant is None:
            return page
        mine = [e.model_copy(update={"id": self.shown(e.id)}) for e in page.entries
                if e.action in VECTOR_ACTIONS and tenant_of(e.id) == self.tenant]
        return page.model_copy(update={"entries": mine[:limit]})


OPERATOR = Tenancy(None)
