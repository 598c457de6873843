"""Static validation of a package and its compatibility with the runtime and the config.

- :func:`validate_manifest`: schema-level sanity of profiles (compiled_batch in {1,4,8,16}, max_seq
  bounds, KV layout consistent with the architecture, the spec §7.3 inactive-lane contract) and the
  tensor index (names/shapes/dtypes vs ``reference.weight_shapes``).
- :func:`runnable_profiles`: which profiles the runtime's capability profile can run (B>1 needs the C3
  batch capability, absent on ``calrt-0.7.6``); none runnable -> refused.
- :func:`check_scheduler_config`: spec §15 last paragraph — a requested profile the package lacks, or
  the runtime cannot run, fails start-up with :class:`ConfigError`.
- :func:`compare_introspection`: spec §11 step 8 — after configure, the runtime's view must match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calserve.config import CalserveConfig
from calserve.errors import ConfigError, ValidationError
from calserve.models.manifest import Manifest, ProfileManifest
from calserve.runtime.types import RuntimeCapabilities

__all__ = [
    "ALLOWED_BATCHES",
    "TensorInfo",
    "validate_manifest",
    "validate_tensors",
    "runnable_profiles",
    "check_scheduler_config",
    "compare_introspection",
]

ALLOWED_BATCHES = frozenset({1, 4, 8, 16})

# name -> (dtype "BF16"/"F16"/"F32", shape)
TensorInfo = Mapping[str, tuple[str, tuple[int, ...]]]


def validate_manifest(manifest: Manifest, source: str = "manifest.json") -> None:
    raise NotImplementedError


def validate_tensors(manifest: Manifest, tensors: TensorInfo, source: str = "model.safetensors") -> None:
    raise NotImplementedError


def runnable_profiles(manifest: Manifest, caps: RuntimeCapabilities) -> dict[int, bool]:
    """compiled_batch -> runnable on ``caps``. Raises ValidationError when none is runnable."""
    raise NotImplementedError


def check_scheduler_config(manifest: Manifest, cfg: CalserveConfig, caps: RuntimeCapabilities) -> list[int]:
    """Cross-check ``scheduler.batch.profiles`` (and ``instance_pool``) with the package and the
    runtime; returns the profiles to load (sorted). Raises ConfigError naming the key path."""
    raise NotImplementedError


def compare_introspection(manifest: Manifest, compiled_batch: int, info: Mapping[str, Any]) -> None:
    """Spec §11 step 8: ``Calbin.introspect()`` must agree with the manifest; else ValidationError."""
    raise NotImplementedError
