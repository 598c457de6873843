"""The built-in demo model: tiny Qwen3 architecture, seeded weights, locally trained byte-level BPE.

Served under alias ``qwen3`` by the embedded default config. Small enough that the software runtime
decodes thousands of tokens/s on one core; profiles 1/4/8/16, max_seq 2048. Built in seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from calserve.runtime.reference import ModelConfig

__all__ = ["DEMO_ALIAS", "DEMO_NAME", "demo_model_config", "demo_package_path", "ensure_demo_package"]

DEMO_ALIAS = "qwen3"
DEMO_NAME = "demo-qwen3"


def demo_model_config(vocab_size: int = 512) -> ModelConfig:
    raise NotImplementedError


def demo_package_path(home: str | os.PathLike[str] | None = None) -> Path:
    """``calserve_home()/models/demo-qwen3``."""
    raise NotImplementedError


def ensure_demo_package(home: str | os.PathLike[str] | None = None) -> Path:
    """Build the demo package once (atomic; safe across processes) and return its path.

    Signed with the development key of ``home`` (created on first use), which the default config
    trusts; lives inside the default model root ``home/models``.
    """
    raise NotImplementedError
