"""The tool calls of an answer as its text grows: each call's name once its JSON holds it whole,
then its ``arguments`` as the model writes them, piece by piece.

OpenAI streams a call so (the first delta of a call carries its id, type and name with
``arguments: ""``, the next ones pieces of the arguments' JSON text), and vLLM's tool parsers and
llama.cpp's server do the same: a client sees a call as it is written instead of all at once at
the end. :class:`CallScanner` reads the calls of one syntax (:class:`Framing`: the generic JSON
answer of ``api/tools.py``, Hermes ``<tool_call>`` tags, Llama 3's JSON) from the answer's text,
(each syntax's module has its framing), fed in pieces of any size, and returns what each piece adds. It is a function of the text alone:
fed the whole text at once it ends where it ends fed piece by piece, which is how the message of
an unstreamed answer (``ToolCalling.message``) and the deltas of the streamed one add up to the
same calls, names and arguments texts.

A call begins once its name is complete and names a tool of the request; its arguments are the
JSON value after the arguments key, character for character as generated (the grammar holds it
to the tool's schema; an answer cut short leaves the last call's arguments cut short, as OpenAI
returns them with ``finish_reason: "length"``). Text that breaks the syntax stops the scan: the
calls found before it stand, nothing after it is read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Container
from typing import Final, final

__all__ = ["Framing", "CallScanner", "CallDelta", "ScannedCall"]


@dataclasses.dataclass(frozen=True)
class Framing:
    """How one syntax writes its calls around their JSON (every string literal, exact)."""

    open: str  # before the first call
    find: bool  # the opening may follow other text (Hermes: content first); else it is the start
    head: str  # a call's JSON up to its name's text
    key: str  # from the end of the name's text to the arguments' value
    close: str  # after the arguments' value: the call's end
    next: str | None  # between two calls (None: one call an answer)
    end: str | None  # after the last call (None: the text's end is the calls' end)


#: ``(index, name, piece)``: call ``index`` begins (``name`` not None: its first delta) and/or its
#: arguments' text grows by ``piece`` (may be "").
CallDelta = tuple[int, str | None, str]


@final
class ScannedCall:
    """One call found: its name and its arguments' JSON text so far."""

    __slots__ = ("name", "parts", "whole")

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[str] = []
        self.whole = False  # its arguments' value and the call's end were read

    @property
    def arguments(self) -> str:
        return "".join(self.parts)


_SCALAR_END: Final = frozenset(',}] \t\r\n')

# states
_SEEK, _OPEN, _HEAD, _NAME, _KEY, _ARGS, _CLOSE, _BETWEEN, _DONE, _OFF = range(10)


@final
class CallScanner:
    """The calls of one answer in one :class:`Framing` (module docstring)."""

    __slots__ = ("_f", "_names", "_buf", "_pos", "_state", "_depth", "_in_str", "_esc",
                 "_began", "start", "calls")

    def __init__(self, framing: Framing, names: Container[str]) -> None:
        self._f = framing
        self._names = names
        self._buf = ""
        self._pos = 0  # the next character of _buf to read
        self._state = _SEEK if framing.find else _OPEN
        self._depth = 0  # the arguments' value: brackets open
        self._in_str = False
        self._esc = False
        self._began = False  # the value's first character was read
        self.start: int | None = None if framing.find else 0  # where the calls begin in the text
        self.calls: list[ScannedCall] = []

    @property
    def stopped(self) -> bool:
        """Nothing more of the text will be read (the calls ended, or the syntax broke)."""
        return self._state in (_DONE, _OFF)

    def closed(self) -> bool:
        """The text read so far ends the calls as the syntax ends them: every call whole, at
        least one, nothing after them."""
        if not self.calls or not self.calls[-1].whole:
            return False
        if self._state == _DONE:
            return True
        return self._state == _BETWEEN and self._f.end is None and self._pos == len(self._buf)

    def feed(self, text: str) -> list[CallDelta]:
        """The answer's next characters -> what they add to its calls."""
        if self.stopped or not text:
            return []
        self._buf += text
        out: list[CallDelta] = []
        while self._step(out):
            pass
        return out

    # ------------------------------------------------------------------------------ the states
    def _step(self, out: list[CallDelta]) -> bool:
        """Read what the current state can; False when it needs more text (or stopped)."""
        s = self._state
        f = self._f
        if s == _SEEK:
            at = self._buf.find(f.open, self._pos)
            if at < 0:  # keep reading from where the opening could still begin
                self._pos = max(self._pos, len(self._buf) - len(f.open) + 1)
                return False
            self.start, self._pos, self._state = at, at + len(f.open), _HEAD
            return True
        if s == _OPEN:
            return self._literal((f.open,), (_HEAD,))
        if s == _HEAD:
            return self._literal((f.head,), (_NAME,))
        if s == _NAME:
            return self._name(out)
        if s == _ARGS:
            return self._value(out)
        if s == _CLOSE:
            if not self._literal((f.close,), (_BETWEEN,)):
                return False
            self.calls[-1].whole = True
            if f.next is None and f.end == "":  # one call an answer, nothing after it
                self._state = _DONE
            return True
        if s == _BETWEEN:  # the next call, or the calls' end (None: what the syntax lacks)
            pairs = [(o, st) for o, st in ((f.next, _HEAD), (f.end, _DONE)) if o is not None]
            return self._literal(tuple(o for o, _ in pairs), tuple(st for _, st in pairs))
        return False

    def _literal(self, options: tuple[str, ...], then: tuple[int, ...]) -> bool:
        """One of ``options`` at the read position -> its state in ``then``; a proper start of
        one waits for more text; anything else stops the scan."""
        rest = self._buf[self._pos:]
        for opt, nxt in zip(options, then):
            if rest.startswith(opt):
                self._pos += len(opt)
                self._state = nxt
                return True
        if not any(opt.startswith(rest) for opt in options):
            self._state = _OFF
        return False

    def _name(self, out: list[CallDelta]) -> bool:
        buf, i = self._buf, self._pos
        n = len(buf)
        while i < n:  # the name's closing quote (an escaped one is not)
            c = buf[i]
            if c == "\\":
                i += 2
                continue
            if c == '"':
                break
            i += 1
        if i >= n:
            return False
        key = self._f.key[1:]  # (the key begins with the name's closing quote)
        rest = buf[i + 1:]
        if len(rest) < len(key):
            if not key.startswith(rest):
                self._state = _OFF
            return False
        if not rest.startswith(key):
            self._state = _OFF
            return False
        try:
            name = json.loads(buf[self._pos - 1:i + 1])  # the head's last character is its quote
        except ValueError:
            name = None
        if not isinstance(name, str) or name not in self._names:
            self._state = _OFF
            return False
        self.calls.append(ScannedCall(name))
        out.append((len(self.calls) - 1, name, ""))
        self._pos = i + 1 + len(key)
        self._state, self._depth, self._in_str, self._esc, self._began = _ARGS, 0, False, False, False
        return True

    def _value(self, out: list[CallDelta]) -> bool:
        """The arguments' JSON value, as far as the text goes (its pieces to ``out``)."""
        buf, i = self._buf, self._pos
        n = len(buf)
        depth, in_str, esc, began = self._depth, self._in_str, self._esc, self._began
        ended = False
        while i < n:
            c = buf[i]
            if not began:
                began = True
                if c in "{[":
                    depth = 1
                elif c == '"':
                    in_str = True
                i += 1
                if depth == 0 and not in_str and c in _SCALAR_END:  # not a value
                    self._state = _OFF
                    return False
                continue
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
                    if depth == 0:  # a string value ends with its quote
                        i += 1
                        ended = True
                        break
                i += 1
                continue
            if depth == 0:  # a number, true, false, null: ends before its delimiter
                if c in _SCALAR_END:
                    ended = True
                    break
                i += 1
                continue
            if c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    i += 1
                    ended = True
                    break
            i += 1
        piece = buf[self._pos:i]
        if piece:
            self.calls[-1].parts.append(piece)
            idx = len(self.calls) - 1
            if out and out[-1][0] == idx:
                j, name, prev = out[-1]
                out[-1] = (j, name, prev + piece)
            else:
                out.append((idx, None, piece))
        self._pos = i
        self._depth, self._in_str, self._esc, self._began = depth, in_str, esc, began
        if ended:
            self._state = _CLOSE
        return ended
