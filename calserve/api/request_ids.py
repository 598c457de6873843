"""Request ids: ``X-Request-Id`` accepted from the client (or generated), echoed on the response,
in JSON error bodies (``"request_id"`` beside ``"error"``), in the access log and in log records.

:class:`~calserve.api.app.CalserveApp` calls :func:`request_id_of` for every HTTP request and sets
:data:`REQUEST_ID` (a context variable, so the handler's tasks and log records see it) and wraps
``send`` with :func:`echo_request_id`. A client's id is kept only when it is a short token
(letters, digits, ``-._:/+=@``, at most 128 characters): anything else could forge log lines or
blow up log storage, and is replaced by a generated one.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

__all__ = ["REQUEST_ID", "HEADER", "request_id_of", "echo_request_id", "new_request_id"]

HEADER: Final = b"x-request-id"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("calserve_request_id",
                                                                         default=None)
_VALID: Final = re.compile(rb"[A-Za-z0-9\-._:/+=@]{1,128}")

Send = Callable[[dict[str, Any]], Awaitable[None]]


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_of(scope: dict[str, Any]) -> str:
    """The request's id: its valid ``X-Request-Id`` header (the first), else a new one."""
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            if _VALID.fullmatch(value):
                return str(value.decode("ascii"))
            break
    return new_request_id()


def echo_request_id(send: Send, rid: str) -> Send:
    """``send`` that adds ``X-Request-Id: rid`` to the response head."""
    header = (HEADER, rid.encode("ascii"))

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    wrapped.__wrapped__ = send  # type: ignore[attr-defined]  # the server's own (socket_probe,
    # chunked_send: a body chunk with more_body skips this wrapper, so it must act on nothing else)
    return wrapped
