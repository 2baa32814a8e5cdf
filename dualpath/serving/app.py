"""The FastAPI app of a ``Frontend``: its routers (``dualpath.serving.routes``, one per API family), the middleware
every route shares (a request id, the body bound, the access log) and the error handlers that answer in OpenAI's
JSON error format."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dualpath.serving.choices import ApiError
from dualpath.serving.guard import BodyGuard
from dualpath.serving.json_bodies import error_body
from dualpath.serving.request_ids import RequestIds
from dualpath.serving.routes import admin, chat, completions, health, models, responses, sglang, vllm
from dualpath.serving.watch import AccessLog

ROUTERS = (health, models, chat, completions, responses, vllm, sglang, admin)  # in the order their routes match


def build_app(front) -> FastAPI:
    app = FastAPI(title="DualPath", docs_url=None, redoc_url=None)
    app.add_middleware(BodyGuard, max_bytes=front.cfg.max_body_bytes)
    if front.cfg.log_requests:  # inside RequestIds: its line names the request's id
        app.add_middleware(AccessLog)
    app.add_middleware(RequestIds)  # the outer one: a body refused by the guard still answers with an id
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    for family in ROUTERS:
        app.include_router(family.router(front))
    return app


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, None), exc.status_code)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _query_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A query parameter of a GET (or /pause's) that is not of its type: a 400 naming it."""
    where = next(iter(exc.errors()), {})
    name = str(where.get("loc", ("", ""))[-1])
    return JSONResponse(error_body(f"{name}: {where.get('msg', 'invalid')}", "invalid_request_error", name, None), 400)
