"""HTTP errors with OpenAI's body: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.errors import InvalidRequestError
from inflight.server.protocol import ErrorInfo, ErrorResponse

# OpenAI's error types, by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=_TYPES.get(self.status, "server_error"),
                         param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else self.headers
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status, headers=headers)


def error_event(error: APIError) -> str:
    """A server-sent event carrying `error`: how a stream that has begun reports a failure."""
    return f"data: {ErrorResponse(error=error.info).model_dump_json()}\n\n"


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(errors: list[Any]) -> APIError:
    """A 400 naming the first bad field of a pydantic (or FastAPI) validation failure."""
    if not errors:
        return invalid("the request body is invalid")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', 'cannot parse it')}")
    if err.get("type") == "model_type" and not loc:
        return invalid("the request body must be a JSON object")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, InvalidRequestError):  # our own validators name the field they refuse
        return invalid(str(cause), cause.param or (loc[0] if loc else None))
    if err.get("type") == "value_error" and cause is not None:
        return invalid(str(cause), loc[0] if loc else None)
    # A union reports each alternative's location ("prompt", "str"); name the field only.
    where = ".".join(p for p in loc if not _is_type_name(p))
    message = f"{where}: {err.get('msg', 'invalid value')}" if where else str(err.get("msg", "invalid value"))
    return invalid(message, loc[0] if loc else None)


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool")


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Every error leaves as an OpenAI body; `on_error(status)` is told of each (for metrics)."""

    def answer(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response()

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return answer(exc)

    async def request_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return answer(from_validation_error(list(exc.errors())))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return answer(APIError(exc.status_code, str(exc.detail)))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return answer(APIError(500, "internal server error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
