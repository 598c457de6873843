"""Build the frozen :class:`EngineStatistics` snapshot from the ``statistics()`` of the parts."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import trio

from calserve.engine.types import EngineStatistics, ExecutorEngineStats, TenantStats

if TYPE_CHECKING:
    from calserve.engine.engine import Engine

__all__ = ["build_statistics"]


def build_statistics(eng: Engine) -> EngineStatistics:
    sched = eng.scheduler.statistics()
    rec = eng.recovery.statistics()
    now = trio.current_time()
    tenants: dict[str, TenantStats] = {}
    kv_states: collections.Counter[str] = collections.Counter()
    kv_reserved = kv_used = 0
    admitted = 0
    waiting_tokens = 0
    starvation = sched.starvation_events_total
    queue_oldest: dict[str, float] = {"decode": 0.0, "short": 0.0, "medium": 0.0, "long": 0.0}
    for gen in eng.model_manager.generations.values():
        a = gen.admission.statistics()
        from calserve.core.admission import Outcome

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
        q = eng.scheduler.queues(gen)
        if q.decode_ready:
            oldest = min(s.ready_since for s in q.decode_ready.values())
            queue_oldest["decode"] = max(queue_oldest["decode"], now - oldest)
        for c, dq in q.prefill.items():
            live = [s for s in dq if not s.ended and s.inflight is None]
            if live and live[0].admitted_at is not None:
                queue_oldest[c.value] = max(queue_oldest[c.value], now - live[0].admitted_at)
    depth = {"decode": sched.decode_ready, **sched.prefill_ready}
    executors: dict[str, ExecutorEngineStats] = {}
    for ex in eng.executors:
        cnt = eng.backend.counters(ex.engine)
        executors[ex.engine.name.lower()] = ExecutorEngineStats(
            cnt.submitted, cnt.completed, cnt.failed, cnt.busy, cnt.timeouts, cnt.inflight
        )
    reg = eng.registry
    running = sched.holders
    current_b = max((g.compiled_batch for g in eng.model_manager.generations.values()), default=1)
    return EngineStatistics(
        requests_running=running,
        requests_waiting=sched.waiting,
        requests_total=dict(reg.requests_total),
        admitted_total=admitted,
        rejected_total=dict(reg.rejected_total),
        waiting_prompt_tokens=waiting_tokens,
        tenants=tenants,
        starvation_events_total=starvation,
        queue_depth=depth,
        queue_oldest_wait_s=queue_oldest,
        batches_total=sched.batches_total,
        lanes_active_total=sched.lanes_active_total,
        lanes_total=sched.lanes_total,
        current_compiled_batch=current_b,
        batch_wait_s_total=sched.batch_wait_s_total,
        prefill_jobs_total=sched.prefill_jobs_total,
        kv_sequences=dict(kv_states),
        kv_tokens_reserved=kv_reserved,
        kv_tokens_used=kv_used,
        kv_free_seconds_total=eng.scheduler.kv_free_seconds_total,
        executor_inflight_jobs=sched.inflight_jobs,
        executor=executors,
        models=eng.model_manager.statistics(),
        model_load_seconds={g.alias: g.load_seconds for g in eng.model_manager.generations.values()},
        faults_total=rec.faults_total,
        resets_total=rec.resets_total,
        quarantined_jobs_total=rec.quarantined_jobs_total,
        quarantined_kv_total=rec.quarantined_kv_total,
        recovery_seconds_total=rec.recovery_seconds_total,
    )

