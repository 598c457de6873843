"""Constrained decoding (engine/grammar.py + the sampler's mask) on the demo tokenizer.

The demo model's text is noise, so random logits are a fair stand-in here: every one of the 20
schemas (``tests/fixtures/json_schemas.json``) must yield output that parses and validates, whatever
the logits. Plus: bad ``response_format`` objects are refused naming it; EOS is allowed exactly
where the grammar may end; a matcher rebuilt from the generated tokens equals the one that
consumed them step by step (re-prefill after a device fault).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.engine.grammar import Grammar, compile_response_format, fill_masks
from calserve.engine.logits import LaneLogits
from calserve.engine.sampler import LaneSampling, sample_batch
from calserve.errors import RequestError
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

SCHEMAS: list[Any] = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "json_schemas.json").read_text())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    hf = tokenizers.Tokenizer.from_str(demo_tokenizer_json())
    return Tokenizer(hf, (hf.token_to_id("<|im_end|>"),))


def rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def run(tok: Tokenizer, g: Grammar, seed: int, max_tokens: int = 600,
        temperature: float = 1.0) -> tuple[list[int], bool]:
    """Generate under ``g`` from random logits; (tokens without EOS, ended on EOS)."""
    vocab = tok.vocab_size
    st_ = g.new_state()
    rng = np.random.default_rng(seed)
    toks: list[int] = []
    eos = set(tok.eos_token_ids)
    for step in range(max_tokens):
        st_.sync(toks)
        mask = fill_masks([st_], vocab)[0]
        x = (rng.standard_normal((1, vocab)) * 3).astype(np.float32)
        ln = LaneSampling(temperature=temperature, seed=seed, step=step,
                          logits=LaneLogits(allowed=mask))
        t = int(sample_batch(x, [ln]).tokens[0])
        if t in eos:
            return toks, True
        toks.append(t)
    return toks, False


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_schema_yields_valid_json_from_noise(tok: Tokenizer, i: int) -> None:
    g = compile_response_format(rf(SCHEMAS[i]), tok, tok.vocab_size)
    assert g is not None
    for seed in range(3):
        for temperature in (1.0, 0.0):
            toks, ended = run(tok, g, seed * 7 + i, temperature=temperature)
            assert ended, (i, tok.decode(toks))
            value = json.loads(tok.decode(toks))
            jsonschema.validate(value, SCHEMAS[i])


def test_json_object_is_an_object(tok: Tokenizer) -> None:
    g = compile_response_format({"type": "json_object"}, tok, tok.vocab_size)
    assert g is not None
    for seed in range(4):
        toks, ended = run(tok, g, seed, max_tokens=1500)
        assert ended
        assert isinstance(json.loads(tok.decode(toks)), dict)


@pytest.mark.parametrize("bad", [
    {"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": 3},
    rf({"type": "objectx"}), rf({"$ref": "#/nope"}), rf(7),
    {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
    rf({"type": "string", "format": "no-such-format"}),
])
def test_bad_response_formats_name_the_field(tok: Tokenizer, bad: Any) -> None:
    with pytest.raises(RequestError) as e:
        compile_response_format(bad, tok, tok.vocab_size)
    assert e.value.param == "response_format"


def test_text_or_absent_is_no_grammar(tok: Tokenizer) -> None:
    assert compile_response_format(None, tok, tok.vocab_size) is None
    assert compile_response_format({"type": "text"}, tok, tok.vocab_size) is None


def _bit(mask: np.ndarray, t: int) -> bool:
    return bool((int(mask[t // 32]) >> (t % 32)) & 1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), schema=st.integers(0, len(SCHEMAS) - 1))
def test_eos_only_where_the_grammar_may_end_and_rebuild_equals_stepping(
        tok: Tokenizer, seed: int, schema: int) -> None:
    g = compile_response_format(rf(SCHEMAS[schema]), tok, tok.vocab_size)
    assert g is not None
    toks, _ = run(tok, g, seed)
    eos = tok.eos_token_ids[0]
    stepping = g.new_state()
    for k in range(len(toks) + 1):
        stepping.sync(toks[:k])
        mask = fill_masks([stepping], tok.vocab_size)[0]
        assert _bit(mask, eos) == stepping.accepting
        # a matcher rebuilt from the tokens (re-prefill) is in the same state
        rebuilt = g.new_state()
        rebuilt.rebuild(toks[:k])
        assert np.array_equal(fill_masks([rebuilt], tok.vocab_size)[0], mask)


def test_masks_of_a_batch_are_computed_together_and_per_lane(tok: Tokenizer) -> None:
    gs = [compile_response_format(rf(s), tok, tok.vocab_size) for s in SCHEMAS[:4]]
    states = [g.new_state() for g in gs if g is not None]
    together = fill_masks(states, tok.vocab_size)
    for i, s in enumerate(states):
        assert np.array_equal(together[i], fill_masks([s], tok.vocab_size)[0])
    # a lane of a batch drawn under its mask takes the same token as alone
    x = np.random.default_rng(1).standard_normal((4, tok.vocab_size)).astype(np.float32)
    lanes = [LaneSampling(temperature=1.0, seed=i, logits=LaneLogits(allowed=together[i]))
             for i in range(4)]
    both = sample_batch(x, lanes).tokens.tolist()
    assert both == [int(sample_batch(x[i:i + 1], [lanes[i]]).tokens[0]) for i in range(4)]


def test_schemas_at_the_size_bounds_compile_in_bounded_time_and_past_them_are_refused(
        tok: Tokenizer) -> None:
    """engine/grammar.py's schema bounds on the demo tokenizer: each schema at a bound compiles
    (under llguidance's LIMITS) in well under a second; one past it is a RequestError naming
    response_format, refused before compiling (in milliseconds, where compiling took seconds)."""
    import time

    from tests.api.test_bounds import SCHEMAS_AT_BOUNDS, SCHEMAS_PAST_BOUNDS

    for f in SCHEMAS_AT_BOUNDS:
        t = time.monotonic()
        assert compile_response_format(f, tok, tok.vocab_size) is not None
        assert time.monotonic() - t < 1.0, f
    for f in SCHEMAS_PAST_BOUNDS:
        t = time.monotonic()
        with pytest.raises(RequestError) as e:
            compile_response_format(f, tok, tok.vocab_size)
        assert e.value.param == "response_format"
        assert time.monotonic() - t < 0.1, f


def test_compiled_grammars_are_cached_per_tokenizer_and_schema(tok: Tokenizer) -> None:
    """The same schema (tools sent request after request) compiles once; a grammar's requests
    advance their own matchers; a schema that fails is never cached; the cache keeps the most
    recent GRAMMAR_CACHE schemas of a tokenizer."""
    from calserve.engine.grammar import GRAMMAR_CACHE, compile_json_schema

    schema = {"type": "object", "properties": {"cached": {"type": "integer"}}}
    g = compile_json_schema(schema, tok, tok.vocab_size)
    assert compile_json_schema(schema, tok, tok.vocab_size) is g
    assert compile_json_schema(schema, tok, tok.vocab_size, kind="json_object") is not g
    assert compile_response_format(rf(schema), tok, tok.vocab_size) is g  # the same grammar either way
    a, b = g.new_state(), g.new_state()
    a.sync(tok.encode('{"cached":'))
    assert b.consumed == 0 and not b.matcher.is_error() and a.consumed > 0
    hf = tokenizers.Tokenizer.from_str(demo_tokenizer_json())
    other = Tokenizer(hf, (hf.token_to_id("<|im_end|>"),))
    assert compile_json_schema(schema, other, other.vocab_size) is not g
    for _ in range(2):  # refused each time, never remembered
        with pytest.raises(RequestError):
            compile_json_schema({"type": "objectx"}, tok, tok.vocab_size, param="tools")
    for i in range(GRAMMAR_CACHE):
        compile_json_schema({"type": "object", "properties": {f"p{i}": {"type": "null"}}}, tok, tok.vocab_size)
    assert compile_json_schema(schema, tok, tok.vocab_size) is not g  # the oldest went
