"""``/steer/monitors``: admins add, replace and delete the probes every chat and completions request is read with
(``hotwire_api.monitors``); any key lists them. They are the operator's: a tenant's key (``hotwire_api.tenancy``) may
not see them."""

from __future__ import annotations

from fastapi import Query, Request, Response

from hotwire_api.audit import entry
from hotwire_api.auth import caller_name, require
from hotwire_api.catalog import CATALOG
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.keys import Role
from hotwire_api.models import Monitor, MonitorList
from hotwire_api.monitors import MonitorBook, probes_of
from hotwire_api.steer_router import error_doc, steer_router
from hotwire_core.admission import Refusal, row_key
from hotwire_core.error_codes import ErrorCode
from hotwire_core.readout_admission import resolve_readout
from hotwire_core.spec import tenant_of

__all__ = ["router"]


router = steer_router("The engine is not running, or cannot be read: `readout_off` (start it with "
                      "HOTWIRE_READOUT=1), `model_not_steerable`.")


_FIELDS = {ErrorCode.LAYER_OUT_OF_RANGE: "layer", ErrorCode.NO_ROW_FOR_LAYER: "layer", ErrorCode.UNKNOWN_VECTOR: "probe",
           ErrorCode.VERSION_GONE: "probe"}


def _book(request: Request) -> MonitorBook:
    return request.app.state.hotwire_monitors


def _listing(book: MonitorBook) -> MonitorList:
    return MonitorList(kept=book.kept, monitors=list(book.current()))


async def _check(engine: HotwireEngine, monitors: list[Monitor]) -> None:
    """``monitors`` (all of them, with the new one last) can read every request: each probe is a registered vector
    with a row at its layer, and together they fit the probes and bank rows one request may use."""
    rules = await CATALOG.ready(engine)
    value = probes_of(monitors)
    try:
        try:
            _, resolved = resolve_readout(value, CATALOG.lookup, rules, rules.model.readout_probes)
        except Refusal as exc:
            if exc.code is not ErrorCode.UNKNOWN_VECTOR:
                raise
            await CATALOG.refresh(engine)  # registered through another API server a moment ago?
            _, resolved = resolve_readout(value, CATALOG.lookup, rules, rules.model.readout_probes)
    except Refusal as exc:
        if exc.code is ErrorCode.BAD_READOUT:  # too many probes: the only way these monitors make a bad readout
            message = (f"{len(monitors)} monitors: a request reads at most {rules.model.readout_probes} probes "
                       "(HOTWIRE_READOUT_PROBES), monitors included; delete one first")
            raise HotwireError(400, exc.code, message) from None
        field = _FIELDS.get(exc.code)
        raise HotwireError(exc.status, exc.code, exc.message, field) from None
    rows = {row_key(vector, probe.layer) for probe, vector in resolved}
    if len(rows) > rules.max_rows:
        raise HotwireError(400, ErrorCode.TOO_MANY_ROWS, f"the monitors would read {len(rows)} bank rows; one request "
                           f"may pin at most {rules.max_rows} (HOTWIRE_MAX_ROWS), monitors included")


@router.get("/monitors", response_model=MonitorList, summary="The monitors every chat and completions request is "
            "read with", dependencies=[require(Role.READ, operator=True)])
async def list_monitors(request: Request) -> MonitorList:
    return _listing(_book(request))


@router.post(
    "/monitors", status_code=201, response_model=MonitorList,
    summary="Add (or replace) a monitor: a probe read on every chat and completions request, scored per request",
    responses={200: {"model": MonitorList, "description": "Replaced a monitor (`?replace=true`)."},
               400: error_doc("A monitor that is not one, or whose probe is a tenant's (`bad_request`), a probe that is not registered "
                              "(`unknown_vector`) or has no row at the layer (`no_row_for_layer`, "
                              "`layer_out_of_range`), or more monitors than one request may read (`bad_readout`, "
                              "`too_many_rows`)."),
               409: error_doc("`exists`: a monitor has this id; pass `?replace=true`.")},
    dependencies=[require(Role.ADMIN, operator=True)],
)
async def add_monitor(body: Monitor, request: Request, response: Response,
                      replace: bool = Query(False, description="Replace the monitor with this id.")) -> MonitorList:
    if tenant_of(body.probe):  # its name would go out in every tenant's responses, its rows pin that tenant's share
        raise HotwireError(400, ErrorCode.BAD_REQUEST, f"a monitor reads every tenant's requests: its probe must be a "
                           f"shared vector, not {body.probe!r} of tenant {tenant_of(body.probe)!r}", "probe")
    book = _book(request)
    others = [m for m in book.current() if m.id != body.id]
    if len(others) < len(book.current()) and not replace:
        raise HotwireError(409, ErrorCode.EXISTS, f"a monitor named {body.id!r} exists: pass ?replace=true to replace "
                           "it, or choose another id", "id")
    await _check(HotwireEngine.of(request.app), [*others, body])
    old = await book.edit(body.id, body)
    if old is not None:
        response.status_code = 200
    await request.app.state.hotwire_registry.record(
        entry(caller_name(request), "monitor_replaced" if old else "monitor_added", body.id))
    return _listing(book)


@router.delete("/monitors/{monitor_id}", status_code=204, response_class=Response, summary="Delete a monitor",
               responses={404: error_doc("`unknown_monitor`: no monitor has this id.")},
               dependencies=[require(Role.ADMIN, operator=True)])
async def delete_monitor(monitor_id: str, request: Request) -> Response:
    book = _book(request)
    if await book.edit(monitor_id, None) is None:
        raise HotwireError(404, ErrorCode.UNKNOWN_MONITOR, f"no monitor named {monitor_id!r}; GET /steer/monitors "
                           "lists them", "id")
    await request.app.state.hotwire_registry.record(entry(caller_name(request), "monitor_deleted", monitor_id))
    return Response(status_code=204)
