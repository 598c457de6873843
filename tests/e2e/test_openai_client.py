"""The official openai client against a real `hypercorn -k trio calserve:app` on 127.0.0.1."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from .server import ServerProcess


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]


def test_completion_and_chat_with_usage(client: openai.OpenAI) -> None:
    c = client.completions.create(model="qwen3", prompt="The quick brown fox", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and c.model == "qwen3"
    assert c.choices[0].finish_reason == "length" and c.choices[0].text
    assert c.usage is not None and c.usage.completion_tokens == 12
    assert c.usage.prompt_tokens > 0
    assert c.usage.total_tokens == c.usage.prompt_tokens + 12
    ch = client.chat.completions.create(model="qwen3", messages=MSGS,  # type: ignore[arg-type]
                                        max_completion_tokens=10, temperature=0)
    assert ch.object == "chat.completion"
    assert ch.choices[0].message.role == "assistant"
    assert ch.usage is not None and 1 <= ch.usage.completion_tokens <= 10
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3"]


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model="qwen3", prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))  # type: ignore[call-overload]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) <= {None}

    chat_kw = dict(model="qwen3", messages=MSGS, max_tokens=15, temperature=0)
    whole_chat = client.chat.completions.create(**chat_kw)  # type: ignore[call-overload]
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **chat_kw)  # type: ignore[call-overload]
    parts, usage = [], None
    for ch in stream:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        else:
            usage = ch.usage
    assert "".join(parts) == whole_chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole_chat.usage.completion_tokens


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model="qwen3", prompt="In the beginning", max_tokens=30,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 8
    stop = text[5:8]
    cut = client.completions.create(model="qwen3", prompt="In the beginning", max_tokens=30,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(
            model="qwen3", prompt="In the beginning", max_tokens=30, temperature=0, stop=stop,
            stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed == text[: text.find(stop)]


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.chat.completions.create(model="qwen3", messages=MSGS,  # type: ignore[arg-type]
                                           max_tokens=24, temperature=1.0, seed=seed,
                                           extra_body={"ignore_eos": True})
        return r.choices[0].message.content or ""

    a, b, c = run(1234), run(1234), run(99)
    assert a == b
    assert a != c  # a different seed samples differently (random weights: near-flat logits)


def test_a_list_of_prompts_through_the_client(client: openai.OpenAI) -> None:
    """``prompt`` as a list (as lm-evaluation-harness sends it): one choice per prompt, in order,
    each the answer that prompt gets alone."""
    prompts = ["The quick brown fox", "In the beginning"]
    alone = [client.completions.create(model="qwen3", prompt=p, max_tokens=6, temperature=0)
             .choices[0].text for p in prompts]
    both = client.completions.create(model="qwen3", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == alone


def test_logprobs(client: openai.OpenAI) -> None:
    c = client.completions.create(model="qwen3", prompt="Numbers:", max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token has the best raw logprob among the alternatives
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen >= max(top.values()) - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    ch = client.chat.completions.create(model="qwen3", messages=MSGS,  # type: ignore[arg-type]
                                        max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True})
    content = ch.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_errors_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen3", prompt="x", max_tokens=5, n=9)  # past server.max_n (8)
    assert e.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=5)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen3", prompt="x" * 20000, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_raw_socket_gets_chunks_before_completion(server: ServerProcess) -> None:
    """What `curl -N` sees: the first SSE chunk arrives while the request is still generating."""
    body = (b'{"model":"qwen3","prompt":"Tell me a story","max_tokens":1500,"stream":true,'
            b'"ignore_eos":true,"temperature":0}')
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: {" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        t_first = time.monotonic()
        assert b"[DONE]" not in got
        assert b"text/event-stream" in got.split(b"\r\n\r\n")[0]
        # the request is still running while we hold the first chunk
        m = httpx.get(server.url + "/metrics", timeout=10).text
        assert "calserve_requests_running 1.0" in m or "calserve_streams_active 1.0" in m
        while b"data: [DONE]" not in got:
            chunk = s.recv(65536)
            assert chunk, got[-300:]
            got += chunk
        assert time.monotonic() > t_first
