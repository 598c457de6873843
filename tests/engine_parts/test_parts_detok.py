"""IncrementalDetokenizer and StopMatcher properties (issue 5 item 6)."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from calserve.engine.detok import IncrementalDetokenizer, StopMatcher
from calserve.models.tokenizer import Tokenizer

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "数据中心的推理服务器需要低延迟和高吞吐",  # CJK: 3-byte UTF-8
    "emoji 🎉🚀🙂 and flags 🇫🇷 mixed with text",  # 4-byte UTF-8 and sequences
    "naïve café résumé — “quotes” ½ ∑ ∞",
    "<|end|> special token in text",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    t.train_from_iterator(_CORPUS, trainer=trainer)
    return Tokenizer(t, eos_token_ids=[0])


def _chunks(seq: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(seq) + 1) for c in cuts} | {0, len(seq)})
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


@given(st.data())
def test_pushes_plus_flush_equal_decode_of_all(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=10))
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(c) for c in _chunks(ids, cuts)]
    pieces.append(d.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert d.tokens_seen == len(ids)


_text = st.lists(st.sampled_from(list("ab c,.数据中心🎉🚀🙂éñ—\n") + ["🇫🇷"]), max_size=40).map("".join)


@given(_text, st.lists(st.integers(0, 64), max_size=10))
def test_valid_text_never_emits_a_replacement_char(tok: Tokenizer, text: str, cuts: list[int]) -> None:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(c) for c in _chunks(ids, cuts)]
    tail = d.flush()
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) + tail == text
    # Token by token, a fully valid text needs nothing held at the end.
    d2 = IncrementalDetokenizer(tok)
    one_by_one = [d2.push([i]) for i in ids]
    assert "".join(one_by_one) == text and d2.flush() == ""


def _byte_level_char(b: int) -> str:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, others to 256 + n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in keep:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in keep].index(b))


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    # One token per byte splits the 4-byte emoji across four pushes.
    byte_ids = [tok.token_to_id(_byte_level_char(b)) for b in "🎉".encode()]
    assert None not in byte_ids
    ids = [i for i in byte_ids if i is not None]
    d = IncrementalDetokenizer(tok)
    assert d.push([ids[0]]) == ""
    assert d.push(ids[1:3]) == ""
    assert d.push([ids[3]]) == "🎉"
    # A dangling lead byte at the end is only released by flush (as U+FFFD, like decode()).
    assert d.push([ids[0]]) == ""
    assert d.flush() == tok.decode([ids[0]]) == "\ufffd"


def test_special_tokens_are_skipped_and_push_after_flush_raises(tok: Tokenizer) -> None:
    end = tok.token_to_id("<|end|>")
    assert end is not None
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("hello") + [end] + tok.encode(" world")
    assert "".join(d.push([i]) for i in ids) + d.flush() == "hello world"
    with pytest.raises(RuntimeError):
        d.push([1])
    assert d.flush() == ""


# ---------------------------------------------------------------------------------------- stops
def _expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """Oracle: cut at the occurrence that completes first (smallest end; then the longest)."""
    best: tuple[int, int] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
            best = (i + len(s), -len(s))
    if best is None:
        return text, False
    return text[: best[0] + best[1]], True


_stop_alpha = st.sampled_from(list("abc数🎉"))


@given(
    st.text(alphabet=_stop_alpha, max_size=60),
    st.lists(st.text(alphabet=_stop_alpha, min_size=1, max_size=5), max_size=4),
    st.lists(st.integers(0, 80), max_size=12),
)
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    m = StopMatcher(stops)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    out: list[str] = []
    matched = False
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = m.feed(text[a:b])
        assert not (matched and piece), "text emitted after a match"
        out.append(piece)
        matched = matched or hit
        # Invariant: what was emitted is always a prefix of the final answer.
        assert _expected(text, stops)[0].startswith("".join(out))
    out.append(m.flush())
    want, want_hit = _expected(text, stops)
    assert ("".join(out), matched) == (want, want_hit)
    assert (m.matched is not None) == want_hit


def test_stop_matcher_holds_possible_prefix_then_releases() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("xtra") == ("</extra", False)
    assert m.feed(" ok </en") == (" ok ", False)
    assert m.feed("d> tail") == ("", True)
    assert m.matched == "</end>"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_unchecked_text_passes_through() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("aSTOP b ST", check=False) == ("aSTOP b ST", False)
    # The "ST" already emitted unchecked cannot form a stop with later text.
    assert m.feed("OP c") == ("OP c", False)
    assert m.feed("x STOP y") == ("x ", True)


def test_no_stops_is_a_pass_through_and_bad_stops_are_rejected() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        StopMatcher(["ok", ""])


class _DecodeOnly:
    """The same tokenizer seen only through ``decode``: forces the generic (pure Python) path."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[arg-type]


@given(st.data())
def test_rust_stream_path_emits_exactly_what_the_generic_path_emits(
    tok: Tokenizer, data: st.DataObject
) -> None:
    """The DecodeStream fast path (HF tokenizers) is an optimisation only: token by token it
    returns the same pieces as the two-decode algorithm, and the same flushed tail (which may hold
    replacement characters of an unfinished UTF-8 sequence)."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=60))
    fast, slow = IncrementalDetokenizer(tok), IncrementalDetokenizer(_DecodeOnly(tok))
    assert fast._stream is not None and slow._stream is None  # both paths really run
    for i in ids:
        assert fast.push_one(i) == slow.push([i])
    assert fast.flush() == slow.flush()
    assert fast.tokens_seen == slow.tokens_seen == len(ids)


def test_push_one_after_flush_raises_on_both_paths(tok: Tokenizer) -> None:
    for d in (IncrementalDetokenizer(tok), IncrementalDetokenizer(_DecodeOnly(tok))):
        d.push_one(5)
        d.flush()
        with pytest.raises(RuntimeError, match="after flush"):
            d.push_one(6)


class _CountingDecode(_DecodeOnly):
    """The generic path, counting its ``decode`` calls."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok)
        self.calls = 0

    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return super().decode(ids, skip_special_tokens)


@given(_text)
def test_flush_decodes_nothing_when_nothing_is_held(tok: Tokenizer, text: str) -> None:
    """Every request's end flushes its detokenizer: when every token was emitted already the tail
    is "" without a decode (two tokenizer calls of cold code before the terminal event); when a
    token is held, flush still decodes it (the tail is the same as before)."""
    ids = tok.encode(text)
    counting = _CountingDecode(tok)
    d = IncrementalDetokenizer(counting)
    out = "".join(d.push([i]) for i in ids)
    held = d._read < len(d._ids)
    before = counting.calls
    tail = d.flush()
    assert out + tail == tok.decode(ids)
    assert (counting.calls - before > 0) == held
    if not held:
        assert tail == ""


def test_flush_of_a_held_token_still_decodes_it(tok: Tokenizer) -> None:
    """The other side of the fast exit: an unfinished UTF-8 sequence at the end is held back by
    the pushes and flushed (with its replacement character) by decoding it (the held tokens; with
    left context before them, two decodes)."""
    emoji = tok.encode("🎉")
    assert len(emoji) > 1  # the fixture's small vocabulary splits it into byte tokens
    counting = _CountingDecode(tok)
    d = IncrementalDetokenizer(counting)
    assert d.push(emoji[:1]) == ""
    before = counting.calls
    assert d.flush() == tok.decode(emoji[:1]) != ""
    assert counting.calls - before >= 1


@given(st.data())
def test_push_many_is_push_one_of_each_token(tok: Tokenizer, data: st.DataObject) -> None:
    """A multi-step job's run (``push_many``) adds the same text as its tokens' ``push_one`` calls,
    whatever the runs' bounds (a character split across runs, held tokens at a run's end), and
    leaves the same state behind: the same later pieces, flushed tail and token count."""
    special = tok.encode("<|end|>")  # skipped when decoded: held, with nothing held in bytes
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1) | st.sampled_from(special), max_size=60))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=12))
    many, one = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    assert many._clean is not None  # the byte-level table path really runs
    for run in _chunks(ids, cuts):
        assert many.push_many(run) == "".join(one.push_one(i) for i in run)
        assert (many._ids[many._prefix:], many._read) == (one._ids[one._prefix:], one._read)
    assert many.flush() == one.flush()
    assert many.tokens_seen == one.tokens_seen == len(ids)


def test_push_many_on_the_generic_path_and_after_flush(tok: Tokenizer) -> None:
    ids = tok.encode("naïve café 🎉 ok")
    generic = IncrementalDetokenizer(_DecodeOnly(tok))
    assert generic._clean is None
    assert generic.push_many(ids) + generic.flush() == tok.decode(ids)
    d = IncrementalDetokenizer(tok)
    d.push_many(ids[:2])
    d.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        d.push_many(ids[2:])
