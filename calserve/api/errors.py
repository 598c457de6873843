"""HTTP error mapping: the only place where calserve exceptions become status codes.

Every error response has OpenAI's body shape ``{"error": {"message", "type", "param", "code"}}``
so the official clients raise their typed exceptions (BadRequestError, RateLimitError, ...).

| status | type                   | code                                  | raised for                      |
|--------|------------------------|---------------------------------------|---------------------------------|
| 400    | invalid_request_error  | invalid_json / invalid_value / unsupported_parameter / context_length_exceeded | bad input |
| 400    | invalid_request_error  | invalid_http_framing / invalid_http   | Content-Length + Transfer-Encoding; malformed HTTP (serve) |
| 401    | invalid_request_error  | invalid_api_key                       | unknown or missing API key      |
| 404    | invalid_request_error  | model_not_found / not_found           | unknown alias / route           |
| 405    | invalid_request_error  | method_not_allowed                    | wrong HTTP method               |
| 408    | invalid_request_error  | request_timeout                       | body (or, serve, head) too slow |
| 413    | invalid_request_error  | request_too_large                     | body over server.max_body_bytes |
| 429    | rate_limit_error       | rate_limit_exceeded                   | CapacityError (budget, quota)   |
| 431    | invalid_request_error  | headers_too_large                     | head over server.max_header_bytes |
| 503    | service_unavailable    | model_unavailable / engine_unavailable| UnavailableError, EngineError   |
| 503    | service_unavailable    | too_many_connections                  | connection cap (serve)          |
| 500    | server_error           | device_error / internal_error         | device fault, genuine bug       |
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final, final

import msgspec

from calserve import errors as E
from calserve.api.request_ids import REQUEST_ID
from calserve.engine.types import ErrorEvent

__all__ = ["ApiError", "from_exception", "to_api_error", "error_event_to_api", "error_body",
           "retry_after_header", "msgspec_error"]

log = logging.getLogger("calserve.api")


@final
class ApiError(Exception):
    """An HTTP-level error: status + OpenAI error fields (+ Retry-After for 429/503)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.close = close  # answer with `Connection: close` (the connection is not reusable)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response_body(self) -> dict[str, Any]:
        """The body of a JSON error response: :meth:`body` plus the request's ``request_id``
        (beside ``error``, whose shape stays OpenAI's)."""
        b = self.body()
        rid = REQUEST_ID.get()
        if rid is not None:
            b["request_id"] = rid
        return b

    def headers(self) -> dict[str, str]:
        h = {} if self.retry_after is None else {"Retry-After": retry_after_header(self.retry_after)}
        if self.close:
            h["Connection"] = "close"
        return h


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110); never 0, so clients actually back off."""
    if not math.isfinite(seconds):
        return "1"
    return str(max(1, math.ceil(seconds)))


_DEFAULT_RETRY_S: Final = 1.0


def from_exception(exc: BaseException) -> ApiError:
    """Map a calserve exception (or ApiError) to an ApiError. Unknown exceptions -> clean 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, E.UnsupportedParameter):
        return ApiError(400, exc.message, param=exc.param, code="unsupported_parameter")
    if isinstance(exc, E.RequestError):
        code = "context_length_exceeded" if "context" in exc.message.lower() else "invalid_value"
        return ApiError(400, exc.message, param=exc.param, code=code)
    if isinstance(exc, E.AuthError):
        return ApiError(401, exc.message, param=exc.param, code="invalid_api_key")
    if isinstance(exc, E.UnknownModel):
        return ApiError(404, exc.message, param=exc.param or "model", code="model_not_found")
    if isinstance(exc, E.CapacityError):
        return _retryable(exc, 429, "rate_limit_error", "rate_limit_exceeded", exc.param, _DEFAULT_RETRY_S)
    if isinstance(exc, E.UnavailableError):
        return _retryable(exc, 503, "service_unavailable", "model_unavailable", exc.param, _DEFAULT_RETRY_S)
    if isinstance(exc, E.EngineError):  # no param: the engine as a whole is down
        return _retryable(exc, 503, "service_unavailable", "engine_unavailable", None, 5.0)
    if isinstance(exc, E.DeviceError):
        return ApiError(500, exc.message, type="server_error", code="device_error")
    return ApiError(500, "internal server error", type="server_error", code="internal_error")


def to_api_error(exc: BaseException) -> ApiError:
    """The answer to a request whose handling raised ``exc``, for every route of both transports:
    an ApiError or a calserve refusal is mapped (:func:`from_exception`); anything else is a genuine
    bug, logged with its traceback and answered 500 ``internal_error`` (tests assert none happen)."""
    if isinstance(exc, (ApiError, E.CalserveError)):
        return from_exception(exc)
    log.error("internal error: %s", exc, exc_info=exc)
    return ApiError(500, "internal server error", type="server_error", code="internal_error")


def error_event_to_api(ev: ErrorEvent) -> ApiError:
    """The engine's terminal ErrorEvent as an HTTP error (a JSON answer's status, or a stream's
    last ``data: {"error": ...}`` event)."""
    if ev.kind in ("unavailable", "shutdown"):
        return ApiError(503, ev.message, type="service_unavailable", code="model_unavailable",
                        retry_after=1.0)
    if ev.kind == "device_unavailable":  # device faults outlasted the request's re-admissions
        return ApiError(503, ev.message, type="service_unavailable", code="device_unavailable",
                        retry_after=1.0)
    if ev.kind == "device_error":
        return ApiError(500, ev.message, type="server_error", code="device_error")
    return ApiError(500, ev.message, type="server_error", code="internal_error")


def _retryable(
    exc: E.CalserveError, status: int, type: str, code: str, param: str | None, default_retry_s: float
) -> ApiError:
    """A 429/503 that always carries Retry-After: the exception's own hint, else ``default_retry_s``."""
    retry_after = exc.retry_after if exc.retry_after is not None else default_retry_s
    return ApiError(status, exc.message, type=type, param=param, code=code, retry_after=retry_after)


def msgspec_error(exc: msgspec.DecodeError | msgspec.ValidationError) -> ApiError:
    """A 400 from a msgspec failure, naming the field (``$.messages[0].content`` -> that path)."""
    from calserve.api.schemas import param_from_msgspec  # local: avoid an import cycle

    msg = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        return ApiError(400, msg, param=param_from_msgspec(msg), code="invalid_value")
    return ApiError(400, f"request body is not valid JSON: {msg}", code="invalid_json")
