"""The byte-level table step (calserve.engine.detok_bytes) answers exactly as the tokenizers
library's DecodeStream, token by token, for any token sequence (issue 18)."""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from calserve.engine.detok import IncrementalDetokenizer
from calserve.engine.detok_bytes import ByteLevelStream, byte_table
from calserve.models import demo_model
from calserve.models.tokenizer import Tokenizer

_CORPUS = ["hello world, the data centre 数据中心 🎉🚀 ééé ñ — done\n", "a b c abc abcd 🙂 🇫🇷"] * 20


def _demo() -> tokenizers.Tokenizer:
    tj = demo_model.demo_tokenizer_json()
    return tokenizers.Tokenizer.from_str(tj if isinstance(tj, str) else json.dumps(tj))


def _trained() -> tokenizers.Tokenizer:
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"], show_progress=False)
    t.train_from_iterator(_CORPUS, trainer=trainer)
    t.add_tokens(["<plain-added>", "añadido"])  # non-special added tokens (one outside the alphabet)
    return t


_TOKS = {"demo": _demo(), "trained": _trained()}


@pytest.mark.parametrize("name", sorted(_TOKS))
@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_tokenizers_get_a_table(name: str, skip: bool) -> None:
    assert byte_table(_TOKS[name], skip) is not None
    assert byte_table(_TOKS[name], skip) is byte_table(_TOKS[name], skip)  # built once


def test_other_decoders_keep_decode_stream() -> None:
    t = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.decoder = decoders.WordPiece()
    assert byte_table(t) is None
    t2 = _trained()
    t2.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert byte_table(t2) is None


def test_the_detokenizer_uses_the_table_for_the_demo_tokenizer() -> None:
    d = IncrementalDetokenizer(Tokenizer(_demo(), eos_token_ids=[0]))
    assert isinstance(d._stream, ByteLevelStream)


def _ids(name: str) -> st.SearchStrategy[list[int]]:
    n = _TOKS[name].get_vocab_size(with_added_tokens=True)
    # mostly byte tokens and their neighbours (partial UTF-8), some specials, some out of range
    return st.lists(st.one_of(st.integers(0, n - 1), st.integers(0, 8), st.integers(n, n + 5)),
                    max_size=60)


@pytest.mark.parametrize("name", sorted(_TOKS))
@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_step_equals_decode_stream(name: str, skip: bool, data: st.DataObject) -> None:
    tok = _TOKS[name]
    ids = data.draw(_ids(name))
    table = byte_table(tok, skip)
    assert table is not None
    mine, ref = ByteLevelStream(table), DecodeStream(skip_special_tokens=skip)
    assert [mine.step(tok, i) for i in ids] == [ref.step(tok, i) for i in ids]


@pytest.mark.parametrize("name", sorted(_TOKS))
@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_step_equals_decode_stream_on_encoded_text(name: str, text: str) -> None:
    tok = _TOKS[name]
    ids = tok.encode(text, add_special_tokens=False).ids
    table = byte_table(tok)
    assert table is not None
    mine, ref = ByteLevelStream(table), DecodeStream(skip_special_tokens=True)
    assert [mine.step(tok, i) for i in ids] == [ref.step(tok, i) for i in ids]
