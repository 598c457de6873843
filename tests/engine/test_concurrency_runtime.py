"""Spec §17.3 again, on the real clock against the software runtime with seeded completion
shuffling (``runtime.completion_jitter_us``): random cancels/deadlines, shutdown in the middle,
exactly one terminal event each, outputs equal to the numpy reference, nothing leaked."""

from __future__ import annotations

import functools

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.models.source import ModelSource
from calserve.runtime.reference import greedy_generate

from .churn import run_churn


async def test_churn_real_runtime(demo_source: ModelSource) -> None:
    cfg = decode_config({
        "runtime": {"profile": "sim-next", "completion_jitter_us": 400, "seed": 3},
        "scheduler": {
            "batch": {"profiles": [8]},
            "executor": {"max_inflight": 2},
            "admission": {"max_sequences": 16, "max_waiting_requests": 200},
        },
    })

    @functools.lru_cache(maxsize=None)
    def reference(prompt: tuple[int, ...], n: int) -> list[int]:
        return greedy_generate(demo_source.model_config, demo_source.weights, list(prompt), n,
                               demo_source.profiles[8].kv_dtype)

    res, eng = await run_churn(
        Engine.open(cfg, sources={"qwen3": demo_source}),
        n=240, seed=9, vocab=demo_source.model_config.vocab_size,
        reference=lambda p, n: reference(tuple(p), n),
        shutdown_after_s=0.35, arrival_span_s=0.5, time_scale=0.01,
    )
    print(res)
    assert res.submitted + res.refused == 240
    assert sum(res.terminals.values()) == res.submitted
    for key in ("length", "cancelled", "deadline"):
        assert res.terminals.get(key, 0) > 0, res.terminals
    assert res.terminals.get("error:shutdown", 0) + res.refused > 0
    assert res.checked_outputs > 20
    assert eng.registry.live == {}
    assert eng.leaked_at_close == 0
    gen = eng.generation()
    k = gen.kv.statistics()
    assert (k.free, k.tokens_reserved) == (k.num_lanes, 0)
    assert eng.core.inflight_jobs() == 0
    st = eng.final_statistics
    assert st is not None
    for name, c in st.executor.items():
        assert c.inflight == 0, name
        assert c.submitted == c.completed + c.failed
