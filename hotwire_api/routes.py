"""The ``/steer/*`` routes: register, list, inspect and delete steering vectors, and read the slot bank."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import BackgroundTasks, Query, Request, Response

from hotwire_api.audit import AuditPage, Author
from hotwire_api.auth import caller_name, require, tenancy
from hotwire_api.catalog import CATALOG
from hotwire_api.codec import RegisterVectorJSON, VectorPayload, read_limited, too_large
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.extraction import ExtractRequest, ExtractResult, run_extraction
from hotwire_api.forms import check_fits
from hotwire_api.keys import Role
from hotwire_api.gguf_codec import encode_gguf, encode_safetensors
from hotwire_api.stats_cache import STATS
from hotwire_api.steer_router import error_doc, routes_last, steer_router
from hotwire_api.models import DeleteResult, FleetView, SlotStats, VectorList, VectorMeta
from hotwire_api.quotas import Quotas
from hotwire_api.settings import Settings
from hotwire_api.uploads import decode_upload
from hotwire_api.vector_registry import VectorRegistry
from hotwire_core.error_codes import ErrorCode
from hotwire_core.spec import TENANT_RE, VECTOR_ID_RE, tenant_of
from hotwire_core.vllm_glue import inactive_reason
from hotwire_core.vllm_glue.api_server import served_model_type


@contextlib.asynccontextmanager
async def _background(app: Any) -> AsyncIterator[None]:
    """Lifespan: keep the slot statistics and the catalog fresh and the vector registry started while ``app`` runs
    (on a vLLM hotwire supports: elsewhere every answer is the 503 of :meth:`HotwireEngine.of`)."""
    routes_last(app)
    if inactive_reason() is not None:
        yield
        return
    tasks = [asyncio.create_task(STATS.run(app)), asyncio.create_task(CATALOG.run(app, app.state.hotwire_settings.catalog_refresh_s))]
    registry: VectorRegistry = app.state.hotwire_registry
    await registry.start(app)
    tasks += await app.state.hotwire_access.start(app)
    await app.state.hotwire_monitors.start(app)
    tasks.append(asyncio.create_task(app.state.hotwire_monitors.run(app.state.hotwire_settings.catalog_refresh_s)))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await registry.stop()


router = steer_router("The engine is not running, or cannot be steered.", lifespan=_background)

_REGISTER_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["id", "file"],
                "properties": {
                    "id": {"type": "string", "pattern": f"^{VECTOR_ID_RE.pattern}$"},
                    "file": {
                        "type": "string",
                        "format": "binary",
                        "description": "safetensors (one tensor, or 1-D tensors named by layer index), a control-vector "
                        "GGUF (direction.N tensors, as llama.cpp and repeng write), or with sae_cfg and feature "
                        "an SAE's sae_weights.safetensors (SAELens).",
                    },
                    "layers": {"type": "string", "description": "Layers naming a safetensors tensor's rows: 10,12 or [10,12]."},
                    "sae_cfg": {"type": "string", "format": "binary", "description": "The SAE's cfg.json (SAELens)."},
                    "feature": {"type": "integer", "description": "The SAE feature whose decoder row is the vector."},
                },
            }
        },
        "application/json": {"schema": RegisterVectorJSON.model_json_schema()},
    },
}


async def _read_upload(request: Request, limit: int) -> tuple[str, VectorPayload]:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type not in ("multipart/form-data", "application/json"):
        raise HotwireError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"send multipart/form-data (id, file=<.safetensors or .gguf>, layers?) or application/json, not {media_type!r}",
        )
    return await decode_upload(content_type, await read_limited(request.stream(), limit), limit)


def _registry(request: Request) -> VectorRegistry:
    """The registry :func:`hotwire_api.server.attach` chose for this app."""
    return request.app.state.hotwire_registry


async def _register(request: Request, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool,
                    via: str) -> tuple[bool, VectorMeta]:
    """Register within the quotas of the id's tenant (``hotwire_api.quotas``); the answer in the caller's names."""
    quotas: Quotas = request.app.state.hotwire_quotas
    async with quotas.registering(vector_id, len(payload.data), engine.vectors, _registry(request).fleet_store()):
        created, meta = await _registry(request).register(engine, vector_id, payload, replace,
                                                          Author(caller_name(request), via))
    return created, tenancy(request).meta(meta)


_TENANT = Query(None, pattern=f"^{TENANT_RE.pattern}$", description="The tenant whose vector the id names (for "
               "the operator's keys; a tenant's key names its own and the shared ones without it).")


def _refresh_stats_later(background: BackgroundTasks, engine: HotwireEngine) -> None:
    background.add_task(STATS.refresh, engine)


async def _refresh_catalog(engine: HotwireEngine) -> None:
    """Before answering a registration or deletion: this API server's next request sees it."""
    try:
        await CATALOG.refresh(engine, not_before=time.monotonic())
    except HotwireError:
        pass  # the change is made; the background refresh catches up once the engine answers


@router.post(
    "/vectors",
    status_code=201,
    response_model=VectorMeta,
    summary="Register a steering vector",
    openapi_extra={"requestBody": _REGISTER_BODY},
    responses={
        200: {"model": VectorMeta, "description": "Replaced an existing vector (`?replace=true`)."},
        400: error_doc("Bad id, dtype, shape, layers or values, or a hidden size / layer the model does not have; "
                    "`bad_request` for a `replace` that is not a boolean."),
        409: error_doc("The id is taken; pass `?replace=true` to replace it."),
        413: error_doc("Larger than HOTWIRE_MAX_UPLOAD_MB."),
        415: error_doc("Neither multipart/form-data nor application/json."),
        500: error_doc("`store_failed`: the vector store could not be written; nothing was registered."),
        503: error_doc("`registry_unavailable`: the fleet's registry (HOTWIRE_REGISTRY) does not answer, or Redis "
                    "restarted and the replicas are putting back what it may have lost (Retry-After); nothing was "
                    "registered."),
    },
    dependencies=[require(Role.ADMIN)],
)
async def register_vector(
    request: Request,
    response: Response,
    background: BackgroundTasks,
    replace: bool = Query(False, description="Replace a vector with the same id (its version goes up)."),
) -> VectorMeta:
    settings: Settings = request.app.state.hotwire_settings
    vector_id, payload = await _read_upload(request, settings.max_upload_bytes)
    vector_id = tenancy(request).owned(vector_id)
    engine = HotwireEngine.of(request.app)
    if payload.kind:  # a GGUF or SAE file: its misfit is named in that format's terms
        model = (await CATALOG.ready(engine)).model
        check_fits(payload, model.n_layers, model.hidden_size)
    created, meta = await _register(request, engine, vector_id, payload, replace, "upload")
    if not created:
        response.status_code = 200
    await _refresh_catalog(engine)
    _refresh_stats_later(background, engine)
    return meta


@router.post(
    "/vectors/extract",
    status_code=201,
    response_model=ExtractResult,
    summary="Compute a steering vector from contrastive examples on this server's engine, and register it",
    responses={
        200: {"model": ExtractResult, "description": "Replaced an existing vector (`replace`)."},
        400: error_doc("Bad id, layers, method or examples: empty sets, pca with unpaired sets, too many "
                    "(HOTWIRE_EXTRACT_MAX_EXAMPLES) or too long (HOTWIRE_EXTRACT_MAX_TOKENS) examples."),
        409: error_doc("The id is taken; send `replace: true` to replace it."),
        429: error_doc("`capture_busy`: every capture row is in use by other extractions; retry."),
        503: error_doc("`capture_off` (start the server with HOTWIRE_CAPTURE=1) or `model_not_steerable`."),
    },
    dependencies=[require(Role.ADMIN)],
)
async def extract_vector(body: ExtractRequest, request: Request, response: Response,
                         background: BackgroundTasks) -> ExtractResult:
    engine = HotwireEngine.of(request.app)
    rules = await CATALOG.ready(engine)

    async def register(vector_id: str, payload: VectorPayload, replace: bool) -> tuple[bool, VectorMeta]:
        return await _register(request, engine, vector_id, payload, replace, "extract")

    body = body.model_copy(update={"id": tenancy(request).owned(body.id)})
    quotas: Quotas = request.app.state.hotwire_quotas
    await quotas.admissible(body.id, engine.vectors, _registry(request).fleet_store())  # before the captures
    created, result = await run_extraction(engine, body, request.app.state.hotwire_settings, rules.model, register)
    if not created:
        response.status_code = 200
    await _refresh_catalog(engine)
    _refresh_stats_later(background, engine)
    return result


@router.get("/vectors", response_model=VectorList, summary="List steering vectors",
            dependencies=[require(Role.STEER)])
async def list_vectors(request: Request, background: BackgroundTasks) -> VectorList:
    engine = HotwireEngine.of(request.app)
    vectors = await engine.vectors()
    _refresh_stats_later(background, engine)
    return VectorList(vectors=tenancy(request).vectors(vectors))


@router.get(
    "/vectors/{vector_id}",
    response_model=VectorMeta,
    summary="Get one steering vector",
    responses={400: error_doc("`bad_request`: `tenant` is not a tenant's name."),
               404: error_doc("No vector has this id (that the key may see).")},
    dependencies=[require(Role.STEER)],
)
async def get_vector(vector_id: str, request: Request, background: BackgroundTasks,
                     tenant: str | None = _TENANT) -> VectorMeta:
    engine = HotwireEngine.of(request.app)
    vectors = {meta.id: meta for meta in await engine.vectors()}
    _refresh_stats_later(background, engine)
    view = tenancy(request)
    meta = vectors.get(view.addressed(vector_id, tenant, vectors.__contains__) or "")
    if meta is not None:
        return view.meta(meta)
    raise _unknown(vector_id)


def _unknown(vector_id: str) -> HotwireError:
    return HotwireError(404, ErrorCode.UNKNOWN_VECTOR, f"unknown steering vector {vector_id!r}; GET /steer/vectors "
                        "lists them", "id")


async def _addressed(request: Request, engine: HotwireEngine, vector_id: str, tenant: str | None) -> str:
    """The engine's id of the vector a path names (``Tenancy.addressed``); 404 where the caller may not see it."""
    await CATALOG.ready(engine)
    found = tenancy(request).addressed(vector_id, tenant, CATALOG.holds)
    if found is None:
        raise _unknown(vector_id)
    return found


@router.get(
    "/vectors/{vector_id}/file",
    response_class=Response,
    summary="Download a steering vector as a file",
    responses={
        200: {"content": {"application/octet-stream": {}},
              "description": "safetensors (registers again unchanged) or a control-vector GGUF (llama.cpp, repeng)."},
        400: error_doc("`not_exportable`: GGUF cannot carry this vector (a [hidden] vector, or a row for layer 0); "
                    "`bad_request` for another `format` or a `version` below 1."),
        404: error_doc("No vector has this id (or this engine holds no such version)."),
    },
    dependencies=[require(Role.STEER)],
)
async def vector_file(
    vector_id: str,
    request: Request,
    file_format: Literal["safetensors", "gguf"] = Query(
        "safetensors", alias="format",
        description="safetensors: the registered dtype, shape and layers; gguf: float32 direction.N tensors.",
    ),
    version: int | None = Query(None, ge=1, description="A retained version; absent: the current one."),
    tenant: str | None = _TENANT,
) -> Response:
    engine = HotwireEngine.of(request.app)
    meta, payload = await engine.export(await _addressed(request, engine, vector_id, tenant), version)
    if file_format == "gguf":
        model = (await CATALOG.ready(engine)).model
        raw = encode_gguf(payload, vector_id, served_model_type(engine.client), model.n_layers)
    else:
        raw = encode_safetensors(payload)
    return Response(raw, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{vector_id}.{file_format}"',
        "x-hotwire-version": str(meta.version),
    })


@router.delete(
    "/vectors/{vector_id}",
    status_code=204,
    response_class=Response,
    summary="Delete a steering vector",
    responses={
        202: {"model": DeleteResult, "description": "Deleted for new requests; running ones keep it until done."},
        400: error_doc("`bad_request`: `tenant` is not a tenant's name."),
        403: error_doc("`forbidden`: a tenant's key deleting a shared vector, or a key whose role may not delete."),
        404: error_doc("No vector has this id (that the key may see)."),
        500: error_doc("`store_failed`: its stored file could not be removed; it stays registered."),
        503: error_doc("`registry_unavailable`: the fleet's registry does not answer, or Redis restarted and the "
                    "replicas are putting back what it may have lost (Retry-After); nothing was deleted."),
    },
    dependencies=[require(Role.ADMIN)],
)
async def delete_vector(vector_id: str, request: Request, background: BackgroundTasks,
                        tenant: str | None = _TENANT) -> Response:
    engine = HotwireEngine.of(request.app)
    found = await _addressed(request, engine, vector_id, tenant)
    if tenancy(request).tenant is not None and not tenant_of(found):
        raise HotwireError(403, ErrorCode.FORBIDDEN, f"{vector_id!r} is a shared vector: only the operator's keys "
                           "(without a tenant) delete shared vectors", "id")
    in_flight = await _registry(request).unregister(engine, found, Author(caller_name(request)))
    await _refresh_catalog(engine)
    _refresh_stats_later(background, engine)
    if in_flight > 0:
        body = DeleteResult(id=vector_id, in_flight=in_flight).model_dump_json()
        return Response(body, status_code=202, media_type="application/json")
    return Response(status_code=204)


@router.get(
    "/slots",
    response_model=SlotStats,
    summary="Steering bank occupancy and counters",
    responses={400: error_doc("`bad_request`: `max_age_ms` is not an integer in 0-60000.")},
    dependencies=[require(Role.READ)],
)
async def slots(
    request: Request,
    max_age_ms: int = Query(
        0, ge=0, le=60_000,
        description="Accept numbers this old (ms) from the server's snapshot instead of asking the engine, which "
        "answers only between two model steps. Pollers (dashboards) should send their poll interval: the answer "
        "then never waits on the engine. 0 (the default): fresh numbers.",
    ),
) -> SlotStats:
    engine = HotwireEngine.of(request.app)
    stats, age_s = await STATS.get(engine, max_age_ms / 1000)
    registry = await _registry(request).status()
    stats = stats.model_copy(update={"age_ms": round(age_s * 1000, 1), "registry": registry})
    view = tenancy(request)
    if view.tenant is None:
        return stats
    await CATALOG.ready(engine)
    return view.slots(stats, sum(map(view.sees, CATALOG.vectors)))


@router.get(
    "/fleet",
    response_model=FleetView,
    summary="Every replica on the fleet's registry: slots, pinned rows, refusals, vector versions held",
    responses={503: error_doc("`registry_unavailable`: the fleet's registry does not answer.")},
    dependencies=[require(Role.READ)],
)
async def fleet(request: Request) -> FleetView:
    return tenancy(request).fleet(await _registry(request).view(HotwireEngine.of(request.app)))


@router.get(
    "/audit",
    response_model=AuditPage,
    summary="Every change to the vectors and the keys, with who made it, newest first",
    responses={400: error_doc("`bad_request`: `limit` is not an integer in 1-10000."),
               503: error_doc("`registry_unavailable`: the fleet's registry does not answer.")},
    dependencies=[require(Role.ADMIN)],
)
async def audit(request: Request, limit: int = Query(100, ge=1, le=10_000, description="How many changes.")) -> AuditPage:
    view = tenancy(request)
    return view.audit(await _registry(request).audit(limit if view.tenant is None else 10_000), limit)
