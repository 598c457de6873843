"""Build the frozen :class:`EngineStatistics` snapshot from the ``statistics()`` of the parts.

It reads only statistics objects (the core's, recovery's, each generation's admission controller
and KV lane manager, the runtime's per-engine counters), never the parts' internals.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

from calserve.core.admission import Outcome
from calserve.engine.core_stats import CoreStatistics
from calserve.engine.recovery import RecoveryStats
from calserve.engine.types import EngineStatistics, ExecutorEngineStats, TenantStats

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["build_statistics", "StatisticsSources"]


@dataclasses.dataclass(frozen=True)
class StatisticsSources:
    core: CoreStatistics
    recovery: RecoveryStats
    generations: list[Generation]
    models: dict[str, tuple[int, str]]  # ModelManager.statistics()
    counters: dict[str, Any]  # engine name -> the runtime's EngineCounters
    requests_total: dict[str, int]
    rejected_total: dict[str, int]
    pingpong_state: str = "off"
    pingpong_degradations_total: dict[str, int] = dataclasses.field(default_factory=dict)


def build_statistics(src: StatisticsSources) -> EngineStatistics:
    core = src.core
    rec = src.recovery
    tenants: dict[str, TenantStats] = {}
    kv_states: collections.Counter[str] = collections.Counter()
    kv_reserved = kv_used = kv_capacity = kv_lanes = 0
    admitted = 0
    waiting_tokens = 0
    for gen in src.generations:
        a = gen.admission.statistics()
        admitted += a.decisions.get(Outcome.ADMIT, 0)
        waiting_tokens += a.waiting_prompt_tokens
        for name, t in a.tenants.items():
            tenants[name] = TenantStats(t.waiting_requests, t.waiting_tokens, t.active_sequences,
                                        t.service, t.virtual_time - a.global_virtual_time)
        k = gen.kv.statistics()
        for state, n in (("Free", k.free), ("Reserved", k.reserved), ("Active", k.active),
                         ("Updating", k.updating), ("Unknown", k.unknown), ("Releasing", k.releasing)):
            kv_states[state] += n
        kv_reserved += k.tokens_reserved
        kv_used += k.tokens_committed
        kv_capacity += k.max_kv_tokens
        kv_lanes += k.num_lanes
    depth = {"decode": core.decode_ready, **core.prefill_ready}
    executors = {
        name: ExecutorEngineStats(c.submitted, c.completed, c.failed, c.busy, c.timeouts, c.inflight)
        for name, c in src.counters.items()
    }
    current_b = max((g.compiled_batch for g in src.generations), default=1)
    return EngineStatistics(
        requests_running=core.holders,
        requests_waiting=core.waiting,
        requests_total=src.requests_total,
        admitted_total=admitted,
        rejected_total=src.rejected_total,
        waiting_prompt_tokens=waiting_tokens,
        tenants=tenants,
        starvation_events_total=core.starvation_events_total,
        queue_depth=depth,
        queue_oldest_wait_s=core.queue_oldest_wait_s,
        batches_total=core.batches_total,
        lanes_active_total=core.lanes_active_total,
        lanes_total=core.lanes_total,
        decode_steps_total=core.decode_steps_total,
        current_compiled_batch=current_b,
        batch_wait_s_total=core.batch_wait_s_total,
        prefill_jobs_total=core.prefill_jobs_total,
        kv_sequences=dict(kv_states),
        kv_tokens_reserved=kv_reserved,
        kv_tokens_used=kv_used,
        kv_free_seconds_total=core.kv_free_seconds_total,
        executor_inflight_jobs=core.inflight_jobs,
        executor=executors,
        models=src.models,
        model_load_seconds={g.alias: g.load_seconds for g in src.generations},
        faults_total=rec.faults_total,
        resets_total=rec.resets_total,
        quarantined_jobs_total=core.quarantined_jobs_total,
        quarantined_kv_total=rec.quarantined_kv_total,
        recovery_seconds_total=rec.recovery_seconds_total,
        pingpong_state=src.pingpong_state,
        pingpong_degradations_total=dict(src.pingpong_degradations_total),
        reset_budget_level=rec.budget_level,
        resets_in_window=rec.resets_in_window,
        uncertain_recoveries_total=rec.uncertain_total,
        recovery_seconds_by_reason=dict(rec.recovery_seconds_by_reason),
        kv_tokens_capacity=kv_capacity,
        kv_lanes_total=kv_lanes,
        job_status_total=core.job_status_total,
        decided_early_total={"continuation": core.fast_steps_total - core.rotations_total,
                             "rotation": core.rotations_total},
        model_phase_seconds={g.alias: dict(g.phase_seconds) for g in src.generations},
        device_restarts_total=rec.device_restarts_total,
        requests_parked=core.parked,
        stream_parks_total=core.parks_total,
        timeslices_total=core.timeslices_total,
        decode_runs_stopped_total=core.runs_stopped_total,
        decode_steps_cut_total=core.steps_cut_total,
    )
