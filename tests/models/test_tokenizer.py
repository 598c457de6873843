"""The package tokenizer and the fixed ChatML renderer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.errors import RequestError
from calserve.models.package import open_package
from calserve.models.signing import TrustStore
from calserve.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(demo_pkg: Path, dev_trust: TrustStore) -> Tokenizer:
    return open_package(demo_pkg, dev_trust, demo_pkg.parent).tokenizer()


def test_demo_tokenizer_shape(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in tok.eos_token_ids
    assert tok.id_to_token(im_end) == "<|im_end|>"
    assert len(tok.encode("The Calculet NPU serves requests")) < len("The Calculet NPU serves requests") / 2


@given(st.text(max_size=60))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text  # byte-level BPE: every string survives


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    s = tok.apply_chat_template(msgs)
    assert s == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[:1], add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.encode(s)
    assert ids[0] == tok.token_to_id("<|im_start|>")  # special tokens are single ids
    assert tok.decode(ids, skip_special_tokens=False) == s
    assert "<|im_start|>" not in tok.decode(ids)


@pytest.mark.parametrize(
    ("msgs", "param"),
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image"}]}], "messages[0].content[0]"),
    ],
)
def test_chat_template_bad_input_names_field(tok: Tokenizer, msgs: list, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template(msgs)
    assert e.value.param == param
