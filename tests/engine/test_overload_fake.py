"""Overload admission on the fake device (fake clock): at 3x the device's capacity, short requests'
TTFT stays bounded by ``admission.max_expected_wait_ms`` while the excess gets 429 (CapacityError
with a Retry-After), nothing is lost and the device stays busy; without it (the old count-bounded
queue, every lane time-shared) the same load makes accepted requests wait many times longer.

B4 with a 4 ms step (1,000 tokens/s), prefill 0.2 ms + 2 us/token; 80 % 16-token and 20 % 400-token
prompts (medium class), 32 output tokens; Poisson arrivals at 3x what the decode lanes can finish.
"""

from __future__ import annotations

import random
from typing import Any

import trio

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.engine.types import FinishEvent, GenerateRequest, SamplingParams, TokenEvent
from calserve.errors import CapacityError

from .helpers import fake_source

STEP_US = 4000.0
B = 4
OUT = 32
CAPACITY_REQ_S = B / (STEP_US * 1e-6) / OUT  # 31.25 req/s if every step were decode
SLO_MS = 200


def _cfg(overload: bool) -> Any:
    adm: dict[str, object] = {"max_waiting_requests": 512}
    if overload:
        adm |= {"max_expected_wait_ms": SLO_MS}
    else:
        adm |= {"max_expected_wait_ms": None, "max_tpot_steps": None}
    return decode_config({"scheduler": {
        "batch": {"profiles": [B]}, "admission": adm,
        "queues": {"short_prefill_max_tokens": 64},
    }})


def _p(data: list[float], q: float) -> float:
    s = sorted(data)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _run(overload: bool, seconds: float = 3.0) -> dict[str, Any]:
    rng = random.Random(7)
    be = FakeBackend("sim-next", seed=3)
    src = fake_source(profiles=(B,), max_sequences=32, step_us=STEP_US)
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    res: dict[str, Any] = {"accepted": 0, "rejected": 0, "retry_after": [], "finished": 0,
                           "tokens": 0}
    async with Engine.open(_cfg(overload), backend=be, sources={"qwen3": src}) as eng:

        async def one(kind: str, prompt: tuple[int, ...]) -> None:
            t0 = trio.current_time()
            try:
                h = await eng.submit(GenerateRequest(prompt, SamplingParams(max_tokens=OUT,
                                                                            ignore_eos=True)))
            except CapacityError as e:
                res["rejected"] += 1
                res["retry_after"].append(e.retry_after)
                return
            res["accepted"] += 1
            first = True
            async for ev in h.events():
                if isinstance(ev, TokenEvent):
                    if first:
                        ttft[kind].append(trio.current_time() - t0)
                        first = False
                    res["tokens"] += len(ev.token_ids)
                else:
                    assert isinstance(ev, FinishEvent), ev
                    res["finished"] += 1

        t_start = trio.current_time()
        async with trio.open_nursery() as n:
            t = 0.0
            i = 0
            while t < seconds:
                t += rng.expovariate(3 * CAPACITY_REQ_S)
                await trio.sleep_until(t_start + t)
                long = rng.random() < 0.2
                prompt = tuple((i * 7 + k) % 100 + 1 for k in range(400 if long else 16))
                n.start_soon(one, "long" if long else "short", prompt)
                i += 1
        res["elapsed"] = trio.current_time() - t_start
        res["sent"] = i
        res["stats"] = gen_stats = next(iter(eng.model_manager.generations.values())).admission.statistics()
        assert gen_stats.active_sequences == 0 and gen_stats.waiting_requests == 0
    res["ttft"] = ttft
    return res


async def test_overload_keeps_short_ttft_bounded_and_refuses_the_excess(autojump_clock: object) -> None:
    new = await _run(overload=True)
    old = await _run(overload=False)
    for r in (new, old):  # nothing lost: every accepted request ended with one FinishEvent
        assert r["accepted"] + r["rejected"] == r["sent"]
        assert r["finished"] == r["accepted"]
        assert r["tokens"] == OUT * r["accepted"]
    # The excess is refused with a Retry-After hint; the old queue (512 deep) refused nothing.
    assert new["rejected"] > 0.4 * new["sent"], new
    assert all(ra is not None and ra > 0 for ra in new["retry_after"])
    assert new["stats"].rejected_expected_wait == new["rejected"]
    assert old["rejected"] == 0
    # Short requests' TTFT stays near the queue-wait SLO (their own prefill and one decode step of
    # slack on top); the old behaviour makes them wait far longer.
    short_new = new["ttft"]["short"]
    p99 = _p(short_new, 0.99)
    print(f"short TTFT p50 {_p(short_new, 0.5) * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms, "
          f"old p99 {_p(old['ttft']['short'], 0.99) * 1e3:.0f} ms, "
          f"429 {new['rejected']}/{new['sent']}, long accepted {len(new['ttft']['long'])}")
    assert p99 <= 1.25 * SLO_MS * 1e-3, p99
    assert _p(old["ttft"]["short"], 0.99) > 4 * p99
    # Long (medium-class) requests still get in: preferred-short is not starve-long.
    assert len(new["ttft"]["long"]) > 0
    # The device stayed busy: the admitted work is at least ~80 % of what the lanes could decode.
    assert new["tokens"] >= 0.8 * (B / (STEP_US * 1e-6)) * 3.0 * 0.8, new["tokens"]
