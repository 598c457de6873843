"""calserve: an OpenAI-compatible LLM server for the Calculet NPU, on Trio.

``calserve:app`` is the ASGI app (``hypercorn -k trio calserve:app``). It is a small proxy that builds
the real app (``calserve.api.app.create_app()``) on first use, so that ``import calserve`` (the CLI,
the runtime, the tests of pure logic) does not pull in the web stack. A module-level ``__getattr__``
is not enough: hypercorn resolves ``calserve:app`` with ``eval("app", vars(module))``, which never
calls it.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["app", "__version__"]


class _LazyApp:
    """ASGI callable that forwards to ``create_app()``, created once on first call/attribute."""

    __slots__ = ("_app",)

    def __init__(self) -> None:
        self._app: Any = None

    def _get(self) -> Any:
        if self._app is None:
            from calserve.api.app import create_app

            # The hypercorn CLI exits 0 whatever its worker does: a start-up failure ends the
            # worker itself (exit code 1, one log line), not a server answering 503 for ever.
            # Its connections get calserve serve's guard (api/listener.py install_cli_guard).
            self._app = create_app(exit_on_start_failure=True, guard_cli_listener=True)
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._get()(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)


app = _LazyApp()
