"""The quart-trio app factory: ``create_app(config=None, *, engine_factory=None)``.

``calserve:app`` (``hypercorn -k trio calserve:app``) is ``create_app()``: config from
``CALSERVE_CONFIG`` or the embedded default (software runtime + the demo package, built on first start
into ``calserve_home()``). The lifespan runs the engine through :class:`EngineHost` (own nursery,
explicit crash policy). What the routes share is :class:`~calserve.api.state.ApiState`; the two
generation routes are raw ASGI (:mod:`calserve.api.asgi`, served from :meth:`CalserveApp.__call__`),
the others quart routes (:mod:`calserve.api.routes`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Final, NoReturn

import msgspec
import trio
from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from calserve.api.admin import register_admin_routes, status_routes
from calserve.api.admin_models import model_routes
from calserve.api.admin_trace import trace_routes
from calserve.api.asgi import FastRoutes, fast_route
from calserve.api.bodies import too_large
from calserve.api.errors import ApiError, from_exception, to_api_error
from calserve.api.hygiene import (RateLimitedLog, body_timeout, head_error, refuse,
                                  shield_final_send)
from calserve.api.lifecycle import EngineFactory, EngineHost, describe
from calserve.api.request_ids import REQUEST_ID, echo_request_id, request_id_of
from calserve.api.responses_routes import register_response_routes
from calserve.api.routes import error_response, register_routes
from calserve.api.state import ApiState
from calserve.config import CalserveConfig, ServerConfig
from calserve.errors import CalserveError

__all__ = ["create_app", "ApiState", "CalserveApp", "ASYNCIO_REFUSAL", "get_state"]

log = logging.getLogger("calserve.api")

ASYNCIO_REFUSAL: Final = (
    "calserve:app runs on Trio only: start it with `hypercorn -k trio calserve:app` "
    "(or `calserve serve`); hypercorn's default asyncio worker is not supported"
)
_STOP_TIMEOUT_S: Final = 4.0  # < quart-trio's 5 s background-task deadline


def _trio_running() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _expected(exc: BaseException | None) -> bool:
    """A deliberate refusal (bad package/config): one log line, no traceback."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_expected(e) for e in exc.exceptions)
    return isinstance(exc, CalserveError)


class CalserveApp(QuartTrio):
    """QuartTrio that refuses, with a clear message, to run under an asyncio ASGI server, logs
    expected refusals (CalserveError) as one line instead of a traceback, and serves the two
    generation routes itself (``fast``, :mod:`calserve.api.asgi`) in front of quart, mounted or
    not (``asgi.fast_route``)."""

    fast: FastRoutes | None = None  # set by create_app
    limits: ServerConfig | None = None  # set at start-up: the protocol limits of every request
    refusals: RateLimitedLog  # set by create_app

    def log_exception(self, exception_info: Any) -> None:
        exc = exception_info[1] if exception_info else None
        if _expected(exc):
            self.logger.error("%s", exc)
            return
        super().log_exception(exception_info)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if _trio_running():
            if scope["type"] == "http":
                rid = request_id_of(scope)
                token = REQUEST_ID.set(rid)
                try:
                    await self._serve_http(scope, receive, echo_request_id(send, rid))
                finally:
                    REQUEST_ID.reset(token)
                return
            await super().__call__(scope, receive, send)
            return
        await self._refuse_asyncio(scope, receive, send)

    async def _serve_http(self, scope: Any, receive: Any, send: Any) -> None:
        send = shield_final_send(send)  # else keep-alive connections never time out
        limits = self.limits
        if limits is not None:
            err = head_error(scope, limits.max_header_bytes)
            if err is not None:
                self.refusals.warning(str(err.code), "refused a request head: %s", err.message)
                get_state(self).metrics.responses.labels(str(err.status)).inc()
                await refuse(send, receive, err, limits.body_timeout_s)
                return
        fast = self.fast
        if fast is not None:
            kind = fast_route(scope)
            if kind is not None:
                await fast(kind, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _refuse_asyncio(self, scope: Any, receive: Any, send: Any) -> None:
        print(f"error: {ASYNCIO_REFUSAL}", file=sys.stderr, flush=True)
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.failed", "message": ASYNCIO_REFUSAL})
                    return
                if msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            body = msgspec.json.encode(from_exception(ApiError(
                500, ASYNCIO_REFUSAL, type="server_error", code="wrong_worker")).body())
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})


def _exit_after(message: str | None, exc: BaseException | None) -> NoReturn:
    """End this (hypercorn CLI worker) process with exit code 1 after saying why once: the
    hypercorn CLI has no other way to stop a worker whose model cannot be served."""
    if message is not None:
        log.critical("%s", message, exc_info=None if exc is None or _expected(exc) else exc)
    for h in [*logging.getLogger().handlers, *log.handlers]:
        h.flush()
    sys.stderr.flush()
    os._exit(1)


async def _exit_on_start_failure(host: EngineHost) -> None:
    await host.opened.wait()
    if host.start_failure is not None:  # already logged once by the host
        _exit_after(None, None)


def get_state(app: QuartTrio) -> ApiState:
    st = app.extensions["calserve"]
    assert isinstance(st, ApiState)
    return st


def create_app(
    config: CalserveConfig | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    prepare_config: Callable[[CalserveConfig], CalserveConfig] | None = None,
    exit_on_start_failure: bool = False,
    guard_cli_listener: bool = False,
) -> CalserveApp:
    """Build the app. ``config`` None = ``load_config()`` at start-up (``CALSERVE_CONFIG`` or the
    embedded default); ``engine_factory(config)`` returns the engine's async context manager
    (default ``Engine.open``); ``prepare_config`` lets ``calserve serve`` rewrite the loaded config.
    ``exit_on_start_failure`` (``calserve:app`` under the hypercorn CLI): a config that cannot be
    loaded or a model that fails to load at start-up ends the process with exit code 1 after one
    log line (``calserve serve`` exits 1 through its own shutdown trigger instead).
    ``guard_cli_listener`` (``calserve:app``): under the hypercorn CLI's trio worker, the
    connection guard of ``calserve serve`` (cap, header timeout, error bodies, socket probe:
    :func:`calserve.api.listener.install_cli_guard`) is put in front of hypercorn's connections."""
    app = CalserveApp("calserve")
    app.refusals = RateLimitedLog(log)
    app.config["RESPONSE_TIMEOUT"] = None  # quart's 60 s default would end streams without [DONE]
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 5
    state = ApiState(config, engine_factory, prepare_config)
    app.extensions["calserve"] = state

    @app.before_serving
    async def _start() -> None:
        # A thread only when building the demo package may block (seconds of file I/O); with an
        # injected engine the start-up stays trio-native (autojump_clock-friendly: the fake
        # clock jumps while a worker thread runs).
        try:
            if state.needs_thread:
                host = await trio.to_thread.run_sync(state.build_host)
            else:
                host = state.build_host()
        except BaseException as e:
            state.startup_error = e
            if exit_on_start_failure and not isinstance(e, trio.Cancelled):
                _exit_after(f"calserve: could not start: {describe(e)}", e)
            raise  # `calserve serve` prints it once
        app.config["MAX_CONTENT_LENGTH"] = host.config.server.max_body_bytes
        app.config["BODY_TIMEOUT"] = host.config.server.body_timeout_s  # quart routes' bodies
        app.limits = host.config.server
        if guard_cli_listener:
            from calserve.api.listener import install_cli_guard

            install_cli_guard(host.config.server, state.metrics.registry)
        # Listen first: the engine opens (the model loads) in the background; host.run returns
        # at once and never raises (a start-up failure is host.start_failure, logged once).
        await app.nursery.start(host.run)
        # the streams' hold timer (pacing.HoldTimer): one task wakes every held stream, and the
        # holds due soon ride the loop's wake-ups from idle
        state.holds.coalesce_s = host.config.server.stream_hold_coalesce_ms / 1000.0
        await app.nursery.start(state.holds.run)
        if exit_on_start_failure:
            app.nursery.start_soon(_exit_on_start_failure, host)

    @app.after_serving
    async def _stop() -> None:
        state.holds.stop()
        if state.host is not None:
            await state.host.stop(_STOP_TIMEOUT_S)
        state.close_store()

    # The error mapping of the quart routes: the same function as the generation routes'.
    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError) -> Response:
        return error_response(err)

    @app.errorhandler(CalserveError)
    async def _calserve_error(err: CalserveError) -> Response:
        return error_response(to_api_error(err))

    @app.errorhandler(HTTPException)
    async def _http_error(err: HTTPException) -> Response:
        code = err.code or 500
        if code == 413:  # quart's own MAX_CONTENT_LENGTH check, same answer as ours
            return error_response(too_large(app.config["MAX_CONTENT_LENGTH"]))
        if code == 408:  # quart's BODY_TIMEOUT: the same answer as the generation routes'
            return error_response(body_timeout(app.config["BODY_TIMEOUT"]))
        names = {404: "not_found", 405: "method_not_allowed"}
        typ = "invalid_request_error" if code < 500 else "server_error"
        return error_response(ApiError(code, err.description or err.name, type=typ,
                                       code=names.get(code)))

    @app.errorhandler(Exception)
    async def _internal(err: Exception) -> Response:
        return error_response(to_api_error(err))  # genuine bugs only: logged, 500

    @app.after_request
    async def _count(resp: Response) -> Response:
        state.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    register_routes(app, state)
    register_response_routes(app, state)
    register_admin_routes(app, state, [status_routes, trace_routes, model_routes])
    app.fast = FastRoutes(state)
    return app
