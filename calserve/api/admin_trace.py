"""``GET /admin/v1/trace``: the engine's timed trace ring as Chrome trace JSON (admin token).

The ring (:mod:`calserve.engine.trace`, ``server.trace_events`` entries) holds the recent device
jobs (engine, kind, profile, lanes, submit, run, completion, status) and request phases (queued,
admitted, first token, lost, end). Save the answer to a file and open it in https://ui.perfetto.dev
or ``chrome://tracing``; ``bench/trace_tools.py`` computes the PING/PONG overlap fraction from it.

Query: ``last`` (optional, >= 1): only the most recent that many entries. The answer also carries
``otherData``: the engine's PING/PONG state and the overlap fraction of the exported window.
"""

from __future__ import annotations

from collections.abc import Callable

from quart import Response, request
from quart_trio import QuartTrio

from calserve.api.admin import ADMIN_PREFIX
from calserve.api.errors import ApiError
from calserve.api.state import ApiState
from calserve.engine.trace import chrome_trace, overlap_fraction

__all__ = ["trace_routes"]


def _last(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ApiError(400, "`last` must be an integer >= 1", param="last", code="invalid_value")
    return n


def trace_routes(app: QuartTrio, state: ApiState, require_admin: Callable[[], None]) -> None:
    from calserve.api.routes import json_response  # routes imports nothing of admin

    @app.get(f"{ADMIN_PREFIX}/trace")
    async def admin_trace() -> Response:
        require_admin()
        last = _last(request.args.get("last"))
        eng = state.engine()  # 503 engine_unavailable while none runs
        events_of = getattr(eng, "trace_events", None)
        if events_of is None:
            raise ApiError(404, "this engine keeps no trace", code="not_found")
        events = list(events_of())
        if last is not None:
            events = events[-last:]
        doc = chrome_trace(events)
        stats = eng.statistics()
        doc["otherData"] = {"pingpong_state": getattr(stats, "pingpong_state", "off"),
                            "entries": len(events), **overlap_fraction(doc)}
        return json_response(doc, headers={"Content-Disposition": 'inline; filename="calserve-trace.json"'})
