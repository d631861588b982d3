"""What every ``/steer/*`` router shares: errors rendered as hotwire's JSON error body, and the responses every
route may give, declared once for the OpenAPI schema."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.routing import Mount

from hotwire_api.errors import HotwireError
from hotwire_api.models import ErrorBody
from hotwire_core.error_codes import ErrorCode

__all__ = ["HotwireRoute", "error_doc", "routes_last", "steer_router"]


class HotwireRoute(APIRoute):
    """Renders :class:`HotwireError` and request-validation failures as hotwire error bodies, whichever
    exception handlers the host app has; a tenant's key gets the vectors in a message named as it names them
    (``hotwire_api.tenancy``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except HotwireError as err:
                tenancy = getattr(request.state, "hotwire_tenancy", None)  # set once the caller's key is known
                return (tenancy.error(err) if tenancy is not None else err).response()
            except RequestValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(part) for part in first["loc"][1:]) or None
                message = f"{field}: {first['msg']}" if field else str(first["msg"])
                return HotwireError(400, ErrorCode.BAD_REQUEST, message, field).response()

        return route


def error_doc(description: str) -> dict[str, Any]:
    """An error response for the OpenAPI schema: hotwire's error body, described."""
    return {"model": ErrorBody, "description": description}


def steer_router(unavailable: str, **kwargs: Any) -> APIRouter:
    """A router under ``/steer`` whose routes answer errors as :class:`HotwireRoute` does; ``unavailable`` describes
    its 503s."""
    return APIRouter(
        prefix="/steer",
        tags=["hotwire"],
        route_class=HotwireRoute,
        # "default" also keeps FastAPI from declaring a 422: HotwireRoute answers a malformed parameter with 400.
        responses={
            401: error_doc("Missing or wrong API key."),
            403: error_doc("`forbidden`: the key's role does not allow this route (HOTWIRE_KEYS_FILE)."),
            503: error_doc(unavailable),
            "default": error_doc("Any other error, in the same body: 500 `internal` or `engines_disagree`, 502 "
                                 "`bad_engine_result` (hotwire_core and hotwire_api of different versions)."),
        },
        **kwargs,
    )


def routes_last(app: Any) -> None:
    """Move hotwire's routes behind the host app's (once the host has added its own: at startup), but ahead of a
    catch-all (a mount at the root, a path that starts with a parameter) that would take ``/steer`` too. Starlette
    tries routes in order, and vLLM's HTTP metrics scan them again for every request: an OpenAI request then need
    not try every ``/steer`` route first."""
    ours = [r for r in app.router.routes if isinstance(r, HotwireRoute)]
    theirs = [r for r in app.router.routes if not isinstance(r, HotwireRoute)]
    at = next((i for i, r in enumerate(theirs) if _takes_everything(r)), len(theirs))
    app.router.routes[:] = theirs[:at] + ours + theirs[at:]


def _takes_everything(route: Any) -> bool:
    path = getattr(route, "path", None)
    return path is not None and (path in ("", "/") and isinstance(route, Mount) or path.startswith("/{"))
