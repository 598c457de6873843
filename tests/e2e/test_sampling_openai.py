"""OpenAI sampling coverage through the official client against a real server (demo package on the
software runtime): ``n``, penalties, ``logit_bias``, ``top_k``/``min_p`` and ``response_format``
(json_object / json_schema with strict), streamed and not, completions and chat.

The demo model's text is noise: a hard test for the grammar mask (every output must parse and
validate against its schema anyway) and a fair one for the penalties (their effect on repeats)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .server import ServerProcess

SCHEMAS: list[Any] = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "json_schemas.json").read_text())
MSGS: Any = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def fmt(schema: Any) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def test_json_schema_outputs_parse_and_validate_on_20_schemas(client: openai.OpenAI) -> None:
    for i, schema in enumerate(SCHEMAS):
        stream = i % 2 == 1
        if stream:
            parts = []
            finish = None
            for ch in client.chat.completions.create(
                    model="qwen3", messages=MSGS, max_tokens=600, seed=i, stream=True,
                    response_format=fmt(schema)):
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                    finish = ch.choices[0].finish_reason or finish
            text = "".join(parts)
        else:
            r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=600,
                                               seed=i, response_format=fmt(schema))
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_on_completions_and_greedy(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        c = client.completions.create(model="qwen3", prompt="{", max_tokens=1200, seed=3,
                                      temperature=temperature,
                                      extra_body={"response_format": {"type": "json_object"}})
        assert c.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(c.choices[0].text), dict)


def test_bad_schema_is_a_400_naming_response_format(client: openai.OpenAI) -> None:
    for rf in (fmt({"type": "objectx"}), fmt({"$ref": "#/missing"}), {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5,
                                           response_format=rf)
        body: Any = e.value.body
        assert body["param"] == "response_format", body


def test_n_choices_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=8, n=3, seed=9,
                                       temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts: dict[int, str] = {}
    for ch in client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=8, n=3,
                                             seed=9, temperature=1.0, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in r.choices}
    c = client.completions.create(model="qwen3", prompt="Hello", max_tokens=6, n=2, seed=1,
                                  extra_body={"ignore_eos": True})
    assert [x.index for x in c.choices] == [0, 1] and c.usage is not None
    assert c.usage.completion_tokens == 12


def ids_of(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200
    return list(r.json()["tokens"])


def test_penalties_bias_and_truncation_through_the_client(client: openai.OpenAI,
                                                          server: ServerProcess) -> None:
    prompt = "The model"

    def pieces(**kw: Any) -> list[str]:
        """The generated tokens' strings (completions logprobs: one per token)."""
        c = client.completions.create(model="qwen3", prompt=prompt, max_tokens=60, logprobs=0,
                                      **kw)
        lp = c.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 60
        return list(lp.tokens)

    greedy = pieces(temperature=0, extra_body={"ignore_eos": True})
    pen = pieces(temperature=0, frequency_penalty=2.0, presence_penalty=1.0,
                 extra_body={"ignore_eos": True})
    # greedy noise repeats itself; the penalties make repeats rarer
    assert max(Counter(pen).values()) < max(Counter(greedy).values())
    assert len(set(pen)) > len(set(greedy))
    # logit_bias -100 on the token greedy repeats most bans it
    s = next(p for p, _ in Counter(greedy).most_common() if len(ids_of(server, p)) == 1)
    t = ids_of(server, s)[0]
    assert s not in pieces(temperature=0, logit_bias={str(t): -100},
                           extra_body={"ignore_eos": True})
    # +100 forces a token even when sampling at temperature 1 with top_k
    forced = client.completions.create(model="qwen3", prompt=prompt, max_tokens=5,
                                       temperature=1.0, seed=2, logit_bias={"65": 100},
                                       extra_body={"ignore_eos": True, "top_k": 3})
    d = httpx.post(server.url + "/detokenize", json={"tokens": [65] * 5}, timeout=30)
    assert forced.choices[0].text == d.json()["prompt"]
    # streamed chat with every processor on: a complete answer, reproducible with its seed
    def chat_stream() -> str:
        parts = []
        for ch in client.chat.completions.create(
                model="qwen3", messages=MSGS, max_tokens=16, seed=5, stream=True,
                presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"7": -5},
                extra_body={"repetition_penalty": 1.3, "top_k": 40, "min_p": 0.05}):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
        return "".join(parts)
    assert chat_stream() == chat_stream()
