"""Reading Hugging Face Qwen3 checkpoints without torch, and a tiny safetensors reader/writer.

``safetensors.numpy`` cannot read BF16 (numpy has no bfloat16), and real Qwen3 checkpoints are BF16,
so the header (8-byte little-endian length + JSON) is parsed here and BF16 is upcast by shifting each
uint16 into the high half of a float32 (exact). F16 and F32 are read as such.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from calserve.runtime.reference import ModelConfig

__all__ = [
    "read_safetensors_header",
    "load_safetensors",
    "write_safetensors",
    "HFCheckpoint",
    "load_hf_checkpoint",
]


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """(header dict without ``__metadata__``, offset of the data section)."""
    raise NotImplementedError


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor as float32 (BF16/F16 upcast)."""
    raise NotImplementedError


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], dtype: str = "BF16"
) -> None:
    """Write ``tensors`` (float arrays) as ``dtype`` (BF16 rounds to nearest even, F16, F32)."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # float32
    tokenizer_json: Path
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    chat_template: str | None
    source_dtype: str  # "BF16" / "F16" / "F32" (of the first tensor)


def load_hf_checkpoint(src: str | os.PathLike[str]) -> HFCheckpoint:
    raise NotImplementedError
