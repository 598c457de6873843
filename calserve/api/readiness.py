"""Readiness: why the server cannot serve an alias right now, in one small function.

``GET /ready`` answers 200 only when the alias' generation is Ready; else 503 + Retry-After with
``{"status": "not_ready", "reason": ..., "model", "generation", "state"}`` where ``reason`` is one of
:data:`REASONS`. ``GET /health`` (liveness) is 200 whenever the process serves HTTP, also while
the model loads, so a supervisor can tell "starting" from "dead".
"""

from __future__ import annotations

from typing import Final, Literal

from calserve.api.lifecycle import EngineHost
from calserve.api.protocol import EngineLike

__all__ = ["NotReady", "REASONS", "not_ready_reason", "RETRY_AFTER_S"]

NotReady = Literal["loading", "draining", "recovering", "failed"]
REASONS: Final[tuple[NotReady, ...]] = ("loading", "draining", "recovering", "failed")
#: Retry-After (s) of a 503 from /ready, by reason.
RETRY_AFTER_S: Final[dict[NotReady, float]] = {
    "loading": 1.0, "draining": 5.0, "recovering": 1.0, "failed": 30.0}

_BY_STATE: Final[dict[str, NotReady]] = {
    "Recovering": "recovering", "Failed": "failed", "Draining": "draining", "Unloading": "draining",
}


def not_ready_reason(host: EngineHost | None, engine: EngineLike | None,
                     state: str | None, ready: bool) -> NotReady | None:
    """None when ready; else why not. ``engine`` is the running engine (None while it opens or
    after it failed); ``state``/``ready`` are the alias' generation state and readiness (ignored
    without an engine)."""
    if host is None or host.loading:
        return "loading"
    if host.failed.is_set():
        return "failed"
    if engine is None:  # stopped after serving: the process is shutting down
        return "draining"
    if ready:
        return None
    return _BY_STATE.get(state or "", "loading")
