"""llama.cpp's ``/infill`` (``calserve/api/infill.py``), what editor plugins (llama.vscode,
llama.vim) call: the FIM prompt llama-server builds (extra context as text, or its repo-level
pattern with repository and file-separator tokens; ``prompt`` after the middle token), answered in
llama-server's shape, streamed or not. Each answer is checked against ``/v1/completions`` with the
token prompt it means (the fake model is a function of the sequence)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tokenizers

from calserve.api.tokenizing import max_text_chars
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.fim import FimTokens
from calserve.models.tokenizer import Tokenizer

from .conftest import make_config
from .real_engine import ChatCharTokenizer, RealHarness, api_source, real_app
from .sse_util import parse_sse, stream_post
from .test_bounds import FLOAT_EXTREMES, INT_EXTREMES

PRE, SUF, MID, PAD, REP, SEP = 120, 121, 122, 123, 124, 125


class FimTokenizer(ChatCharTokenizer):
    fim = FimTokens(PRE, SUF, MID, (PAD,))


class RepoFimTokenizer(ChatCharTokenizer):
    fim = FimTokens(PRE, SUF, MID, (PAD, REP, SEP), rep=REP, sep=SEP)


def enc(text: str) -> list[int]:
    return ChatCharTokenizer().encode(text)


def app(tok: Any) -> Any:
    return real_app(make_config(), sources=[api_source(tokenizer=tok)])


async def same_as_completion(h: RealHarness, ids: list[int], doc: dict[str, Any],
                             body: dict[str, Any], stops: list[int]) -> None:
    """``body`` (an /infill answer) is what /v1/completions answers for the token prompt ``ids``."""
    want = await h.post_ok("/v1/completions", {
        "prompt": ids, "max_tokens": doc["n_predict"], "temperature": 0, "stop_token_ids": stops})
    assert body["content"] == want["choices"][0]["text"]
    assert body["tokens_evaluated"] == len(ids) == want["usage"]["prompt_tokens"]
    assert body["tokens_predicted"] == want["usage"]["completion_tokens"]
    assert body["stop_type"] == {"stop": "eos", "length": "limit"}[want["choices"][0]["finish_reason"]]


async def test_infill_answer_in_llama_servers_shape() -> None:
    async with app(FimTokenizer()) as h:
        doc = {"input_prefix": "def f(a,b):", "input_suffix": "return(c)", "n_predict": 6,
               "temperature": 0, "cache_prompt": True, "samplers": ["top_k"]}
        body = await h.post_ok("/infill", doc)
        assert body["stop"] is True and body["truncated"] is False and body["model"] == "qwen3"
        assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                        "predicted_per_second"}
        ids = [PRE, *enc("def f(a,b):"), SUF, *enc("return(c)"), MID]
        await same_as_completion(h, ids, doc, body, [PAD])
        # the text already typed after the cursor goes after the middle token; other files as
        # text before the FIM prefix (no repository / file-separator tokens)
        doc2 = {**doc, "prompt": "c=", "input_extra": [{"filename": "u.py", "text": "x=1"}]}
        body = await h.post_ok("/infill", doc2)
        ids = [*enc("\n\n--- snippet ---\n\n"), *enc("x=1"), PRE, *enc("def f(a,b):"), SUF,
               *enc("return(c)"), MID, *enc("c=")]
        await same_as_completion(h, ids, doc2, body, [PAD])


async def test_repo_level_pattern_with_repo_and_file_tokens() -> None:
    async with app(RepoFimTokenizer()) as h:
        doc = {"input_prefix": "y=", "input_suffix": ";", "n_predict": 5, "temperature": 0,
               "input_extra": [{"filename": "a.py", "text": "k=2"}, {"text": "z"}]}
        body = await h.post_ok("/infill", doc)
        ids = [REP, *enc("myproject\n"), SEP, *enc("a.py\n"), *enc("k=2"), SEP, *enc("tmp\n"),
               *enc("z"), SEP, *enc("filename\n"), PRE, *enc("y="), SUF, *enc(";"), MID]
        await same_as_completion(h, ids, doc, body, [PAD, REP, SEP])


async def test_streamed_infill() -> None:
    async with app(FimTokenizer()) as h:
        doc = {"input_prefix": "for i in", "input_suffix": ":", "n_predict": 8, "temperature": 0}
        whole = await h.post_ok("/infill", doc)
        status, raw = await stream_post(h.client, "/infill", {**doc, "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert "[DONE]" not in events  # llama-server ends without it
        assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
        assert "".join(e["content"] for e in events) == whole["content"]
        last = events[-1]
        for key in ("tokens_predicted", "tokens_evaluated", "stop_type", "truncated"):
            assert last[key] == whole[key], key


async def test_a_long_prefix_is_cut_from_its_start() -> None:
    """The fake model's context is 256 tokens: a 600-character prefix keeps its end."""
    async with app(FimTokenizer()) as h:
        prefix = "".join(chr(33 + i % 90) for i in range(600))
        doc = {"input_prefix": prefix, "input_suffix": "end", "n_predict": 16, "temperature": 0}
        body = await h.post_ok("/infill", doc)
        assert body["truncated"] is True
        n = body["tokens_evaluated"]
        assert 200 <= n <= 256 - 16
        kept = n - 3 - len("end")
        ids = [PRE, *enc(prefix)[-kept:], SUF, *enc("end"), MID]
        await same_as_completion(h, ids, doc, body, [PAD])


@pytest.mark.parametrize("bad, param", [
    ({"n_predict": -2}, "n_predict"), ({"input_prefix": 3}, "input_prefix"),
    ({"input_extra": [{"text": 1}]}, "input_extra[0].text"), ({"temperature": 3}, "temperature"),
    ({"stop": [""]}, "stop"),
])
async def test_bad_fields_name_themselves(bad: dict[str, Any], param: str) -> None:
    async with app(FimTokenizer()) as h:
        status, err, _ = await h.post("/infill", {"input_prefix": "a", **bad})
        assert status == 400 and err["error"]["param"] == param, err


async def test_a_model_without_fim_tokens() -> None:
    async with real_app(make_config()) as h:
        status, err, _ = await h.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 400 and err["error"]["param"] == "input_suffix"
        assert "fill-in-the-middle" in err["error"]["message"]


async def test_every_numeric_field_at_and_past_its_bounds() -> None:
    """The hostile-input sweep for /infill's own fields (the engine stays live)."""
    async with app(FimTokenizer()) as h:
        seen: dict[str, set[int]] = {}
        for field in ("n_predict", "temperature", "top_k", "top_p", "min_p", "seed",
                      "repeat_penalty", "presence_penalty", "frequency_penalty"):
            for v in [*INT_EXTREMES, *FLOAT_EXTREMES]:
                doc = {"input_prefix": "a=", "input_suffix": ";", "n_predict": 3, field: v}
                if field == "n_predict" and isinstance(v, int) and 3 < v < 2**31:
                    doc[field] = 3  # keep generation short; out-of-range values stay
                for stream in (False, True):
                    status, raw = await stream_post(h.client, "/infill", {**doc, "stream": stream})
                    assert status in (200, 400), (doc, raw[:200])
                    if status == 400:
                        err = json.loads(raw)["error"]
                        assert err["param"] == field, (doc, err)
                    elif stream:
                        assert parse_sse(raw)[-1]["stop"] is True
                    seen.setdefault(field, set()).add(status)
        assert all(s == {200, 400} for s in seen.values()), seen
        body = await h.post_ok("/infill", {"input_prefix": "a", "n_predict": 2, "temperature": 0})
        assert body["tokens_predicted"] == 2


async def test_texts_far_past_the_context_are_refused_before_tokenizing() -> None:
    """With a byte-level tokenizer the characters a context can hold are known: a text up to
    4 contexts' worth is tokenized and cut; past it, a 400 naming the field."""
    tok = Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()))
    tok.fim = FimTokens(0, 1, 2)  # the demo vocabulary's specials stand in for FIM tokens
    src = api_source(tokenizer=tok, vocab_size=tok.vocab_size)
    cap = max_text_chars(tok, 256)
    assert cap is not None
    async with real_app(make_config(), sources=[src]) as h:
        body = await h.post_ok("/infill", {"input_prefix": "a" * (2 * cap), "n_predict": 2})
        assert body["truncated"] is True and body["tokens_evaluated"] <= 256 - 2
        for field in ("input_prefix", "input_suffix", "prompt"):
            status, err, _ = await h.post("/infill", {field: "a" * (4 * cap + 1), "n_predict": 2})
            assert status == 400 and err["error"]["param"] == field, err
        status, err, _ = await h.post("/infill", {"input_extra": [{"text": "a" * (4 * cap + 1)}]})
        assert status == 400 and err["error"]["param"] == "input_extra", err
