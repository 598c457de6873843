"""Stub of the C extension ``calserve.vexp64`` (ext/vexp64.c). Use calserve.engine.fastexp instead."""

from typing import Any

def exp_inplace(buffer: Any, /) -> bool: ...
