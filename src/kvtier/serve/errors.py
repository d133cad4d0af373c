"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Owns ``APIError`` (raise it from any route), ``route_of(scope)`` (the route label of metrics)
and ``install_error_handlers`` (maps ``APIError``, schema failures and anything unexpected onto
that shape, so a client never sees a bare 422 or an HTML page). An unhandled exception is a 500
``server_error``, counted by route and logged once with its traceback (by uvicorn). Schema
failures become 400 ``invalid_request_error`` with every bad field named: code
``invalid_json`` (what is wrong, at which line and column), ``unknown_parameter`` (a field the
schema does not declare) or ``invalid_value``. Request threads (asyncio).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answer: HTTP ``status`` with a message a person can act on."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def route_of(scope: Any) -> str:
    """The path template of the route that matched (``/v1/completions``), else 'unmatched'."""
    route = scope.get("route")
    return str(getattr(route, "path", None) or "unmatched")


def _describe(errors: list[dict[str, Any]], body: Any) -> tuple[str, str | None, str]:
    """(message, first bad field, code) for schema failures: malformed JSON says what is wrong
    and where (line, column), an unknown field is named as OpenAI names it."""
    parts, first, codes = [], None, set()
    for err in errors:
        kind = err.get("type")
        if kind == "json_invalid":
            codes.add("invalid_json")
            parts.append(_json_problem(err, body))
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") \
            or (err.get("ctx") or {}).get("field") or "body"
        first = first or where
        if kind == "extra_forbidden":
            codes.add("unknown_parameter")
            parts.append(f"unrecognized request argument supplied: {where}")
        else:
            codes.add("invalid_value")
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
    code = next((c for c in ("invalid_json", "invalid_value") if c in codes), "unknown_parameter")
    return "; ".join(parts) or "invalid request body", first, code


def _json_problem(err: dict[str, Any], body: Any) -> str:
    """'the request body is not valid JSON: Expecting value at line 2, column 5 (char 9)'."""
    pos = next((p for p in err.get("loc", ()) if isinstance(p, int)), None)
    what = (err.get("ctx") or {}).get("error") or "JSON decode error"
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if pos is None or not isinstance(text, str):
        return f"the request body is not valid JSON: {what}"
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return (f"the request body is not valid JSON: {what} at line {line}, column {column} "
            f"(char {pos})")


def install_error_handlers(app: Any) -> None:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(_request: Any, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Any, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(list(exc.errors()), getattr(exc, "body", None))
        return JSONResponse(APIError(400, message, param=param, code=code).body(),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Any, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400:  # the body could not be parsed at all (not UTF-8, say)
            code, message = "invalid_json", f"the request body is not valid JSON text: {message}"
        return JSONResponse(APIError(exc.status_code, message, code=code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Any, exc: Exception) -> JSONResponse:
        route = route_of(request.scope)
        counters = getattr(request.app.state, "limits", None)
        if counters is not None:  # this answer is sent outside ``CountErrors``
            counters.count_server_error(route, 500)
        log.error("unhandled error on %s %s (%s): %s: %s", request.method, request.url.path,
                  route, type(exc).__name__, exc)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(),
                            status_code=500)
