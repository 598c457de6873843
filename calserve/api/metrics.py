"""Prometheus metrics (spec §16): a Collector that reads ``engine.statistics()`` on each scrape, plus
latency histograms observed by the HTTP layer.

One ``CollectorRegistry`` per app (never the global one), so tests can build many apps. Labels are
bounded: alias, tenant, outcome, state, class, engine, reason, compiled_batch — never request or
job ids (spec §16: those go to logs only).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import (
    GCCollector, CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector,
    ProcessCollector, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from calserve import __version__
from calserve.api.metrics_faults import fault_metrics
from calserve.engine.types import EngineStatistics

__all__ = ["ApiMetrics", "EngineCollector", "CONTENT_TYPE", "version_info"]

def version_info() -> dict[str, str]:
    """What ``GET /version`` answers and ``calserve_build_info`` labels (bounded: one series)."""
    return {"version": __version__, "python": platform.python_version(),
            "implementation": platform.python_implementation()}


CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
_ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _g(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _c(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, label: str,
    values: dict[str, float] | dict[str, int] | dict[int, int],
) -> Metric:
    m = kind(name, doc, labels=[label])
    for k, v in sorted(values.items(), key=lambda kv: str(kv[0])):
        m.add_metric([str(k)], float(v))
    return m


class EngineCollector(Collector):
    """Reads one ``EngineStatistics`` snapshot per scrape. ``source`` returns None while no engine
    runs (starting, failed, stopped): then only ``calserve_engine_up 0`` is exported."""

    def __init__(self, source: Callable[[], EngineStatistics | None]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._source()
        yield _g("calserve_engine_up", "1 while the engine runs and has not failed", 0 if s is None else 1)
        if s is None:
            return
        G, C = GaugeMetricFamily, CounterMetricFamily
        # admission
        yield _g("calserve_requests_running", "Admitted, not yet terminal requests", s.requests_running)
        yield _g("calserve_requests_waiting", "Requests waiting for admission or model", s.requests_waiting)
        yield _g("calserve_requests_parked", "Running requests parked: client behind, or taking turns (time-slicing)",
                 s.requests_parked)
        yield _c("calserve_stream_parks", "Streams parked because their client was behind", s.stream_parks_total)
        yield _c("calserve_timeslices", "Running requests parked to let a waiting one run (time-slicing)",
                 s.timeslices_total)
        yield _g("calserve_waiting_prompt_tokens", "Prompt tokens of waiting requests", s.waiting_prompt_tokens)
        yield _c("calserve_admitted", "Requests admitted", s.admitted_total)
        yield _labelled(C, "calserve_rejected", "Requests rejected at admission by outcome", "outcome",
                        with_known(s.rejected_total, REJECT_OUTCOMES))
        yield _labelled(C, "calserve_requests_finished", "Terminal requests by outcome", "outcome",
                        with_known(s.requests_total, FINISH_OUTCOMES))
        # fairness (per tenant)
        tw = G("calserve_tenant_waiting_requests", "Waiting requests per tenant", labels=["tenant"])
        tt = G("calserve_tenant_waiting_tokens", "Waiting prompt tokens per tenant", labels=["tenant"])
        ta = G("calserve_tenant_active_sequences", "Active sequences per tenant", labels=["tenant"])
        ts = C("calserve_tenant_service_tokens", "Delivered service (cost units) per tenant", labels=["tenant"])
        tl = G("calserve_tenant_virtual_lag", "Tenant virtual time minus global virtual time", labels=["tenant"])
        for name, t in sorted(s.tenants.items()):
            tw.add_metric([name], t.waiting_requests)
            tt.add_metric([name], t.waiting_tokens)
            ta.add_metric([name], t.active_sequences)
            ts.add_metric([name], t.service_tokens)
            tl.add_metric([name], t.virtual_lag)
        yield from (tw, tt, ta, ts, tl)
        yield _c("calserve_starvation_events", "Times a long-waiting request was forced ahead", s.starvation_events_total)
        # queues
        yield _labelled(G, "calserve_queue_depth", "Queue depth by class", "class", s.queue_depth)
        yield _labelled(G, "calserve_queue_oldest_wait_seconds", "Oldest wait by class", "class", s.queue_oldest_wait_s)
        # batches
        yield _labelled(C, "calserve_batches", "Decode batches run by compiled batch size", "compiled_batch", s.batches_total)
        yield _labelled(C, "calserve_batch_lanes_active", "Active lanes summed over batches", "compiled_batch", s.lanes_active_total)
        yield _labelled(C, "calserve_batch_lanes", "Compiled lanes summed over batches", "compiled_batch", s.lanes_total)
        yield _labelled(C, "calserve_decode_steps", "Device steps run by decode batches (multi-step decode: "
                        "several a batch)", "compiled_batch", s.decode_steps_total)
        fill = G("calserve_batch_fill_ratio", "Active / compiled lanes over all batches", labels=["compiled_batch"])
        waste = C("calserve_batch_lane_waste", "Inactive (wasted) lanes summed over batches", labels=["compiled_batch"])
        for b, total in sorted(s.lanes_total.items()):
            active = s.lanes_active_total.get(b, 0)
            fill.add_metric([str(b)], active / total if total else 0.0)
            waste.add_metric([str(b)], float(total - active))
        yield from (fill, waste)
        yield _g("calserve_batch_compiled_size", "Compiled batch size currently in use", s.current_compiled_batch)
        yield _c("calserve_batch_wait_seconds", "Time spent waiting to fill batches", s.batch_wait_s_total)
        yield _c("calserve_prefill_jobs", "Prefill jobs submitted", s.prefill_jobs_total)
        yield _labelled(C, "calserve_decode_jobs_decided_early",
                        "Decode jobs decided and submitted before the completion that freed their "
                        "engine was booked (continuation: the same sequences; rotation: another "
                        "batch of the ready set)", "how",
                        with_known(s.decided_early_total, ("continuation", "rotation")))
        yield _c("calserve_decode_runs_stopped", "Multi-step decodes driven by the host asked to end "
                 "with their step in flight: a prompt waited for them, or one of their requests "
                 "ended early", s.decode_runs_stopped_total)
        yield _c("calserve_decode_steps_cut", "Device steps host-driven runs did not run (stopped early, or every lane "
                 "ended on its end token first)",
                 s.decode_steps_cut_total)
        # KV
        yield _labelled(G, "calserve_kv_sequences", "KV sequences by state", "state",
                        with_known(s.kv_sequences, KV_STATES))
        yield _g("calserve_kv_tokens_reserved", "KV tokens reserved", s.kv_tokens_reserved)
        yield _g("calserve_kv_tokens_used", "KV tokens used", s.kv_tokens_used)
        yield _c("calserve_kv_free_seconds", "Time spent freeing KV sequences", s.kv_free_seconds_total)
        # executor
        yield _g("calserve_executor_inflight_jobs", "Jobs submitted to the device and not yet waited", s.executor_inflight_jobs)
        fams = {
            f: C(f"calserve_executor_jobs_{f}", f"Executor jobs {f} by engine", labels=["engine"])
            for f in ("submitted", "completed", "failed", "busy", "timeouts")
        }
        inflight = G("calserve_executor_engine_inflight", "In-flight jobs by engine", labels=["engine"])
        for eng, es in sorted(s.executor.items()):
            for f, fam in fams.items():
                fam.add_metric([eng], getattr(es, f))
            inflight.add_metric([eng], es.inflight)
        yield from fams.values()
        yield inflight
        # models
        gen = G("calserve_model_generation", "Current generation per alias", labels=["alias"])
        st = G("calserve_model_state", "1 for the current state of the alias' generation", labels=["alias", "state"])
        for alias, (g, state) in sorted(s.models.items()):
            gen.add_metric([alias], g)
            for known in MODEL_STATES:  # one series per state: 1 for the current one, else 0
                st.add_metric([alias, known], 1 if known == state else 0)
        yield from (gen, st)
        yield _labelled(G, "calserve_model_load_seconds", "Last load duration per alias", "alias", s.model_load_seconds)
        # recovery
        yield _labelled(C, "calserve_faults", "Device faults by reason", "reason",
                        with_known(s.faults_total, FAULT_REASONS))
        yield _c("calserve_resets", "Device resets", s.resets_total)
        yield _c("calserve_quarantined_jobs", "Jobs quarantined by recovery", s.quarantined_jobs_total)
        yield _c("calserve_quarantined_kv", "KV sequences quarantined by recovery", s.quarantined_kv_total)
        yield _c("calserve_recovery_seconds", "Time spent recovering", s.recovery_seconds_total)
        yield from fault_metrics(s)  # degradation, reset budget (calserve/api/metrics_faults.py)
        yield from ops_metrics(s)


#: Known label values, exported as 0 before their first event (a fault counter shows 0 before the
#: first fault; dashboards and alerts need the series to exist). Bounded: nothing else is a value.
FAULT_REASONS: Final = ("timeout", "crosstalk", "ccu_fault", "dma_unknown", "aborted", "invalid")
JOB_STATUSES: Final = ("ok", "aborted", "ccu_fault", "dma_unknown", "invalid", "timeout", "refused")
REJECT_OUTCOMES: Final = ("invalid", "capacity", "quota", "unavailable", "deadline")
FINISH_OUTCOMES: Final = ("completed", "cancelled", "deadline", "failed", "shutdown")
KV_STATES: Final = ("Free", "Reserved", "Active", "Updating", "Unknown", "Releasing")
MODEL_STATES: Final = ("Unloaded", "Validating", "Configuring", "Warming", "Ready", "Draining",
                       "Unloading", "Recovering", "Failed")
LOAD_PHASES: Final = ("configure", "inspect", "warmup")


def with_known(values: dict[str, int], known: tuple[str, ...]) -> dict[str, int]:
    """``values`` with every known label value present (0 when it never happened)."""
    return {**dict.fromkeys(known, 0), **values}


def ops_metrics(s: EngineStatistics) -> Iterator[Metric]:
    """The operator metrics of issue 20 (spec §16 items the families above lack)."""
    G, C = GaugeMetricFamily, CounterMetricFamily
    cap = s.kv_tokens_capacity
    yield _g("calserve_kv_usage_ratio", "KV tokens reserved / KV token capacity (0-1)",
             s.kv_tokens_reserved / cap if cap else 0.0)
    free = s.kv_sequences.get("Free", 0)
    yield _g("calserve_kv_lanes_usage_ratio", "KV lanes not Free / KV lanes (0-1)",
             (s.kv_lanes_total - free) / s.kv_lanes_total if s.kv_lanes_total else 0.0)
    yield _labelled(C, "calserve_executor_job_status", "Jobs handed back by how they ended "
                    "(the Wait status; timeout: the wait passed executor.wait_timeout_ms; "
                    "refused: at submit)", "status", with_known(s.job_status_total, JOB_STATUSES))
    ph = G("calserve_model_load_phase_seconds", "Duration of each load phase of the alias' "
           "current generation (its load; calserve_model_phase_seconds: the histograms)",
           labels=["alias", "phase"])
    for alias, phases in sorted(s.model_phase_seconds.items()):
        for phase, v in sorted(phases.items()):
            ph.add_metric([alias, phase], v)
    yield ph
    yield _c("calserve_device_restarts", "Calbins reconfigured after a DMA_UNKNOWN fault "
             "(recovery.restart_on_unknown_dma)", s.device_restarts_total)


def register_process_metrics(registry: CollectorRegistry) -> None:
    """prometheus-client's own collectors on the app's registry: ``process_*`` (CPU, RSS, fds,
    start time: ``changes(process_start_time_seconds[1h])`` counts restarts), ``python_gc_*``,
    ``python_info``; and ``calserve_build_info``."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("calserve_build", "calserve build: version, Python", registry=registry).info(version_info())


class ApiMetrics:
    """Per-app metrics: the engine collector plus HTTP-layer histograms and counters."""

    def __init__(self, source: Callable[[], EngineStatistics | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(source))
        r = self.registry
        self.ttft = Histogram("calserve_request_ttft_seconds", "Submit to first token, seen by HTTP",
                              ["alias"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("calserve_request_inter_token_seconds", "Gap between tokens, seen by HTTP",
                             ["alias"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("calserve_request_e2e_seconds", "Submit to terminal event, seen by HTTP",
                             ["alias"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("calserve_request_queue_seconds", "Submit to admission (engine timings)",
                               ["alias"], buckets=_LATENCY_BUCKETS, registry=r)
        self.responses = Counter("calserve_http_responses", "HTTP responses by status code",
                                 ["outcome"], registry=r)
        self.responses_stored = Counter(
            "calserve_responses_stored", "POST /v1/responses answers stored for"
            " previous_response_id and GET /v1/responses/{id}, by outcome (stored, error)",
            ["outcome"], registry=r)
        self.streams_disconnected = Counter(
            "calserve_stream_disconnects", "Streams whose client went away before the end",
            ["alias"], registry=r)
        self.streams_active = Gauge("calserve_streams_active", "SSE streams currently open",
                                    registry=r)
        self.completion_tokens = Counter("calserve_completion_tokens", "Tokens sent to clients",
                                         ["alias", "tenant"], registry=r)
        self.prompt_tokens = Counter("calserve_prompt_tokens", "Prompt tokens of accepted requests",
                                     ["alias", "tenant"], registry=r)
        register_process_metrics(r)

    def init_labels(self, aliases: list[str], tenants: list[str]) -> None:
        """Create the labelled series of the known aliases and tenants (0 before first use)."""
        for alias in aliases:
            for h in (self.ttft, self.itl, self.e2e, self.queue, self.streams_disconnected):
                h.labels(alias)
            for tenant in tenants:
                self.completion_tokens.labels(alias, tenant)
                self.prompt_tokens.labels(alias, tenant)

    def render(self) -> bytes:
        return generate_latest(self.registry)
