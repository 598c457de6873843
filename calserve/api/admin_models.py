"""The model control plane's admin routes (issue 14), behind the admin gate (:mod:`calserve.api.admin`).

- ``GET  /admin/v1/models`` -> ``{"models": [{"alias", "generation", "state", "package", "sha256",
  "previous", "resident", "generations": [{"id", "state", "active_requests", "inflight_jobs",
  "loaded_at", ...}]}]}``
- ``POST /admin/v1/models/{alias}/load`` ``{"package": "<path relative to trust.model_root>",
  "drain_timeout_s": 30}`` -> 200 with the alias's entry once the new generation is Ready and
  published (a new alias is created this way).
- ``POST /admin/v1/models/{alias}/unload`` ``{"drain_timeout_s": 30}`` -> 200 once the generation is
  Unloaded (its device memory freed); afterwards the alias is unknown (404).
- ``POST /admin/v1/models/{alias}/rollback`` ``{"drain_timeout_s": 30}`` (body optional) -> 200 with
  the entry once the previous artifact, re-verified, is Ready and published; 409 ``no_previous``.

Every refusal is a 4xx in the OpenAI error body whose ``code`` names the step that refused:
``package_path`` / ``signature`` / ``integrity`` / ``validation`` / ``compatibility`` /
``introspection`` / ``golden`` (400), ``configure`` / ``lifecycle_busy`` / ``insufficient_capacity`` /
``no_previous`` (409), ``model_not_found`` (404). On a runtime with one resident calbin, loading an
alias while another is resident registers it non-resident (answer ``"resident": false``; loaded when a
request for it arrives, :mod:`calserve.engine.timeswitch`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from calserve.api.admin import ADMIN_PREFIX
from calserve.api.bodies import decode
from calserve.api.errors import ApiError
from calserve.api.metrics_models import ModelControlCollector
from calserve.api.routes import json_response
from calserve.api.state import ApiState

__all__ = ["model_routes", "LoadBody", "DrainBody"]

_Timeout = Annotated[float, msgspec.Meta(ge=0, le=86400)]


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    package: str
    drain_timeout_s: _Timeout | None = None


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    drain_timeout_s: _Timeout | None = None


_DEFAULT_DRAIN_S = 30.0


def _timeout(v: float | None) -> float:
    return _DEFAULT_DRAIN_S if v is None else float(v)


def _refusal(exc: BaseException) -> ApiError | None:
    """A ControlError (duck-typed: the web layer imports no engine module) as its ApiError."""
    status = getattr(exc, "status", None)
    code = getattr(exc, "code", None)
    if not isinstance(status, int) or not isinstance(code, str):
        return None
    typ = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, str(getattr(exc, "message", exc)), type=typ,
                    param=getattr(exc, "param", None), code=code)


def model_routes(app: QuartTrio, state: ApiState, require_admin: Callable[[], None]) -> None:
    # the control plane's metric families (spec §16 model row) ride with its routes
    state.metrics.registry.register(ModelControlCollector(
        lambda: state.host.engine if state.host is not None else None))

    def control() -> Any:
        eng = state.engine()
        ctl = getattr(eng, "control", None)
        if ctl is None:
            raise ApiError(501, "this engine has no model control plane", type="server_error",
                           code="not_supported")
        return ctl

    async def body(kind: type[Any], optional: bool) -> Any:
        data = await request.get_data(cache=False, as_text=False)
        raw = data if isinstance(data, bytes) else data.encode()
        if optional and not raw.strip():
            raw = b"{}"
        return decode(kind, raw)

    async def operate(kind: type[Any], optional: bool,
                      op: Callable[[Any, Any], Awaitable[Any]]) -> Response:
        """An admin operation: the gate, its body, then ``op(control, body)``'s answer as JSON (a
        refusal of the control plane as its 4xx)."""
        require_admin()
        b = await body(kind, optional)
        ctl = control()
        try:
            return json_response(await op(ctl, b))
        except Exception as exc:
            err = _refusal(exc)
            if err is None:
                raise
            raise err from None

    @app.get(f"{ADMIN_PREFIX}/models")
    async def admin_models() -> Response:
        require_admin()
        return json_response({"models": control().entries()})

    @app.post(f"{ADMIN_PREFIX}/models/<alias>/load")
    async def admin_load(alias: str) -> Response:
        async def op(ctl: Any, b: Any) -> Any:
            await ctl.load(alias, b.package, _timeout(b.drain_timeout_s))
            return ctl.entry(alias)

        return await operate(LoadBody, False, op)

    @app.post(f"{ADMIN_PREFIX}/models/<alias>/unload")
    async def admin_unload(alias: str) -> Response:
        async def op(ctl: Any, b: Any) -> Any:
            return await ctl.unload(alias, _timeout(b.drain_timeout_s))

        return await operate(DrainBody, True, op)

    @app.post(f"{ADMIN_PREFIX}/models/<alias>/rollback")
    async def admin_rollback(alias: str) -> Response:
        async def op(ctl: Any, b: Any) -> Any:
            await ctl.rollback(alias, _timeout(b.drain_timeout_s))
            return ctl.entry(alias)

        return await operate(DrainBody, True, op)
