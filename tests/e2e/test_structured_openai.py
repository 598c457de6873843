"""vLLM's and llama.cpp's structured outputs (api/structured.py) through the openai client against a
real server (the demo package on the software runtime): ``structured_outputs`` (regex, choice,
grammar, json, json_object), the older ``guided_*`` fields, llama.cpp's ``json_schema`` and GBNF
``grammar``, on chat and completions, streamed and not, and their 400s.

The demo model's text is noise: every answer must match its constraint whatever it would have
written."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from .server import ServerProcess

MSGS: Any = [{"role": "user", "content": "Answer."}]
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ["positive", "negative", "neutral", "n/a \"quoted\""]
# the same language as a GBNF grammar (llama.cpp) and a Lark one (llguidance's dialect)
GBNF = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9]{1,3}'
LARK = 'start: "(" NUM ("," NUM)~0..3 ")"\nNUM: /[0-9]{1,3}/'
TUPLE = r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, extra: dict[str, Any], seed: int, stream: bool = False,
         max_tokens: int = 200) -> tuple[str, str | None]:
    kw: Any = {"model": "qwen3", "messages": MSGS, "max_tokens": max_tokens, "seed": seed,
               "temperature": 1.0, "extra_body": extra}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    parts, finish = [], None
    for ch in client.chat.completions.create(**kw, stream=True):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    return "".join(parts), finish


CASES: list[tuple[dict[str, Any], Any]] = [
    ({"structured_outputs": {"regex": EMAIL}}, EMAIL),
    ({"guided_regex": EMAIL}, EMAIL),
    ({"structured_outputs": {"choice": CHOICES}}, CHOICES),
    ({"guided_choice": CHOICES, "guided_decoding_backend": "xgrammar"}, CHOICES),
    ({"structured_outputs": {"grammar": GBNF}}, TUPLE),
    ({"guided_grammar": LARK}, TUPLE),
    ({"grammar": GBNF}, TUPLE),  # llama.cpp
    ({"structured_outputs": {"json": SCHEMA}}, SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, SCHEMA),
    ({"json_schema": SCHEMA}, SCHEMA),  # llama.cpp
]


def check(text: str, want: Any) -> None:
    if isinstance(want, str):
        assert re.fullmatch(want, text), text
    elif isinstance(want, list):
        assert text in want, text
    else:
        jsonschema.validate(json.loads(text), want)


@pytest.mark.parametrize(("extra", "want"), CASES, ids=[next(iter(e)) + (
    "." + next(iter(e[next(iter(e))])) if isinstance(e[next(iter(e))], dict) else "")
    for e, _ in CASES])
def test_every_answer_matches_its_constraint(client: openai.OpenAI, extra: dict[str, Any],
                                             want: Any) -> None:
    for seed in range(3):
        text, finish = chat(client, extra, seed, stream=seed == 2)
        assert finish == "stop", (seed, text)
        check(text, want)


def test_choices_are_all_reachable_and_completions_too(client: openai.OpenAI) -> None:
    seen = {chat(client, {"guided_choice": CHOICES}, seed)[0] for seed in range(24)}
    assert len(seen) >= 2 and seen <= set(CHOICES)
    c = client.completions.create(model="qwen3", prompt="Mail:", max_tokens=60, seed=1,
                                  extra_body={"guided_regex": EMAIL})
    assert c.choices[0].finish_reason == "stop"
    check(c.choices[0].text, EMAIL)
    # a free JSON object (the noise model writes long strings in it: greedy, as
    # test_sampling_openai's json_object test)
    c = client.completions.create(model="qwen3", prompt="{", max_tokens=1200, seed=3,
                                  temperature=0.0,
                                  extra_body={"structured_outputs": {"json_object": True}})
    assert c.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(c.choices[0].text), dict)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": EMAIL, "guided_choice": CHOICES}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "grammar": GBNF}, "grammar"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"json_schema": SCHEMA, "min_tokens": 3}, "min_tokens"),
    ({"guided_regex": "a{1000}{1000}"}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, extra: dict[str, Any],
                                                   param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=5,
                                       extra_body=extra)
    body: Any = e.value.body
    assert body["param"] == param, body
