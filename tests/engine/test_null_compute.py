"""``runtime.null_compute``: the engine starts without the golden check (it cannot pass on
pseudo-logits) and says so in the log; with real compute a wrong golden still refuses to load."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.models.source import ModelSource
from calserve.engine.types import FinishEvent, GenerateRequest, SamplingParams
from calserve.errors import ValidationError

from .helpers import fake_source


def wrong_golden() -> ModelSource:
    # Not what the fake model generates for this prompt (fake_greedy differs): golden must fail.
    return dataclasses.replace(fake_source(profiles=(4,)), golden=[((1, 2, 3), {4: [0, 0, 0, 0]})])


def cfg(null: bool) -> object:
    return decode_config({"scheduler": {"batch": {"profiles": [4]}},
                          "runtime": {"null_compute": null}})


async def test_wrong_golden_refuses_to_load_with_real_compute(autojump_clock: object) -> None:
    with pytest.raises(BaseException) as ei:
        async with Engine.open(cfg(False), backend=FakeBackend("sim-next"),
                               sources={"qwen3": wrong_golden()}):
            pass
    err: BaseException = ei.value
    while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
        err = err.exceptions[0]
    assert isinstance(err, ValidationError) and "golden mismatch" in str(err)


async def test_null_compute_skips_golden_and_logs(autojump_clock: object,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="calserve.engine.generations"):
        async with Engine.open(cfg(True), backend=FakeBackend("sim-next"),
                               sources={"qwen3": wrong_golden()}) as eng:
            h = await eng.submit(GenerateRequest((1, 2, 3), SamplingParams(max_tokens=3)))
            events = [ev async for ev in h.events()]
            assert isinstance(events[-1], FinishEvent)
    assert any("golden check skipped" in r.getMessage() for r in caplog.records)


async def test_null_compute_real_runtime_starts_with_the_demo_package(
        demo_source: ModelSource) -> None:
    """The software runtime with null_compute returns pseudo-logits; the demo package's golden
    cases would fail, so this start is what the bench's CPU-floor scenario needs."""
    c = decode_config({"scheduler": {"batch": {"profiles": [4]}},
                       "runtime": {"profile": "sim-next", "null_compute": True}})
    async with Engine.open(c, sources={"qwen3": demo_source}) as eng:
        h = await eng.submit(GenerateRequest((5, 6, 7), SamplingParams(max_tokens=4),))
        events = [ev async for ev in h.events()]
        assert isinstance(events[-1], FinishEvent)
