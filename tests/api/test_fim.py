"""``suffix`` on ``/v1/completions``: fill-in-the-middle on a model whose vocabulary has FIM tokens
(``calserve/models/fim.py``). The prompt is the prefix; the model sees ``FIM_PRE prefix FIM_SUF
suffix FIM_MID`` and writes the middle; its FIM pad/repo/file tokens end the answer. Checked
against the same ids sent as a token prompt without ``suffix`` (the fake model is a function of
the sequence), and the exact prompt ids through ``prompt_logprobs`` (keyed by token id)."""

from __future__ import annotations

from typing import Any

from calserve.models.fim import FimTokens

from .conftest import make_config
from .real_engine import ChatCharTokenizer, api_source, real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
PRE, SUF, MID, PAD = 120, 121, 122, 123


class FimTokenizer(ChatCharTokenizer):
    """The char tokenizer (text maps to ids < 90) with four FIM tokens above them."""

    fim = FimTokens(PRE, SUF, MID, (PAD,))


TOK = FimTokenizer()


def fim_app(**server: Any) -> Any:
    return real_app(make_config(server=server) if server else make_config(),
                    sources=[api_source(tokenizer=TOK)])


def fim_ids(prefix: str, suffix: str) -> list[int]:
    return [PRE, *TOK.encode(prefix), SUF, *TOK.encode(suffix), MID]



async def test_the_middle_is_the_completion_of_the_fim_prompt() -> None:
    async with fim_app() as h:
        prefix, suffix = "def add(a,b):c=", ";return(c)"
        base = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
        body = await h.post_ok(C, {**base, "prompt": prefix, "suffix": suffix, "prompt_logprobs": 0})
        ch = body["choices"][0]
        ids = fim_ids(prefix, suffix)
        # the prompt the model saw, token by token
        assert [None if e is None else int(next(iter(e))) for e in ch["prompt_logprobs"]] == \
            [None, *ids[1:]]
        assert body["usage"]["prompt_tokens"] == len(ids)
        same = (await h.post_ok(C, {**base, "prompt": ids, "stop_token_ids": [PAD]}))["choices"][0]
        assert (ch["text"], ch["logprobs"], ch["finish_reason"]) == \
            (same["text"], same["logprobs"], same["finish_reason"])
        # streamed: the same middle
        status, raw = await stream_post(h.client, C, {**base, "prompt": prefix, "suffix": suffix,
                                                       "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ch["text"]


async def test_prefix_forms_and_the_cursor_at_the_start() -> None:
    async with fim_app(max_prompts=4) as h:
        base = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 0, "suffix": "tail"}

        def seen(choice: dict[str, Any]) -> list[int]:
            return [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]]

        empty = (await h.post_ok(C, {**base, "prompt": ""}))["choices"][0]  # cursor at the start
        assert seen(empty) == fim_ids("", "tail")[1:]
        toks = (await h.post_ok(C, {**base, "prompt": [5, 6, 7]}))["choices"][0]  # prefix as ids
        assert seen(toks) == [5, 6, 7, SUF, *TOK.encode("tail"), MID]
        many = (await h.post_ok(C, {**base, "prompt": ["ab", "cd"]}))["choices"]
        assert [seen(c) for c in many] == [fim_ids(p, "tail")[1:] for p in ("ab", "cd")]


async def test_a_fim_end_token_ends_the_answer_unless_ignore_eos() -> None:
    async with fim_app() as h:
        doc = {"prompt": "x=", "suffix": ";", "max_tokens": 4, "temperature": 0,
               "logit_bias": {str(PAD): 100}}
        body = await h.post_ok(C, doc)
        ch = body["choices"][0]
        assert ch["finish_reason"] == "stop" and ch["text"] == ""
        assert body["usage"]["completion_tokens"] == 1
        body = await h.post_ok(C, {**doc, "ignore_eos": True})
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        # not a FIM request: the pad token is an ordinary token
        body = await h.post_ok(C, {"prompt": "x=", "max_tokens": 4, "temperature": 0,
                                 "logit_bias": {str(PAD): 100}})
        assert body["usage"]["completion_tokens"] == 4


async def test_suffix_refused_without_fim_tokens_or_with_echo() -> None:
    async with fim_app() as h:
        status, err, _ = await h.post(C, {"prompt": "a", "suffix": "b", "echo": True})
        assert status == 400 and err["error"]["param"] == "suffix", err
        status, err, _ = await h.post(C, {"prompt": "a", "suffix": "b",
                                          "truncate_prompt_tokens": 4})
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err
        body = await h.post_ok(C, {"prompt": "a", "suffix": "", "max_tokens": 2})  # "": no FIM
        assert body["usage"]["prompt_tokens"] == 1
    async with real_app(make_config()) as h:  # the plain char tokenizer has no FIM tokens
        status, err, _ = await h.post(C, {"prompt": "a", "suffix": "b"})
        assert status == 400 and err["error"]["param"] == "suffix"
        assert err["error"]["code"] == "unsupported_parameter"
        assert "fill-in-the-middle" in err["error"]["message"]
