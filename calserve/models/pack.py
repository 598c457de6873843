"""Building signed packages: from a HF Qwen3 checkpoint, or the built-in demo model.

A package is assembled in a temp dir next to ``out`` and atomically renamed into place, so a reader
never sees a half-written package. Golden outputs are computed with the numpy reference
(``greedy_generate``) per profile, with that profile's KV dtype, on the weights *as stored* (BF16 ->
float32), which is exactly what the runtime loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["pack_from_hf", "pack_demo", "DEFAULT_PROFILES"]

DEFAULT_PROFILES: tuple[int, ...] = (1, 4, 8, 16)


def pack_from_hf(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    profiles: Sequence[int] = DEFAULT_PROFILES,
    timing: str = "none",
    *,
    max_seq: int = 2048,
    max_sequences: int | None = None,
    kv_dtype: str = "fp32",
) -> Path:
    """Pack the checkpoint directory ``src`` into the package directory ``out``, signed with ``key``."""
    raise NotImplementedError


def pack_demo(
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    profiles: Sequence[int] = DEFAULT_PROFILES,
    timing: str = "none",
) -> Path:
    """Pack the built-in demo model (see :mod:`calserve.models.demo`) into ``out``."""
    raise NotImplementedError
