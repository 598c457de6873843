"""Request bodies for every route of both transports: the size limit and the decoding, one rule each.

The generation routes read their body from ASGI ``receive`` (:mod:`calserve.api.asgi`), the other
routes through quart (:mod:`calserve.api.routes`); both refuse a body over
``server.max_body_bytes`` with the same 413 (on the declared Content-Length or on the bytes read,
whichever shows it first) and decode with the same msgspec decoders into the same 400s.

Nesting: a free-form value (a schema's ``Any``: ``tools``, ``response_format``, ``prompt``'s items,
...) nested deeper than :data:`MAX_JSON_DEPTH` is a 400 ``invalid_json`` naming it. msgspec itself
decodes ~900 levels into them and raises ``RecursionError`` (not a ``DecodeError``) beyond: that was
a 500 with a logged traceback per request; it is a 400 ``invalid_json`` too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np

from calserve.api.errors import ApiError, msgspec_error
from calserve.api.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody

__all__ = ["too_large", "check_declared", "decode", "decoder", "json_too_deep", "MAX_JSON_DEPTH"]

MAX_JSON_DEPTH: Final = 64  # OpenAI bodies nest < 10 levels; JSON schemas in tools a few more

T = TypeVar("T")

_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    """The one JSON decoder of body type ``kind`` (built once, with its free-form extractor)."""
    d = _DECODERS.get(kind)
    if d is None:
        d = _DECODERS[kind] = msgspec.json.Decoder(kind)
        _EXTRACT[kind] = _extractor(mi.type_info(kind), set()) or _none
    return d


_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_NOT_BRACKET: Final = bytes(b for b in range(256) if b not in b"[]{}")
_STEP: Final = np.zeros(256, np.int32)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_too_deep(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when JSON ``data`` nests arrays/objects deeper than ``limit``: two ``count`` calls
    when it has fewer brackets than that (the usual case), else the brackets' running depth
    outside strings (numpy)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    depth = np.cumsum(_STEP[np.frombuffer(brackets, np.uint8)])
    return bool(depth.size) and int(depth.max()) > limit


# Free-form values: where a schema says ``Any`` (``tools``, ``response_format``, ``prompt``'s
# items, ``messages[i].tool_calls``, ...) JSON may nest without bound; every typed part of a body
# nests only as deep as its schema. Each body kind gets, once, a function yielding its decoded
# free-form values with their parameter path (found with msgspec.inspect, so new fields count).
Found = Iterator[tuple[str, Any]]
Extract = Callable[[Any, str], Found]


def _none(v: Any, path: str) -> Found:
    return iter(())


def _free(kinds: tuple[type, ...]) -> Extract:
    def extract(v: Any, path: str) -> Found:
        if isinstance(v, kinds):
            yield path, v
    return extract


def _unwrap(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _extractor(t: mi.Type, building: set[type]) -> Extract | None:
    """None when values of type ``t`` hold no free-form value."""
    t = _unwrap(t)
    if isinstance(t, mi.AnyType):
        return _free((list, dict))
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        if isinstance(_unwrap(t.item_type), mi.AnyType):
            return _free((list, tuple))  # the whole container is one free-form value
        item = _extractor(t.item_type, building)
        if item is None:
            return None

        def items(v: Any, path: str) -> Found:
            if isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    yield from item(x, f"{path}[{i}]")
        return items
    if isinstance(t, mi.DictType):
        if isinstance(_unwrap(t.value_type), mi.AnyType):
            return _free((dict,))
        value = _extractor(t.value_type, building)
        if value is None:
            return None

        def values(v: Any, path: str) -> Found:
            if isinstance(v, dict):
                for k, x in v.items():
                    yield from value(x, f"{path}.{k}")
        return values
    if isinstance(t, mi.UnionType):
        subs = [e for e in (_extractor(u, building) for u in t.types) if e is not None]
        if not subs:
            return None

        def union(v: Any, path: str) -> Found:
            for e in subs:
                yield from e(v, path)
        return union
    if isinstance(t, mi.StructType):
        if t.cls in building:  # a recursive schema: take the value whole
            return _free((t.cls,))
        building.add(t.cls)
        fields = [(f.name, e) for f in t.fields
                  if (e := _extractor(f.type, building)) is not None]
        building.discard(t.cls)
        if not fields:
            return None

        def struct(v: Any, path: str) -> Found:
            if isinstance(v, t.cls):
                for name, e in fields:
                    yield from e(getattr(v, name), f"{path}.{name}" if path else name)
        return struct
    return None


_EXTRACT: dict[type[Any], Extract] = {}


def _too_deep(param: str | None) -> ApiError:
    return ApiError(400, f"request body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} "
                    "levels", param=param, code="invalid_json")


def decode(kind: type[T], data: bytes | str) -> T:
    """``data`` as a ``kind``, or a 400 naming the field (``invalid_value``/``invalid_json``, this
    one also for a free-form value nested deeper than :data:`MAX_JSON_DEPTH`)."""
    try:
        body = decoder(kind).decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise msgspec_error(e) from None
    except RecursionError:  # msgspec's own limit (~900 levels, the interpreter's stack)
        raise _too_deep(None) from None
    brackets = data.count(b"[") + data.count(b"{") if isinstance(data, bytes) else (
        data.count("[") + data.count("{"))
    if brackets > MAX_JSON_DEPTH:  # else nothing can nest deeper: the usual body stops here
        for path, value in _EXTRACT[kind](body, ""):
            if json_too_deep(msgspec.json.encode(value)):
                raise _too_deep(path)
    return body


for _k in (ChatBody, CompletionBody, DetokenizeBody, TokenizeBody):
    decoder(_k)  # build at import: a schema error fails here, not in a request


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
