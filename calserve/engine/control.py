"""ModelControl: load, hot-replace, drain, unload and roll back model generations (spec §10-§12).

Every operation works on immutable generations (:class:`~calserve.engine.generations.Generation`);
a request is pinned to the generation it was admitted on for its whole life, and an alias is only
re-pointed (one dict assignment) once a new generation passed golden + warmup.

``load(alias, package)`` follows spec §11 in order: (1) resolve the path inside
``trust.model_root`` (outside: refused), (2) signature + every hash, (3) static validation and
compatibility with the runtime and the scheduler config, (4) the capacity plan
(:mod:`calserve.models.capacity`) — all of these outside the alias's lifecycle lock —, (5) the
lifecycle lock (409 when another operation on the alias runs), (6) on a runtime that cannot keep
two calbins resident (``calrt-0.7.6``) the old generation is drained and unloaded first, (7)
configure, (8) introspection, (9) golden + warmup, (10) publish, (11) keep the artifact for
rollback. Any refusal raises :class:`ControlError` naming the step; the old generation keeps
serving (on calrt-0.7.6, a refusal after the old one was unloaded re-publishes the old artifact
as a new generation, and the refusal is still reported).

Co-resident runtimes (sim-next): blue/green. The new generation loads beside the old one; after the
flip the old one drains in the background (it does not hold the alias's lock: a rollback issued
meanwhile is accepted): the requests it already admitted or queued finish on it, then it unloads.

Drain (spec §12): Ready -> Draining; new requests for an unloading alias are refused (503 +
Retry-After) by admission; on an unload the waiting requests end at once with an error; running ones
finish, or are cancelled at the drain deadline; submitted jobs always drain. When a job is still on
the device at the deadline the generation goes Recovering and nothing of it is freed until that job
came back (the executor's wait timeout resets the device if it never does). Then its sequences and
calbins are freed and the device DRAM it was charged is checked to be back -> Unloaded.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from calserve.config import CalserveConfig, calserve_home
from calserve.core.model_state import ModelState
from calserve.engine.backend import DeviceBackend
from calserve.engine.generations import BuildProgress, Generation, ModelManager, serving_profiles
from calserve.engine.types import GenerateRequest
from calserve.engine.timeswitch import Artifact, TimeSwitcher
from calserve.engine.unload import PHASES, Unloader
from calserve.errors import (CalserveError, ConfigError, EngineError, IntegrityError,
                             PackagePathError, SignatureError, UnavailableError, UnknownModel,
                             ValidationError)
from calserve.models.source import ModelSource
from calserve.runtime.types import CalrtError

if TYPE_CHECKING:
    from calserve.engine.driver import CoreDriver

__all__ = ["ModelControl", "ControlError", "Artifact", "PHASES", "WAIT_MODEL_RETRY_S"]

log = logging.getLogger("calserve.engine.control")

T = TypeVar("T")

WAIT_MODEL_RETRY_S = 2.0
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


class ControlError(CalserveError):
    """A refused lifecycle operation: HTTP ``status`` and ``code`` (the step that refused)."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.code = code


def _package_error(exc: BaseException) -> ControlError:
    """Steps 1-3 of spec §11 as a 400 naming the step."""
    if isinstance(exc, PackagePathError):
        code = "package_path"
    elif isinstance(exc, SignatureError):
        code = "signature"
    elif isinstance(exc, IntegrityError):
        code = "integrity"
    elif isinstance(exc, ValidationError):
        code = "validation"
    elif isinstance(exc, ConfigError):
        code = "compatibility"
    else:
        code = "package"
    msg = exc.message if isinstance(exc, CalserveError) else str(exc)
    return ControlError(400, code, msg, param="package")


class ModelControl:
    """The model control plane of one engine (the admin API calls it)."""

    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend, models: ModelManager,
                 driver: CoreDriver, nursery: trio.Nursery) -> None:
        self.cfg = cfg
        self.backend = backend
        self.models = models
        self.driver = driver
        self.core = driver.core
        self.nursery = nursery
        self._locks: dict[str, trio.Lock] = {}
        self.current: dict[str, Artifact] = {}
        self.previous: dict[str, Artifact] = {}
        # alias -> set while a single-resident switch runs: new requests wait (WaitingModel)
        self.switching: dict[str, trio.Event] = {}
        self.waiting_model = 0  # requests waiting for a switch now
        self.waiting_model_tokens = 0
        self.unloader = Unloader(backend, models, driver, nursery)
        self.switcher = TimeSwitcher(self)
        self.phases = self.unloader.phases
        self.switches_total: collections.Counter[str] = collections.Counter()
        self.operations_total: collections.Counter[tuple[str, str]] = collections.Counter()

    @property
    def co_resident(self) -> bool:
        return bool(self.backend.capabilities.multi_calbin)

    # ------------------------------------------------------------------------------ registry
    def adopt(self, gen: Generation, package: str) -> None:
        """A generation loaded at start-up: its artifact is the alias's current one."""
        entry = self.cfg.models.get(gen.alias)
        self.current[gen.alias] = Artifact(gen.id, package, gen.source.sha256,
                                           entry.timing if entry is not None else None)

    def lock_of(self, alias: str) -> trio.Lock:
        lock = self._locks.get(alias)
        if lock is None:
            lock = self._locks[alias] = trio.Lock()
        return lock

    def _acquire(self, alias: str) -> trio.Lock:
        lock = self.lock_of(alias)
        if lock.locked():
            raise ControlError(409, "lifecycle_busy",
                               f"another lifecycle operation on model {alias!r} is running")
        return lock

    # ------------------------------------------------------------------------------ operations
    async def load(self, alias: str, package: str, drain_timeout_s: float = 30.0, *,
                   expect_sha256: str | None = None, timing: str | None = None,
                   op: str = "load") -> Generation | None:
        """Spec §11 for ``package`` under ``alias`` (new alias, or a replacement). Runs to its end
        even if the caller goes away (a half-done replacement is worse than a late answer).
        None: registered non-resident (time-switching, loaded on demand)."""
        return await self._detached(lambda: self._load(alias, package, drain_timeout_s,
                                                       expect_sha256, timing, op))

    async def unload(self, alias: str, drain_timeout_s: float = 30.0) -> dict[str, Any]:
        return await self._detached(lambda: self._unload(alias, drain_timeout_s))

    async def rollback(self, alias: str, drain_timeout_s: float = 30.0) -> Generation | None:
        """Re-publish the previous generation's retained artifact (re-verified) through the same
        steps as a load; 409 ``no_previous`` when there is none."""
        parked = self.switcher.parked.get(alias)
        art = parked.previous if parked is not None else self.previous.get(alias)
        if (alias not in self.models.aliases and alias not in self.switching
                and parked is None):
            raise UnknownModel(f"model {alias!r} does not exist", param="alias")
        if art is None:
            raise ControlError(409, "no_previous",
                               f"model {alias!r} has no previous generation to roll back to")
        return await self.load(alias, art.package, drain_timeout_s, expect_sha256=art.sha256,
                               timing=art.timing, op="rollback")

    async def _detached(self, fn: Callable[[], Awaitable[T]]) -> T:
        done = trio.Event()
        box: dict[str, Any] = {}

        async def run() -> None:
            try:
                box["value"] = await fn()
            except Exception as e:  # handed to the caller (Cancelled propagates: shutdown)
                box["error"] = e
            finally:
                done.set()

        self.nursery.start_soon(run)
        await done.wait()
        if "error" in box:
            raise box["error"]
        if "value" not in box:
            raise EngineError("the engine is shutting down")
        result: T = box["value"]
        return result

    async def _load(self, alias: str, package: str, drain_timeout_s: float,
                    expect_sha256: str | None, timing: str | None, op: str) -> Generation | None:
        if not _ALIAS.match(alias):
            raise ControlError(400, "invalid_alias", f"alias {alias!r}: 1-64 characters of "
                               "letters, digits, '.', '_', ':' or '-'", param="alias")
        t0 = time.monotonic()
        entry = self.cfg.models.get(alias)
        if timing is None and entry is not None:
            timing = entry.timing  # models.<alias>.timing applies to every generation of it
        try:
            source, manifest = await trio.to_thread.run_sync(self.open_source, alias, package, timing)
            if expect_sha256 is not None and source.sha256 != expect_sha256:
                raise ControlError(409, "integrity", f"{package}: the retained artifact changed "
                                   f"(sha256 {source.sha256[:12]}..., expected "
                                   f"{expect_sha256[:12]}...)", param="package")
            try:
                members = serving_profiles(self.cfg, source, self.backend)
            except ConfigError as e:
                raise _package_error(e) from None
            old = self._current_gen(alias)
            if not self.co_resident and old is None and (
                    alias in self.switcher.parked or self.switcher.resident() is not None):
                # one resident calbin, taken by another alias: registered, loaded on demand (§13)
                self.plan(manifest, members, None, alone=True)
                async with self._acquire(alias):
                    self.switcher.park_new(alias, source, Artifact(0, package, source.sha256,
                                                                   timing))
                self.operations_total[(op, "ok")] += 1
                return None
            self.plan(manifest, members, old)  # step 4, outside the lock
            lock = self._acquire(alias)  # step 5
            async with lock:
                if self.co_resident or old is None:
                    gen = await self.build(source, package)
                    self.publish(gen, timing)
                    if old is not None:
                        self.unloader.in_background(old, drain_timeout_s)
                else:
                    gen = await self._switch(old, source, package, timing, drain_timeout_s)
        except BaseException as e:
            self.operations_total[(op, "refused" if isinstance(e, CalserveError) else "error")] += 1
            raise
        self.operations_total[(op, "ok")] += 1
        self.phases["load"].observe(time.monotonic() - t0)
        return gen

    def open_source(self, alias: str, package: str, timing: str | None) -> tuple[ModelSource, Any]:
        """Steps 1-3 (file I/O: a worker thread)."""
        from calserve.models.package import open_package
        from calserve.models.signing import TrustStore
        from calserve.models.source import source_from_package

        root = self.cfg.trust.model_root or str(calserve_home() / "models")
        try:
            pkg = open_package(package, TrustStore.from_config(self.cfg.trust), root)
            return source_from_package(pkg, alias, timing), pkg.manifest
        except CalserveError as e:
            raise _package_error(e) from None

    def plan(self, manifest: Any, members: list[int], old: Generation | None, *,
             alone: bool = False) -> None:
        """Step 4; ``alone``: as the one resident calbin (a time-switched alias)."""
        from calserve.models.capacity import plan_capacity

        cap, used = self.backend.dram()
        if alone:
            used = 0
        elif old is not None and not self.co_resident:
            used -= old.dram_bytes  # it is unloaded before the new one is configured
        plan = plan_capacity(manifest, members, cap, max(used, 0), self.cfg.scheduler.admission,
                             max_inflight=self.cfg.scheduler.executor.max_inflight,
                             shared_kv=len(members) > 1 and self.backend.capabilities.shared_kv)
        if not plan.fits:
            raise ControlError(409, "insufficient_capacity", f"capacity plan: {plan.reason}",
                               param="package")

    async def build(self, source: ModelSource, package: str) -> Generation:
        """Steps 7-9, refusals named by the step."""
        progress = BuildProgress()
        t0 = time.monotonic()
        try:
            gen = await self.models.build(source, package, progress)
        except CalserveError as e:
            code = progress.step
            raise ControlError(409 if code == "configure" else 400, code,
                               f"{code}: {e.message}", param="package") from None
        except (CalrtError, RuntimeError, ValueError, OSError) as e:  # the runtime refused
            raise ControlError(409, progress.step, f"{progress.step}: {e}", param="package") from None
        self.phases["configure"].observe(progress.configured_at - t0)
        self.phases["warmup"].observe(time.monotonic() - progress.configured_at)
        return gen

    def publish(self, gen: Generation, timing: str | None) -> None:
        old = self.current.get(gen.alias)
        self.models.publish(gen)  # step 10
        if old is not None:  # step 11: keep the replaced artifact
            self.previous[gen.alias] = old
            self.switches_total[gen.alias] += 1
        self.current[gen.alias] = Artifact(gen.id, gen.package, gen.source.sha256, timing)

    def _current_gen(self, alias: str) -> Generation | None:
        gid = self.models.aliases.get(alias)
        gen = self.models.generations.get(gid) if gid is not None else None
        return gen if gen is not None and gen.state is not ModelState.UNLOADED else None

    async def _switch(self, old: Generation, source: ModelSource, package: str,
                      timing: str | None, drain_timeout_s: float) -> Generation:
        """One resident calbin (calrt-0.7.6): drain + unload the old generation, then load the new
        one; new requests for the alias wait meanwhile (:meth:`wait_for_alias`). If the new one is
        refused, the old artifact is re-published (a new generation id) and the refusal raised."""
        alias = old.alias
        ev = self.switching[alias] = trio.Event()
        try:
            await self.unloader.retire(old, drain_timeout_s, admit_waiting=True, keep_listed=True)
            try:
                gen = await self.build(source, package)
            except ControlError as e:
                restored = await self._restore(alias, self.current[alias])
                e.message = (f"{e.message}; the previous package was re-published as generation "
                             f"{restored.id}")
                e.args = (e.message,)
                log.error("model %s: %s", alias, e.message, extra={"model": alias})
                raise
            self.publish(gen, timing)
            return gen
        finally:
            self.models.generations.pop(old.id, None)
            self.core.requests.forget(old)  # a pass may have re-created its (empty) queues
            if self.models.aliases.get(alias) == old.id:  # nothing could be re-published
                del self.models.aliases[alias]
            del self.switching[alias]
            ev.set()

    async def _restore(self, alias: str, art: Artifact) -> Generation:
        """Re-publish ``art`` (re-verified) after a refused switch: a new generation id."""
        source, _ = await trio.to_thread.run_sync(self.open_source, alias, art.package, art.timing)
        if source.sha256 != art.sha256:
            raise ControlError(500, "rollback_failed", f"{art.package}: the retained artifact "
                               "changed; nothing is serving this model")
        gen = await self.models.build(source, art.package)
        self.models.publish(gen)
        self.current[alias] = dataclasses.replace(art, generation=gen.id)
        self.operations_total[("auto_rollback", "ok")] += 1
        return gen

    async def _unload(self, alias: str, drain_timeout_s: float) -> dict[str, Any]:
        gen = self._current_gen(alias)
        if gen is None and alias in self.switcher.parked:  # not resident: nothing on the device
            async with self._acquire(alias):
                self.switcher.parked.pop(alias)
            self.operations_total[("unload", "ok")] += 1
            return {"alias": alias, "generation": None, "state": "Unloaded", "dram_freed_bytes": 0}
        if gen is None:
            raise UnknownModel(f"model {alias!r} does not exist", param="alias")
        lock = self._acquire(alias)
        async with lock:
            freed = await self.unloader.retire(gen, drain_timeout_s, admit_waiting=False)
            if self.models.aliases.get(alias) == gen.id:
                del self.models.aliases[alias]
            self.current.pop(alias, None)
            self.previous.pop(alias, None)
        self.operations_total[("unload", "ok")] += 1
        return {"alias": alias, "generation": gen.id, "state": gen.state.value,
                "dram_freed_bytes": freed}

    # ------------------------------------------------------------------------------ requests
    async def wait_for_alias(self, req: GenerateRequest) -> GenerateRequest:
        """WaitingModel: a request for an alias that is being switched (its one resident calbin
        replaced) or is not resident (time-switching, spec §13) waits until its generation is
        Ready, bounded by its deadline and the waiting budgets (else 503 + Retry-After). Returns
        the request with the time it waited taken off its deadline."""
        alias = req.model or self.models.default
        if alias not in self.switching and alias not in self.switcher.parked:
            return req
        adm = self.cfg.scheduler.admission
        n = len(req.prompt_tokens)
        if (self.waiting_model + 1 > adm.max_waiting_requests
                or self.waiting_model_tokens + n > adm.max_waiting_prompt_tokens):
            raise UnavailableError(f"model {alias!r} is being switched in and too many requests "
                                   "wait for it", retry_after=WAIT_MODEL_RETRY_S)
        rel = req.deadline_s if req.deadline_s is not None else adm.deadline_default_ms / 1000.0
        t0 = trio.current_time()
        deadline = t0 + rel
        self.waiting_model += 1
        self.waiting_model_tokens += n
        try:
            while trio.current_time() < deadline:
                ev = self.switching.get(alias)
                if ev is not None:
                    with trio.move_on_at(deadline):
                        await ev.wait()
                elif alias in self.switcher.parked:
                    refusal = await self.switcher.wait_resident(alias, deadline)
                    if refusal is not None:
                        raise UnavailableError(f"model {alias!r} could not be loaded: {refusal}",
                                               retry_after=WAIT_MODEL_RETRY_S)
                else:
                    break
        finally:
            self.waiting_model -= 1
            self.waiting_model_tokens -= n
        left = deadline - trio.current_time()
        if left <= 0 or alias in self.switching or alias in self.switcher.parked:
            raise UnavailableError(f"model {alias!r} is being switched in and was not ready "
                                   "within the request's deadline", retry_after=WAIT_MODEL_RETRY_S)
        return dataclasses.replace(req, deadline_s=left)

    # ------------------------------------------------------------------------------ reading
    def entries(self) -> list[dict[str, Any]]:
        """``GET /admin/v1/models``."""
        out = []
        for alias, gid in list(self.models.aliases.items()):
            gen = self.models.generations.get(gid)
            cur = self.current.get(alias)
            prev = self.previous.get(alias)
            gens = sorted((g for g in self.models.generations.values() if g.alias == alias),
                          key=lambda g: g.id)
            state = gen.state.value if gen is not None else ModelState.UNLOADED.value
            if alias in self.switching:
                state = "Loading"
            out.append({
                "alias": alias, "generation": gid, "state": state,
                "package": cur.package if cur is not None else (gen.package if gen else ""),
                "sha256": cur.sha256 if cur is not None else "",
                "previous": prev.generation if prev is not None else None,
                "resident": gen is not None and gen.state is not ModelState.UNLOADED,
                "generations": [self.generation_entry(g) for g in gens],
            })
        out.extend(self.switcher.entries())
        return out

    def generation_entry(self, g: Generation) -> dict[str, Any]:
        active, jobs = self.unloader.load_of(g)
        return {"id": g.id, "state": g.state.value, "active_requests": active,
                "inflight_jobs": jobs, "loaded_at": g.created, "sha256": g.source.sha256,
                "system_fingerprint": g.fingerprint, "dram_bytes": g.dram_bytes}

    def entry(self, alias: str) -> dict[str, Any]:
        for e in self.entries():
            if e["alias"] == alias:
                return e
        raise UnknownModel(f"model {alias!r} does not exist", param="alias")
