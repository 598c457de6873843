"""TimeSwitcher: several aliases on a runtime with one resident calbin (calrt-0.7.6, spec §13.1
"同板时间切换").

One alias is resident; the others are *parked*: verified, listed (``"state": "Unloaded",
"resident": false``), holding no device memory, their tokenizer and limits kept on the host so
requests can be prepared. A request for a parked alias waits (WaitingModel) and asks for a switch;
the switcher task drains and unloads the resident alias and loads the requested one through the
control plane's load steps (re-verified package, capacity plan, configure, introspection, golden).

Anti-thrashing policy:

- **minimum residency** (``switching.min_residency_s``): a resident alias is switched out only
  after it was resident this long, or earlier once it was idle (nothing waiting or running) for a
  quarter of that (:data:`IDLE_GRACE`);
- **batching per model**: the alias switched out drains with its queued requests admitted (they
  finish on it), and every request waiting for the alias switched in is served in that one
  residency; requests for the alias switched out wait for its next turn;
- **oldest demand first**: among parked aliases with waiting requests, the one whose first waiting
  request is oldest is switched in next (round robin under sustained demand).

So at most one switch per ``min_residency_s`` while several aliases have work, and none while only
the resident one does. A refused switch-in ends its waiting requests with 503 + Retry-After and the
refusal; the alias switched out stays loadable (it comes back on its next request).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import trio

from calserve.core.model_state import ModelState
from calserve.engine.generations import Generation, serving_profiles
from calserve.models.source import ModelSource

__all__ = ["TimeSwitcher", "Parked", "Artifact"]

log = logging.getLogger("calserve.engine.timeswitch")

#: A resident alias is switched out before its minimum residency only after it was idle (no request
#: of it waiting or running) for this share of ``switching.min_residency_s``: a closed-loop client's
#: next request arrives within milliseconds, and an alias idle for a moment is not "done".
IDLE_GRACE = 0.25


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A signed package a generation was loaded from (kept for rollback; re-verified on use)."""

    generation: int
    package: str  # as given: relative to trust.model_root (or absolute inside it)
    sha256: str
    timing: str | None


@dataclasses.dataclass
class Parked:
    """A registered, non-resident alias."""

    alias: str
    artifact: Artifact
    source: ModelSource  # weights dropped: the tokenizer, profiles and identity only
    previous: Artifact | None = None
    since: float = 0.0  # monotonic time it was parked


class TimeSwitcher:
    def __init__(self, control: Any) -> None:
        self.c = control  # the ModelControl (not imported: it imports this module)
        self.parked: dict[str, Parked] = {}
        self._demand: dict[str, float] = {}  # parked alias -> when its oldest waiter arrived
        self._waiters: dict[str, int] = {}
        self._arrived: dict[str, trio.Event] = {}  # set when the alias is resident (or refused)
        self._refused: dict[str, str] = {}
        self._wake = trio.Event()
        self.resident_since = 0.0
        self.switches_total = 0

    # ------------------------------------------------------------------------------ registry
    def park_new(self, alias: str, source: ModelSource, art: Artifact) -> None:
        """Register ``alias`` (verified, planned) without loading it."""
        old = self.parked.get(alias)
        self._refused.pop(alias, None)
        self.parked[alias] = Parked(alias, art, dataclasses.replace(source, weights={}),
                                    old.artifact if old is not None else None, time.monotonic())

    def resident(self) -> Generation | None:
        gens: list[Generation] = list(self.c.models.generations.values())
        for g in gens:
            if g.state is not ModelState.UNLOADED and self.c.models.aliases.get(g.alias) == g.id:
                return g
        return None

    # ------------------------------------------------------------------------------ requests
    async def wait_resident(self, alias: str, deadline: float) -> str | None:
        """Wait (until ``deadline``) for ``alias`` to be switched in; the refusal if it was not.
        A package refused once is not tried again until it is registered anew (admin load)."""
        if alias in self._refused:
            return self._refused[alias]
        now = trio.current_time()
        self._demand.setdefault(alias, now)
        self._waiters[alias] = self._waiters.get(alias, 0) + 1
        ev = self._arrived.get(alias)
        if ev is None:
            ev = self._arrived[alias] = trio.Event()
        self._wake.set()
        try:
            with trio.move_on_at(deadline):
                await ev.wait()
        finally:
            self._waiters[alias] -= 1
            if not self._waiters[alias]:
                del self._waiters[alias]
                self._demand.pop(alias, None)
        return self._refused.get(alias) if alias in self.parked else None

    # ------------------------------------------------------------------------------ the task
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._wake = trio.Event()
            target = self._next()
            if target is None:
                await self._wake.wait()
                continue
            await self._hold_residency()
            if target in self.parked and target in self._demand:
                await self._switch(target)

    def _next(self) -> str | None:
        cands = [(t, a) for a, t in self._demand.items() if a in self.parked]
        return min(cands)[1] if cands else None

    async def _hold_residency(self) -> None:
        """The anti-thrashing wait: until the resident alias has been resident for
        ``min_residency_s``, or has no work left."""
        gen = self.resident()
        if gen is None:
            return
        min_res = self.c.cfg.switching.min_residency_s
        until = self.resident_since + min_res
        grace = IDLE_GRACE * min_res
        idle_since: float | None = None
        while (now := trio.current_time()) < until:
            if self.c.unloader.load_of(gen) == (0, 0):
                idle_since = now if idle_since is None else idle_since
                # One arithmetic for the test and the wake-up: ``now - idle_since >= grace`` can
                # be false where ``idle_since + grace <= now`` (float rounding), and then the wait
                # below ended at once, for ever, at a fixed time (found by a random-seed run).
                idle_until = idle_since + grace
                if now >= idle_until:
                    return  # idle for a while: no one is being served by keeping it
                wake = min(until, idle_until)
            else:
                idle_since = None
                wake = until
            with trio.move_on_at(wake):
                await self.c.driver.wait_progress()

    async def _switch(self, target: str) -> None:
        c = self.c
        gen = self.resident()
        t0 = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            for a in sorted({target, *([gen.alias] if gen else [])}):  # one order: no deadlock
                await stack.enter_async_context(c.lock_of(a))
            if gen is not None:
                await self._park_resident(gen)
            p = self.parked[target]
            try:
                source, manifest = await trio.to_thread.run_sync(
                    c.open_source, target, p.artifact.package, p.artifact.timing)
                if source.sha256 != p.artifact.sha256:
                    raise RuntimeError("the package changed since it was registered")
                c.plan(manifest, serving_profiles(c.cfg, source, c.backend), None)
                new = await c.build(source, p.artifact.package)
            except Exception as e:  # refused: its waiters get 503, the alias stays parked
                msg = getattr(e, "message", None) or str(e)
                log.error("model %s: switch-in refused: %s", target, msg, extra={"model": target})
                c.operations_total[("switch", "refused")] += 1
                self._refused[target] = msg
                self._demand.pop(target, None)
                ev = self._arrived.pop(target, None)
                if ev is not None:
                    ev.set()
                return
            del self.parked[target]
            self._refused.pop(target, None)
            c.models.publish(new)
            c.current[target] = dataclasses.replace(p.artifact, generation=new.id)
            if p.previous is not None:
                c.previous[target] = p.previous
            self.resident_since = trio.current_time()
            self.switches_total += 1
            c.switches_total[target] += 1
            c.operations_total[("switch", "ok")] += 1
            c.phases["load"].observe(time.monotonic() - t0)
        log.info("model %s switched in as generation %d (%.2fs)", target, new.id,
                 time.monotonic() - t0, extra={"model": target, "generation": new.id})
        ev = self._arrived.pop(target, None)
        if ev is not None:
            ev.set()

    async def _park_resident(self, gen: Generation) -> None:
        """Drain + unload the resident alias (its queued requests finish on it); its new requests
        wait meanwhile, then for its next turn."""
        c = self.c
        alias = gen.alias
        ev = c.switching[alias] = trio.Event()
        try:
            await c.unloader.retire(gen, c.cfg.switching.drain_timeout_s, admit_waiting=True,
                                    keep_listed=True)
        finally:
            c.models.generations.pop(gen.id, None)
            c.core.requests.forget(gen)
            if c.models.aliases.get(alias) == gen.id:
                del c.models.aliases[alias]
            art = c.current.pop(alias, None)
            if art is not None:
                self.parked[alias] = Parked(alias, art, dataclasses.replace(gen.source, weights={}),
                                            c.previous.pop(alias, None), time.monotonic())
            del c.switching[alias]
            ev.set()

    # ------------------------------------------------------------------------------ reading
    def entries(self) -> list[dict[str, Any]]:
        return [{"alias": a, "generation": None, "state": ModelState.UNLOADED.value,
                 "package": p.artifact.package, "sha256": p.artifact.sha256,
                 "previous": p.previous.generation if p.previous is not None else None,
                 "resident": False, "generations": [],
                 "waiting_requests": self._waiters.get(a, 0)}
                for a, p in sorted(self.parked.items())]

