"""Logging of ``calserve serve``: text lines or one JSON object per line (``server.log_format``).

Both carry the request id (:mod:`calserve.api.request_ids`) of the HTTP request whose handler
logged the record; hypercorn's access lines end with the response's ``X-Request-Id`` and, as JSON,
become fields (``remote``, ``method``, ``path``, ``status``, ``bytes``, ``duration_s``,
``request_id``, ``user_agent``) instead of a preformatted line.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from calserve.api.request_ids import REQUEST_ID

__all__ = ["JsonFormatter", "RequestIdFilter", "configure_logging", "ACCESS_LOG_FORMAT",
           "TEXT_FORMAT"]

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: hypercorn's access line (its default atoms) + the response's request id.
ACCESS_LOG_FORMAT: Final = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss request_id=%({x-request-id}o)s'
#: Fields the engine passes as ``extra=`` that a JSON line keeps.
_EXTRAS: Final = ("job_id", "request_ids", "model", "generation", "reason", "tenant")
_ACCESS: Final = {"remote": "h", "method": "m", "path": "U", "query": "q", "status": "s",
                  "bytes": "b", "duration_s": "L", "user_agent": "a",
                  "request_id": "{x-request-id}o"}


class RequestIdFilter(logging.Filter):
    """Puts the current HTTP request's id on the record (``record.http_request_id``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.http_request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, request_id, the
    engine's extras, exc (a traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name,
        }
        args = record.args
        if record.name == "hypercorn.access" and isinstance(args, Mapping):
            out["message"] = "access"
            for field, atom in _ACCESS.items():
                v = args[atom]
                if v not in (None, "-"):
                    out[field] = v
        else:
            out["message"] = record.getMessage()
        rid = getattr(record, "http_request_id", None)
        engine_rid = getattr(record, "request_id", None)
        if rid is not None:
            out.setdefault("request_id", rid)
        if engine_rid is not None:
            out["engine_request_id" if "request_id" in out else "request_id"] = engine_rid
        for name in _EXTRAS:
            v = getattr(record, name, None)
            if v is not None:
                out[name] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out, enc_hook=str).decode()


def configure_logging(level: str, log_format: str) -> None:
    """The root logger of ``calserve serve``: one stderr handler, text or JSON, with request ids."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
