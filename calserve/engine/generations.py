"""ModelManager (first version): load each configured package as a numbered, immutable generation.

Spec §10/§11: a request is pinned to the :class:`Generation` it was created on; aliases point at
generations and are switched only after golden + warmup. There is no global "current model": every
path carries its generation. Hot replacement/unload/rollback come later; the shape is ready for it
(``ModelManager.generations`` keyed by id, ``aliases`` alias -> id, one lifecycle lock).

A :class:`ModelSource` is what a verified package (or a test) provides; :func:`source_from_package`
builds one from a verified package (:mod:`calserve.models.source`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import trio

from calserve.config import CalserveConfig, default_alias
from calserve.core.model_state import ModelEvent, ModelState
from calserve.core.model_state import fire as model_fire
from calserve.core.admission import AdmissionController, CapacityBudget, TenantPolicy
from calserve.core.kv import KvLaneManager
from calserve.core.wait_estimate import ServiceModel, running_cap
from calserve.engine.backend import BackendCalbin, DeviceBackend
from calserve.models.source import ModelSource
from calserve.errors import ConfigError, UnknownModel, ValidationError
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import JobEngine, JobStatus, ProfileSpec, Timing

__all__ = ["Generation", "ModelManager", "BuildProgress", "release_members"]

log = logging.getLogger("calserve.engine.generations")


@dataclasses.dataclass(eq=False)
class Generation:
    """One loaded, immutable model generation. Requests hold a reference; nothing global."""

    id: int
    alias: str
    source: ModelSource
    spec: ProfileSpec  # the serving profile (the largest member: capacity, model info)
    calbin: BackendCalbin  # the KV owner: sequences, prefill, frees (the only member without a group)
    admission: Any  # AdmissionController
    kv: Any  # KvLaneManager
    state: ModelState = ModelState.UNLOADED
    created: int = 0
    load_seconds: float = 0.0
    # load phase -> seconds (spec §16 model durations): configure, inspect, warmup
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # lane -> runtime sequence id of every lane holding a device sequence (recovery frees them)
    lane_seq: dict[int, int] = dataclasses.field(default_factory=dict)
    # compiled B -> member calbin of the generation's shared-KV group (spec §8: the decode profile is
    # chosen per tick among these). One entry (B -> ``calbin``) when the runtime has no shared KV.
    # Invariant: every member shares ``calbin``'s KvManager; any member runs any sequence's job.
    calbins: dict[int, BackendCalbin] = dataclasses.field(default_factory=dict)
    # --- the control plane's (engine/control.py) ------------------------------------------------
    package: str = ""  # the package path it was loaded from (as given, relative to trust.model_root)
    dram_bytes: int = 0  # device DRAM its members were charged (introspection), freed at unload
    weight: float = 1.0  # models.<alias>.weight: its share of the device against other generations
    # Being drained for an unload or a replacement: never Ready again (recovery leaves it Draining).
    retiring: bool = False
    # While Draining: requests already queued for it are still admitted (a replacement: they finish
    # here); False for an unload (they end with an error at once).
    admit_waiting: bool = True
    # The drain deadline passed: whatever is left is cancelled, the jobs on the device still drain.
    drain_expired: bool = False
    # Bytes of logits a prefill may return for every prompt position (a scored prompt in one job:
    # runtime capability prompt_logits, scheduler.batch.prompt_logits_max_bytes); 0: none
    prompt_logits_max: int = 0
    # Greedy decode steps a job may run on the device (runtime capability multi_step,
    # scheduler.batch.multi_step); 1: one step a job
    multi_step: int = 1
    # ... driven by the host (runtime capability host_multi_step): a run in flight can be ended
    # with its step in flight when other work waits for it (Planner.stop_runs)
    host_steps: bool = False

    def scores_in_prefill(self, prompt_len: int) -> bool:
        """Whether a scored prompt of ``prompt_len`` tokens takes its scores from its prefill."""
        return 1 < prompt_len and prompt_len * self.source.model_config.vocab_size * 4 <= (
            self.prompt_logits_max)

    def __post_init__(self) -> None:
        if not self.calbins:
            self.calbins = {self.spec.compiled_batch: self.calbin}

    @property
    def admitting(self) -> bool:
        """Admission runs for it (ready, or draining with its waiting requests admitted)."""
        return self.state is ModelState.READY or (self.state is ModelState.DRAINING and self.admit_waiting)

    @property
    def selecting(self) -> bool:
        """True when the decode profile is chosen per tick (more than one member loaded)."""
        return len(self.calbins) > 1

    @property
    def engines_serialise(self) -> bool:
        """Whether PING and PONG jobs of this model share the device's time (the package's timing
        figures say ``pingpong_overlap`` 0, or give none: spec §12, in-flight 2 does not prove
        overlap). Then a decode batch held back while a prefill runs loses no device time."""
        return all(t.pingpong_overlap == 0.0 for t in self.source.timing.values())

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint`` of every response it serves: generation id + package identity."""
        return f"calserve-g{self.id}-{self.source.sha256[:8]}"

    @property
    def compiled_batch(self) -> int:
        return self.spec.compiled_batch

    @property
    def max_seq(self) -> int:
        return self.spec.max_seq

    def fire(self, event: ModelEvent) -> None:
        self.state = model_fire(self.state, event)


@dataclasses.dataclass
class BuildProgress:
    """Where :meth:`ModelManager.build` is (a refusal names its step)."""

    step: str = "configure"  # configure | introspection | golden
    configured_at: float = 0.0  # monotonic time configure + introspection ended


def make_admission(
    cfg: CalserveConfig, max_sequences: int, max_kv_tokens: int, max_seq: int,
    timing: Timing | None = None, batch: int = 1,
) -> AdmissionController:
    """``timing``/``batch``: the modeled timing and compiled batch of the largest serving profile
    (the expected-wait estimate and the running-sequence cap, ``calserve.core.wait_estimate``)."""
    a = cfg.scheduler.admission
    service = ServiceModel.from_profile(batch) if timing is None else ServiceModel.from_profile(
        batch, decode_step_us=timing.decode_step_us, prefill_base_us=timing.prefill_base_us,
        prefill_us_per_token=timing.prefill_us_per_token)
    budget = CapacityBudget(
        max_sequences=max_sequences,
        max_kv_tokens=max_kv_tokens,
        max_waiting_requests=a.max_waiting_requests,
        max_waiting_prompt_tokens=a.max_waiting_prompt_tokens,
        max_inflight_jobs=a.max_inflight_jobs or cfg.scheduler.executor.max_inflight,
    )
    tenants = {
        name: TenantPolicy(t.weight, t.max_active_sequences, t.max_waiting_tokens, t.qps, t.burst)
        for name, t in cfg.tenants.items()
    }
    f = cfg.scheduler.fairness
    return AdmissionController(
        budget, max_seq, tenants, output_token_cost=f.output_token_cost, policy=f.policy,
        queues=cfg.scheduler.queues, service=service,
        max_expected_wait_s=None if a.max_expected_wait_ms is None else a.max_expected_wait_ms / 1e3,
        max_running=running_cap(a, batch, service.decode_step_s),
    )


def serving_profile(cfg: CalserveConfig, source: ModelSource, backend: DeviceBackend) -> int:
    """The largest compiled batch this generation serves (see :func:`serving_profiles`)."""
    return serving_profiles(cfg, source, backend)[-1]


_GROUP_FIELDS = ("max_seq", "max_sequences", "kv_dtype")


def serving_profiles(cfg: CalserveConfig, source: ModelSource, backend: DeviceBackend) -> list[int]:
    """The compiled batches this generation loads, ascending; the first is the KV owner.

    Sequences live in one KvManager, so a request cannot move between calbins unless they share it:
    with ``capabilities.shared_kv`` (sim-next) and no ``batch.instance_pool``, every configured
    profile joins one KV group and the decode profile is picked per tick (spec §8). Otherwise the
    instance serves one pool (``batch.instance_pool`` or the largest configured profile) and fills
    fewer lanes (valid mask) at low load. Fails fast on impossible configs (spec §15)."""
    want = _checked_profiles(cfg, source, backend)
    pool = cfg.scheduler.batch.instance_pool
    if pool is not None:
        if pool not in want:
            raise ConfigError("$.scheduler.batch.instance_pool must be one of batch.profiles")
        return [pool]
    members = sorted(set(want))
    if len(members) > 1 and backend.capabilities.shared_kv:
        first = source.profiles[members[0]]
        differ = [f"{f} (B{b})" for b in members for f in _GROUP_FIELDS
                  if getattr(source.profiles[b], f) != getattr(first, f)]
        if not differ:
            return members
        log.warning("model %s: profiles cannot share KV (%s differ): serving B%d only",
                    source.alias, ", ".join(differ), members[-1])
    return [members[-1]]


def _checked_profiles(cfg: CalserveConfig, source: ModelSource, backend: DeviceBackend) -> list[int]:
    want: list[int] = list(cfg.scheduler.batch.profiles)
    for b in want:
        if b not in source.profiles:
            raise ConfigError(
                f"$.scheduler.batch.profiles: B{b} is not a profile of package {source.alias!r} "
                f"(has {sorted(source.profiles)})"
            )
        if b > 1 and not backend.capabilities.batch_profiles:
            raise ConfigError(
                f"$.scheduler.batch.profiles: B{b} needs batch profiles, which runtime "
                f"{backend.capabilities.name} does not have"
            )
    return want


class ModelManager:
    """Owns generations and aliases (the per-alias lifecycle locks are the control plane's,
    :mod:`calserve.engine.control`)."""

    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend) -> None:
        self.cfg = cfg
        self.backend = backend
        self.generations: dict[int, Generation] = {}
        self.aliases: dict[str, int] = {}
        self._next_id = 1
        # Held by a recovery episode and while the control plane frees a generation's sequences and
        # calbins: a reset never runs while a calbin is being destroyed, nor a free under a reset.
        self.device_lock = trio.Lock()

    def resolve(self, alias: str | None) -> Generation:
        name = alias or default_alias(self.cfg)
        gid = self.aliases.get(name)
        if gid is None:
            raise UnknownModel(f"model {name!r} does not exist", param="model")
        return self.generations[gid]

    async def load(self, source: ModelSource, package: str = "") -> Generation:
        """Spec §11 steps 7-10 for an already verified source (start-up): build, then publish."""
        gen = await self.build(source, package)
        self.publish(gen)
        return gen

    def new_id(self) -> int:
        gid = self._next_id
        self._next_id += 1
        return gid

    @property
    def default(self) -> str:
        return default_alias(self.cfg)

    async def build(self, source: ModelSource, package: str = "",
                    progress: BuildProgress | None = None) -> Generation:
        """Spec §11 steps 7-9: configure every member, inspect, golden + warmup. The Ready generation
        is registered but not published; a failure releases what was loaded (Failed, never
        registered: no pass or recovery episode sees a generation being built)."""
        t0 = time.monotonic()
        progress = progress if progress is not None else BuildProgress()
        progress.step = "configure"
        members = serving_profiles(self.cfg, source, self.backend)
        b = members[-1]
        spec = source.profiles[b]
        gid = self.new_id()
        adm_cfg = self.cfg.scheduler.admission
        max_sequences = min(spec.max_sequences, adm_cfg.max_sequences or spec.max_sequences)
        max_kv = adm_cfg.max_kv_tokens or max_sequences * spec.max_seq
        calbins = await self._load_group(source, members)
        t_configured = time.monotonic()
        entry = self.cfg.models.get(source.alias)
        gen = Generation(
            id=gid,
            alias=source.alias,
            source=source,
            spec=spec,
            calbin=calbins[members[0]],
            admission=make_admission(self.cfg, max_sequences, max_kv, spec.max_seq,
                                     source.timing.get(b), b),
            kv=KvLaneManager(max_sequences, spec.max_seq, max_kv),
            calbins=calbins,
            package=package,
            weight=entry.weight if entry is not None else 1.0,
            prompt_logits_max=(self.cfg.scheduler.batch.prompt_logits_max_bytes
                               if self.backend.capabilities.prompt_logits else 0),
            multi_step=(self.cfg.scheduler.batch.multi_step
                        if self.backend.capabilities.multi_step else 1),
            host_steps=self.backend.capabilities.host_multi_step,
        )
        gen.fire(ModelEvent.LOAD)
        gen.fire(ModelEvent.VALIDATED)
        try:
            progress.step = "introspection"
            for mb, cb in calbins.items():  # introspection per member (spec §11 step 8)
                info = cb.introspect()
                gen.dram_bytes += int(info.get("dram_bytes", 0))
                if source.verify is not None:
                    source.verify(info, mb)
            gen.fire(ModelEvent.CONFIGURED)
            progress.step = "golden"
            progress.configured_at = t_inspected = time.monotonic()
            await self._golden(gen)
            gen.fire(ModelEvent.WARMED)
            gen.phase_seconds = {"configure": t_configured - t0,
                                 "inspect": t_inspected - t_configured,
                                 "warmup": time.monotonic() - t_inspected}
        except BaseException:
            gen.fire(ModelEvent.FAIL)
            with trio.CancelScope(shield=True):
                await release_members(gen)
            raise
        gen.created = int(time.time())
        gen.load_seconds = time.monotonic() - t0
        self.generations[gid] = gen  # Ready: listed (and passed over until published)
        if gen.selecting:
            how = "per-tick profile selection over one shared-KV group"
        else:
            pool = self.cfg.scheduler.batch.instance_pool
            how = (f"instance pool B{b} (batch.instance_pool)" if pool is not None
                   else f"instance pool B{b} (the largest configured profile)")
        log.info(
            "model %s generation %d ready (B%s: %s, %.2fs)", source.alias, gid,
            "/B".join(str(m) for m in members), how, gen.load_seconds,
            extra={"model": source.alias, "generation": gid},
        )
        return gen

    def publish(self, gen: Generation) -> None:
        """Spec §11 step 10: the alias points at ``gen`` (one assignment: atomic for every reader)."""
        self.aliases[gen.alias] = gen.id

    async def _load_group(self, source: ModelSource, members: Sequence[int]) -> dict[int, BackendCalbin]:
        """Load ``members`` (ascending): the first alone, the others into its KV group (same weights
        object, equal max_seq/max_sequences/kv_dtype). A failure releases what was loaded."""
        out: dict[int, BackendCalbin] = {}
        try:
            for mb in members:
                owner = out.get(members[0])
                spec = source.profiles[mb]
                timing = source.timing.get(mb)
                if owner is None:
                    out[mb] = await self.backend.load_calbin(source.model_config, source.weights, spec, timing)
                else:
                    out[mb] = await self.backend.load_calbin(
                        source.model_config, source.weights, spec, timing, kv_owner=owner)
        except BaseException:
            with trio.CancelScope(shield=True):
                for cb in reversed(list(out.values())):
                    await cb.release()
            raise
        return out

    async def _golden(self, gen: Generation) -> None:
        """Golden check + warmup straight on the calbin before any request can see it.

        Skipped (and logged) with ``runtime.null_compute``: that runtime computes nothing and returns
        pseudo-logits by design, so no golden comparison could pass; it exists for CPU benchmarks."""
        if self.cfg.runtime.null_compute:
            if gen.source.golden:
                log.warning(
                    "model %s generation %d: golden check skipped (runtime.null_compute: the "
                    "runtime computes nothing, outputs are not the model's)", gen.alias, gen.id,
                    extra={"model": gen.alias, "generation": gen.id})
            return
        for B, cb in gen.calbins.items():
            await self._golden_member(gen, B, cb)

    async def _golden_member(self, gen: Generation, B: int, cb: BackendCalbin) -> None:
        for prompt, per_b in gen.source.golden:
            expected = per_b.get(B)
            if not expected:
                continue
            sid = await cb.create_sequence()
            try:
                t = await cb.submit_prefill(sid, np.asarray(prompt, np.int32), JobEngine.PING)
                got: list[int] = []
                pos = len(prompt)
                while True:
                    r = await _wait_done(cb, t)
                    if r.status is not JobStatus.OK:
                        raise ValidationError(f"{gen.alias}: golden job ended {r.status.name}")
                    tok = int(np.argmax(r.logits[0 if r.logits.shape[0] == 1 else 0]))
                    got.append(tok)
                    if len(got) >= len(expected):
                        break
                    ids = np.full(B, sid, np.int32)
                    toks = np.zeros(B, np.int32)
                    toks[0] = tok
                    poss = np.zeros(B, np.int32)
                    poss[0] = pos
                    valid = np.zeros(B, np.uint8)
                    valid[0] = 1
                    ids[1:] = -1
                    t = await cb.submit_decode(ids, toks, poss, valid, JobEngine.PING)
                    pos += 1
                if got != list(expected):
                    raise ValidationError(
                        f"{gen.alias}: golden mismatch on B{B}: expected {list(expected)[:8]}..., "
                        f"got {got[:8]}..."
                    )
            finally:
                with trio.CancelScope(shield=True):
                    await cb.free_sequences([sid])

    def statistics(self) -> dict[str, tuple[int, str]]:
        return {a: (g, self.generations[g].state.value) for a, g in self.aliases.items()
                if g in self.generations}


async def release_members(gen: Generation) -> None:
    """Release every member calbin of a generation (owner last; any order is valid, the group's KV
    goes with its last member). Call with no job of the generation in flight."""
    for cb in sorted(gen.calbins.values(), key=lambda c: c is gen.calbin):
        await cb.release()


async def _wait_done(cb: BackendCalbin, ticket: Any) -> Any:
    with trio.CancelScope(shield=True):
        while True:
            r = await cb.wait(ticket, 30.0)
            if r is not None:
                return r
