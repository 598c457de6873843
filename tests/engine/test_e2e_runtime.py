"""End to end on the demo package with the software runtime (real clock, real C kernels).

- one request streams the package's golden tokens (default config: calrt-0.7.6, B1, package loaded
  through calserve.models from CALSERVE_HOME);
- 16 concurrent requests of different lengths at B4/B8/B16 (sim-next) and B1 (calrt-0.7.6), each
  equal to its solo greedy output from the numpy reference (at B16 and B4 also with multi-step
  decode: several greedy steps a job on the device);
- prompts that arrive while host-driven multi-step runs decode end those runs early (calrt-0.7.6,
  which has no multi-step of its own), the outputs unchanged;
- a short request submitted while long ones run finishes first, and its lane is reused by the next
  waiting request at once (continuous batching), while the long ones keep running.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import trio

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.models.source import ModelSource
from calserve.engine.types import FinishReason, GenerateRequest, SamplingParams, TokenEvent
from calserve.runtime.reference import greedy_generate
from calserve.runtime.types import JobEngine, Timing

from .helpers import greedy_concurrently, stream


async def test_golden_tokens_stream_default_config(engine_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                   demo_source: ModelSource) -> None:
    monkeypatch.setenv("CALSERVE_HOME", str(engine_home))
    cfg = decode_config({})  # the embedded default: calrt-0.7.6, B1, demo package as "qwen3"
    async with Engine.open(cfg) as eng:
        assert eng.ready()
        [info] = eng.models()
        assert (info.alias, info.generation, info.state) == ("qwen3", 1, "Ready")
        assert len(demo_source.golden) >= 1
        for prompt, expected in demo_source.golden:
            want = list(expected[1])
            toks, fin = await stream(eng, tuple(prompt), len(want), ignore_eos=True)
            assert toks == want
            assert fin.reason is FinishReason.LENGTH
            assert fin.usage.completion_tokens == len(want)
            assert fin.timings is not None and fin.timings.ttft_s is not None


@functools.lru_cache(maxsize=None)
def _solo(source_id: int, prompt: tuple[int, ...], n: int, kv: str) -> list[int]:
    src = _SOURCES[source_id]
    return greedy_generate(src.model_config, src.weights, list(prompt), n, kv)


_SOURCES: dict[int, ModelSource] = {}


@pytest.mark.parametrize(
    "profile,batch,multi_step,host",
    [("calrt-0.7.6", 1, 1, False), ("sim-next", 4, 1, False), ("sim-next", 8, 1, False),
     ("sim-next", 16, 1, False), ("sim-next", 16, 8, False), ("sim-next", 4, 3, False),
     ("calrt-0.7.6", 1, 8, True), ("sim-next", 16, 8, True)],
    ids=["B1-0.7.6", "B4", "B8", "B16", "B16-multi-step-8", "B4-multi-step-3", "B1-0.7.6-host-multi-step-8",
         "B16-host-multi-step-8"],
)
async def test_16_concurrent_equal_solo(demo_source: ModelSource, profile: str, batch: int,
                                        multi_step: int, host: bool) -> None:
    """(With multi_step: the runtime's own argmax fed back on the device, N steps a job; with
    ``host`` too, N one-step device jobs a job, the argmax fed back by the binding in C: on
    calrt-0.7.6, which has no multi-step of its own, as well.)"""
    _SOURCES[id(demo_source)] = demo_source
    cfg = decode_config({"runtime": {"profile": profile, "host_multi_step": host},
                         "scheduler": {"batch": {"profiles": [batch], "multi_step": multi_step}}})
    prompts = [tuple((7 * i + j * 13 + 5) % 500 + 3 for j in range(2 + (i * 5) % 23)) for i in range(16)]
    lengths = [4 + (i * 7) % 29 for i in range(16)]
    async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
        out = await greedy_concurrently(eng, prompts, lengths)
        st = eng.statistics()
        if batch > 1:
            # really batched: decode jobs carried several lanes
            assert st.lanes_active_total[batch] > st.batches_total[batch]
        if multi_step > 1:  # and several steps a job (one while prompts wait for their prefill)
            assert st.decode_steps_total[batch] > 1.25 * st.batches_total[batch]
        if host:  # the device ran every step as a job of its own (prefills are jobs too)
            submitted = sum(eng.backend.counters(e).submitted for e in JobEngine)
            assert submitted >= st.decode_steps_total[batch] + 16
    kv = demo_source.profiles[batch].kv_dtype
    for i in range(16):
        assert out[i] == _solo(id(demo_source), prompts[i], lengths[i], kv), f"request {i}"


async def test_prompts_end_host_runs_early(demo_source: ModelSource) -> None:
    """calrt-0.7.6 (one step a device job), B1, ``runtime.host_multi_step`` with 16-step runs on a
    timed device (2 ms a step): a long request decodes while short ones arrive every 9 ms; each
    arrival ends the run in flight with its step in flight (a prefill waits), so runs are cut short
    and the steps they did not run are counted; every output equals its solo greedy one."""
    _SOURCES[id(demo_source)] = demo_source
    step = Timing(prefill_base_us=300.0, prefill_us_per_token=5.0, decode_step_us={1: 2000.0})
    source = dataclasses.replace(demo_source, timing={b: step for b in demo_source.profiles})
    cfg = decode_config({"runtime": {"profile": "calrt-0.7.6", "host_multi_step": True},
                         "scheduler": {"batch": {"profiles": [1], "multi_step": 16}}})
    prompts = [(11, 22, 33)] + [(40 + i, 7, 9) for i in range(6)]
    lengths = [120] + [3] * 6
    async with Engine.open(cfg, sources={"qwen3": source}) as eng:
        out = await greedy_concurrently(eng, prompts, lengths, [0.0] + [0.03 + 0.009 * i for i in range(1, 7)])
        st = eng.statistics()
    assert st.decode_runs_stopped_total >= 1 and st.decode_steps_cut_total >= 1, st
    kv = demo_source.profiles[1].kv_dtype
    for i in range(len(prompts)):
        assert out[i] == _solo(id(demo_source), prompts[i], lengths[i], kv), f"request {i}"


async def test_end_tokens_end_host_run_lanes(demo_source: ModelSource) -> None:
    """sim-next B4, 8-step runs driven by the host: requests ending on a stop token id (picked from
    their solo greedy outputs, each one's first new token from its 4th on) or on their EOS end
    their lanes inside a run (``hs_start_ends``): the same tokens and finish as one step a job;
    one request alone runs exactly the steps up to its token, where the device's own 8-step runs
    run to their ends."""
    _SOURCES[id(demo_source)] = demo_source
    kv = demo_source.profiles[4].kv_dtype
    eos = set(demo_source.eos_token_ids)
    prompts: list[tuple[int, ...]] = []
    stops: list[int] = []
    at: list[int] = []
    for i in range(40):  # four that end on a stop token (the first new one from their 4th on)...
        p = (11 + i, 22, 33)
        g = _solo(id(demo_source), p, 40, kv)
        k = next((j for j in range(3, 40) if g[j] not in g[:j] and g[j] not in eos), None)
        if k is not None and not eos & set(g[:k]) and len(prompts) < 4:
            prompts.append(p)
            stops.append(g[k])
            at.append(k)
        elif eos & set(g[3:]) and len(prompts) == 4:  # ... and one on its EOS, after its 4th
            prompts.append(p)
            stops.append(next(t for t in range(1, 400) if t not in g and t not in eos))  # never drawn
            at.append(-1)
            break
    assert len(prompts) == 5, prompts

    async def run(multi_step: int, host: bool, which: list[int]) -> tuple[dict[int, Any], Any]:
        cfg = decode_config({"runtime": {"profile": "sim-next", "host_multi_step": host},
                             "scheduler": {"batch": {"profiles": [4], "multi_step": multi_step}}})
        out: dict[int, Any] = {}
        async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
            async def one(i: int) -> None:
                out[i] = await stream(eng, prompts[i], 40, stop_token_ids=frozenset({stops[i]}))

            async with trio.open_nursery() as nursery:
                for i in which:
                    nursery.start_soon(one, i)
            return out, eng.statistics()

    one, s1 = await run(1, False, [0])
    dev, sd = await run(8, False, [0])
    host, sh = await run(8, True, [0])
    for toks, fin in (dev[0], host[0]):
        assert toks == one[0][0] and fin.reason is one[0][1].reason is FinishReason.STOP
    steps = [sum(s.decode_steps_total.values()) for s in (s1, sd, sh)]
    assert steps[0] == steps[2] == at[0] and steps[1] == 8 * -(-at[0] // 8), (steps, at)
    # five at once over four lanes: the fifth waits for the first lane to end inside a run
    one5, _ = await run(1, False, [0, 1, 2, 3, 4])
    host5, _ = await run(8, True, [0, 1, 2, 3, 4])
    for i in range(5):
        assert host5[i][0] == one5[i][0] and host5[i][1].reason is FinishReason.STOP, i


async def test_short_request_finishes_first_and_its_lane_is_reused(demo_source: ModelSource) -> None:
    # 4 lanes only: 3 long requests + 1 short one fill them; a 5th request waits for a lane.
    cfg = decode_config({
        "runtime": {"profile": "sim-next"},
        "scheduler": {"batch": {"profiles": [4]}, "admission": {"max_sequences": 4}},
    })
    finished: list[str] = []
    lanes: dict[str, int] = {}
    rid: dict[str, int] = {}
    async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
        async def run(name: str, prompt: tuple[int, ...], n: int, started: trio.Event | None = None) -> None:
            h = await eng.submit(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                        ignore_eos=True)))
            rid[name] = h.request_id
            async for ev in h.events():
                if isinstance(ev, TokenEvent) and name not in lanes:
                    lanes[name] = eng.registry.live[h.request_id].lease.lane
                    if started is not None:
                        started.set()
            finished.append(name)

        async with trio.open_nursery() as nursery:
            started = [trio.Event() for _ in range(3)]
            for i in range(3):
                nursery.start_soon(run, f"long{i}", (11 + i, 22, 33), 400, started[i])
            for ev in started:
                await ev.wait()
            # 8 tokens: the waiter (submitted next) must be queued before the short one's release
            # (with 3, a loaded host sometimes ran all of them before the waiter's submit)
            nursery.start_soon(run, "short", (44, 55), 8)
            while "short" not in rid:
                await trio.sleep(0)
            nursery.start_soon(run, "waiter", (66, 77), 3)
        assert finished[:2] == ["short", "waiter"], finished
        assert lanes["waiter"] == lanes["short"]
        # the waiter was admitted into the freed lane in the same tick as the runtime confirmed the
        # release of the short request's sequence (a lane is reused only after that, spec §9.2),
        # while the long ones kept decoding; its prefill then came within the decode:short = 8:4
        # round robin (at most 2 decode picks before it)
        trace = list(eng.core.requests.trace)
        released_short = trace.index(("released", (rid["short"],)))
        admit_waiter = trace.index(("admit", (rid["waiter"],)))
        assert admit_waiter == released_short + 1, trace[released_short - 3:admit_waiter + 2]
        last_short = max(i for i, (k, ids) in enumerate(trace) if k in ("prefill", "decode") and rid["short"] in ids)
        assert last_short < released_short
        waiter_prefill = trace.index(("prefill", (rid["waiter"],)))
        between = [k for k, _ in trace[admit_waiter + 1:waiter_prefill]]
        assert between.count("decode") <= 2 and "prefill" not in between
        later_decodes = [ids for k, ids in trace[waiter_prefill:] if k == "decode"]
        assert later_decodes and all(rid["long0"] in ids for ids in later_decodes[:3])
