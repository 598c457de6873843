"""Closing the connection of a streamed response whose client does not read (README "Per-request
limits and slow readers"): hypercorn's write to such a client never completes and cannot be
cancelled (it is shielded), so the only way to end it, and to free the connection, is to close the
socket under it (:attr:`~calserve.api.socket_probe.SocketProbe.close`).

:class:`WriteWatch`, one per streamed response that has a socket probe:

- a write of the stream that has not completed ``server.send_timeout_s`` after it started closes
  the connection (its client has read nothing for that long: the kernels' buffers are full) —
  whether or not the engine is still producing: a stream that ran to its end while its client
  never read would otherwise hold its connection and its last bytes until the client leaves;
- once the engine gave up on the client as too slow (``client_too_slow``), the connection is
  closed :data:`CUT_CLOSE_S` later (time to write that last event to a client that reads again).

Cost: two cancel-scope deadline updates per write.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from math import inf
from typing import Any, Final, final

import trio

__all__ = ["CUT_CLOSE_S", "WriteWatch", "close_later"]

#: A stream given up as too slow has this long to write its last event, then its connection is
#: closed.
CUT_CLOSE_S: Final = 1.0

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def close_later(close: Callable[[], None]) -> None:
    """``close()`` :data:`CUT_CLOSE_S` from now. Shielded from its first step (no checkpoint
    before the shield): the handler's scope is cancelled when its response ends, and a write
    blocked on a client that does not read only ends with the socket."""
    with trio.CancelScope(shield=True):
        await trio.sleep(CUT_CLOSE_S)
        _close(close)


def _close(close: Callable[[], None]) -> None:
    try:
        close()
    except OSError:
        pass


@final
class WriteWatch:
    """See the module docstring. :meth:`wrap` times the stream's writes, :meth:`run` (a task of
    the handler's, cancelled with it) closes the connection when a deadline passes."""

    __slots__ = ("_scope", "_timeout", "_close", "_cut")

    def __init__(self, close: Callable[[], None], timeout_s: float) -> None:
        self._scope = trio.CancelScope()  # its deadline: when to close (inf: no write pending)
        self._timeout = timeout_s
        self._close = close
        self._cut = False

    def wrap(self, send: Send) -> Send:
        """``send`` whose every write must complete within ``timeout_s``."""
        scope = self._scope
        timeout = self._timeout
        clock = trio.current_time

        async def timed(message: dict[str, Any]) -> None:
            scope.deadline = clock() + timeout
            try:
                await send(message)
            finally:
                if not self._cut:
                    scope.deadline = inf

        return timed

    def cut(self) -> None:
        """The engine gave up on the client: close :data:`CUT_CLOSE_S` from now at the latest."""
        self._cut = True
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + CUT_CLOSE_S)

    async def run(self, given_up: Callable[[], Awaitable[None]] | None) -> None:
        """Until a deadline passes (then close), or the handler cancels it. ``given_up()``
        returns once the engine gave up on the client (None: not known)."""
        async with trio.open_nursery() as nursery:
            if given_up is not None:
                nursery.start_soon(self._on_given_up, given_up)
            with self._scope:
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()
            _close(self._close)

    async def _on_given_up(self, given_up: Callable[[], Awaitable[None]]) -> None:
        await given_up()
        self.cut()
