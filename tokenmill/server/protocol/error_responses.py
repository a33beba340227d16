"""The server's errors, all in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is what a route raises for a client's mistake (its status, message and
field); ``install_error_handlers`` maps it, and every other error a request can meet
(an invalid field from a validator, an unknown model, a malformed body, a dead engine,
Starlette's own 404 and 405), onto ``error_response``. FastAPI's 422 never reaches a
client: an invalid body is a 400 naming its field.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import EngineDeadError, InvalidRequestError, UnknownModelError
from tokenmill.server.protocol.openai import error_body

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ContextLengthError(APIError):
    """A prompt (and max_tokens) that does not fit the model's context: a 400, and for a
    router a reason to ask the large model."""


RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def error_response(status: int, message: str, param: str | None = None, retry_after: bool = False) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 or retry_after else None
    return JSONResponse(
        error_body(message, ERROR_TYPES.get(status, "Error"), status, param), status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error a request can raise, answered in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(e), e.param)

    @app.exception_handler(UnknownModelError)
    async def _unknown_model(_: Request, e: UnknownModelError) -> JSONResponse:
        return error_response(404, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        error = first.get("ctx", {}).get("error")
        if isinstance(error, InvalidRequestError):  # raised by a validator: its own message and field
            return error_response(400, str(error), error.param)
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        return error_response(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", where)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine is not running: {e}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405, ...
        detail = e.detail if isinstance(e.detail, str) else "error"
        return error_response(e.status_code, f"{detail}: {request.method} {request.url.path}")
