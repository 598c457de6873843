"""Request bodies for every route of both transports: the size limit and the decoding, one rule each.

The generation routes read their body from ASGI ``receive`` (:mod:`calserve.api.asgi`), the other
routes through quart (:mod:`calserve.api.routes`); both refuse a body over
``server.max_body_bytes`` with the same 413 (on the declared Content-Length or on the bytes read,
whichever shows it first) and decode with the same msgspec decoders into the same 400s.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from calserve.api.errors import ApiError, msgspec_error
from calserve.api.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody

__all__ = ["too_large", "check_declared", "decode", "decoder"]

T = TypeVar("T")

_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    """The one JSON decoder of body type ``kind`` (built once)."""
    d = _DECODERS.get(kind)
    if d is None:
        d = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return d


for _k in (ChatBody, CompletionBody, DetokenizeBody, TokenizeBody):
    decoder(_k)  # build at import: a schema error fails here, not in a request


def decode(kind: type[T], data: bytes | str) -> T:
    """``data`` as a ``kind``, or a 400 naming the field (``invalid_value``/``invalid_json``)."""
    try:
        return decoder(kind).decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise msgspec_error(e) from None


def too_large(limit: int) -> ApiError:
    """The 413 of a body over ``server.max_body_bytes`` (``limit``)."""
    return ApiError(413, f"request body exceeds server.max_body_bytes ({limit})",
                    code="request_too_large")


def check_declared(content_length: int | bytes | str | None, limit: int) -> None:
    """413 before reading when the declared length is over ``limit``; an unreadable Content-Length
    is left to the bytes actually read."""
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        return
    if declared > limit:
        raise too_large(limit)
