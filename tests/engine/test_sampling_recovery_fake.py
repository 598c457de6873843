"""The sampler's per-request state across a device fault (fake device, fake clock): a request with
penalties, logit_bias, min_p/top_k or a response_format grammar that loses its KV and is
re-prefilled samples exactly what it samples in a fault-free run (penalty counts and the grammar
matcher are functions of the generated tokens the request keeps)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest
import tokenizers
import trio

from calserve.engine.engine import Engine
from calserve.engine.grammar import compile_response_format
from calserve.engine.types import FinishEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer
from calserve.runtime.types import FaultKind, JobEngine
from calserve.testing.fake_device import FakeBackend

from .helpers import config, fake_source

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def demo_tok() -> Tokenizer:
    hf = tokenizers.Tokenizer.from_str(demo_tokenizer_json())
    return Tokenizer(hf, (hf.token_to_id("<|im_end|>"),))


def requests(tok: Tokenizer) -> list[SamplingParams]:
    g = compile_response_format({"type": "json_schema", "json_schema": {
        "name": "t", "schema": SCHEMA, "strict": True}}, tok, tok.vocab_size)
    obj = compile_response_format({"type": "json_object"}, tok, tok.vocab_size)
    return [
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, frequency_penalty=1.5,
                       presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=2.0),
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, logit_bias=((5, -100.0), (9, 4.0))),
        SamplingParams(temperature=0.9, seed=4, max_tokens=40, top_k=20, min_p=0.1),
        SamplingParams(temperature=1.0, seed=5, max_tokens=200, grammar=g),
        SamplingParams(temperature=0.0, max_tokens=200, grammar=g),
        SamplingParams(temperature=1.0, seed=7, max_tokens=300, grammar=obj,
                       presence_penalty=0.3),
        SamplingParams(temperature=1.0, seed=8, max_tokens=40, min_p=0.2),
    ]


async def run_all(eng: Engine, params: list[SamplingParams]) -> list[tuple[list[int], Any]]:
    out: list[tuple[list[int], Any]] = [([], None)] * len(params)

    async def one(i: int) -> None:
        h = await eng.submit(GenerateRequest((i + 1, 2 * i + 3, 7), params[i]))
        toks: list[int] = []
        term = None
        async for ev in h.events():
            if isinstance(ev, TokenEvent):
                toks.extend(ev.token_ids)
            else:
                term = ev
        out[i] = (toks, term)

    async with trio.open_nursery() as nursery:
        for i in range(len(params)):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("kind", [FaultKind.CCU_FAULT, FaultKind.CROSSTALK])
async def test_processed_and_constrained_requests_continue_exactly_after_a_fault(
        autojump_clock: object, kind: FaultKind) -> None:
    tok = demo_tok()
    src = dataclasses.replace(fake_source(vocab=tok.vocab_size, eos=tok.eos_token_ids),
                              tokenizer=tok)
    cfg = config(batch={"profiles": [8], "batching_window_us": 1_000_000},
                 executor={"wait_timeout_ms": 200}, recovery={"max_request_retries": 2})
    results = []
    for fault in (False, True):
        be = FakeBackend("sim-next", seed=2)
        async with Engine.open(cfg, backend=be, sources={"qwen3": src}) as eng:
            if fault:
                be.inject_fault(kind, JobEngine.PING, 10, lane=3)
            results.append(await run_all(eng, requests(tok)))
            if fault:
                await trio.sleep(1.0)
                assert eng.statistics().resets_total == 1
                assert eng.core.statistics(trio.current_time()).readmitted_total == 8
    clean, faulted = results
    assert [t for t, _ in faulted] == [t for t, _ in clean]
    for i, (toks, term) in enumerate(clean):
        assert isinstance(term, FinishEvent), term
        assert isinstance(faulted[i][1], FinishEvent) and faulted[i][1].reason == term.reason
        if i in (4, 5, 6):  # the constrained ones end on EOS with valid JSON
            assert term.reason is FinishReason.STOP, (i, tok.decode(toks))
            value = json.loads(tok.decode(toks))
            if i < 6:
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)
        if i == 2:
            assert 5 not in toks
