"""Opening a package: spec §11 steps 1–3, in order, before any device state is touched.

1. resolve the path inside the trusted model root (symlinks and ``..`` escaping it are refused;
   ``allow_outside_root`` trusts a package named on the command line as a *location* only),
2. check ``SHA256SUMS.sig`` against the trusted keys,
3. check every hash (missing file, extra file, tampered byte), then the static validator
   (:mod:`calserve.models.validate`).

Every refusal raises a :class:`calserve.errors.PackageError` subclass naming the file and the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from calserve.errors import IntegrityError, PackagePathError, SignatureError, ValidationError
from calserve.models.manifest import Golden, Manifest
from calserve.models.signing import TrustStore
from calserve.models.tokenizer import Tokenizer

__all__ = ["VerifiedPackage", "open_package", "resolve_package_path"]


def resolve_package_path(
    path: str | os.PathLike[str], model_root: str | os.PathLike[str], *, allow_outside_root: bool = False
) -> Path:
    """Spec §11 step 1. Returns the resolved package directory or raises PackagePathError."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class VerifiedPackage:
    """A package whose signature, hashes and static validation passed. Files are read lazily."""

    path: Path
    manifest: Manifest
    sha256: str  # sha256 of SHA256SUMS: the package identity (ModelGeneration.calbin_sha256)
    signer: str  # key id (hex) that signed it

    def weights(self) -> dict[str, np.ndarray]:
        """All tensors as float32 (BF16/F16 upcast), HF names."""
        raise NotImplementedError

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def golden(self) -> Golden:
        """The golden cases (``Golden.cases[i].prompt`` / ``.expected[compiled_batch]``)."""
        raise NotImplementedError


def open_package(
    path: str | os.PathLike[str],
    trust: TrustStore,
    model_root: str | os.PathLike[str],
    *,
    allow_outside_root: bool = False,
) -> VerifiedPackage:
    """Resolve, verify signature and hashes, validate statically. Raises PackageError subclasses."""
    raise NotImplementedError
