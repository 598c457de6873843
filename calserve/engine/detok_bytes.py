"""The incremental detokenizer's per-token step for byte-level BPE tokenizers as a table lookup
(issue 18: per-token work that must stay per request should be a dict lookup).

``tokenizers.decoders.DecodeStream.step`` decodes a window of tokens in Rust for every token
(~1.2 µs on the demo tokenizer). For a tokenizer whose decoder is the plain ``ByteLevel`` one,
the text of a token sequence is the lossy UTF-8 decoding of the concatenation of each token's
bytes (special tokens skipped), so the step reduces to: a token whose bytes are complete text on
their own, with nothing held, is its pre-decoded text (one dict lookup); otherwise its bytes are
appended to what is held, and the held bytes are emitted once their decoding is non-empty and does
not end in U+FFFD (``DecodeStream``'s rule). :class:`ByteLevelStream` has ``DecodeStream``'s
``step(tokenizer, id) -> str | None`` and gives the same answers for every token sequence
(``tests/engine_parts/test_parts_detok_bytes.py``, hypothesis, on the demo tokenizer and a
trained byte-level BPE).

:func:`byte_table` builds a tokenizer's table once (per tokenizer object and
``skip_special_tokens``, weakly cached) and checks it: the tokenizer's own decoding, in order and
reversed, must equal the lossy decoding of the table's bytes for a sample of the vocabulary (every added token, the first 1,024 ids — the byte tokens — and
1,024 spread over the rest, ~2 ms), else there is no table and the detokenizer keeps
``DecodeStream``. Tokens are filled in as they are first met (one dict entry each).
"""

from __future__ import annotations

import weakref
from typing import Any, Final, final

try:  # tokenizers >= 0.21
    from tokenizers import decoders as _decoders
except ImportError:  # pragma: no cover
    _decoders = None  # type: ignore[assignment]

__all__ = ["ByteTable", "ByteLevelStream", "byte_table"]

_REPLACEMENT: Final = "\ufffd"


def _char_bytes() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, character -> byte (``bytes_to_unicode`` inverted)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_CHAR_BYTES: Final = _char_bytes()


@final
class ByteTable:
    """A byte-level tokenizer's tokens, filled in as they are first met (a 150k vocabulary is
    never walked on the serving thread): per token id its bytes (b"" for a skipped special token
    or an id the tokenizer does not know), and in ``clean`` its text when those bytes are
    complete text on their own (non-empty, valid UTF-8, not ending in U+FFFD)."""

    __slots__ = ("raw", "clean", "_backend", "_skip", "_special")

    def __init__(self, backend: Any, skip_special_tokens: bool, special: set[int]) -> None:
        self.raw: dict[int, bytes] = {}
        self.clean: dict[int, str] = {}
        self._backend = backend
        self._skip = skip_special_tokens
        self._special = special

    def add(self, token_id: int) -> bytes:
        """Fill in ``token_id`` (``raw`` and, if it is, ``clean``); returns its bytes."""
        if token_id < 0:
            raise OverflowError(f"token id {token_id} is negative")
        tok = self._backend.id_to_token(token_id)
        b = b"" if tok is None or (self._skip and token_id in self._special) else _token_bytes(tok)
        self.raw[token_id] = b
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if text and not text.endswith(_REPLACEMENT):
            self.clean[token_id] = text
        return b


def _token_bytes(token: str) -> bytes:
    """What the ByteLevel decoder makes of one token: its characters through the alphabet, or
    its own UTF-8 when one of them is not in it (an added token)."""
    out = bytearray()
    for ch in token:
        b = _CHAR_BYTES.get(ch)
        if b is None:
            return token.encode("utf-8")
        out.append(b)
    return bytes(out)


_SAMPLE: Final = 1024


def _build(backend: Any, skip_special_tokens: bool) -> ByteTable | None:
    if _decoders is None or not isinstance(getattr(backend, "decoder", None), _decoders.ByteLevel):
        return None
    try:
        return _checked(backend, skip_special_tokens)
    except Exception:  # a tokenizers version without one of these calls: keep DecodeStream
        return None


def _checked(backend: Any, skip_special_tokens: bool) -> ByteTable | None:
    n = int(backend.get_vocab_size(with_added_tokens=True))
    added = backend.get_added_tokens_decoder()
    table = ByteTable(backend, skip_special_tokens, {i for i, t in added.items() if t.special})
    # The check: every added token, the first ids (the byte tokens) and ids spread over the rest
    ids = sorted({*added, *range(min(n, _SAMPLE)), *range(0, n, max(1, n // _SAMPLE)), n, n + 1})
    raw = {i: table.add(i) for i in ids}
    for order in (ids, ids[::-1]):
        want = backend.decode(order, skip_special_tokens=skip_special_tokens)
        if want != b"".join(raw[i] for i in order).decode("utf-8", "replace"):
            return None
    return table


_TABLES: weakref.WeakKeyDictionary[Any, dict[bool, ByteTable | None]] = weakref.WeakKeyDictionary()


def byte_table(backend: Any, skip_special_tokens: bool = True) -> ByteTable | None:
    """The checked table of a HF ``tokenizers.Tokenizer``, one per tokenizer object and
    ``skip_special_tokens`` (None: not a plain byte-level decoder, or the check failed: keep
    ``DecodeStream``)."""
    try:
        per = _TABLES.setdefault(backend, {})
    except TypeError:  # not weakly referenceable: one table per detokenizer (none such today)
        return _build(backend, skip_special_tokens)
    if skip_special_tokens not in per:
        per[skip_special_tokens] = _build(backend, skip_special_tokens)
    return per[skip_special_tokens]


@final
class ByteLevelStream:
    """``DecodeStream`` for a byte-level tokenizer, from its :class:`ByteTable` (module
    docstring). Invariant: ``held`` is the bytes of the tokens since the last emit; ``clean`` is
    the table's ``clean`` (both read-only for callers: the detokenizer's per-token fast path reads
    them to skip the call when nothing is held)."""

    __slots__ = ("_raw", "clean", "_add", "held")

    def __init__(self, table: ByteTable) -> None:
        self._raw = table.raw
        self.clean = table.clean
        self._add = table.add
        self.held = b""

    def step(self, tokenizer: object, token_id: int) -> str | None:
        """The text ``token_id`` completes (None: nothing yet), as ``DecodeStream.step``;
        ``tokenizer`` is ignored (the table is its)."""
        raw = self._raw.get(token_id)
        if raw is None:
            raw = self._add(token_id)
        held = self.held
        if not held:
            text = self.clean.get(token_id)
            if text is not None:
                return text
        held += raw
        out = held.decode("utf-8", "replace")
        if out and not out.endswith(_REPLACEMENT):
            self.held = b""
            return out
        self.held = held
        return None
