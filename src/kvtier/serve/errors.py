"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Owns ``APIError`` (raise it from any route) and ``install_error_handlers`` (maps ``APIError``,
schema failures and anything unexpected onto that shape, so a client never sees a bare 422 or an
HTML page). Schema failures become 400 with every bad field named. Request threads (asyncio).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
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


def _describe(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    parts, first = [], None
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        first = first or where
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", first


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
        message, param = _describe(list(exc.errors()))
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Any, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Any, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(),
                            status_code=500)
