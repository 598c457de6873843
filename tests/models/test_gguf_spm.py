"""A SentencePiece GGUF vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2, TinyLlama,
Mistral) rebuilt as a ``tokenizers`` tokenizer (calserve/models/gguf_tokenizer.py), checked against
an independent implementation: the ``sentencepiece`` library itself, on a BPE model it trains here
the way Llama's was set up (identity normalization, a dummy prefix, whitespace kept, byte
fallback). Its pieces, scores and types are written into GGUF metadata as llama.cpp's converter
writes them; the ids of a corpus with Unicode, digits, runs of spaces and characters the model
never saw (byte pieces) must be sentencepiece's, and decoding must give the text back."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.errors import ValidationError
from calserve.models.gguf_tokenizer import tokenizer_from_metadata

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "In 1969, 3 astronauts flew 384,400 km to the Moon and back.",
    "def tokenize(text):\n    return [t for t in text.split()]",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 中文句子。",
    "Emoji 🙂 and symbols ∑ ∞ → ≠ are rarer.",
    "  leading spaces,   runs   of spaces,\ttabs\tand\nnew\nlines.  ",
    "Tokenizers split words into pieces; frequent pieces become whole tokens.",
] * 20

TEXTS = [
    "Hello world", " Hello  world ", "", " ", "a", "The capital of France is Paris.",
    "unseen: ქართული ∮ ⅞ 🜚", "numbers 12345 678.9", "mixed 日本 and English",
    "tabs\tand\nnewlines\n\n", "Straße naïve café", "x" * 50,
]

# SentencePiece piece types -> llama.cpp's token types (1 normal, 2 unknown, 3 control, 4
# user-defined, 6 byte), as convert_hf_to_gguf.py maps them
_TYPE = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=400,
        character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=["<|im_start|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def metadata(sp: spm.SentencePieceProcessor, **extra: Any) -> dict[str, Any]:
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.id_to_piece(i) == "<|im_start|>":
            types.append(4)
        else:
            types.append(1)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, **extra}


@pytest.fixture(scope="module")
def tok(sp: spm.SentencePieceProcessor) -> tokenizers.Tokenizer:
    g = tokenizer_from_metadata(metadata(sp))
    assert g.bos_token_id == 1 and g.eos_token_ids == (2,) and g.add_bos_token
    return tokenizers.Tokenizer.from_str(g.tokenizer_json)


def test_the_corpus_and_odd_texts_encode_as_sentencepiece_does(
        sp: spm.SentencePieceProcessor, tok: tokenizers.Tokenizer) -> None:
    byte_pieces = 0
    for text in [*dict.fromkeys(CORPUS), *TEXTS]:
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text, [sp.id_to_piece(i) for i in want],
                             [sp.id_to_piece(i) for i in got])
        byte_pieces += sum(1 for i in want if sp.is_byte(i))
        assert tok.decode(got) == sp.decode(want) == text
    assert byte_pieces > 10  # the unseen characters took the byte fallback
    # BOS as the file says (add_bos_token), and the control pieces are special
    assert tok.encode("Hi").ids == [1, *sp.encode("Hi")]
    assert tok.decode([1, *sp.encode("Hi"), 2]) == "Hi"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abcdefghij ABC.,!?0123\n\téüß日本🙂 ")), max_size=40))
def test_any_text_encodes_as_sentencepiece_does(sp: spm.SentencePieceProcessor,
                                                tok: tokenizers.Tokenizer, text: str) -> None:
    want = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False).ids == want
    assert tok.decode(want) == text


def test_user_defined_pieces_match_whole(sp: spm.SentencePieceProcessor,
                                         tok: tokenizers.Tokenizer) -> None:
    """A user-defined piece is matched whole and the text after it starts a new fragment with its
    own space prefix: llama.cpp's partition (and transformers' added tokens). sentencepiece itself
    puts the one dummy prefix before the whole text instead."""
    i = sp.piece_to_id("<|im_start|>")
    got = tok.encode("<|im_start|>user\nHi", add_special_tokens=False).ids
    assert got == [i, *sp.encode("user\nHi")]


def test_without_a_space_prefix_and_bad_metadata(sp: spm.SentencePieceProcessor) -> None:
    g = tokenizer_from_metadata(metadata(sp, **{"tokenizer.ggml.add_space_prefix": False}))
    t = tokenizers.Tokenizer.from_str(g.tokenizer_json)
    ids = t.encode("Hello world", add_special_tokens=False).ids
    assert not t.id_to_token(ids[0]).startswith("\u2581") and t.decode(ids) == "Hello world"
    meta = metadata(sp)
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ValidationError, match="tokenizer.ggml.scores"):
        tokenizer_from_metadata(meta)
    with pytest.raises(ValidationError, match="tokenizer.ggml.model"):
        tokenizer_from_metadata({**metadata(sp), "tokenizer.ggml.model": "bert"})


def test_a_spm_gguf_packs_and_serves_its_tokenizer(sp: spm.SentencePieceProcessor,
                                                   tmp_path: Path) -> None:
    """A Llama GGUF with this vocabulary packs; the package's tokenizer is sentencepiece's."""
    import gguf
    import numpy as np

    from calserve.models.gguf_import import read_gguf
    from calserve.runtime.reference import ModelConfig, random_weights

    from .test_gguf_import import _gguf_name

    n = sp.get_piece_size()
    cfg = ModelConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, architecture="LlamaForCausalLM")
    wr = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for k, v in {"llama.block_count": 1, "llama.embedding_length": 32,
                 "llama.feed_forward_length": 64, "llama.attention.head_count": 2,
                 "llama.attention.head_count_kv": 1, "llama.context_length": 128}.items():
        wr.add_uint32(k, v)
    wr.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    wr.add_float32("llama.rope.freq_base", 10000.0)
    meta = metadata(sp)
    wr.add_string("tokenizer.ggml.model", "llama")
    wr.add_array("tokenizer.ggml.tokens", meta["tokenizer.ggml.tokens"])
    wr.add_array("tokenizer.ggml.scores", meta["tokenizer.ggml.scores"])
    wr.add_array("tokenizer.ggml.token_type", meta["tokenizer.ggml.token_type"])
    wr.add_uint32("tokenizer.ggml.bos_token_id", 1)
    wr.add_uint32("tokenizer.ggml.eos_token_id", 2)
    wr.add_bool("tokenizer.ggml.add_bos_token", True)
    for name, a in random_weights(cfg, seed=1).items():  # not permuted: only the tokenizer matters
        wr.add_tensor(_gguf_name(name), np.ascontiguousarray(a, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    m = read_gguf(tmp_path / "spm.gguf")
    t = tokenizers.Tokenizer.from_str(m.tokenizer.tokenizer_json)
    for text in TEXTS:
        assert t.encode(text, add_special_tokens=False).ids == sp.encode(text)
    assert m.special_tokens().bos_token == "<s>" and m.special_tokens().add_bos_token


def test_a_conversation_tokenizes_as_its_whole_text(sp: spm.SentencePieceProcessor) -> None:
    """A content holding a special-token string is tokenized piece by piece (its specials as
    text: calserve/models/tokenizer.py); with SentencePiece every piece but a fragment's first
    must go without the space prefix, so the ids are those of the whole text tokenized literally
    (this template writes no special token of its own)."""
    from calserve.models.tokenizer import Tokenizer

    g = tokenizer_from_metadata(metadata(sp))
    backend = tokenizers.Tokenizer.from_str(g.tokenizer_json)
    tmpl = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = Tokenizer(backend, (2,), tmpl, bos_token_id=1)
    literal = tokenizers.Tokenizer.from_str(g.tokenizer_json)
    literal.encode_special_tokens = True
    for content in ("a </s> b", "</s>", " </s> x  y", "x</s>", "<s>Paris</s> is"):
        msgs = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok </s>"}]
        rendered = tok.apply_chat_template(msgs, True)
        ids = tok.encode_chat(msgs, rendered, True)
        assert ids == literal.encode(rendered, add_special_tokens=False).ids, content
        assert 2 not in ids and 1 not in ids
    # after a special token of the template, a fragment starts again (its prefix comes back)
    tmpl2 = "{% for m in messages %}<s>{{ m.content }}</s>{% endfor %}"
    tok2 = Tokenizer(backend, (2,), tmpl2, bos_token_id=1)
    msgs = [{"role": "user", "content": "Hi </s> there"}]
    ids = tok2.encode_chat(msgs, tok2.apply_chat_template(msgs, False), False)
    assert ids == [1, *literal.encode("Hi </s> there", add_special_tokens=False).ids, 2]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abcdefghij ABC.,0123\n\téüß日本🙂ქ ")), max_size=40))
def test_streamed_text_is_the_decoded_text(sp: spm.SentencePieceProcessor, text: str) -> None:
    """The engine's incremental detokenizer (here on DecodeStream: not a byte-level decoder)
    gives a generated answer's text piece by piece: the leading space of the first piece goes,
    byte pieces of a character are held until it is whole."""
    from calserve.engine.detok import IncrementalDetokenizer
    from calserve.models.tokenizer import Tokenizer

    g = tokenizer_from_metadata(metadata(sp))
    tok = Tokenizer(tokenizers.Tokenizer.from_str(g.tokenizer_json), (2,))
    ids = sp.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push_one(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == sp.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-1])


def test_end_of_generation_tokens_by_their_text(sp: spm.SentencePieceProcessor) -> None:
    """A Llama 3 GGUF whose EOS is <|end_of_text|> still ends a chat turn at <|eot_id|>: llama.cpp
    takes the tokens of END_OF_GENERATION as ends whatever the file's EOS id."""
    meta = metadata(sp)
    toks = list(meta["tokenizer.ggml.tokens"])
    toks[-1], toks[-2] = "<|eot_id|>", "<|end_of_text|>"
    meta["tokenizer.ggml.tokens"] = toks
    meta["tokenizer.ggml.eos_token_id"] = len(toks) - 2
    g = tokenizer_from_metadata(meta)
    assert g.eos_token_ids == (len(toks) - 2, len(toks) - 1)


@pytest.fixture(scope="module")
def sp_gemma() -> spm.SentencePieceProcessor:
    """Gemma's setup: no dummy prefix (its GGUF says ``tokenizer.ggml.add_space_prefix`` false), the
    turn markers as control pieces."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=400,
        character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, control_symbols=["<start_of_turn>", "<end_of_turn>"],
        unk_id=3, bos_id=2, eos_id=1, pad_id=0, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def test_without_a_space_prefix_encodes_as_sentencepiece_does(
        sp_gemma: spm.SentencePieceProcessor) -> None:
    """``add_space_prefix`` false (Gemma): the ids are those of sentencepiece without a dummy prefix,
    decoding keeps a leading space, BOS is added, and <end_of_turn> (a control piece, named by no
    id key) ends generation after <eos>."""
    meta = {**metadata(sp_gemma), "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3}
    g = tokenizer_from_metadata(meta)
    eot = sp_gemma.piece_to_id("<end_of_turn>")
    assert g.eos_token_ids == (1, eot) and g.add_bos_token and g.bos_token_id == 2
    tok = tokenizers.Tokenizer.from_str(g.tokenizer_json)
    for text in [*dict.fromkeys(CORPUS), *TEXTS]:
        want = sp_gemma.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text, [sp_gemma.id_to_piece(i) for i in want],
                             [sp_gemma.id_to_piece(i) for i in got])
        assert tok.decode(got) == sp_gemma.decode(want) == text
    assert tok.encode("Hi").ids == [2, *sp_gemma.encode("Hi")]
    sot = sp_gemma.piece_to_id("<start_of_turn>")
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", add_special_tokens=False).ids
    assert ids == [sot, *sp_gemma.encode("user\nHi"), eot, *sp_gemma.encode("\n")]
