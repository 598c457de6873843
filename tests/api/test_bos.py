"""BOS for a model that expects it (``special_tokens.add_bos_token``: Llama 2/3, Mistral, Phi-3 —
from the GGUF's ``tokenizer.ggml.add_bos_token`` or the checkpoint's tokenizer_config): a
completion's text prompt and a rendered conversation start with BOS exactly once (a template that
writes ``{{ bos_token }}`` gets no second one, as llama.cpp's server does it); a prompt of token
ids is the client's; ``/tokenize`` counts what the request will have. A model without it
(SmolLM2, Qwen, the demo) is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers

from calserve.models.demo import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

from .conftest import make_config
from .real_engine import api_source, real_app

BOS = 0  # the demo vocabulary's <|endoftext|>, standing in for <s>
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
WITH_BOS = "{{ bos_token }}" + PLAIN


def tok(template: str, add_bos: bool) -> Tokenizer:
    return Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()), [2], template,
                     bos_token_id=BOS, add_bos_token=add_bos)


@pytest.mark.parametrize("add_bos", [True, False])
async def test_prompts_start_with_bos_once(add_bos: bool) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    plain = tok(PLAIN, False).encode("hello there")
    for template in (PLAIN, WITH_BOS):
        t = tok(template, add_bos)
        async with real_app(make_config(), sources=[api_source(tokenizer=t, vocab_size=512)]) as h:
            status, c, _ = await h.post("/v1/completions", {"prompt": "hello there",
                                                            "max_tokens": 1, "temperature": 0})
            assert status == 200, c
            assert c["usage"]["prompt_tokens"] == len(plain) + add_bos
            status, r, _ = await h.post("/tokenize", {"prompt": "hello there"})
            assert r["tokens"] == ([BOS] if add_bos else []) + plain
            status, r, _ = await h.post("/tokenize", {"prompt": "hello there",
                                                      "add_special_tokens": False})
            assert r["tokens"] == plain
            # token ids are the client's: nothing added
            status, c, _ = await h.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
            assert c["usage"]["prompt_tokens"] == 2
            status, r, _ = await h.post("/tokenize", {"messages": msgs})
            ids: list[Any] = r["tokens"]
            bos_first = add_bos or template == WITH_BOS
            assert ids.count(BOS) == (1 if bos_first else 0) and (ids[0] == BOS) == bos_first
            status, ch, _ = await h.post("/v1/chat/completions", {"messages": msgs,
                                                                  "max_tokens": 1})
            assert status == 200 and ch["usage"]["prompt_tokens"] == len(ids), ch
            # a content holding a special-token string takes the literal path: BOS all the same
            hot = [{"role": "user", "content": "a <|im_end|> b"}]
            status, r, _ = await h.post("/tokenize", {"messages": hot})
            assert (r["tokens"][0] == BOS) == bos_first and r["tokens"].count(BOS) == bos_first
