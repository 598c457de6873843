"""The admin API's gate: ``/admin/v1/...`` routes and their bearer-token check.

Auth: ``admin.token`` in the config, else the env ``CALSERVE_ADMIN_TOKEN``; a request carries
``Authorization: Bearer <token>``. Missing or wrong → 401 (OpenAI error body, code
``invalid_admin_token``); no token configured → 403 naming ``admin.token`` (code
``admin_disabled``). Tenant API keys never grant admin. Tokens compare in constant time
(``hmac.compare_digest``).

Route groups register through :func:`register_admin_routes`: each group is a function
``(app, state, require_admin) -> None`` in its own module (the model control plane, the trace
export), so that the gate is written once.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from typing import Final

from quart import Response, request
from quart_trio import QuartTrio

from calserve.api.errors import ApiError
from calserve.api.state import ApiState
from calserve.config import CalserveConfig

__all__ = ["admin_token", "check_admin", "register_admin_routes", "AdminGroup", "ADMIN_PREFIX",
           "ENV_ADMIN_TOKEN", "status_routes"]

ADMIN_PREFIX: Final = "/admin/v1"
ENV_ADMIN_TOKEN: Final = "CALSERVE_ADMIN_TOKEN"

#: A group of admin routes: registers its routes; calls ``require_admin()`` first in each.
AdminGroup = Callable[[QuartTrio, ApiState, Callable[[], None]], None]


def admin_token(config: CalserveConfig) -> str | None:
    """The configured admin token (config first, then the environment); None = admin disabled."""
    tok = config.admin.token
    if tok is None:
        tok = os.environ.get(ENV_ADMIN_TOKEN) or None
    return tok if tok else None


def check_admin(expected: str | None, authorization: str) -> None:
    """Raise the ApiError of an admin request whose ``Authorization`` header is ``authorization``
    when it may not pass; return when it may."""
    if expected is None:
        raise ApiError(403, "the admin API is disabled: set `admin.token` in the config (or the "
                       f"environment variable {ENV_ADMIN_TOKEN})", type="permission_error",
                       param="admin.token", code="admin_disabled")
    scheme, _, given = authorization.partition(" ")
    given = given.strip()
    ok = scheme.lower() == "bearer" and bool(given)
    # compare_digest on bytes of any length: constant time in the secret's content.
    if not hmac.compare_digest(given.encode() if ok else b"", expected.encode()) or not ok:
        raise ApiError(401, "missing or invalid admin token: send `Authorization: Bearer "
                       "<admin.token>`", type="invalid_request_error",
                       code="invalid_admin_token")


def register_admin_routes(app: QuartTrio, state: ApiState, groups: list[AdminGroup]) -> None:
    """Register every admin route group behind the one gate."""

    def require_admin() -> None:
        check_admin(admin_token(state.config), request.headers.get("Authorization", ""))

    for group in groups:
        group(app, state, require_admin)


def status_routes(app: QuartTrio, state: ApiState, require_admin: Callable[[], None]) -> None:
    """``GET /admin/v1/status``: is the engine running, which aliases it serves (the gate's own
    smallest route; operators' tooling uses it to check a token)."""
    from calserve.api.routes import json_response  # routes imports nothing of admin

    @app.get(f"{ADMIN_PREFIX}/status")
    async def admin_status() -> Response:
        require_admin()
        host = state.host
        eng = host.engine if host is not None else None
        models = [i.alias for i in eng.models()] if eng is not None else []
        return json_response({"engine": "running" if eng is not None else "not_running",
                              "models": models})
