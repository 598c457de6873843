"""``POST /v1/responses`` through the official openai client against a real server (the demo
package on the software runtime): text, streamed (the raw events and the SDK's own
``responses.stream`` accumulator) and not, function tools with valid calls, a conversation that
carries earlier calls and their results as input items, ``text.format`` JSON schemas, and the
400s naming the Responses field.

The demo model's text is noise: the grammar makes every call and every JSON answer valid."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio

from .server import ServerProcess
from .test_tools_openai import BY_NAME, TOOLS

# the Responses API's function tools are flat: {"type": "function", "name", "parameters", ...}
FLAT: Any = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_streamed_and_not(client: openai.OpenAI) -> None:
    kw: Any = {"model": "qwen3", "input": "Hello", "instructions": "Answer briefly.",
               "max_output_tokens": 12, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage is not None and r.usage.output_tokens <= 12
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == r.output_text and final.usage == r.usage
    # the SDK's accumulator rebuilds the response from the events and checks their order
    with client.responses.stream(**kw) as s:
        last = list(s)[-1]
    assert last.type == f"response.{r.status}"
    assert last.response.output_text == r.output_text  # type: ignore[union-attr]
    # logprobs, as the SDK types them
    lp = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3)
    part: Any = lp.output[0].content[0]  # type: ignore[union-attr]
    assert part.text == r.output_text and len(part.logprobs) == r.usage.output_tokens
    assert all(len(x.top_logprobs) == 3 and x.logprob <= 0 for x in part.logprobs)


def _check_calls(items: Any, only: str | None = None) -> list[Any]:
    calls = [i for i in items if i.type == "function_call"]
    assert calls, items
    for c in calls:
        assert c.name in BY_NAME and (only is None or c.name == only)
        jsonschema.validate(json.loads(c.arguments), BY_NAME[c.name])
        assert c.call_id and c.status == "completed"
    return calls


def test_function_calls_streamed_and_not(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.responses.create(model="qwen3", input="What is the weather in Paris?",
                                    tools=FLAT, tool_choice="required", extra_body={"seed": seed},
                                    parallel_tool_calls=False, max_output_tokens=300)
        assert r.status == "completed"
        _check_calls(r.output)
    kw: Any = {"model": "qwen3", "input": "Add 2 and 3.", "tools": FLAT,
               "tool_choice": {"type": "function", "name": "add"}, "parallel_tool_calls": False,
               "max_output_tokens": 300, "extra_body": {"seed": 5}}
    r = client.responses.create(**kw)
    (call,) = _check_calls(r.output, "add")
    events = list(client.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.arguments for i in _check_calls(final.output)] == [call.arguments]


def test_a_conversation_with_a_call_and_its_result(client: openai.OpenAI) -> None:
    """The earlier call and its output go back as input items; the answer is text."""
    first = client.responses.create(model="qwen3", input="Weather in Paris?", tools=FLAT,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200, temperature=0)
    (call,) = _check_calls(first.output, "get_weather")
    r = client.responses.create(
        model="qwen3", tools=FLAT, tool_choice="none", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 21}'}])
    assert r.output_text and not [i for i in r.output if i.type == "function_call"]


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    for seed in range(3):
        r = client.responses.create(model="qwen3", input="A trip?", extra_body={"seed": seed},
                                    max_output_tokens=200,
                                    text={"format": {"type": "json_schema", "name": "trip",
                                                     "schema": schema, "strict": True}})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), schema)
    fmt: Any = {"format": {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}}
    kw: Any = {"model": "qwen3", "input": "A trip?", "max_output_tokens": 200, "text": fmt,
               "extra_body": {"seed": 1}}
    r = client.responses.create(**kw)
    assert r.status == "completed", r
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()  # the SDK's accumulator: needs response.completed
    assert final.output_text == r.output_text


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_refusals_name_the_responses_field(client: openai.OpenAI, kw: dict[str, Any],
                                           param: str) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="qwen3", input="Hi", **kw)
    body: Any = ei.value.body
    assert body["param"].startswith(param), body


def test_stored_responses_and_follow_ups(client: openai.OpenAI) -> None:
    """``store`` (on by default; the server's file in its CALSERVE_HOME), a follow-up naming the
    stored response answered as the whole conversation sent again, its input items, retrieve
    and delete — through the SDK's own calls."""
    kw: Any = {"model": "qwen3", "max_output_tokens": 6, "temperature": 0}
    r1 = client.responses.create(input="Hello", **kw)
    assert r1.store is True
    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text and got.usage == r1.usage
    r2 = client.responses.create(input="More", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id
    earlier = [i.model_dump(exclude_none=True) for i in r1.output]
    again = client.responses.create(
        input=[{"role": "user", "content": "Hello"}, *earlier, {"role": "user", "content": "More"}],
        store=False, **kw)
    assert again.store is False
    assert r2.output_text == again.output_text
    assert r2.usage is not None and again.usage is not None
    assert r2.usage.input_tokens == again.usage.input_tokens
    items = client.responses.input_items.list(r2.id, order="asc")
    texts = [c.text for i in items.data for c in i.content]  # type: ignore[union-attr]
    assert texts == ["Hello", r1.output_text, "More"]
    streamed = list(client.responses.create(input="Again", previous_response_id=r2.id,
                                            stream=True, **kw))
    final = streamed[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == final.output_text
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(input="x", previous_response_id=r1.id, **kw)
    body: Any = ei.value.body
    assert body["code"] == "previous_response_not_found", body


async def test_many_streams_some_cut_store_only_the_answered(server: ServerProcess) -> None:
    """16 streamed answers at once with ``store`` on the real server, every other one's client
    gone after its first event: exactly the answered ones are kept (each as its terminal event
    had it), the cut ones never are, and the server ends idle (every lane back)."""
    from . import rawhttp
    from .server import scrape, value
    from .test_load import wait_idle

    stored_before = value(scrape(server.url), "calserve_responses_stored_total", outcome="stored")
    kept: dict[str, Any] = {}
    cut: list[str] = []
    refused = [0]

    def terminal(raw: str) -> Any:
        datas = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
        assert datas[-1]["type"] == "response.incomplete" or datas[-1]["type"] == \
            "response.completed", datas[-1]
        return datas[-1]["response"]

    async def answered(client: httpx.AsyncClient, k: int) -> None:
        async with client.stream("POST", "/v1/responses", json={
                "model": "qwen3", "input": f"q{k}", "stream": True, "max_output_tokens": 8,
                "temperature": 0}) as r:
            if r.status_code == 429:
                refused[0] += 1
                return
            assert r.status_code == 200
            final = terminal((await r.aread()).decode())
        kept[final["id"]] = final

    def gone_sync(k: int) -> None:
        """A raw socket that reads up to the response's id, then closes (no client library
        that would drain the body)."""
        body = json.dumps({"model": "qwen3", "input": f"q{k}", "stream": True,
                           "max_output_tokens": 400, "temperature": 0}).encode()
        assert server.port is not None
        s = rawhttp.connect(server.port)
        try:
            s.sendall(rawhttp.post("/v1/responses", body))
            buf = rawhttp.read_until(s, b"\r\n\r\n")
            if b" 429 " in buf.split(b"\r\n", 1)[0]:
                refused[0] += 1
                return
            mark = b'"response.created"'
            while mark not in buf or b"\n\n" not in buf[buf.index(mark):]:
                data = s.recv(65536)
                assert data, buf
                buf += data
            line = next(ln for ln in buf.decode().splitlines() if '"response.created"' in ln)
            cut.append(json.loads(line[line.index("{"):])["response"]["id"])
        finally:
            s.close()

    async def gone(client: httpx.AsyncClient, k: int) -> None:
        await trio.to_thread.run_sync(gone_sync, k)

    async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                 limits=httpx.Limits(max_connections=64)) as client:
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                for k in range(16):
                    n.start_soon(answered if k % 2 else gone, client, k)
        m = await trio.to_thread.run_sync(wait_idle, server.url)
        assert kept and cut and len(kept) + len(cut) + refused[0] == 16
        for rid, final in kept.items():
            r = await client.get(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json() == final
        for rid in cut:
            assert (await client.get(f"/v1/responses/{rid}")).status_code == 404
    assert value(m, "calserve_requests_running") == 0
    assert value(m, "calserve_responses_stored_total", outcome="stored") - stored_before == len(kept)
