"""How a route that is not a generation is answered: its caller checked first (an admin route's at the admin gate:
``dualpath.serving.auth``), then its body read and parsed (only once the caller passed), its answer given, and the
request counted in ``http_requests_total``."""

from __future__ import annotations

import inspect

from fastapi import Request
from fastapi.responses import JSONResponse

from dualpath.core.errors import RequestError
from dualpath.serving.choices import ApiError
from dualpath.serving.json_bodies import parse


async def answered(front, request: Request, name: str, answer, admin: str | None = None) -> JSONResponse:
    """``answer``: the coroutine that gives the JSON body or the response, awaited once the caller is checked (of
    group ``admin`` for an admin route), and closed unrun when the caller is refused."""
    status = 200
    try:
        front.auth.admin(request, admin) if admin else front.auth.caller(request)
        out = await answer
        if isinstance(out, JSONResponse):
            status = out.status_code
            return out
        return JSONResponse(out)
    except ApiError as e:
        status = e.status
        return e.response()
    finally:
        answer.close()  # a no-op once awaited
        front.metrics.count(name, status)


async def answered_body(
    front, request: Request, name: str, model_cls, answer, admin: str | None = None
) -> JSONResponse:
    """A route with a body (``model_cls``; none: every field's default): ``answer(req)`` gives a JSON body, or
    (awaited) a response. A ``model`` the body names must be served."""

    async def parsed_and_answered():
        try:
            req = parse(model_cls, await request.body() or b"{}")
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        if getattr(req, "model", None) is not None:
            front.models.check(req.model)
        out = answer(req)
        return await out if inspect.isawaitable(out) else out

    return await answered(front, request, name, parsed_and_answered(), admin)
