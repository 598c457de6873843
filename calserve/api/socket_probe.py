"""How far behind a client is on one TCP connection, from the kernel's ``TCP_INFO`` (Linux).

Why: a client that never reads is invisible to the server until the kernels' socket buffers are
full. On loopback a never-reading client's receive buffer alone takes ~128 KB (``tcp_rmem``) and the
server's autotuned send buffer more: ~100-150 tokens of a 20-logprob stream, each generated on a
lane other requests wait for, before a single ``send`` blocks (README "Per-request limits and slow
readers"). The kernel knows earlier: what the server queued and has not sent, and the receive
window the client advertises, which shrinks by every byte its application leaves unread.

:meth:`SocketProbe.unread` estimates what was written and the client has not read: the bytes
still queued unsent on our side (``tcpi_notsent_bytes``) plus the bytes the client acknowledged
since it last caught up (``tcpi_bytes_acked`` since then). It has caught up when its window is
(nearly) fully open again and its right edge (acknowledged + window) moved on by the write before
the last (the last one may be unread by any client when its ACK leaves), or when it freed all it
got since it last caught up (a window that shrank below its peak for another reason is no
excuse). A client that reads keeps its window open, so this restarts at every read that catches
up. In flight bytes
(sent, not yet acknowledged) do not count: they are the network's, not the client's. The estimate
errs low (a window update can lag a read by one segment; a receive window still growing at the
start hides what it took): it never calls a reader behind that is not.

The connection guard (:mod:`calserve.api.listener`: ``calserve serve``, and the hypercorn CLI once
the app installed it at start-up) makes one probe per connection and hands it to the app through
the ASGI scope's ``state`` (:data:`PROBE_KEY`). Without the guard (the app served by hypercorn in
another way), :func:`probe_from_send` finds the socket behind the ASGI ``send`` of hypercorn
0.17/0.18's HTTP/1.1 stream (``HTTPStream.send`` -> ``H11Protocol.send`` -> ``TCPServer.stream``);
any other shape (HTTP/2, TLS, another server or version) gives no probe, and a test pins that the
CLI still gives one. The streaming pump reports the figure to the request's stream before each
write (``StreamWriter.report_unread``), where it counts in the backlog bound
(``server.stream_buffer_bytes``), and a client that has not caught up for
``server.stream_contended_stall_ms`` gives its running slot up (is parked) while others wait;
while parked, :mod:`calserve.api.write_watch` keeps sampling. Without a probe the backlog is what
the engine and the pump hold (and a write that does not complete).

What the kernel cannot show: with small writes (plain-text tokens, ~150-300 B each) a
never-reading Linux client's advertised window often does not move at all until tens of KB are
queued (measured: constant for a whole 1,000-token plain-text stream, ~35 KB); larger writes
(logprob chunks, ~1.4 KB per token, coalesced ~20 KB) shrink it as they arrive, after the
receiver's window has grown for the first ~20-40 KB.
"""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Callable
from typing import Any, Final, final

__all__ = ["SocketProbe", "PROBE_KEY", "probe_of", "probe_from_send"]

#: The key of a connection's probe in the ASGI scope's ``state`` (set by the listener).
PROBE_KEY: Final = "calserve.socket_probe"

# struct tcp_info (linux/tcp.h): offsets of the fields read here; the struct has had them since
# Linux 5.4 (tcpi_snd_wnd), shorter answers mean an older kernel: no estimate.
_BYTES_ACKED: Final = 120  # __u64 tcpi_bytes_acked
_NOTSENT: Final = 144  # __u32 tcpi_notsent_bytes
_SND_WND: Final = 228  # __u32 tcpi_snd_wnd (the peer's advertised window, scaled, bytes)
_INFO_LEN: Final = 232
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None
# The three fields in one unpack: (tcpi_bytes_acked, tcpi_notsent_bytes, tcpi_snd_wnd)
_FIELDS = struct.Struct(f"={_BYTES_ACKED}xQ{_NOTSENT - _BYTES_ACKED - 8}xI{_SND_WND - _NOTSENT - 4}xI")
assert _FIELDS.size == _INFO_LEN
# The window counts as open (the client has read what it got) when it is within what arrived
# since the last sample (a reader's window dips by at most about that: the ACK of a write is sent
# before the client reads it) plus this of the largest seen; a never-reader's falls steadily.
_OPEN_SLACK: Final = 2048


@final
class SocketProbe:
    """The unread-bytes estimate of one connection (module docstring). Cheap: one
    ``getsockopt`` per call. Never raises: on any error (a closed socket, no ``TCP_INFO``) it
    answers 0, i.e. "nothing known to be unread"."""

    __slots__ = ("_sock", "_max_wnd", "_base", "_acked", "_caught_up", "_ok", "stall_s", "close",
                 "_edge", "_base_edge", "_arrived")

    def __init__(self, sock: Any, stall_s: float, close: Callable[[], None] | None = None) -> None:
        """``stall_s``: how long a client may leave data unread before :meth:`sample` calls it
        stalled (``server.stream_contended_stall_ms``). ``close()`` closes the connection (a
        blocked write then fails at once; default: close the socket), for a client the server
        gave up on (``client_too_slow``)."""
        self._sock = sock
        self.close: Callable[[], None] = close if close is not None else sock.close
        self._max_wnd = 0
        self._base = 0  # bytes_acked when the window was last open
        self._acked = 0  # bytes_acked at the last sample
        self._caught_up = 0.0  # when it was (the clock of the caller)
        self._edge = 0  # the right edge of the window (acked + window) at the last sample
        self._base_edge = 0  # ... when the window was last open
        self._arrived = 0  # what the last sample found newly acknowledged
        self._ok = _TCP_INFO is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        self.stall_s = stall_s

    def sample(self, now: float) -> tuple[int, float | None]:
        """``(unread bytes, stalled for)``: the estimate, and how long the client has not caught
        up when that is at least ``stall_s`` and something is unread (else None)."""
        if not self._ok:
            return 0, None
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
        except (OSError, ValueError):
            self._ok = False
            return 0, None
        if len(info) < _INFO_LEN:
            self._ok = False
            return 0, None
        acked, notsent, wnd = _FIELDS.unpack_from(info)
        if wnd > self._max_wnd:
            self._max_wnd = wnd
        arrived = acked - self._acked
        self._acked = acked
        edge = acked + wnd
        # Caught up: the window is (nearly) fully open and the client has read the write before
        # the last (its window's right edge moved on by that much: the last one may be unread
        # yet, by any client), or it has freed everything it got since it last caught up (a
        # window that shrank for another reason, e.g. the receiver's memory, is no excuse), or
        # at least a few KB arrived since the last sample and the edge moved on by all of it (its
        # kernel keeps room: nothing shows it filling up; the receiver scales its window by the
        # size of what it gets, so after small writes a reader's window can stay below its peak
        # for good; smaller arrivals vanish in the window's rounding). The last two need
        # something to have arrived: a closed window with data unsent is behind.
        step = edge - self._edge
        lag_ok = step + _OPEN_SLACK >= self._arrived
        freed_all = (acked > self._base
                     and edge - self._base_edge + _OPEN_SLACK >= acked - self._base)
        self._edge = edge
        self._arrived = arrived
        if ((wnd + arrived + _OPEN_SLACK >= self._max_wnd and lag_ok) or freed_all
                or _OPEN_SLACK <= arrived <= step):
            self._base = acked
            self._base_edge = edge
            self._caught_up = now
        unread = int(acked - self._base + notsent)
        behind = now - self._caught_up
        return unread, behind if unread and behind >= self.stall_s else None


def probe_of(scope: dict[str, Any]) -> SocketProbe | None:
    """The connection's probe from an ASGI scope (None: the launcher gives none)."""
    state = scope.get("state")
    if not isinstance(state, dict):
        return None
    probe = state.get(PROBE_KEY)
    return probe if isinstance(probe, SocketProbe) else None


def probe_from_send(send: Any, stall_s: float) -> SocketProbe | None:
    """A probe of the socket behind hypercorn's ASGI ``send`` (module docstring), or None.
    ``functools.wraps``-style wrappers (``__wrapped__``) are looked through."""
    while hasattr(send, "__wrapped__"):
        send = send.__wrapped__
    obj: Any = send
    for attr in ("__self__", "send", "__self__", "send", "__self__", "stream", "socket"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    if not (callable(getattr(obj, "getsockopt", None)) and isinstance(getattr(obj, "family", None),
                                                                       int)):
        return None
    return SocketProbe(obj, stall_s)
