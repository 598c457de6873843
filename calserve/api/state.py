"""What every route of both transports needs, one per app: :class:`ApiState`.

The quart app (:mod:`calserve.api.app`), its routes (:mod:`calserve.api.routes`) and the raw-ASGI
generation routes (:mod:`calserve.api.asgi`) all work on this one object: the engine host, the
metrics, the tenants' keys and the stream pacer. It imports none of them (no import circles).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, final

import msgspec
import trio
from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from calserve.api.lifecycle import EngineFactory, EngineHost
from calserve.api.metrics import ApiMetrics
from calserve.api.pacing import HoldTimer, StreamPacer
from calserve.api.protocol import EngineLike
from calserve.api.response_store import ResponseStore, run_store
from calserve.config import CalserveConfig, calserve_home, load_config
from calserve.errors import AuthError, EngineError

__all__ = ["ApiState", "resolve_default_packages"]

log = logging.getLogger("calserve.api")


@final
class ApiState:
    """Everything the routes need; one per app (``app.extensions['calserve']``)."""

    def __init__(self, config: CalserveConfig | None, factory: EngineFactory | None,
                 prepare: Callable[[CalserveConfig], CalserveConfig] | None) -> None:
        self._config = config
        self._factory = factory
        self._prepare = prepare
        self.host: EngineHost | None = None
        self.metrics = ApiMetrics(self._stats)
        self.api_keys: dict[str, str] = {}  # key -> tenant; empty = one "default" tenant
        self.startup_error: BaseException | None = None  # why before_serving failed, if it did
        self._pacer: StreamPacer | None = None
        self._store: ResponseStore | None = None
        #: How the streams wait out the pacer's holds: one task wakes them all (started and
        #: stopped with the app; until then a hold is ``trio.sleep_until``).
        self.holds = HoldTimer()
        reg = self.metrics.registry
        Gauge("calserve_stream_grouping", "1 while streams group tokens per chunk because the "
              "serving thread is saturated (server.stream_busy_interval_ms)",
              registry=reg).set_function(lambda: float(self._pacer is not None and self._pacer.engaged))
        Gauge("calserve_serving_thread_busy_ratio", "(run + runnable-waiting)/wall of the serving "
              "thread over the last pacing window (measured while streams write)",
              registry=reg).set_function(lambda: self._pacer.busy_fraction if self._pacer else 0.0)
        reg.register(_HoldCounters(self.holds))

    @property
    def needs_thread(self) -> bool:
        return self._factory is None

    def _stats(self) -> Any:
        return self.host.statistics() if self.host is not None else None

    @property
    def config(self) -> CalserveConfig:
        assert self.host is not None
        return self.host.config

    @property
    def pacer(self) -> StreamPacer:
        """The streams' hold interval, shared by all of them (one serving thread, one load)."""
        p = self._pacer
        if p is None:
            p = self._pacer = StreamPacer.from_config(self.config.server, self.holds)
        return p

    def responses_store(self) -> ResponseStore | None:
        """The stored responses (``api/response_store.py``; None: ``server.responses_store`` is
        off). Opened at first use: the server's (no injected engine) in
        ``CALSERVE_HOME/state/responses.sqlite3`` unless ``server.responses_store_path`` says
        where, an app with an injected engine in memory."""
        server = self.config.server
        if not server.responses_store:
            return None
        st = self._store
        if st is None:
            path = server.responses_store_path or (
                str(calserve_home() / "state" / "responses.sqlite3") if self._factory is None
                else ":memory:")
            st = self._store = ResponseStore(path, server.responses_ttl_s,
                                             server.responses_max_stored)
        return st

    async def keep_response(self, tenant: str, response: dict[str, Any],
                            input_items: list[dict[str, Any]] | None) -> None:
        """Store an answered response (``input_items`` None: it asked not to be; a failed one is
        not kept). Called before its last byte is sent; a store that fails is logged and counted,
        the answer goes out all the same (``api/response_store.py``)."""
        store = self.responses_store()
        if input_items is None or store is None or response.get("status") == "failed":
            return
        try:
            await run_store(lambda: store.put(tenant, response, input_items))
        except Exception:  # sqlite3.Error, OSError: the file, not the request
            log.exception("could not store response %s", response.get("id"))
            self.metrics.responses_stored.labels("error").inc()
            return
        self.metrics.responses_stored.labels("stored").inc()

    def close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def engine(self) -> EngineLike:
        """The running engine, or EngineError (503 ``engine_unavailable`` + Retry-After)."""
        host = self.host
        eng = host.engine if host is not None else None
        if eng is None:
            if host is not None and host.failed.is_set():
                raise EngineError("the engine failed and is not serving; restart the server")
            if host is None or host.loading:
                raise EngineError("the model is loading (the server is starting)", retry_after=1.0)
            raise EngineError("the engine is not running (stopping)")
        return eng

    def tenant_of(self, authorization: str) -> str:
        """Tenant of an ``Authorization`` header value ("" = none); AuthError (401) if unknown.
        Without configured keys everyone is the one "default" tenant. The one auth rule of every
        route (both transports)."""
        if not self.api_keys:
            return "default"
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("missing API key: send `Authorization: Bearer <key>`")
        name = self.api_keys.get(key.strip())
        if name is None:
            raise AuthError("invalid API key")
        return name

    def build_host(self) -> EngineHost:
        config = self._config if self._config is not None else load_config()
        factory = self._factory
        if factory is None:
            # The demo package (models without one) is built, on a first start, while the engine
            # opens behind the listening port (listen first), not before it.
            factory = _default_factory if self._prepare is not None else _resolving_factory
        if self._prepare is not None:
            config = self._prepare(config)
        self.api_keys = {k: name for name, t in config.tenants.items() for k in t.api_keys}
        self.metrics.init_labels(list(config.models), list(config.tenants) or ["default"])
        self.host = EngineHost(config, factory)
        return self.host


def _default_factory(config: CalserveConfig) -> AbstractAsyncContextManager[EngineLike]:
    # Typed: mypy checks here that the real engine satisfies EngineLike (and its handle HandleLike).
    from calserve.engine.engine import Engine  # lazy: the web layer imports without the engine

    return Engine.open(config, persist_budget=True)  # the reset budget survives a restart


@contextlib.asynccontextmanager
async def _resolving_factory(config: CalserveConfig) -> AsyncIterator[EngineLike]:
    """The default engine, after resolving models without a package to the demo package (built on a
    first start: seconds of file I/O, in a worker thread)."""
    config = await trio.to_thread.run_sync(resolve_default_packages, config)
    async with _default_factory(config) as engine:
        yield engine


def resolve_default_packages(config: CalserveConfig) -> CalserveConfig:
    """Models without a package use the built-in demo package, built on first start (logged)."""
    if all(m.package is not None for m in config.models.values()):
        return config
    try:
        from calserve.models.demo import demo_package_path, ensure_demo_package
    except ImportError:  # the engine resolves ``package: null`` itself
        return config
    built = not (demo_package_path() / "SHA256SUMS.sig").exists()
    path = ensure_demo_package()
    if built:  # said once, on the start that built it
        log.warning("calserve: built the demo package at %s (first start)", path)
    else:
        log.info("calserve: using the demo package at %s", path)
    models = {
        alias: (msgspec.structs.replace(m, package=str(path)) if m.package is None else m)
        for alias, m in config.models.items()
    }
    return msgspec.structs.replace(config, models=models)


class _HoldCounters(Collector):
    """The app's hold timer's counters (api/pacing.py): holds taken, and those released early at a
    wake-up of the serving loop from idle (``server.stream_hold_coalesce_ms``)."""

    def __init__(self, timer: HoldTimer) -> None:
        self._timer = timer

    def collect(self) -> Iterator[CounterMetricFamily]:
        t = self._timer
        yield CounterMetricFamily("calserve_stream_holds", "Stream chunks held by the app's hold "
                                  "timer (server.stream_interval_ms / stream_busy_interval_ms)",
                                  value=t.holds)
        yield CounterMetricFamily("calserve_stream_holds_coalesced", "Holds released early, with "
                                  "a wake-up of the serving loop from idle "
                                  "(server.stream_hold_coalesce_ms)", value=t.coalesced)
