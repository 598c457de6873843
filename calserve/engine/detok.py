"""Incremental detokenisation and stop-string matching (issue 5 item 6).

Both classes are per-request, synchronous and owned by the request actor (the only writer of its
request, spec §4). Neither knows about trio.

:class:`IncrementalDetokenizer` turns a growing token sequence into text pieces that are safe to
emit: a byte-level BPE token can end in the middle of a UTF-8 character, so a piece that decodes to
a trailing U+FFFD is held back until the next token completes the character. It uses the
"prefix offset / read offset" technique of TGI and vLLM: decode a small window of already-emitted
tokens (for tokenizers whose decoding of a token depends on its left neighbours, e.g. leading-space
rules) plus the new ones, and emit only the difference.

:class:`StopMatcher` holds back text that could still become a stop string, and on a match returns
only the text before it: the stop text and everything after it are never emitted (OpenAI
semantics). A match is the occurrence that *completes* first in the stream (smallest end index;
among those, the longest), which is what a streaming server can know at that point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, final

__all__ = ["TokenDecoder", "IncrementalDetokenizer", "StopMatcher"]

_REPLACEMENT: Final = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (``calserve.models.tokenizer.Tokenizer`` fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@final
class IncrementalDetokenizer:
    """Emit text for a token stream as soon as it is complete.

    Invariant: the concatenation of every ``push`` result and the final ``flush`` equals
    ``tokenizer.decode(all tokens)`` for concatenative decoders (byte-level BPE), and no piece but
    the flushed tail ends in a replacement character produced by an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the tokens from prefix_offset on are kept; offsets are relative to self._ids.
        self._ids: list[int] = []
        # Invariant: 0 <= _prefix <= _read <= len(_ids); tokens before _read are fully emitted;
        # tokens in [_prefix, _read) are decoded again as left context only.
        self._prefix = 0
        self._read = 0
        self._flushed = False
        self.tokens_seen = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text newly safe to emit (may be "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self.tokens_seen += len(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            out = new_text[len(prefix_text) :]
            # Drop tokens that can no longer serve as left context; keep memory O(window).
            del self._ids[: self._read]
            self._prefix = 0
            self._read = len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """The held-back tail (possibly with replacement characters); the stream is over."""
        if self._flushed:
            return ""
        self._flushed = True
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        return new_text[len(prefix_text) :]


@final
class StopMatcher:
    """Hold back text that could start a stop string; cut at the first completed stop string.

    Invariant: text returned so far never contains the start of a possible stop occurrence, so a
    match found later always lies entirely in the held buffer.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        for i, s in enumerate(stops):
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop[{i}] must be a non-empty string")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._maxlen = max((len(s) for s in self._stops), default=0)
        self._buf = ""
        self._matched: str | None = None
        self._done = False

    @property
    def matched(self) -> str | None:
        """The stop string that matched, if any."""
        return self._matched

    def feed(self, text: str, *, check: bool = True) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string matched).

        ``check=False`` (e.g. before ``min_tokens`` is reached) passes everything through and only
        occurrences starting in later, checked text can match. After a match, further feeds return
        ("", True).
        """
        if self._done:
            return "", self._matched is not None
        if not self._stops:
            return text, False
        if not check:
            out, self._buf = self._buf + text, ""
            return out, False
        buf = self._buf + text
        best: tuple[int, int] | None = None  # (end, -len) of the first-completing occurrence
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), -len(s))
                if best is None or key < best:
                    best, self._matched = key, s
        if best is not None:
            end, neg_len = best
            self._done = True
            self._buf = ""
            return buf[: end + neg_len], True
        hold = self._held_suffix_len(buf)
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._maxlen - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def flush(self) -> str:
        """End of stream without a match: the held text is emitted."""
        out, self._buf = self._buf, ""
        self._done = True
        return "" if self._matched is not None else out
