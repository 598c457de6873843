"""The Engine: an async context manager owning the device, the model generations and every task.

::

    async with Engine.open(config) as engine:        # device open, generation 1 loaded, tasks up
        handle = await engine.submit(GenerateRequest(prompt_tokens=(1, 2, 3)))
        async for ev in handle.events():              # TokenEvent* then FinishEvent | ErrorEvent
            ...
        engine.cancel(handle.request_id)              # idempotent

Supervision: one nursery holds the recovery task, one executor per enabled job engine, the
scheduler task and the request actors, all started with ``nursery.start``. The scheduling state is
the :class:`~calserve.engine.core.EngineCore`'s; the tasks are its shells
(:class:`~calserve.engine.driver.CoreDriver`). A crash in any of
them cancels the nursery; :attr:`failed` is set whenever the engine cannot serve any more (crash,
or every generation Failed after recovery gave up), so the HTTP layer drops readiness and
``calserve serve`` exits non-zero.

Shutdown (``__aexit__``): new submits are refused, every live request ends with a terminal event
(requests with a job on the device end when it drains: jobs are never abandoned), the tasks are
cancelled, the runtime sequences and calbins are released and the device is closed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio

from calserve.config import CalserveConfig, default_alias
from calserve.core.model_state import ModelState
from calserve.engine.backend import DeviceBackend, RuntimeBackend
from calserve.engine.control import ModelControl
from calserve.engine.drain import DrainReport, drain_engine
from calserve.engine.timeswitch import Artifact, Parked
from calserve.engine.driver import CoreDriver
from calserve.engine.generations import (Generation, ModelManager, release_members,
                                         serving_profile)
from calserve.engine.registry import RequestHandle, RequestRegistry
from calserve.engine.reset_budget import ResetBudget, open_budget
from calserve.engine.stats import StatisticsSources, build_statistics
from calserve.engine.types import EngineStatistics, GenerateRequest, ModelInfo, ProfileInfo
from calserve.models.source import ModelSource, load_sources
from calserve.runtime.types import JobEngine

__all__ = ["Engine", "RequestHandle"]

log = logging.getLogger("calserve.engine")

#: after the engine failed, its requests' terminal events may take this long to reach their handles
FAILED_GRACE_S = 5.0


class Engine:
    """Use :meth:`open`; the constructor only builds the parts (each gets what it needs at
    construction: nothing is wired afterwards)."""

    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend, nursery: trio.Nursery,
                 budget: ResetBudget | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.model_manager = ModelManager(cfg, backend)
        ex_cfg = cfg.scheduler.executor
        engines = [JobEngine.PING]
        if ex_cfg.max_inflight == 2 and not ex_cfg.fixed_engine and backend.capabilities.pingpong:
            engines.append(JobEngine.PONG)
        self.driver = CoreDriver(cfg, backend, self.model_manager, engines, budget)
        self.core = self.driver.core
        self.registry = RequestRegistry(cfg, self.model_manager, self.core, self.driver, nursery)
        self.control = ModelControl(cfg, backend, self.model_manager, self.driver, nursery)
        self._nursery = nursery
        # Set when the engine can no longer serve (crash, or every model Failed).
        self.failed = self.driver.recovery.failed
        self.leaked_at_close = 0
        # the last snapshot, taken after the drain and before the device is closed
        self.final_statistics: EngineStatistics | None = None

    @property
    def executors(self) -> list[Any]:
        """The executor shells, PING first (statistics, tests)."""
        return list(self.driver.executors.values())

    # ------------------------------------------------------------------------------------------
    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        cfg: CalserveConfig,
        *,
        backend: DeviceBackend | None = None,
        sources: Mapping[str, ModelSource] | None = None,
        persist_budget: bool = False,
    ) -> AsyncIterator[Engine]:
        """Open the device (unless ``backend`` is given), load every configured model as its first
        generation (``sources`` overrides the packages, e.g. an in-memory test model), start the
        tasks; on exit shut down cleanly (see the module docstring). ``persist_budget``: keep the
        reset budget in ``CALSERVE_HOME/state`` when ``recovery.state_dir`` is unset (the
        server's engine does; tests and tools keep it in memory unless a state dir is configured)."""
        own_backend = backend is None
        if backend is None:
            r = cfg.runtime
            backend = await RuntimeBackend.open(
                r.profile, r.dram_bytes, r.null_compute, r.completion_jitter_us, r.seed, r.faults,
                r.gc_gen0_threshold, device=r.device, completion_poll_us=r.completion_poll_us,
                host_multi_step=r.host_multi_step,
            )
        try:
            srcs = dict(sources) if sources is not None else await trio.to_thread.run_sync(
                load_sources, cfg, backend.capabilities
            )
            async with trio.open_nursery() as nursery:
                eng = cls(cfg, backend, nursery, open_budget(cfg, persist_budget))
                try:
                    await eng._load_configured(srcs, own_sources=sources is None)
                    await nursery.start(eng.driver.recovery.run)
                    for ex in eng.executors:
                        await nursery.start(ex.run)
                    await nursery.start(eng.driver.run)
                    await nursery.start(eng.control.switcher.run)
                    eng.registry.running = True
                    yield eng
                    await eng._drain()
                except BaseException:
                    eng.failed.set()
                    eng.registry.closing = True
                    raise
                finally:
                    nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await eng._release_all()
        finally:
            if own_backend:
                with trio.CancelScope(shield=True):
                    try:
                        await backend.aclose()
                    except Exception as e:  # a lost device: logged, never a traceback at exit
                        log.error("closing the device failed: %s", e)

    async def _load_configured(self, srcs: Mapping[str, ModelSource], own_sources: bool) -> None:
        """Every configured model as its first generation; on a runtime with one resident calbin
        and several aliases only the default one is loaded, the others are registered non-resident
        (time-switching, :mod:`calserve.engine.timeswitch`)."""
        cfg = self.cfg
        single = not self.backend.capabilities.multi_calbin
        order = sorted(cfg.models, key=lambda a: a != self.default_alias)  # the default first
        for i, alias in enumerate(order):
            entry = cfg.models[alias]
            if alias not in srcs:
                raise KeyError(f"no model source for alias {alias!r}")
            package = "" if not own_sources else (entry.package or "")
            if single and i > 0:
                serving_profile(cfg, srcs[alias], self.backend)  # an impossible config fails now
                self.control.switcher.park_new(alias, srcs[alias], Artifact(
                    0, package, srcs[alias].sha256, entry.timing))
                continue
            gen = await self.model_manager.load(srcs[alias], package)
            self.control.adopt(gen, package)

    async def _drain(self) -> None:
        """Graceful part of shutdown: terminal events for all, submitted jobs drained."""
        self.registry.shutdown()
        await self.registry.wait_empty()
        await self.driver.wait_idle()

    async def _release_all(self) -> None:
        """Return every lane (confirming releases) and every calbin to the device.

        ``leaked_at_close`` counts runtime sequences still bound to a lane of a request that never
        ended (only after a crash/outside cancellation); a clean shutdown leaves it 0."""
        await self.driver.wait_idle()
        gens = [g for g in self.model_manager.generations.values()
                if g.state is not ModelState.UNLOADED]
        for gen in gens:
            await self.driver.free_released(gen)
        self.final_statistics = self.statistics()
        if self.driver.watch.device_lost:
            # uncertain recovery: jobs may still sit on the device and it cannot be trusted; the
            # process is exiting (or serving 503) and the next one starts with a reset
            log.error("the device is lost: its calbins and sequences are not released")
            return
        for gen in gens:
            leftover = self.core.leftover_sequences(gen)
            self.leaked_at_close += len(leftover)
            await gen.calbin.free_sequences(leftover)
            await release_members(gen)  # every member of its KV group

    # ------------------------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> RequestHandle:
        """Accept a request or raise (RequestError / UnknownModel / CapacityError /
        UnavailableError / EngineError) — decided synchronously at admission."""
        # Create first (admission and, when a lane and an executor are free, the prefill dispatch
        # happen right here), then yield without a cancellation point: a request that was accepted
        # always reaches its caller, which owns its handle.
        if self.control.switching or self.control.switcher.parked:  # WaitingModel (switching)
            req = await self.control.wait_for_alias(req)
        handle = self.registry.create(req)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return handle

    async def drain(self, timeout_s: float, hurry: trio.Event | None = None) -> DrainReport:
        """Server-wide graceful drain before close (SIGTERM): :mod:`calserve.engine.drain`."""
        return await drain_engine(self.registry, self.driver, timeout_s, hurry)

    def cancel(self, request_id: int | str) -> None:
        """Idempotent; unknown or finished ids are ignored (ids may come back as strings)."""
        try:
            rid = int(request_id)
        except (TypeError, ValueError):
            return
        self.registry.cancel(rid)

    @property
    def default_alias(self) -> str:
        return default_alias(self.cfg)

    async def wait_failed(self) -> None:
        """Return when the engine can no longer serve (every model Failed with
        ``recovery.exit_on_failed``, or a task crashed), once its requests got their terminal
        events (at most a few seconds later): the HTTP side answers them before the host stops."""
        await self.failed.wait()
        with trio.move_on_after(FAILED_GRACE_S):
            await self.registry.wait_empty()

    def generation(self, alias: str | None = None) -> Generation:
        return self.model_manager.resolve(alias)

    def tokenizer(self, alias: str | None = None) -> Any:
        parked = self.control.switcher.parked.get(alias or self.default_alias)
        if parked is not None:
            return parked.source.tokenizer
        return self.model_manager.resolve(alias).source.tokenizer

    def ready(self, alias: str | None = None) -> bool:
        """Whether ``alias`` can be served now (a non-resident alias is loaded on demand: yes);
        without ``alias``: whether any alias can."""
        if self.failed.is_set() or self.registry.closing or not self.registry.running:
            return False
        parked = self.control.switcher.parked
        if alias is None:
            return bool(parked) or any(self.ready(a) for a in self.model_manager.aliases)
        if alias in parked:
            return True
        try:
            return self.model_manager.resolve(alias).state is ModelState.READY
        except Exception:
            return False

    def models(self) -> list[ModelInfo]:
        """The published aliases, for ``/v1/models`` and ``/ready``."""
        out = [info for alias, gid in self.model_manager.aliases.items()
               if (info := self._resident_info(alias, gid)) is not None]
        out += [self._parked_info(alias, p)
                for alias, p in sorted(self.control.switcher.parked.items())]  # loaded on demand
        return out

    def model_info(self, alias: str) -> ModelInfo | None:
        """:meth:`models`' first entry of ``alias`` (None: not served), built alone: a request
        resolves its model once, whatever the number of models served."""
        gid = self.model_manager.aliases.get(alias)
        info = self._resident_info(alias, gid) if gid is not None else None
        if info is None:
            p = self.control.switcher.parked.get(alias)
            info = self._parked_info(alias, p) if p is not None else None
        return info

    def _profiles(self, src: ModelSource) -> tuple[ProfileInfo, ...]:
        """A package's batch profiles as ``/v1/models`` lists them."""
        batch = self.backend.capabilities.batch_profiles
        return tuple(ProfileInfo(b, src.tiers.get(b, "C0" if b == 1 else "C3"), b == 1 or batch)
                     for b in sorted(src.profiles))

    def _resident_info(self, alias: str, gid: int) -> ModelInfo | None:
        g = self.model_manager.generations.get(gid)
        if g is None:
            return None
        return ModelInfo(alias, gid, g.state.value, g.max_seq, self._profiles(g.source),
                         g.source.sha256, g.created,
                         {"serving_batch": g.compiled_batch, "resident": True})

    def _parked_info(self, alias: str, p: Parked) -> ModelInfo:
        src = p.source
        spec = src.profiles[serving_profile(self.cfg, src, self.backend)]
        return ModelInfo(alias, 0, ModelState.UNLOADED.value, spec.max_seq, self._profiles(src),
                         src.sha256, 0, {"resident": False})

    def trace_events(self) -> list[tuple[Any, ...]]:
        """The timed trace ring (device jobs, request phases), oldest first (GET /admin/v1/trace)."""
        return self.core.requests.timeline.snapshot()

    def statistics(self) -> EngineStatistics:
        return build_statistics(StatisticsSources(
            core=self.core.statistics(trio.current_time()),
            recovery=self.driver.recovery.statistics(),
            generations=list(self.model_manager.generations.values()),
            models=self.model_manager.statistics(),
            counters={e.name.lower(): self.backend.counters(e) for e in self.driver.executors},
            requests_total=dict(self.registry.requests_total),
            rejected_total=dict(self.registry.rejected_total),
            pingpong_state=self.driver.watch.guard.state,
            pingpong_degradations_total=dict(self.driver.watch.guard.degradations_total),
        ))
