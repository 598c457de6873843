"""Test helpers: an in-memory model source for the FakeBackend, a tiny tokenizer stand-in, and the
greedy request runners (collect / stream / greedy_concurrently) the engine tests share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from calserve.config import CalserveConfig, decode_config
from calserve.engine.engine import Engine
from calserve.testing.fake_device import fake_logits, history_hash
from calserve.models.source import ModelSource
from calserve.engine.types import FinishEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import ProfileSpec, Timing


class CharTokenizer:
    """Token i decodes to one printable character (ids >= 90 map into CJK to exercise multi-char)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(33 + i) if i < 90 else chr(0x4E00 + i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 33 if ord(c) < 0x4E00 else ord(c) - 0x4E00 for c in text]


def fake_source(
    vocab: int = 128,
    profiles: Sequence[int] = (1, 4, 8, 16),
    max_seq: int = 512,
    max_sequences: int = 32,
    eos: tuple[int, ...] = (),
    step_us: float = 1000.0,
    alias: str = "qwen3",
) -> ModelSource:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    specs = {b: ProfileSpec(b, max_seq, max_sequences) for b in profiles}
    timing = {b: Timing(200.0, 2.0, {b: step_us}) for b in profiles}
    return ModelSource(alias=alias, model_config=cfg, weights={}, profiles=specs, eos_token_ids=eos,
                       tokenizer=CharTokenizer(), sha256="0" * 64, timing=timing)


def fake_greedy(prompt: Sequence[int], steps: int, vocab: int = 128) -> list[int]:
    """What the fake device's model generates greedily (solo reference)."""
    toks = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        t = int(np.argmax(fake_logits(history_hash(toks), vocab)))
        out.append(t)
        toks.append(t)
    return out


def config(**sched: object) -> CalserveConfig:
    """A config with scheduler overrides given as nested dicts, e.g. batch={"profiles": [8]}."""
    return decode_config({"scheduler": sched})


async def collect(eng: Engine, prompt: tuple[int, ...], max_tokens: int, **kw: Any) -> tuple[list[int], object]:
    """One greedy request: its tokens and its single terminal event (``kw``: more SamplingParams)."""
    h = await eng.submit(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)))
    toks: list[int] = []
    term = None
    async for ev in h.events():
        if isinstance(ev, TokenEvent):
            toks.extend(ev.token_ids)
        else:
            assert term is None
            term = ev
    return toks, term


async def stream(eng: Engine, prompt: tuple[int, ...], max_tokens: int, **kw: Any) -> tuple[list[int], FinishEvent]:
    """:func:`collect` for a request that must finish (not error)."""
    toks, term = await collect(eng, prompt, max_tokens, **kw)
    assert isinstance(term, FinishEvent), term
    return toks, term


async def greedy_concurrently(
    eng: Engine, prompts: Sequence[tuple[int, ...]], lengths: Sequence[int],
    starts: Sequence[float] | None = None,
) -> dict[int, list[int]]:
    """Run request i (``prompts[i]``, exactly ``lengths[i]`` tokens, ignore_eos) concurrently for
    every i (``starts[i]`` s from now, when given); each must finish by LENGTH. Returns i -> its
    tokens."""
    out: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        if starts is not None:
            await trio.sleep(starts[i])
        toks, fin = await stream(eng, prompts[i], lengths[i], ignore_eos=True)
        assert fin.reason is FinishReason.LENGTH
        out[i] = toks

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out
