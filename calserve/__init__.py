"""calserve: an OpenAI-compatible LLM server for the Calculet NPU, on Trio.

``calserve:app`` is the ASGI app (``hypercorn -k trio calserve:app``). It is imported lazily so that
``import calserve`` (the CLI, the runtime, the tests of pure logic) does not pull in the web stack.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "app":
        from calserve.api.app import create_app

        app = create_app()
        globals()["app"] = app
        return app
    raise AttributeError(f"module 'calserve' has no attribute {name!r}")
