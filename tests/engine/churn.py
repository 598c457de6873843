"""The spec §17.3 churn workload, shared by the fake-clock and the real-runtime runs.

N requests with random prompt/output lengths, random arrival, random deadlines, random cancels
(before admission, while queued, while running) and an engine shutdown in the middle. Every request
that was accepted must get exactly one terminal event, as the last event of its stream; greedy
requests that completed must equal the solo reference; afterwards no lane, sequence or job is left.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import trio

from calserve.engine.engine import Engine
from calserve.engine.types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
)
from calserve.errors import CapacityError, EngineError, UnavailableError


@dataclasses.dataclass
class ChurnResult:
    submitted: int = 0
    refused: int = 0  # capacity / engine closed
    terminals: dict[str, int] = dataclasses.field(default_factory=dict)
    checked_outputs: int = 0


async def run_churn(
    eng_cm: Any,
    n: int,
    seed: int,
    vocab: int,
    reference: Callable[[Sequence[int], int], list[int]],
    shutdown_after_s: float,
    arrival_span_s: float,
    time_scale: float = 1.0,
) -> tuple[ChurnResult, Engine]:
    rng = random.Random(seed)
    res = ChurnResult()
    plans = []
    for i in range(n):
        plen = rng.randint(1, 24)
        plans.append(dict(
            prompt=tuple(rng.randrange(vocab) for _ in range(plen)),
            max_tokens=rng.randint(1, 24),
            arrive=rng.random() * arrival_span_s,
            deadline=rng.choice([None, None, rng.uniform(0.5, 40.0) * time_scale,
                                 rng.uniform(0.05, 1.0) * time_scale]),
            cancel=rng.choice(["none", "none", "now", "soon", "later"]),
            cancel_after=rng.uniform(0.0, 20.0) * time_scale,
        ))

    async def client(eng: Engine, p: dict[str, Any], nursery: trio.Nursery) -> None:
        await trio.sleep(p["arrive"])
        req = GenerateRequest(
            p["prompt"], SamplingParams(temperature=0.0, max_tokens=p["max_tokens"]),
            deadline_s=p["deadline"],
        )
        try:
            h = await eng.submit(req)
        except (CapacityError, EngineError, UnavailableError):
            res.refused += 1
            return
        res.submitted += 1
        if p["cancel"] == "now":
            h.cancel()
            h.cancel()  # idempotent
        elif p["cancel"] in ("soon", "later"):
            delay = p["cancel_after"] * (0.05 if p["cancel"] == "soon" else 1.0)

            async def later() -> None:
                await trio.sleep(delay)
                eng.cancel(h.request_id)

            nursery.start_soon(later)
        events = [ev async for ev in h.events()]
        terminal = [ev for ev in events if not isinstance(ev, TokenEvent)]
        assert len(terminal) == 1, f"request {h.request_id}: {len(terminal)} terminal events"
        assert events[-1] is terminal[0]
        t = terminal[0]
        toks = [tid for ev in events if isinstance(ev, TokenEvent) for tid in ev.token_ids]
        if isinstance(t, FinishEvent):
            key = t.reason.value
            assert t.usage.completion_tokens >= len(toks)
            if t.reason is FinishReason.LENGTH:
                assert len(toks) == p["max_tokens"]
            outputs.append((h.request_id, p["prompt"], toks))
        else:
            assert isinstance(t, ErrorEvent)
            key = "error:" + t.kind
        res.terminals[key] = res.terminals.get(key, 0) + 1

    outputs: list[tuple[int, tuple[int, ...], list[int]]] = []
    async with trio.open_nursery() as outer:
        async with eng_cm as eng:
            for p in plans:
                outer.start_soon(client, eng, p, outer)
            await trio.sleep(shutdown_after_s)
        # the engine is closed: late cancels must be harmless no-ops
    # Outputs are checked after the run: the reference may be slow and must not stall the loop.
    for rid, prompt, toks in outputs:
        ref = reference(prompt, len(toks))
        assert toks == ref, f"request {rid}: {toks} != {ref}"
        res.checked_outputs += 1
    return res, eng
