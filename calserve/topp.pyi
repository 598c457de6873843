"""Stub of the C extension ``calserve.topp`` (ext/topp.c). Use calserve.engine.nucleus instead."""

from typing import Any

def cut(e: Any, z: Any, top_p: Any, before: Any, counts: Any, cols: Any, /) -> None: ...
