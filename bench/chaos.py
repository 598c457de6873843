"""Chaos through HTTP: greedy requests against a server whose software runtime injects faults.

One request per prompt (``/v1/completions``, temperature 0, ``ignore_eos``, random ``max_tokens``),
half streamed; some clients disconnect early (after a few chunks, or a JSON request after a short
time), some requests outlive ``admission.deadline_default_ms``. Every outcome records how the
request ended (``ok`` / ``truncated`` (deadline: finish "length" before ``max_tokens``) /
``error`` / ``rejected`` / ``disconnected``), the text, the terminal events it saw (exactly one is
the rule) and whether it *noticed* a fault (an error, or a 5xx). :func:`check_outputs` compares each
completed output with the fault-free solo output of the same prompt (a second server without
faults); :func:`gauges_at_rest` reads the gauges that must come back to 0.

Used by ``tests/e2e/test_chaos.py`` (a few hundred requests) and the bench scenario ``chaos``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any
from urllib.parse import urlsplit

import trio

from bench.httpclient import Connection, ConnectionPool, iter_sse
from bench.scrape import parse_metrics

__all__ = ["Plan", "Outcome", "make_plans", "run_chaos", "check_outputs", "gauges_at_rest",
           "REST_GAUGES", "summarise"]

REST_GAUGES = ("calserve_requests_running", "calserve_kv_tokens_reserved",
               "calserve_executor_inflight_jobs")


@dataclasses.dataclass(frozen=True)
class Plan:
    i: int
    prompt: str
    max_tokens: int
    stream: bool
    disconnect_after: int | None  # chunks (stream) or milliseconds (JSON); None = read to the end
    at: float  # seconds after the start when it is sent


@dataclasses.dataclass
class Outcome:
    plan: Plan
    kind: str = ""  # ok | truncated | error | rejected | disconnected | transport
    status: int = 0
    text: str = ""
    tokens: int = 0
    code: str | None = None
    message: str = ""
    retry_after: str | None = None
    terminals: int = 0  # terminal events seen ([DONE] / error event / a JSON body)
    seconds: float = 0.0

    @property
    def noticed(self) -> bool:
        """The client saw something of a fault: an error from the engine, or a 5xx."""
        return self.kind == "error" or (self.kind == "rejected" and self.status >= 500)


def make_plans(n: int, seed: int, *, rate: float, disconnect_p: float = 0.1,
               long_p: float = 0.05, max_tokens: tuple[int, int] = (4, 32),
               long_tokens: int = 400) -> list[Plan]:
    """``n`` requests arriving at ``rate`` per second (Poisson), deterministic for ``seed``."""
    rng = random.Random(seed)
    plans = []
    at = 0.0
    for i in range(n):
        at += rng.expovariate(rate)
        stream = rng.random() < 0.5
        mt = long_tokens if rng.random() < long_p else rng.randint(*max_tokens)
        disc = None
        if rng.random() < disconnect_p:
            disc = rng.randint(1, 4) if stream else rng.randint(5, 200)
        words = " ".join(f"w{rng.randint(0, 999)}" for _ in range(rng.randint(3, 24)))
        plans.append(Plan(i, f"chaos {i}: {words}", mt, stream, disc, at))
    return plans


async def _one(pool: ConnectionPool, p: Plan, t0: float) -> Outcome:
    await trio.sleep_until(t0 + p.at)
    o = Outcome(p)
    req: dict[str, Any] = {"model": "qwen3", "prompt": p.prompt, "max_tokens": p.max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": p.stream}
    if p.stream:
        req["stream_options"] = {"include_usage": True}
    body = json.dumps(req).encode()
    start = trio.current_time()
    try:
        if p.stream:
            await _stream(pool, p, body, o)
        else:
            await _json(pool, p, body, o)
    except (OSError, trio.BrokenResourceError, Exception) as e:  # noqa: BLE001 - reported
        if not o.kind:
            o.kind, o.code = "transport", type(e).__name__
    o.seconds = trio.current_time() - start
    return o


async def _json(pool: ConnectionPool, p: Plan, body: bytes, o: Outcome) -> None:
    if p.disconnect_after:
        # its own connection, closed when the client gives up (the server sees the disconnect)
        conn = await Connection.open(pool.host, pool.port)
        try:
            with trio.move_on_after(p.disconnect_after / 1000) as scope:
                resp = await conn.request("POST", "/v1/completions", body,
                                          {"Content-Type": "application/json"})
                data = b"".join([part async for part in resp.body_parts()])
        finally:
            await conn.aclose()
        if scope.cancelled_caught:
            o.kind = "disconnected"
            return
    else:
        resp = await pool.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        data = b"".join([part async for part in resp.body_parts()])
        await pool.release(resp.conn)
    o.status = resp.status
    o.terminals = 1
    o.retry_after = resp.headers.get("retry-after")
    doc = json.loads(data)
    if resp.status == 200:
        ch = doc["choices"][0]
        o.text = ch["text"]
        o.tokens = int(doc["usage"]["completion_tokens"])
        o.kind = "ok" if o.tokens == p.max_tokens else "truncated"
    else:
        o.code = doc.get("error", {}).get("code")
        o.message = str(doc.get("error", {}).get("message", ""))
        o.kind = "error" if o.code in ("device_unavailable", "device_error", "internal_error") or (
            o.code == "model_unavailable" and resp.status == 503 and _after_admission(doc)) else "rejected"


def _after_admission(doc: dict[str, Any]) -> bool:
    """A 503 whose message says the model failed under the request (not a refusal at submit)."""
    return "failed" in str(doc.get("error", {}).get("message", ""))


async def _stream(pool: ConnectionPool, p: Plan, body: bytes, o: Outcome) -> None:
    resp = await pool.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    o.status = resp.status
    o.retry_after = resp.headers.get("retry-after")
    if resp.status != 200:
        data = b"".join([part async for part in resp.body_parts()])
        await pool.release(resp.conn)
        o.terminals = 1
        err = json.loads(data).get("error", {})
        o.code, o.message = err.get("code"), str(err.get("message", ""))
        o.kind = "rejected"
        return
    async with aclosing(iter_sse(resp)) as events:
        finish, done = await _read_events(p, events, o)
    if not done:  # disconnected on purpose
        await resp.conn.aclose()
        return
    await pool.release(resp.conn)
    if o.kind == "error":
        return
    if not o.tokens:
        o.tokens = -1  # unknown (no usage chunk): compared by text only
    o.kind = "ok" if (o.tokens == p.max_tokens or (o.tokens == -1 and finish == "length")) else "truncated"


async def _read_events(p: Plan, events: AsyncIterator[tuple[float, bytes]], o: Outcome
                       ) -> tuple[str | None, bool]:
    """(finish reason, read to the end) of a stream's events."""
    chunks = 0
    finish = None
    async for _t, data in events:
        if data == b"[DONE]":
            o.terminals += 1
            continue
        ev = json.loads(data)
        if "error" in ev:
            o.terminals += 1
            o.code = ev["error"].get("code")
            o.message = str(ev["error"].get("message", ""))
            o.kind = "error"
            continue
        if ev.get("usage"):
            o.tokens = int(ev["usage"]["completion_tokens"])
        if not ev.get("choices"):
            continue  # the usage chunk
        ch = ev["choices"][0]
        o.text += ch.get("text", "")
        finish = ch.get("finish_reason") or finish
        chunks += 1
        if p.disconnect_after is not None and chunks >= p.disconnect_after:
            o.kind = "disconnected"
            return finish, False
    return finish, True


async def run_chaos(url: str, plans: Sequence[Plan], *, max_connections: int = 512) -> list[Outcome]:
    u = urlsplit(url)
    pool = ConnectionPool(u.hostname or "127.0.0.1", u.port or 80, max_idle=max_connections)
    out: list[Outcome] = [Outcome(p) for p in plans]
    t0 = trio.current_time()

    async def run(k: int) -> None:
        out[k] = await _one(pool, plans[k], t0)

    try:
        async with trio.open_nursery() as n:
            for k in range(len(plans)):
                n.start_soon(run, k)
    finally:
        await pool.aclose()
    return out


def check_outputs(outcomes: Sequence[Outcome], reference: dict[int, str]) -> list[str]:
    """Mismatches: a completed output must equal the fault-free solo output of its prompt; one
    cut by its deadline must be a prefix of it."""
    bad = []
    for o in outcomes:
        ref = reference.get(o.plan.i)
        if ref is None:
            continue
        if o.kind == "ok" and o.text != ref:
            bad.append(f"request {o.plan.i}: {o.text!r} != {ref!r}")
        elif o.kind == "truncated" and not ref.startswith(o.text):
            bad.append(f"request {o.plan.i} (deadline): {o.text!r} is no prefix of {ref!r}")
    return bad


def gauges_at_rest(metrics_text: str) -> dict[str, float]:
    """The gauges that must be back at 0 once no request runs (non-free KV sequences summed)."""
    m = parse_metrics(metrics_text)
    out = {g: float(m.get(g, 0.0)) for g in REST_GAUGES}
    out["calserve_kv_sequences(non-free)"] = sum(
        v for k, v in m.items() if k.startswith("calserve_kv_sequences{") and "free" not in k.lower())
    return out


def summarise(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    codes: dict[str, int] = {}
    for o in outcomes:
        if o.code:
            codes[o.code] = codes.get(o.code, 0) + 1
    return {"requests": len(outcomes), "outcomes": kinds, "codes": codes,
            "noticed_fault": sum(1 for o in outcomes if o.noticed),
            "max_seconds": round(max((o.seconds for o in outcomes), default=0.0), 3),
            "terminals_not_one": sum(1 for o in outcomes
                                     if o.kind not in ("disconnected", "transport") and o.terminals != 1)}


def wall() -> float:
    return time.time()
