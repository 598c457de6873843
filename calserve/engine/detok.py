"""Incremental detokenisation and stop-string matching (issue 5 item 6).

Both classes are per-request, synchronous and owned by the request actor (the only writer of its
request, spec §4). Neither knows about trio.

:class:`IncrementalDetokenizer` turns a growing token sequence into text pieces that are safe to
emit: a byte-level BPE token can end in the middle of a UTF-8 character, so a piece that decodes to
a trailing U+FFFD is held back until the next token completes the character. It uses the
"prefix offset / read offset" technique of TGI and vLLM: decode a small window of already-emitted
tokens (for tokenizers whose decoding of a token depends on its left neighbours, e.g. leading-space
rules) plus the new ones, and emit only the difference. For a HF ``tokenizers`` tokenizer (ours:
``calserve.models.tokenizer.Tokenizer`` exposes it as ``backend``) the per-token step runs in Rust
(``tokenizers.decoders.DecodeStream``, the same algorithm) instead of two Python-level ``decode``
calls: ~1.4 µs instead of ~4.8 µs per token on the demo tokenizer, on the serving hot path; for
a byte-level tokenizer (the demo's, Qwen's, GPT-2's) a table lookup with the same answers instead
(:mod:`calserve.engine.detok_bytes`, ~0.2 µs).

:class:`StopMatcher` holds back text that could still become a stop string, and on a match returns
only the text before it: the stop text and everything after it are never emitted (OpenAI
semantics). A match is the occurrence that *completes* first in the stream (smallest end index;
among those, the longest), which is what a streaming server can know at that point. It runs an
Aho-Corasick automaton over the text, so its per-token cost does not grow with the number or the
length of the stop strings (a request may send 16 of 256 characters).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any, Final, Protocol, final

from calserve.engine.detok_bytes import ByteLevelStream, byte_table

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer as _HfTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the generic path only
    _HfTokenizer = None  # type: ignore[assignment,misc]
    _DecodeStream = None  # type: ignore[assignment,misc]

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
        # Fast path: the Rust DecodeStream keeps its own window; _ids/_read still track what is
        # emitted so that flush() is the generic computation. Invariant (fast path): _prefix == 0
        # and _ids[:_read] is the window of the last emitting push, _ids[_read:] the held tokens.
        backend = getattr(tokenizer, "backend", None)
        self._hf: Any = backend if _HfTokenizer is not None and isinstance(backend, _HfTokenizer) else None
        self._stream: Any = None
        if self._hf is not None:  # a byte-level tokenizer's step is a table lookup (detok_bytes)
            table = byte_table(self._hf, skip_special_tokens)
            self._stream = (ByteLevelStream(table) if table is not None
                            else _DecodeStream(skip_special_tokens=skip_special_tokens))
        self._clean: dict[int, str] | None = (
            self._stream.clean if isinstance(self._stream, ByteLevelStream) else None)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text newly safe to emit (may be "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        if not token_ids:
            return ""
        if self._stream is not None:
            if len(token_ids) == 1:
                return self.push_one(int(token_ids[0]))
            return "".join([self.push_one(int(t)) for t in token_ids])
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

    def push_one(self, token_id: int) -> str:
        """``push([token_id])`` without the list: the actor's per-token call."""
        stream = self._stream
        if stream is None:
            return self.push((token_id,))
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        self.tokens_seen += 1
        clean = self._clean
        # the byte-level stream's step when nothing is held (a table hit), without the call
        out: str | None = (clean.get(token_id) if clean is not None and not stream.held else None)
        if out is None:
            out = stream.step(self._hf, token_id)
        if out is None:
            self._ids.append(token_id)  # held: decoded again by flush() if the stream ends here
            return ""
        # emitted: the window of this push is what was held since the last emit, and this token
        ids = self._ids
        if self._read:
            del ids[: self._read]
        ids.append(token_id)
        self._read = len(ids)
        return out

    def push_many(self, token_ids: list[int]) -> str:
        """``push(token_ids)`` for a run of tokens (a multi-step job's, :class:`TokenRun`): the
        text they add and the state they leave, the same as their :meth:`push_one` calls, in one
        call. On a byte-level tokenizer a token met while nothing is held is a table hit, and of
        a row of such hits only the first and the last touch the window."""
        clean = self._clean
        if clean is None:
            return self.push(token_ids)
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        stream = self._stream
        step = stream.step
        hf = self._hf
        ids = self._ids
        read = self._read
        pieces: list[str] = []
        hit = -1  # the last of a row of table hits after its first, not yet the window (-1: none)
        in_row = False  # the previous token was a table hit
        for t in token_ids:
            if not stream.held:
                out = clean.get(t)
                if out is not None:
                    pieces.append(out)
                    if in_row:
                        hit = t
                    else:  # the row's first hit: push_one's emit
                        in_row = True
                        if read:
                            del ids[:read]
                        ids.append(t)
                        read = len(ids)
                    continue
            in_row = False
            if hit >= 0:  # after a row of hits the window is its last one
                ids[:] = (hit,)
                read = 1
                hit = -1
            out = step(hf, t)
            if out is None:
                ids.append(t)  # held: decoded again by flush() if the stream ends here
                continue
            if read:
                del ids[:read]
            ids.append(t)
            read = len(ids)
            pieces.append(out)
        if hit >= 0:
            ids[:] = (hit,)
            read = 1
        self._read = read
        self.tokens_seen += len(token_ids)
        return "".join(pieces)

    def flush(self) -> str:
        """The held-back tail (possibly with replacement characters); the stream is over."""
        if self._flushed:
            return ""
        self._flushed = True
        if self._read >= len(self._ids):  # nothing held: both decodes below would be the same
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        return new_text[len(prefix_text) :]


@final
class _StopAutomaton:
    """The Aho-Corasick automaton of one set of stop strings: immutable once built, so requests with
    the same stops share it (:func:`_automaton`). Node 0 is the root; a node is the prefix of some
    stop string that spells the path to it.

    ``goto[n]`` the trie edges; ``fail[n]`` the node of the longest proper suffix of ``n``'s prefix
    that is itself a prefix of some stop; ``depth[n]`` its length; ``out[n]`` the longest stop
    string that is a suffix of ``n``'s prefix (None: none ends there)."""

    __slots__ = ("goto", "fail", "depth", "out")

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[str | None] = [None]
        for s in stops:
            n = 0
            for ch in s:
                nxt = goto[n].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[n][ch] = nxt
                    goto.append({})
                    depth.append(depth[n] + 1)
                    own.append(None)
                n = nxt
            own[n] = s
        fail = [0] * len(goto)
        out = list(own)
        queue = collections.deque(goto[0].values())
        while queue:  # breadth first: a node's fail link is shallower, so already final
            n = queue.popleft()
            for ch, child in goto[n].items():
                f = fail[n]
                while f and ch not in goto[f]:
                    f = fail[f]
                g = goto[f].get(ch, 0)
                fail[child] = g if g != child else 0
                if out[child] is None:
                    out[child] = out[fail[child]]
                queue.append(child)
        self.goto, self.fail, self.depth, self.out = goto, fail, depth, out


@functools.lru_cache(maxsize=256)
def _automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    """Shared automata: building one for 16 stops of 256 characters is ~4k trie nodes of Python work,
    and clients tend to send the same stops with every request."""
    return _StopAutomaton(stops)


@final
class StopMatcher:
    """Hold back text that could start a stop string; cut at the first completed stop string.

    Invariant: text returned so far never contains the start of a possible stop occurrence, so a
    match found later always lies entirely in the held buffer.

    Cost: one Aho-Corasick step per character of text fed, amortised O(1) whatever the number and
    length of the stop strings (each fail-link hop undoes one earlier step; the schema allows 16
    stops of 256 characters), plus copying the held text (< the longest stop) once per feed. The
    held text is exactly the automaton node's prefix, so nothing is searched again.
    """

    __slots__ = ("_auto", "_node", "_buf", "_matched", "_done")

    def __init__(self, stops: Sequence[str]) -> None:
        for i, s in enumerate(stops):
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop[{i}] must be a non-empty string")
        uniq = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._auto: _StopAutomaton | None = _automaton(uniq) if uniq else None
        self._node = 0  # the automaton node of the held text (0: nothing held)
        self._buf = ""  # the held text: the node's prefix, the end of what was fed
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
        auto = self._auto
        if auto is None:
            return text, False
        if not check:
            out, self._buf, self._node = self._buf + text, "", 0
            return out, False
        goto, fail, out_of = auto.goto, auto.fail, auto.out
        n = self._node
        for i, ch in enumerate(text):
            while True:
                nxt = goto[n].get(ch)
                if nxt is not None:
                    n = nxt
                    break
                if not n:
                    break
                n = fail[n]
            hit = out_of[n]
            if hit is not None:  # the first stop to complete, the longest of those ending here
                buf = self._buf + text[: i + 1]
                self._done = True
                self._matched = hit
                self._buf = ""
                return buf[: len(buf) - len(hit)], True
        self._node = n
        hold = auto.depth[n]
        buf = self._buf + text
        cut = len(buf) - hold
        self._buf = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """End of stream without a match: the held text is emitted."""
        out, self._buf = self._buf, ""
        self._done = True
        return "" if self._matched is not None else out
