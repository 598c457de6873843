"""A thinking model's reasoning apart from its answer (api/reasoning.py): the split, the stream's
deltas adding up to the unstreamed message whatever the pieces (with and without Hermes tool
calls), which templates think, and ``reasoning_format`` through the HTTP API."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.api.reasoning import Answer, Reasoning, split_reasoning
from calserve.api.tools import parse_tools
from calserve.engine.types import FinishReason

from .conftest import make_config
from .real_engine import api_source, real_app
from .test_chat_template_api import real_tokenizer
from .test_tool_stream import accumulate, cut, deltas, wanted
from .test_tools_hermes import PARIS, QWEN25, TOOLS, stream

# A template that thinks (the shape Qwen3's has): earlier answers lose their thinking, and
# ``enable_thinking: false`` renders an empty block; ``open_think`` opens the block in the prompt.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined %}<think>\n{% endif %}{% endif %}")


def test_the_split() -> None:
    assert split_reasoning("<think>\nHmm.\n</think>\n\nParis.", False) == ("Hmm.", "Paris.")
    assert split_reasoning("  <think>a</think>b", False) == ("a", "b")
    assert split_reasoning("Paris. <think>x</think>", False) == (None, "Paris. <think>x</think>")
    assert split_reasoning("<think>\nstill thinking", False) == ("still thinking", "")
    assert split_reasoning("Hmm.\n</think>\n\nParis.", True) == ("Hmm.", "Paris.")
    assert split_reasoning("no close", True) == ("no close", "")
    assert split_reasoning("", False) == (None, "")


def test_which_templates_think() -> None:
    assert real_tokenizer(THINKING).reasoning_tags  # type: ignore[attr-defined]
    assert not real_tokenizer(QWEN25).reasoning_tags  # type: ignore[attr-defined]
    assert Reasoning.of("<|im_start|>assistant\n<think>\n", True, None) == Reasoning(opened=True)
    assert Reasoning.of("<|im_start|>assistant\n", True, "auto") == Reasoning(opened=False)
    assert Reasoning.of("<|im_start|>assistant\n", True, "none") is None
    assert Reasoning.of("<|im_start|>assistant\n", False, None) is None


def test_messages_with_and_without_calls() -> None:
    plain = Answer(reasoning=Reasoning())
    msg, fr = plain.message("<think>\nThe user wants Paris.\n</think>\n\nParis.", "stop")
    assert msg == {"role": "assistant", "content": "Paris.",
                   "reasoning_content": "The user wants Paris."} and fr == "stop"
    assert plain.message("Paris.", "stop")[0] == {"role": "assistant", "content": "Paris."}
    tools = parse_tools(TOOLS, None, None, "hermes")
    both = Answer(tools, Reasoning())
    msg, fr = both.message("<think>\nA weather question.\n</think>\n\n" + PARIS, "stop")
    assert fr == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"] == "A weather question." and len(msg["tool_calls"]) == 1
    msg, _ = both.message("<think>\nHm.\n</think>\nLet me look.\n" + PARIS, "stop")
    assert msg["content"] == "Let me look." and msg["reasoning_content"] == "Hm."
    # the generic JSON answer has no text to split
    generic = Answer(parse_tools(TOOLS, None, None), Reasoning())
    assert "reasoning_content" not in generic.message('{"response":"<think>x</think>y"}', "stop")[0]


PIECES = st.sampled_from(["Hi", " ", "\n", "<", "<think>", "</think>", "</", "think>", "</th",
                          "ink>", "ok.", "\u00e9", "x<y"])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=12), st.booleans(), st.booleans(),
       st.sampled_from(["", PARIS]), st.lists(st.integers(0, 200), max_size=10),
       st.integers(0, 30))
def test_streamed_deltas_add_up_to_the_message(pieces: list[str], opened: bool, lead: bool,
                                               calls: str, points: list[int], short: int) -> None:
    """Any text (tags whole or split), opened by the prompt or not, maybe with Hermes calls after
    it, split anywhere and maybe cut short: the reasoning deltas are the message's
    ``reasoning_content``, the content deltas its ``content``, the calls' deltas its calls."""
    tools = parse_tools(TOOLS, None, None, "hermes") if calls else None
    answer = Answer(tools, Reasoning(opened))
    text = ("<think>\n" if lead else "") + "".join(pieces) + calls
    finish = FinishReason.STOP
    if short:
        text, finish = text[:max(0, len(text) - short)], FinishReason.LENGTH
    ds = deltas(stream(cut(text, points), answer, finish))
    want, fr = answer.message(text, "length" if finish is FinishReason.LENGTH else "stop")
    assert ds[-1] == ({}, fr)
    assert "".join(d.get("reasoning_content", "") for d, _ in ds) == (
        want.get("reasoning_content") or "")
    assert "".join(d.get("content", "") for d, _ in ds[1:]) == (want["content"] or "")
    assert [(c["name"], c["arguments"]) for c in accumulate(ds)] == wanted(want)


async def test_reasoning_through_the_api() -> None:
    """A template that opens the think block: the (noise) answer is all reasoning, unstreamed and
    streamed alike; ``reasoning_format: "none"`` keeps it in ``content``; a bad value is a 400."""
    src = api_source(tokenizer=real_tokenizer(THINKING), vocab_size=512)
    msgs = [{"role": "user", "content": "Hi"}]
    async with real_app(make_config(), sources=[src]) as h:
        doc: dict[str, Any] = {"messages": msgs, "max_tokens": 6, "temperature": 0,
                               "chat_template_kwargs": {"open_think": True}}
        status, plain, _ = await h.post("/v1/chat/completions", {**doc, "reasoning_format": "none"})
        assert status == 200, plain
        text = plain["choices"][0]["message"]["content"]
        status, body, _ = await h.post("/v1/chat/completions", doc)
        assert status == 200, body
        msg = body["choices"][0]["message"]
        assert (msg.get("reasoning_content"), msg["content"]) == split_reasoning(text, True)
        status, raw, _ = await h.post("/v1/chat/completions", {**doc, "stream": True})
        assert status == 200
        ds = [c["choices"][0]["delta"] for c in
              (json.loads(line[6:]) for line in raw.decode().split("\n\n")
               if line.startswith("data: {"))
              if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in ds) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in ds) == msg["content"]
        # no block opened and none written: the answer is content, as before
        status, body, _ = await h.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                                "temperature": 0})
        assert status == 200 and "reasoning_content" not in body["choices"][0]["message"], body
        status, body, _ = await h.post("/v1/chat/completions", {**doc, "reasoning_format": "x"})
        assert status == 400 and body["error"]["param"] == "reasoning_format", body
