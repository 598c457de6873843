"""The calserve configuration: typed msgspec structs, decoded strictly.

A config file (YAML or JSON) has these top-level sections; every one is optional and the defaults are
the embedded default (software CalRT ``calrt-0.7.6`` + the built-in demo package under alias ``qwen3``).
``configs/calserve.yaml`` mirrors these defaults with a comment per key.

- ``scheduler``: the ``calculet-scheduler/v1`` document of spec §15 (admission, queues, batch, executor,
  recovery) plus documented extensions (``fairness``, ``batch.selection``, ``batch.instance_pool``,
  ``admission`` capacity overrides, ``executor.wait_timeout_ms``).
- ``server``: HTTP listener and limits.
- ``runtime``: which CalRT (software profile, DRAM capacity, null-compute, completion jitter).
- ``trust``: trusted public keys and the trusted model root.
- ``models``: alias -> package.
- ``tenants``: API keys, weights and per-tenant limits (control plane only, never request parameters).

Unknown keys, wrong types and out-of-range values raise :class:`calserve.errors.ConfigError` naming the
key path (``$.scheduler.queues.decode_weight``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from calserve.errors import ConfigError

__all__ = [
    "AdmissionConfig",
    "QueuesConfig",
    "FairnessConfig",
    "BatchConfig",
    "ExecutorConfig",
    "DegradeConfig",
    "RecoveryConfig",
    "SchedulerConfig",
    "ServerConfig",
    "RuntimeConfig",
    "TrustConfig",
    "AdminConfig",
    "ModelEntry",
    "SwitchingConfig",
    "TenantConfig",
    "CalserveConfig",
    "calserve_home",
    "default_alias",
    "load_config",
    "decode_config",
]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(gt=0, le=1)]
BatchSize = Literal[1, 4, 8, 16]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class AdmissionConfig(_Strict):
    max_waiting_requests: NonNeg = 128
    max_waiting_prompt_tokens: NonNeg = 262144
    deadline_default_ms: Pos = 120000
    # Extensions: capacity overrides. None = from the package's capacity plan.
    max_sequences: Pos | None = None
    max_kv_tokens: Pos | None = None
    max_inflight_jobs: Pos | None = None
    # Extensions (overload, spec §5.2 "Queue: 保持等待 only while there is hope before the deadline"):
    # a new request is refused (429 + Retry-After) when its *expected* queue wait (the work ahead of it:
    # queued prefill + decode lane-steps, from the generation's modeled/observed step and prefill
    # times; see calserve.core.wait_estimate) exceeds its own deadline or this queue-wait SLO. None
    # (default) = the deadline only, as the spec says; set it (e.g. 1000) where TTFT matters more
    # than admitting everything (interactive serving; bench `overload`). Clients should honour
    # Retry-After: one that retries at once turns refusals into a request storm. A request is never
    # refused by it when nothing is waiting or running.
    max_expected_wait_ms: Pos | None = None
    # Lane-holding (admitted, unfinished) sequences are capped at B x max_tpot_steps for B the largest
    # serving profile, so every running sequence gets a token at least every max_tpot_steps decode
    # steps. 3 = one full batch per job engine with PING/PONG plus one more ready while the host turns
    # the last one around (sampling, streaming), so the device never waits for the host; beyond that
    # more sequences add TPOT, not throughput (and at B1 under overload every one crawls).
    # None = max_sequences only (time-share every admitted sequence).
    max_tpot_steps: Pos | None = 3
    # When set and the decode step is known (timing model or observed), overrides max_tpot_steps with
    # max(1, floor(max_tpot_ms / step)).
    max_tpot_ms: Pos | None = None


class QueuesConfig(_Strict):
    """Spec §6/§15: weighted round robin of service opportunities decode:short:medium:long."""

    decode_weight: Pos = 8
    short_prefill_weight: Pos = 4
    medium_prefill_weight: Pos = 2
    long_prefill_weight: Pos = 1
    short_prefill_max_tokens: Pos = 512
    medium_prefill_max_tokens: Pos = 4096


class FairnessConfig(_Strict):
    """Extension (spec §5.3). ``output_token_cost`` is §5.3's multiplier of requested output tokens in a
    request's fair-queue cost (VTC: 2); it is not ``queues.decode_weight``."""

    policy: Literal["wfq", "fcfs"] = "wfq"
    output_token_cost: PosFloat = 2.0
    # A tenant may hold at most this share of a batch's lanes, unless no other candidate exists.
    tenant_max_lane_share: Share = 1.0
    # Decode lanes go to at-risk deadlines first (EDF) when the deadline is at most this far away;
    # otherwise to the least-served tenant (VTC). Far-away deadlines must not order lanes, or the
    # default deadline (arrival + 120 s) would make the order FCFS. ``fcfs`` ignores it.
    deadline_urgency_ms: NonNeg = 2000


class ProfileSelection(_Strict):
    """Extension (spec §8): the smallest ready count at which each profile is chosen."""

    b4_min_ready: Pos = 3
    b8_min_ready: Pos = 6
    b16_min_ready: Pos = 12


class BatchConfig(_Strict):
    profiles: list[BatchSize] = msgspec.field(default_factory=lambda: [1])
    batching_window_us: NonNeg = 0
    selection: ProfileSelection = msgspec.field(default_factory=ProfileSelection)
    # Extension: when profiles cannot co-reside, the one profile this instance serves.
    instance_pool: BatchSize | None = None
    # Extension (runtime capability prompt_logits, sim-next only): a prompt scored for
    # ``prompt_logprobs`` / ``echo`` + ``logprobs`` takes every position's logits from its prefill,
    # one job, when they fit in this many bytes (4 x prompt tokens x vocabulary); longer prompts,
    # and 0, score by teacher forcing (a decode step per prompt token). The scores are computed
    # on the event loop at once: ~41 ms at the default on a 2-vCPU box (README)
    prompt_logits_max_bytes: NonNeg = 32 << 20
    # Extension (runtime capability multi_step, C3-style, sim-next only; 1 = off, and always off
    # without the capability): a decode job whose lanes are all plain greedy (temperature 0, no
    # logprobs, no logits processor, not scoring a prompt) runs up to this many steps on the
    # device, each lane's argmax fed back, capped by every lane's remaining max_tokens and KV
    # reservation. The host's per-job work (pick, submit, wait, verify, commit) is paid once per
    # N tokens of each lane; a lane that stops on EOS or a stop token inside the job drops the
    # steps after it (device work wasted, never shown). One step while a prompt waits for its
    # prefill (time to first token). Costs: a stream's tokens arrive N at a time, a cancel,
    # deadline or stop string takes effect after up to N steps.
    multi_step: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class DegradeConfig(_Strict):
    """Extension (spec §14): automatic PING/PONG degradation (calserve/engine/degrade.py). Any
    condition moves new jobs to one engine; jobs already submitted on both engines drain."""

    enabled: bool = True
    busy_streak: Pos = 4  # this many consecutive submits refused with DeviceBusy
    fault_streak: Pos = 2  # this many consecutive jobs ending in a timeout or CCU fault
    # recent P99 step time of a profile above this x its modeled step (null = never; timing known only)
    p99_factor: PosFloat | None = 3.0
    p99_min_samples: Pos = 64  # steps of a profile before its P99 counts
    # PING/PONG is on again this long after the last trigger (null = never again until restart)
    probation_s: PosFloat | None = 60.0


class ExecutorConfig(_Strict):
    max_inflight: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    fixed_engine: bool = False
    # extension: a Wait past this is a device fault (the upper bound of the hung-job timeout)
    wait_timeout_ms: Pos = 30000
    # Extension: a job is hung after hang_factor x its modeled time (timing model), else x the recent
    # P99 of its profile (observed), never below hang_min_ms nor above wait_timeout_ms.
    hang_factor: PosFloat = 20.0
    hang_min_ms: Pos = 1000
    degrade: DegradeConfig = msgspec.field(default_factory=DegradeConfig)


class RecoveryConfig(_Strict):
    max_resets_per_10min: NonNeg = 2
    restart_on_unknown_dma: bool = True
    # A request whose device KV a fault lost (its batch faulted, or a reset wiped the device) is
    # re-admitted and re-prefilled from its prompt + the tokens it generated, and continues where it
    # stopped; it ends with an error only after more than this many consecutive faults with no
    # token in between. 0 turns re-admission off (every request holding lost KV fails).
    max_request_retries: NonNeg = 2
    # Extensions (calserve/engine/reset_budget.py): resets beyond max_resets_per_10min, up to this
    # many more in the window, degrade (one engine, smallest profile, admission cool-down) before the
    # generation goes Failed.
    degraded_resets_per_10min: NonNeg = 2
    degraded_admit_cooldown_ms: NonNeg = 1000  # no new admission this long after a degraded reset
    # Where the reset budget is kept per board (runtime.device) across restarts. None = CALSERVE_HOME/state
    # for the server's engine (an engine opened by tests or tools keeps it in memory).
    state_dir: str | None = None
    # A reset that raises or leaves the device faulted is tried this many times in all; then the
    # recovery is uncertain and the generation goes Failed.
    reset_attempts: Pos = 2
    # Failed (reset budget spent, uncertain recovery): true = the process exits 1 once the HTTP side
    # answered (a supervisor restarts it); false = it stays up answering 503.
    exit_on_failed: bool = True


class SchedulerConfig(_Strict):
    schema: Literal["calculet-scheduler/v1"] = "calculet-scheduler/v1"
    # The default alias (requests without ``model``). None = the first key of ``models``.
    model_alias: str | None = None
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    queues: QueuesConfig = msgspec.field(default_factory=QueuesConfig)
    fairness: FairnessConfig = msgspec.field(default_factory=FairnessConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    executor: ExecutorConfig = msgspec.field(default_factory=ExecutorConfig)
    recovery: RecoveryConfig = msgspec.field(default_factory=RecoveryConfig)
    # Time-slicing (engine/timeslice.py): once the oldest waiting request has waited
    # timeslice_wait_ms (at least twice admission.max_expected_wait_ms when that is set: waits
    # admission promised are not preempted) and only the max_running cap blocks it, the running
    # request (of its tenant first) that has run longest since its admission / resume, at least
    # timeslice_ms, is parked (keeps its KV, never cut for it) and resumed at the back of the line.
    # It bounds how long one tenant's long streams (e.g. clients that never read but whose whole
    # answer fits their socket buffers) hold a short request of the same tenant. 0 = off.
    timeslice_ms: NonNeg = 100
    timeslice_wait_ms: NonNeg = 300


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    max_body_bytes: Pos = 1 << 20
    # Kept for compatibility, no effect (>= 1): the StreamWriter coalesces every pending token into
    # one event, and the backlog is bounded in bytes (stream_buffer_bytes).
    stream_buffer_events: Pos = 64
    # Optional minimum gap between two streamed token chunks of one stream (ms, 0 = off, the
    # default): tokens arriving meanwhile go out as one chunk (fewer SSE events, less server CPU
    # per token) at the cost of up to this much added inter-token latency, and of a terminal event
    # up to this much later. The first token is never held. Like vLLM's --stream-interval.
    stream_interval_ms: NonNeg = 0
    # Adaptive grouping (calserve/api/pacing.py), when stream_interval_ms is 0: while the serving
    # thread is saturated (a 100 ms window's (run + wait-for-CPU)/wall >= stream_busy_fraction; released below 0.7
    # of it), streams hold chunks this long (ms; 0 = never): one SSE send per token costs every
    # stream throughput exactly when the host, not the device, is the bottleneck.
    stream_busy_interval_ms: NonNeg = 20
    stream_busy_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    # A held chunk due within this long (ms; 0 = off) after the serving loop wakes from idle (a
    # device completion, a request) goes out with that wake-up, up to this much early and never
    # late: on a device that paces the host, it no longer wakes the loop again on its own
    # (calserve/api/pacing.py).
    stream_hold_coalesce_ms: NonNeg = 2
    # Per-request limits and slow readers (README "Per-request limits and slow readers").
    # The backlog bound of one stream (bytes, estimated: text + ~2 KB per token with 20 top
    # logprobs): what the engine holds for its consumer plus what the HTTP pump took and has not
    # finished writing. Replaces stream_buffer_events. 0 = unbounded.
    stream_buffer_bytes: NonNeg = 65536
    # A stream whose backlog stays over stream_buffer_bytes this long (ms) while its request is
    # still producing is cancelled (logged once): its KV lane is freed and its backlog dropped. At
    # once (no grace) while other requests of its model wait for admission: they wait for its lane.
    stream_stall_grace_ms: NonNeg = 1000
    # While other requests of its model wait for admission, a stream whose client has left what
    # was written to it unread this long (ms; seen on the socket's TCP_INFO: its receive window
    # has not reopened), or whose last write has not completed this long (and >= 0.5 s), gives
    # its running slot up however few bytes that is: they wait for it. Parked where the socket is
    # watched (stream_parked_cut_ms), else cancelled. 0 = off (README "Per-request limits and
    # slow readers").
    stream_contended_stall_ms: NonNeg = 5
    # Where the server watches the client's socket (both launchers, HTTP/1.1): such a stream is
    # not cancelled at once but parked — its running slot goes to a waiting request, nothing more
    # is generated for it — and resumed as soon as its client caught up; parked this long (ms)
    # without catching up, it is cancelled (client_too_slow). A client that reads in bursts is
    # paused while others wait, never cut (README "Per-request limits and slow readers"). A
    # parked stream keeps its KV lane meanwhile (500 ms cut a reading client on a host at load 8).
    stream_parked_cut_ms: NonNeg = 1000
    # Entries of the engine's debugging trace ring (recent admissions, jobs and releases, in order;
    # tests and debugging read it). Bounded: at 20,000 entries it held ~6.6 MiB in a soak.
    trace_events: NonNeg = 4096
    # Most choices one request may ask for (OpenAI `n`): n independent sequences of the prompt,
    # each its own prefill (no KV fork), admitted and charged like n requests.
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 8
    # Most prompts one /v1/completions request may list (`prompt` as a list of strings or of
    # token-id lists): each prompt is served as its own request (n choices each), all admitted and
    # charged like that many requests.
    max_prompts: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    # Stored responses of POST /v1/responses (calserve/api/response_store.py): `store` (true unless
    # the request says false) keeps a response for `previous_response_id` follow-ups and GET /
    # DELETE /v1/responses/{id}. false: nothing is kept (a `store: true` answer says `store: false`;
    # `previous_response_id` is a 400).
    responses_store: bool = True
    # Their SQLite file. None = CALSERVE_HOME/state/responses.sqlite3 for the server (shared by the
    # calserve processes of one host: a follow-up may land on any replica); an app built with an
    # injected engine (tests, tools) keeps them in memory unless a path is set. ":memory:": this
    # process only.
    responses_store_path: str | None = None
    # A stored response is gone this long after it was created (s; OpenAI keeps them 30 days) ...
    responses_ttl_s: PosFloat = 30 * 24 * 3600.0
    # ... and only the last this many stored are kept (older ones go first).
    responses_max_stored: Pos = 10_000
    # --- Connections and protocol limits (calserve/api/listener.py, calserve/api/hygiene.py) ---
    # Both launchers unless marked "calserve serve only" (the hypercorn CLI owns its own Config:
    # there, --keep-alive (default 5 s) is both the idle and the header timeout, no connection cap).
    # An idle keep-alive connection, and a new one that sends nothing, is closed after this (s).
    # calserve serve only.
    keep_alive_timeout_s: PosFloat = 10.0
    # A request head (request line + headers) must be complete this long after its first byte (s),
    # else the connection is closed (408 when HTTP/1.1). calserve serve only.
    header_timeout_s: PosFloat = 5.0
    # A request body must be complete this long after its head (s), else 408 + close.
    body_timeout_s: PosFloat = 30.0
    # One write of a streamed response that has not completed this long (s: its client has read
    # nothing meanwhile, the kernels' buffers are full) closes the connection, also when the
    # stream has ended engine-side (where the app has the socket: calserve/api/write_watch.py).
    send_timeout_s: PosFloat = 30.0
    # A request head larger than this (bytes: request target + headers) gets 431 + close.
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16384
    # Open client connections at most (calserve serve only). At the cap the longest-idle keep-alive
    # connection is closed to make room, else the new one gets 503 + Retry-After and is closed.
    # Clamped to the open-file limit (RLIMIT_NOFILE) less a reserve for the process itself.
    max_connections: Pos = 1024
    # Graceful drain on SIGTERM (calserve serve): /ready turns 503 at once, new generation requests
    # get 503 + Retry-After, admitted ones may run this long (s) before they end with an error event;
    # submitted jobs always drain. Under the hypercorn CLI set --graceful-timeout >= this.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    # Log records as text lines or one JSON object per line (for log shippers: ts, level, logger,
    # message, request_id, ...; access lines as fields). calserve serve only (the hypercorn CLI
    # configures its own logging).
    log_format: Literal["text", "json"] = "text"


FaultName = Literal["timeout", "ccu", "unknown_dma", "busy", "crosstalk"]


class FaultsConfig(_Strict):
    """Fault injection by the software runtime (drills, chaos tests, benchmarks; never hardware)."""

    rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0  # probability per submitted job
    kinds: list[FaultName] = msgspec.field(
        default_factory=lambda: ["timeout", "ccu", "unknown_dma", "busy", "crosstalk"])
    seed: int = 1  # the same seed and order of submits give the same faults


class RuntimeConfig(_Strict):
    profile: Literal["calrt-0.7.6", "sim-next"] = "calrt-0.7.6"
    # The board this process opens (index, 0-based; ``calserve serve --device N``). One process per
    # board: several boards are several processes behind a load balancer (spec §3, deploy/).
    device: NonNeg = 0
    dram_bytes: Pos = 32 << 30
    null_compute: bool = False
    # Seeded random completion delay (µs, 0 = off) that shuffles completion order (spec §17.3).
    completion_jitter_us: NonNeg = 0
    seed: int = 0
    # Faults the software runtime injects on its own (rate 0 = none): see FaultsConfig.
    faults: FaultsConfig = msgspec.field(default_factory=FaultsConfig)
    # The serving process's cyclic-GC gen0 threshold, applied with gc.freeze() after every model
    # load (calserve.engine.backend.tune_gc_for_serving says why 10k); 0 = CPython's own thresholds
    # and no freeze.
    gc_gen0_threshold: NonNeg = 10_000
    # Extension: a job wait first polls (yielding to trio) for up to this many µs, adaptively, before
    # it parks on the runtime's completion fd (calserve/engine/backend_waits.py); 0 = park at once.
    completion_poll_us: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 100
    # Extension: decode jobs of scheduler.batch.multi_step > 1 driven by the host on any runtime
    # (calrt-0.7.6 included): N one-step device jobs back to back on the job's engine, each lane's
    # argmax fed back by the runtime binding in C on the engine's wait thread, with no Python
    # between the steps (ext/host_steps.c). The device still runs one step a job; the host's
    # Python work a job is paid once per N tokens a lane. Used instead of the device's own
    # multi_step capability (sim-next) where both exist.
    host_multi_step: bool = False


class TrustConfig(_Strict):
    # Public key files (ed25519, hex or raw). The development key in CALSERVE_HOME is always added
    # when ``trust_dev_key`` is true.
    trusted_keys: list[str] = msgspec.field(default_factory=list)
    trust_dev_key: bool = True
    # Packages resolve only inside this directory. None = CALSERVE_HOME/models.
    model_root: str | None = None


class AdminConfig(_Strict):
    # Bearer token of the admin API (/admin/v1/...). None = the env CALSERVE_ADMIN_TOKEN, and with
    # neither the admin routes answer 403. Tenant API keys never grant admin.
    token: str | None = None


class SwitchingConfig(_Strict):
    # calrt-0.7.6 with several aliases (one resident calbin, spec §13 time-switching): a resident
    # alias is switched out for another one with waiting requests only after it was resident this
    # long, or as soon as it has no work left (anti-thrashing; its queued requests are served first).
    min_residency_s: NonNegFloat = 2.0
    # Drain deadline of the alias switched out (its running requests finish or are cancelled then).
    drain_timeout_s: NonNegFloat = 30.0


class ModelEntry(_Strict):
    # Package directory. None = the built-in demo package (built on first start).
    package: str | None = None
    # Timing profile name for the software runtime, overriding the package's (None = package's).
    timing: str | None = None
    # Share of the device's job engines against the other co-resident aliases (sim-next; default
    # equal): generations with work are served in weighted fair order of their device time.
    weight: PosFloat = 1.0


class TenantConfig(_Strict):
    api_keys: list[str] = msgspec.field(default_factory=list)
    weight: PosFloat = 1.0
    max_active_sequences: Pos | None = None
    max_waiting_tokens: Pos | None = None
    qps: PosFloat | None = None
    burst: Pos | None = None


class CalserveConfig(_Strict):
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    trust: TrustConfig = msgspec.field(default_factory=TrustConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    switching: SwitchingConfig = msgspec.field(default_factory=SwitchingConfig)
    models: dict[str, ModelEntry] = msgspec.field(
        default_factory=lambda: {"qwen3": ModelEntry()}
    )
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: at least one alias is needed (more are loaded at run time "
                             "through POST /admin/v1/models/{alias}/load)")
        if self.scheduler.model_alias is not None and self.scheduler.model_alias not in self.models:
            raise ValueError(
                f"scheduler.model_alias {self.scheduler.model_alias!r} is not a key of models"
            )
        q = self.scheduler.queues
        if q.short_prefill_max_tokens >= q.medium_prefill_max_tokens:
            raise ValueError(
                "scheduler.queues.short_prefill_max_tokens must be < medium_prefill_max_tokens"
            )
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            for k in t.api_keys:
                if k in seen:
                    raise ValueError(f"tenants.{name}.api_keys: key also used by tenant {seen[k]!r}")
                seen[k] = name


def default_alias(cfg: CalserveConfig) -> str:
    """The alias a request without ``model`` goes to: ``scheduler.model_alias``, else the first key
    of ``models``."""
    return cfg.scheduler.model_alias if cfg.scheduler.model_alias is not None else next(iter(cfg.models))


def calserve_home() -> Path:
    """Where calserve keeps its cache, development key and demo package (``CALSERVE_HOME``)."""
    env = os.environ.get("CALSERVE_HOME")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "calserve"


def decode_config(data: Any, source: str = "<config>") -> CalserveConfig:
    """Validate an already-parsed document (dict) into a :class:`CalserveConfig`."""
    try:
        return msgspec.convert(data if data is not None else {}, CalserveConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike[str] | None = None) -> CalserveConfig:
    """Load a YAML/JSON config file; ``None`` reads ``CALSERVE_CONFIG`` or returns the defaults."""
    if path is None:
        path = os.environ.get("CALSERVE_CONFIG") or None
    if path is None:
        return CalserveConfig()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror}") from None
    try:
        if p.suffix == ".json":
            data = msgspec.json.decode(raw)
        else:
            data = msgspec.yaml.decode(raw)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{p}: not valid YAML/JSON: {e}") from None
    return decode_config(data, str(p))
