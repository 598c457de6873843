"""Protocol hygiene that ``calserve:app`` enforces itself, at the ASGI level: the same under both
launchers (``hypercorn -k trio calserve:app`` and ``calserve serve``).

Keep-alive (:func:`shield_final_send`). Hypercorn 0.18 restarts a connection's keep-alive timer from
inside the app's last ``send`` of a response (h11 ``_maybe_recycle`` -> ``Updated(idle=True)`` ->
``TrioSingleTask.restart`` -> ``nursery.start``), and it queues ``http.disconnect`` to the app just
before. quart-trio's message task, and the generation routes' disconnect watcher, cancel the handler
on that message while the handler is still inside this ``send``. ``nursery.start`` from a cancelled
context never hands the new task over (trio's ``TaskStatus.started`` "quietly quits"): the timer task
dies at once, and the connection is never closed for idleness — a probe found 0 of 100 idle
connections closed after 70 s. Sending the response's last message in a shielded scope lets the
timer start; the cancel lands right after.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

__all__ = ["shield_final_send"]

Send = Callable[[dict[str, Any]], Awaitable[None]]

# The shielded last send is bounded: it only has to outlive a cancel that is already pending (its
# socket write is shielded by hypercorn itself), not to wait for a stuck queue forever.
_FINAL_SEND_GRACE_S: Final = 2.0


def shield_final_send(send: Send) -> Send:
    """``send`` whose last message of a response runs shielded (see the module docstring)."""

    async def guarded(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _FINAL_SEND_GRACE_S):
                await send(message)
        else:
            await send(message)

    return guarded
