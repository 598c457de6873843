"""Gemma 3 and Gemma 2 served end to end: a small gemma3 (gemma2) GGUF (written by tests/models/test_gguf_gemma3.py as
llama.cpp's converter writes one: sliding layers, sandwich norms, norms stored as 1 + w,
SentencePiece vocabulary without a space prefix) packed with ``--from-gguf``'s code, served by
``calserve serve --model`` on the software runtime at B1 and B4, asked through the openai client.

- Greedy tokens and their logprobs equal llama.cpp's gemma3 graph written in numpy in that test
  (no code shared with the importer or ``runtime/reference.py``), on a prompt longer than the
  sliding window, alone and sent together with three other prompts (which the scheduler may run
  in one B4 job: other lanes, other positions, other windows).
- The package's chat template renders the conversation with BOS once and the answer stops at
  ``<end_of_turn>`` (the model is random: its text is noise, its ending is the format's).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from calserve.models.gguf_import import pack_from_gguf
from calserve.models.signing import generate_keypair

from models.test_gguf_gemma3 import BOS, PROMPT, LlamaCppGemma3, write_gemma3_gguf
from .server import ServerProcess, serving_calserve

pytestmark = pytest.mark.timeout(300)


# Gemma 2 the same way (its gemma2 graph: soft-capped scores and logits, every other layer
# sliding), with caps tight enough to matter
ARCHS = {"gemma3": {}, "gemma2": {"gemma2.attn_logit_softcapping": 2.0,
                                  "gemma2.final_logit_softcapping": 3.0}}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def gemma(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    d = tmp_path_factory.mktemp(f"{request.param}-served")
    write_gemma3_gguf(d / "g.gguf", arch=request.param, meta=ARCHS[request.param])
    generate_keypair(d / "key")
    pkg = pack_from_gguf(d / "g.gguf", d / "pkg", d / "key", profiles=(1, 4))
    with serving_calserve(d / "home", d, "--model", str(pkg), "--alias", "gemma",
                          "--trusted-key", f"{d / 'key'}.pub") as proc:
        yield proc, d / "g.gguf"


@pytest.fixture
def client(gemma: tuple[ServerProcess, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma[0].url + "/v1", api_key="unused", max_retries=0)


def test_greedy_tokens_and_logprobs_equal_llama_cpp_s_graph(
        gemma: tuple[ServerProcess, Path], client: openai.OpenAI) -> None:
    steps = 6
    want, want_lp, _ = LlamaCppGemma3(gemma[1]).greedy(PROMPT, steps)
    text = httpx.post(gemma[0].url + "/detokenize", json={"tokens": want},
                      timeout=30).json()["content"]

    def ask(prompt: list[int]) -> Any:
        return client.completions.create(model="gemma", prompt=prompt, max_tokens=steps,
                                         temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True}).choices[0]

    # alone, then at the same time as three other prompts
    alone = ask(PROMPT)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, p) for p in (PROMPT, PROMPT[:5], PROMPT[3:], [BOS, *PROMPT[6:]])]
        batched = futures[0].result()
        for f in futures[1:]:
            assert f.result().text is not None
    for c in (alone, batched):
        assert c.text == text
        lp = c.logprobs
        assert lp is not None and lp.token_logprobs is not None
        for i in range(steps):
            assert abs(lp.token_logprobs[i] - want_lp[i]) <= 1e-3, (i, lp.token_logprobs, want_lp)


def test_the_template_renders_with_bos_once_and_the_turn_ends_the_answer(
        gemma: tuple[ServerProcess, Path], client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "the world"}]
    r = httpx.post(gemma[0].url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    assert r["prompt"] == "<bos><start_of_turn>user\nthe world<end_of_turn>\n"
    assert r["tokens"].count(BOS) == 1 and r["tokens"][0] == BOS
    c = client.chat.completions.create(model="gemma", messages=msgs, max_tokens=40, temperature=0)
    assert c.usage is not None and c.usage.prompt_tokens == r["count"]
    assert c.choices[0].finish_reason in ("stop", "length")
    assert "<end_of_turn>" not in (c.choices[0].message.content or "")
