"""OpenAI-shaped errors for the HTTP API: the body, the exception handlers and their OpenAPI entries.

Every error leaves as `{"error": {"message", "type", "param", "code"}}`: pydantic validation and unreadable
bodies (400, never 422), Starlette's own 404 and 405, the body cap (413), auth (401), overload (429), a tier
outage (503). Known errors get their own handlers: the catch-all `Exception` handler sits in Starlette's
ServerErrorMiddleware, which re-raises, so uvicorn would log a traceback and drop the keep-alive connection.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from services.errors import CapacityError, InvalidRequestError, TierUnavailableError

SHOWN_ERRORS = 3  # a list of a million bad items would otherwise come back as a megabyte of messages
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
         413: "RequestTooLargeError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
# Errors raised below the API: status, type and code; the retryable ones also say when to come back.
KNOWN = {InvalidRequestError: (400, "invalid_request"), CapacityError: (429, "overloaded"),
         TierUnavailableError: (503, None)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    type_ = TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """Messages may quote client input, lone surrogates included, which UTF-8 cannot encode: escape to ASCII."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> AsciiJSONResponse:
    return AsciiJSONResponse(error_body(status, message, param, code), status, headers)


def known_error(error: Exception) -> tuple[int, dict]:
    """The status and body of an error the tiers raise on purpose (500 for anything else)."""
    for cls, (status, code) in KNOWN.items():
        if isinstance(error, cls):  # admission's errors name the field at fault and their own code
            return status, error_body(status, str(error), getattr(error, "param", None),
                                      getattr(error, "code", None) or code)
    return 500, error_body(500, f"internal error ({type(error).__name__})")


def _param(loc: tuple) -> str | None:
    # The request field at fault; the message carries the full path (union members included).
    return str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None


def _describe(error: dict) -> str:
    path = ".".join(str(p) for p in error.get("loc", ())[1:]) or "body"
    return f"{path}: {error.get('msg')}"


async def _on_validation(request: Request, exc: RequestValidationError) -> AsciiJSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(400, f"invalid JSON: {errors[0]['ctx']['error']} at position {errors[0]['loc'][-1]}",
                              code="invalid_json")
    message = "; ".join(_describe(e) for e in errors[:SHOWN_ERRORS])
    if len(errors) > SHOWN_ERRORS:
        message += f" (and {len(errors) - SHOWN_ERRORS} more)"
    return error_response(400, message or "invalid request", _param(errors[0]["loc"]) if errors else None,
                          "invalid_request")


async def _on_http(request: Request, exc: HTTPException) -> AsciiJSONResponse:
    # Starlette's 404 and 405 (with its Allow header) and FastAPI's 400 for a body it cannot decode.
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


async def _on_api_error(request: Request, exc: ApiError) -> AsciiJSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _on_known(request: Request, exc: Exception) -> AsciiJSONResponse:
    status, body = known_error(exc)
    return AsciiJSONResponse(body, status, {"Retry-After": "1"} if status in (429, 503) else None)


async def _on_unexpected(request: Request, exc: Exception) -> AsciiJSONResponse:
    return AsciiJSONResponse(known_error(exc)[1], 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(ApiError, _on_api_error)
    for cls in KNOWN:
        app.add_exception_handler(cls, _on_known)
    app.add_exception_handler(Exception, _on_unexpected)


def documented(*statuses: int) -> dict:
    """OpenAPI `responses=` for these error statuses; "4XX" also covers 404/405 and stops FastAPI's 422 entry."""
    entries = {status: {"model": ErrorResponse, "description": TYPES[status]} for status in statuses}
    return {**entries, "4XX": {"model": ErrorResponse, "description": "Any other client error"}}
