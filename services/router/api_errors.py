"""The API's errors: OpenAI's nested envelope with vLLM's conventions for `type` and `code` (an
exception name and the HTTP status): `{"error": {"message", "type", "param", "code"}}`.

`APIError` is an error the client caused or must handle; `install_error_handlers` makes a FastAPI
app answer every error that way: schema errors are 400s naming the field (not FastAPI's 422),
404/405 and 500s carry the same body, and nothing echoes large inputs back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from services.router.streams import Overloaded

RETRY_AFTER_S = 1  # what a refused client is told to wait (Retry-After), in seconds

log = structlog.get_logger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the client caused or must handle: becomes an OpenAI error body with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def __reduce__(self) -> tuple[Any, ...]:
        # Whole across a process boundary (the chat template's worker processes).
        return APIError, (self.status, self.message, self.param, self.retry_after_s)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope for an HTTP status."""
    error_type = ERROR_TYPES.get(
        status, "BadRequestError" if status < 500 else "InternalServerError"
    )
    param = None if param is None else _printable(param)
    return {
        "error": {"message": _printable(message), "type": error_type, "param": param,
                  "code": status}
    }  # fmt: skip


def _printable(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate echoed in an error must not make it a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the API returns (OpenAI's envelope)."""

    error: ErrorInfo


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these statuses, each with the error envelope as its body."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_TYPES[status]} for status in statuses
    }


# ---- FastAPI exception handlers: every error leaves as an OpenAI error body ----

MAX_VALIDATION_ERRORS = 5  # per response: bounded bodies, no echo of large inputs
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_TAG_PREFIXES = (
    "function",
    "constrained-",
    "kind:",  # a discriminated union's branch (`tokenize_api.TokenizeRequest`)
)  # pydantic's names for validators and constrained types


def install_error_handlers(app: FastAPI) -> None:
    """400 for schema errors (not FastAPI's 422), OpenAI bodies for 404/405 and for 500s."""
    app.add_exception_handler(APIError, _api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
    # A refusal after admission (a plain response's re-run found no engine with room in time):
    # its status (429/503) and Retry-After, as at admission, not a 500.
    app.add_exception_handler(Overloaded, _overloaded_response)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error_response)


def _json_error(status: int, message: str, param: str | None = None) -> Response:
    return JSONResponse(error_body(status, message, param), status_code=status)


async def _api_error_response(_: Request, exc: APIError) -> Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _validation_error_response(_: Request, exc: RequestValidationError) -> Response:
    """Name the first bad field (`param`) and list a few errors, without echoing the input."""
    errors = exc.errors()[:MAX_VALIDATION_ERRORS]
    if errors and errors[0].get("type") == "json_invalid":
        return _json_error(400, f"malformed JSON body: {errors[0].get('ctx', {}).get('error')}")
    params = [param_path(e.get("loc", ())) for e in errors]
    message = "; ".join(
        f"{param or 'body'}: {e.get('msg', 'invalid')}"
        for param, e in zip(params, errors, strict=True)
    )
    return _json_error(400, message or "invalid request", params[0] if params else None)


def param_path(loc: Sequence[Any]) -> str | None:
    """`("body", "prompt", "list[int]", 0)` -> `"prompt.0"`: the field path without the union
    branch names pydantic puts in it."""
    parts = [
        str(p)
        for p in loc[1:]
        if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p.startswith(_TAG_PREFIXES)))
    ]
    return ".".join(parts) or None


async def _overloaded_response(_: Request, exc: Overloaded) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(exc.status, str(exc)), status_code=exc.status, headers=headers)


async def _http_error_response(_: Request, exc: HTTPException) -> Response:
    return _json_error(exc.status_code, str(exc.detail))


async def _internal_error_response(_: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    return _json_error(500, "internal server error")
