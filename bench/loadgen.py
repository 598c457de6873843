"""The load generator: open-loop (Poisson/gamma) or closed-loop load against an OpenAI-compatible server.

Usage (``python -m bench.loadgen --help``)::

    python -m bench.loadgen --base-url http://127.0.0.1:8000 --rate 20 --duration 30 \\
        --prompt-len 64:256 --output-len 128 --out bench/out/myrun

writes ``records.jsonl`` (one :class:`bench.summary.Record` per request), ``summary.json``,
``metrics.jsonl`` (``/metrics`` samples) and ``spec.json``; prints the summary's headline to stdout and
a progress line to stderr. Output length is pinned with ``ignore_eos`` + ``max_tokens`` (as vLLM's
bench does). Every run stops by itself: sending stops at ``--duration``/``--num-requests``, in-flight
requests get ``--drain-timeout`` more seconds, and anything still open is recorded as ``timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import trio

from bench import procstat
from bench.httpclient import ConnectionPool, HttpError, iter_sse
from bench.scrape import Scraper, derive_series
from bench.summary import Record, latency_stats, summarize, write_records
from bench.workload import (Lengths, PlannedRequest, TenantSpec, TraceEntry, arrivals, load_trace,
                            make_prompt, parse_tenant)

__all__ = ["LoadSpec", "RunResult", "run_load", "run_load_sync", "main"]

_json = msgspec.json.Decoder()


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    base_url: str
    tenants: tuple[TenantSpec, ...]
    endpoint: Literal["completions", "chat"] = "completions"
    model: str | None = None
    duration_s: float | None = None
    num_requests: int | None = None
    stream: bool = True
    include_usage: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0  # sent when below 1 (a sampled load: temperature > 0)
    seed: int = 0
    burstiness: float = 1.0
    prompt_mode: Literal["ids", "text"] = "ids"
    vocab: tuple[int, int] = (256, 500)
    trace: tuple[TraceEntry, ...] = ()
    request_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    disconnect_prob: float = 0.0  # chance a streaming request hangs up after a random token count
    scrape_interval_s: float | None = 0.5
    server_pid: int | None = None  # sampled from /proc alongside /metrics
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    progress: bool = True
    # Closed loop: a worker whose request was refused (429/503) waits the server's Retry-After, at
    # most this long, before its next request, as a well-behaved client does (0 = resend at once).
    max_retry_after_s: float = 1.0
    # Start of the steady window (s; None: min(1, 0.2 x duration)): where throughput, TPOT and fill
    # "at saturation" are read. Slow arrival rates need longer to fill the server's lanes.
    steady_start_s: float | None = None

    def __post_init__(self) -> None:
        if self.duration_s is None and self.num_requests is None and not self.trace:
            raise ValueError("give --duration or --num-requests (or a --trace)")
        if not self.tenants:
            raise ValueError("need at least one tenant")
        if len({t.name for t in self.tenants}) != len(self.tenants):
            raise ValueError("tenant names must be unique")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if not 0 <= self.disconnect_prob <= 1:
            raise ValueError("disconnect_prob must be in [0, 1]")

    @property
    def hard_timeout_s(self) -> float:
        send = self.duration_s if self.duration_s is not None else self.request_timeout_s * 4
        return send + self.drain_timeout_s + 5.0  # backstop; the drain deadline fires first


@dataclasses.dataclass
class RunResult:
    records: list[Record]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    proc: list[dict[str, Any]]


class _Run:
    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        u = urlsplit(spec.base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"--base-url: need http://HOST:PORT, got {spec.base_url!r}")
        self.prefix = u.path.rstrip("/")
        self.pool = ConnectionPool(u.hostname, u.port or 80)
        self.scrape_pool = ConnectionPool(u.hostname, u.port or 80, max_idle=1)
        self.path = self.prefix + ("/v1/completions" if spec.endpoint == "completions"
                                   else "/v1/chat/completions")
        self.records: list[Record] = []
        self.inflight = 0
        self.sent = 0
        self.t0 = 0.0
        self.remaining = spec.num_requests if spec.num_requests is not None else math.inf
        self.tokens_seen = 0
        self.proc: list[dict[str, Any]] = []
        self.by_tenant_trace: dict[str, list[TraceEntry]] = {}
        for e in spec.trace:
            self.by_tenant_trace.setdefault(e.tenant, []).append(e)
        self.stop_sending = trio.Event()

    # ---- planning -------------------------------------------------------------------------------
    def _plan(self, tenant: TenantSpec, rng: random.Random, i: int) -> PlannedRequest | None:
        trace = self.by_tenant_trace.get(tenant.name)
        if self.spec.trace:
            if trace is None or i >= len(trace):
                return None
            e = trace[i]
            if e.prompt is not None:
                plen = len(e.prompt) if isinstance(e.prompt, list) else len(e.prompt.split())
                prompt: list[int] | str = e.prompt
            else:
                plen = e.prompt_len or 1
                prompt = make_prompt(rng, plen, self._mode(), self.spec.vocab)
            return PlannedRequest(0, tenant.name, e.at or 0.0, prompt, plen, e.output_len)
        plen = tenant.prompt_len.sample(rng)
        olen = tenant.output_len.sample(rng)
        return PlannedRequest(0, tenant.name, 0.0,
                              make_prompt(rng, plen, self._mode(), self.spec.vocab), plen, olen)

    def _mode(self) -> str:
        return "text" if self.spec.endpoint == "chat" else self.spec.prompt_mode

    def _take(self) -> bool:
        if self.stop_sending.is_set() or self.remaining <= 0:
            return False
        self.remaining -= 1
        if self.remaining <= 0:
            self.stop_sending.set()
        return True

    def _body(self, p: PlannedRequest) -> bytes:
        s = self.spec
        body: dict[str, Any] = {"max_tokens": p.output_len, "stream": s.stream,
                                "temperature": s.temperature}
        if s.top_p < 1.0:
            body["top_p"] = s.top_p
        if s.model:
            body["model"] = s.model
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.stream and s.include_usage:
            body["stream_options"] = {"include_usage": True}
        if s.endpoint == "chat":
            text = p.prompt if isinstance(p.prompt, str) else " ".join(map(str, p.prompt))
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = p.prompt
        return msgspec.json.encode(body)

    # ---- senders --------------------------------------------------------------------------------
    async def open_loop(self, tenant: TenantSpec, nursery: trio.Nursery) -> None:
        assert tenant.rate is not None
        rng = random.Random(f"{self.spec.seed}:{tenant.name}")
        gaps = arrivals(random.Random(f"{self.spec.seed}:{tenant.name}:arrivals"), tenant.rate,
                        self.spec.burstiness)
        at = tenant.start_s
        i = 0
        while True:
            p = self._plan(tenant, rng, i)
            if p is None:
                return
            at = p.at if (self.spec.trace and p.at) else at + next(gaps)
            if self.spec.duration_s is not None and at >= self.spec.duration_s:
                return
            with trio.move_on_at(self.t0 + at):
                await self.stop_sending.wait()
            if not self._take():
                return
            p = dataclasses.replace(p, index=self.sent, at=at)
            self.sent += 1
            nursery.start_soon(self.one, p, rng.random())
            i += 1

    async def senders(self, reqs: trio.Nursery) -> None:
        async with trio.open_nursery() as sn:
            for t in self.spec.tenants:
                if t.rate is not None:
                    sn.start_soon(self.open_loop, t, reqs)
                else:
                    counter = [0]
                    for w in range(t.concurrency or 1):
                        sn.start_soon(self.closed_loop, t, w, counter)
        self.stop_sending.set()

    async def closed_loop(self, tenant: TenantSpec, worker: int, counter: list[int]) -> None:
        rng = random.Random(f"{self.spec.seed}:{tenant.name}:{worker}")
        with trio.move_on_at(self.t0 + tenant.start_s):
            await self.stop_sending.wait()
        while True:
            # The sending window ends on the clock, as for the open loop: a worker whose request
            # ended just after the duration may run before the task that sets stop_sending at
            # the deadline (a loaded box runs them in either order).
            now = trio.current_time() - self.t0
            if self.spec.duration_s is not None and now >= self.spec.duration_s:
                return
            i = counter[0]
            counter[0] += 1
            p = self._plan(tenant, rng, i)
            if p is None or not self._take():
                return
            p = dataclasses.replace(p, index=self.sent, at=now)
            self.sent += 1
            retry_after = await self.one(p, rng.random())
            if retry_after and self.spec.max_retry_after_s > 0:
                # (the worker stops at its next plan once the sending window is over)
                await trio.sleep(min(retry_after, self.spec.max_retry_after_s))

    # ---- one request ----------------------------------------------------------------------------
    async def one(self, p: PlannedRequest, u: float) -> float | None:
        """Send one planned request and record its outcome; the Retry-After seconds of a refusal
        (429/503, 1 s when the server gave none), else None."""
        s = self.spec
        retry_after: float | None = None
        rec = Record(index=p.index, tenant=p.tenant, planned=round(p.at, 6), prompt_tokens=p.prompt_len)
        tenant = next(t for t in s.tenants if t.name == p.tenant)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if tenant.api_key:
            headers["Authorization"] = f"Bearer {tenant.api_key}"
        headers.update(tenant.headers)
        # Seeded hang-up point for soak runs: after this many content events (-1 = never).
        cut = -1
        if s.disconnect_prob and u < s.disconnect_prob:
            cut = int((u / s.disconnect_prob) * max(1, p.output_len))
        body = self._body(p)
        self.inflight += 1
        start = trio.current_time()
        rec.start = round(start - self.t0, 6)
        done = False
        conn = None
        try:
            with trio.move_on_after(s.request_timeout_s) as cs:
                resp = await self.pool.request("POST", self.path, body, headers)
                conn = resp.conn
                rec.status = resp.status
                if resp.status != 200:
                    raw = await resp.read_all()
                    rec.outcome = "rejected" if resp.status in (429, 503) else "failed"
                    if rec.outcome == "rejected":
                        retry_after = _retry_after(resp.headers)
                    rec.error = _error_message(raw) or f"HTTP {resp.status}"
                elif s.stream:
                    await self._read_stream(resp, rec, start, cut)
                else:
                    raw = await resp.read_all()
                    self._read_json(raw, rec)
                rec.e2e = round(trio.current_time() - start, 6)
                done = True
            if cs.cancelled_caught:
                rec.outcome, rec.error = "timeout", "request_timeout"
                rec.e2e = round(trio.current_time() - start, 6)
                done = True
        except (HttpError, OSError, trio.BrokenResourceError) as e:
            rec.outcome, rec.error = "failed", f"{type(e).__name__}: {e}"
            rec.e2e = round(trio.current_time() - start, 6)
            done = True
        finally:
            self.inflight -= 1
            if not done:  # cancelled by the run's hard deadline
                rec.outcome, rec.error = "timeout", "run_hard_timeout"
                rec.e2e = round(trio.current_time() - start, 6)
            self.records.append(rec)
            if conn is not None:  # reused only if its body was read to the end (conn.reusable)
                with trio.CancelScope(shield=True):
                    await self.pool.release(conn)
        return retry_after

    async def _read_stream(self, resp: Any, rec: Record, start: float, cut: int) -> None:
        got_done = False
        async with aclosing(iter_sse(resp)) as events_iter:
            async for t, data in events_iter:
                if self._on_event(t, data, rec, start, cut):
                    return
                if data == b"[DONE]":
                    got_done = True
        if not got_done:
            rec.outcome, rec.error = "failed", "stream ended without [DONE]"
            return
        if not rec.output_tokens:
            rec.output_tokens = len(rec.token_times)
        rec.outcome = "ok"

    def _on_event(self, t: float, data: bytes, rec: Record, start: float, cut: int) -> bool:
        """Account one SSE event; True = stop reading (error, or the planned hang-up)."""
        if data == b"[DONE]":
            return False
        try:
            obj = _json.decode(data)
        except msgspec.DecodeError:
            rec.outcome, rec.error = "failed", f"bad SSE JSON {data[:60]!r}"
            return True
        if not isinstance(obj, dict):
            return False
        if "error" in obj:
            rec.outcome, rec.error = "failed", _msg(obj["error"])
            return True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        for ch in obj.get("choices") or ():
            if ch.get("finish_reason"):
                rec.finish_reason = ch["finish_reason"]
            delta = ch.get("delta")
            text = ch.get("text") if delta is None else (delta.get("content") or
                                                         delta.get("reasoning_content"))
            if text:
                rel = round(t - start, 6)
                if rec.ttft is None:
                    rec.ttft = rel
                rec.token_times.append(rel)
                rec.content_bytes += len(data) + 8  # b"data: " ... b"\n\n"
                self.tokens_seen += 1
        if 0 <= cut <= len(rec.token_times):
            rec.outcome = "disconnected"
            rec.error = f"client hung up after {len(rec.token_times)} events"
            return True
        return False

    def _read_json(self, raw: bytes, rec: Record) -> None:
        try:
            obj = _json.decode(raw)
            usage = obj.get("usage") or {}
            ch = (obj.get("choices") or [{}])[0]
        except (msgspec.DecodeError, AttributeError):
            rec.outcome, rec.error = "failed", f"bad JSON body {raw[:60]!r}"
            return
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.finish_reason = ch.get("finish_reason")
        self.tokens_seen += rec.output_tokens
        rec.outcome = "ok"

    # ---- side tasks -----------------------------------------------------------------------------
    async def progress(self) -> None:
        tty = sys.stderr.isatty()
        last_tok, last_t = 0, trio.current_time()
        while True:
            await trio.sleep(1.0 if tty else 5.0)
            now = trio.current_time()
            rate = (self.tokens_seen - last_tok) / max(1e-9, now - last_t)
            last_tok, last_t = self.tokens_seen, now
            oc: dict[str, int] = {}
            for r in self.records:
                oc[r.outcome] = oc.get(r.outcome, 0) + 1
            line = (f"[{now - self.t0:6.1f}s] sent {self.sent} inflight {self.inflight} "
                    f"ok {oc.get('ok', 0)} rej {oc.get('rejected', 0)} fail {oc.get('failed', 0)} "
                    f"events/s {rate:7.0f}")
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr,
                  flush=True)

    async def proc_sampler(self, pid: int, interval: float) -> None:
        while True:
            s = procstat.sample(pid)
            if s is None:
                return
            self.proc.append({"t": round(trio.current_time() - self.t0, 4),
                              **dataclasses.asdict(s)})
            await trio.sleep(interval)


def _msg(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


def _retry_after(headers: dict[str, str]) -> float:
    """Seconds a refused client should wait: the Retry-After header (delta-seconds), else 1 s."""
    try:
        return max(0.0, float(headers.get("retry-after", "1")))
    except ValueError:  # an HTTP-date: not worth parsing for a bench client
        return 1.0


def _error_message(raw: bytes) -> str | None:
    try:
        obj = _json.decode(raw)
        return _msg(obj["error"]) if isinstance(obj, dict) and "error" in obj else None
    except msgspec.DecodeError:
        return raw[:200].decode("utf-8", "replace") or None


async def run_load(spec: LoadSpec) -> RunResult:
    """Run the load described by ``spec`` and return records + summary (nothing is written)."""
    run = _Run(spec)
    run.t0 = trio.current_time()
    scraper = Scraper(run.scrape_pool, spec.scrape_interval_s or 1.0)
    end: float | None = None
    with trio.move_on_after(spec.hard_timeout_s):
        async with trio.open_nursery() as side:
            if spec.scrape_interval_s:
                side.start_soon(scraper.run, run.t0)
            if spec.server_pid:
                side.start_soon(run.proc_sampler, spec.server_pid, spec.scrape_interval_s or 0.5)
            if spec.progress:
                side.start_soon(run.progress)
            async with trio.open_nursery() as reqs:
                reqs.start_soon(run.senders, reqs)
                # Sending ends at the duration, the request-count bound, or when every sender is
                # done; in-flight requests then get drain_timeout_s before they are cut (timeout).
                with trio.move_on_at(run.t0 + spec.duration_s if spec.duration_s else math.inf):
                    await run.stop_sending.wait()
                run.stop_sending.set()
                reqs.cancel_scope.deadline = trio.current_time() + spec.drain_timeout_s
            end = trio.current_time()
            if spec.scrape_interval_s:
                await scraper.scrape_once(run.t0)  # the state right after the load
            side.cancel_scope.cancel()
    if spec.progress:
        print(file=sys.stderr)
    await run.pool.aclose()
    await run.scrape_pool.aclose()
    run.records.sort(key=lambda r: r.index)
    series = derive_series(scraper.samples)
    extra: dict[str, Any] = {"spec": _spec_doc(spec), "connections_opened": run.pool.opened}
    fill = [v for _, v in series["batch_fill"]]
    extra["batch_fill"] = {"mean": sum(fill) / len(fill) if fill else None, "samples": len(fill)}
    q = [v for _, v in series["queue_depth"]]
    extra["queue_depth"] = {"mean": sum(q) / len(q) if q else None, "max": max(q) if q else None}
    if run.proc:
        extra["server_proc"] = _proc_summary(run.proc)
    duration = (end if end is not None else trio.current_time()) - run.t0
    window = None
    if spec.duration_s:
        w0 = spec.steady_start_s if spec.steady_start_s is not None else min(1.0, 0.2 * spec.duration_s)
        window = (min(w0, spec.duration_s), spec.duration_s)
    summary = summarize(run.records, duration=duration, slo_ttft_ms=spec.slo_ttft_ms,
                        slo_tpot_ms=spec.slo_tpot_ms, extra=extra, window=window)
    if window is not None:
        wf = [v for t, v in series["batch_fill"] if window[0] <= t <= window[1]]
        summary["window"]["batch_fill"] = sum(wf) / len(wf) if wf else None
    return RunResult(run.records, summary, scraper.samples, run.proc)


def _proc_summary(proc: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = proc[0], proc[-1]
    return {"cpu_s": last["cpu_s"] - first["cpu_s"], "rss_start": first["rss_bytes"],
            "rss_end": last["rss_bytes"], "rss_max": max(p["rss_bytes"] for p in proc),
            "fds_start": first["open_fds"], "fds_end": last["open_fds"],
            "fds_max": max(p["open_fds"] for p in proc)}


def _spec_doc(spec: LoadSpec) -> dict[str, Any]:
    d = dataclasses.asdict(spec)
    d["trace"] = len(spec.trace)
    d["tenants"] = [{**dataclasses.asdict(t), "api_key": "***" if t.api_key else None,
                     "prompt_len": [t.prompt_len.lo, t.prompt_len.hi],
                     "output_len": [t.output_len.lo, t.output_len.hi]} for t in spec.tenants]
    doc: dict[str, Any] = json.loads(json.dumps(d, default=str))
    return doc


def save_run(result: RunResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "records.jsonl", result.records)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=1))
    with (out / "metrics.jsonl").open("w") as f:
        for s in result.metrics:
            f.write(json.dumps(s) + "\n")
    if result.proc:
        with (out / "proc.jsonl").open("w") as f:
            for p in result.proc:
                f.write(json.dumps(p) + "\n")


def run_load_sync(spec: LoadSpec, out: Path | None = None) -> RunResult:
    result = trio.run(run_load, spec)
    if out is not None:
        save_run(result, out)
    return result


def headline(s: dict[str, Any]) -> str:
    """A few lines an operator reads first."""
    def st(k: str) -> str:
        x = s[k]
        return (f"mean {x['mean']:.1f} p50 {x['p50']:.1f} p90 {x['p90']:.1f} p99 {x['p99']:.1f} ms"
                if x.get("count") else "n/a")
    o = s["outcomes"]
    lines = [
        f"requests: sent {s['sent']} ok {o['ok']} rejected {o['rejected']} failed {o['failed']} "
        f"disconnected {o['disconnected']} timeout {o['timeout']}  by status {s['by_status']}",
        f"duration {s['duration_s']:.1f}s  req/s {s['request_throughput']:.2f}  "
        f"output tok/s {s['output_throughput']:.0f} (steady window "
        f"{(s.get('window') or {}).get('output_throughput', float('nan')):.0f})  "
        f"goodput {s['goodput']:.2f} req/s",
        f"TTFT {st('ttft_ms')}", f"TPOT {st('tpot_ms')}", f"ITL  {st('itl_ms')}",
        f"E2E  {st('e2e_ms')}",
    ]
    if s.get("batch_fill", {}).get("mean") is not None:
        lines.append(f"batch fill mean {s['batch_fill']['mean']:.3f}  queue depth mean "
                     f"{s['queue_depth']['mean']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="http://HOST:PORT of the server")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--model", default=None)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, help="open loop: requests/s (inf = all at once)")
    g.add_argument("--concurrency", type=int, help="closed loop: fixed number of in-flight requests")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--duration", type=float, help="seconds of sending")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--prompt-len", default="128", help="N | LO:HI | P*N,P*LO:HI")
    ap.add_argument("--output-len", default="128", help="N | LO:HI | P*N,P*LO:HI")
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids")
    ap.add_argument("--vocab", default="256:500", help="token id range LO:HI for --prompt-mode ids")
    ap.add_argument("--trace", type=Path, help="JSONL: prompt|prompt_len, output_len, tenant, at")
    ap.add_argument("--tenant", action="append", default=[],
                    help="NAME:key=K,rate=R|concurrency=C,prompt=..,output=..,start=S (repeatable)")
    ap.add_argument("--api-key", default=None, help="key of the single default tenant")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--disconnect-prob", type=float, default=0.0)
    ap.add_argument("--steady-start", type=float, default=None,
                    help="start of the steady window in s (default min(1, 0.2 x duration))")
    ap.add_argument("--max-retry-after", type=float, default=1.0,
                    help="closed loop: after a 429/503 a worker waits Retry-After, at most this many "
                         "seconds (0: resend at once)")
    ap.add_argument("--scrape-interval", type=float, default=0.5, help="0 = do not scrape /metrics")
    ap.add_argument("--server-pid", type=int, help="sample this PID's CPU/RSS/fds from /proc")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", type=Path, help="run directory for records/summary/metrics")
    return ap


def spec_from_args(a: argparse.Namespace) -> LoadSpec:
    plen = Lengths.parse(a.prompt_len, "--prompt-len")
    olen = Lengths.parse(a.output_len, "--output-len")
    trace = tuple(load_trace(a.trace)) if a.trace else ()
    if a.tenant:
        tenants = tuple(parse_tenant(t, plen, olen) for t in a.tenant)
    elif trace:
        names = sorted({e.tenant for e in trace})
        rate = a.rate if a.rate is not None else (None if a.concurrency else math.inf)
        tenants = tuple(TenantSpec(n, a.api_key, rate, a.concurrency, plen, olen) for n in names)
    else:
        if a.rate is None and a.concurrency is None:
            raise ValueError("give --rate or --concurrency (or --tenant ...)")
        tenants = (TenantSpec("default", a.api_key, a.rate, a.concurrency, plen, olen),)
    lo, _, hi = a.vocab.partition(":")
    return LoadSpec(
        base_url=a.base_url, tenants=tenants, endpoint=a.endpoint, model=a.model,
        duration_s=a.duration, num_requests=a.num_requests, stream=not a.no_stream,
        ignore_eos=not a.no_ignore_eos, seed=a.seed, burstiness=a.burstiness,
        prompt_mode=a.prompt_mode, vocab=(int(lo), int(hi)), trace=trace,
        request_timeout_s=a.request_timeout, drain_timeout_s=a.drain_timeout,
        disconnect_prob=a.disconnect_prob, scrape_interval_s=a.scrape_interval or None,
        max_retry_after_s=a.max_retry_after, steady_start_s=a.steady_start,
        server_pid=a.server_pid, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
        progress=not a.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_load_sync(spec, a.out)
    print(headline(result.summary))
    if a.out:
        print(f"wrote {a.out}/records.jsonl, summary.json, metrics.jsonl")
    return 0


__all__ += ["save_run", "headline", "latency_stats"]

if __name__ == "__main__":
    raise SystemExit(main())
