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
import hashlib
import os
from pathlib import Path

import numpy as np

from calserve.errors import IntegrityError, PackagePathError, SignatureError, ValidationError
from calserve.models.hf import load_safetensors, tensor_index
from calserve.models.manifest import Golden, Manifest, decode_golden, decode_manifest
from calserve.models.signing import SIG_FILE, SUMS_FILE, TrustStore, compute_sums, parse_sums
from calserve.models.validate import validate_manifest, validate_tensors
from calserve.models.tokenizer import Tokenizer

__all__ = ["VerifiedPackage", "open_package", "resolve_package_path"]


def resolve_package_path(
    path: str | os.PathLike[str],
    model_root: str | os.PathLike[str],
    *,
    allow_outside_root: bool = False,
) -> Path:
    """Spec §11 step 1. Returns the resolved package directory or raises PackagePathError.

    A relative ``path`` is taken relative to the model root (config ``models.<alias>.package``), or to
    the working directory when ``allow_outside_root`` (a path typed on the command line). Inside the
    root, the *resolved* path must stay inside the resolved root: a ``..`` or a symlink leading out is
    refused, whichever component it is on.
    """
    p = Path(path).expanduser()
    if allow_outside_root:
        real = p.resolve()
    else:
        root = Path(model_root).expanduser()
        if not root.is_dir():
            raise PackagePathError(f"{root}: trusted model root does not exist")
        root_real = root.resolve()
        full = p if p.is_absolute() else root / p
        real = full.resolve()
        if not real.is_relative_to(root_real):
            lexical = Path(os.path.normpath(full.absolute()))
            how = (
                "via a symlink"
                if lexical.is_relative_to(Path(os.path.normpath(root.absolute())))
                else "via '..' or an outside path"
            )
            raise PackagePathError(f"{path}: resolves outside the trusted model root {root} ({how})")
    if not real.exists():
        raise PackagePathError(f"{path}: no such package directory")
    if not real.is_dir():
        raise PackagePathError(f"{path}: a package is a directory, this is a file")
    return real


@dataclasses.dataclass(frozen=True)
class VerifiedPackage:
    """A package whose signature, hashes and static validation passed. Files are read lazily.

    Invariant: ``path`` passed spec §11 steps 1–3 when this object was made; loaders read files again,
    so the package directory must not be modified while it is in use (it is read-only by convention).
    """

    path: Path
    manifest: Manifest
    sha256: str  # sha256 of SHA256SUMS: the package identity (ModelGeneration.calbin_sha256)
    signer: str  # key id (hex) that signed it

    def weights(self) -> dict[str, np.ndarray]:
        """All tensors as float32 (BF16/F16 upcast), HF names."""
        out: dict[str, np.ndarray] = {}
        for f in self.manifest.weights:
            out.update(load_safetensors(self.path / f))
        return out

    def tokenizer(self) -> Tokenizer:
        st = self.manifest.special_tokens
        return Tokenizer.from_file(
            self.path / self.manifest.tokenizer,
            st.eos_token_ids,
            self.manifest.chat_template,
            st.pad_token_id,
            st.bos_token_id,
            st.add_bos_token,
        )

    def golden(self) -> Golden:
        """The golden cases (``Golden.cases[i].prompt`` / ``.expected[compiled_batch]``)."""
        return decode_golden((self.path / self.manifest.golden).read_bytes(), self.manifest.golden)


def _check_files(pkg: Path, listed: dict[str, str]) -> None:
    """Missing, extra, symlinked or tampered files -> refused (spec §11 step 2)."""
    for rel in listed:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts:
            raise IntegrityError(f"{SUMS_FILE}: entry {rel!r} points outside the package")
    for rel in sorted(listed):
        f = pkg / rel
        if f.is_symlink():
            raise PackagePathError(f"{rel}: is a symlink; package files must be regular files")
        if not f.is_file():
            raise IntegrityError(f"{rel}: missing (listed in {SUMS_FILE})")
    actual = compute_sums(pkg)  # hashes every file present, listed or not
    for rel in sorted(actual):
        if (pkg / rel).is_symlink():
            raise PackagePathError(f"{rel}: is a symlink; package files must be regular files")
        if rel not in listed:
            raise IntegrityError(f"{rel}: extra file not listed in {SUMS_FILE}")
    for rel, h in sorted(listed.items()):
        if actual[rel] != h:
            raise IntegrityError(f"{rel}: sha256 mismatch (file modified after signing)")


def open_package(
    path: str | os.PathLike[str],
    trust: TrustStore,
    model_root: str | os.PathLike[str],
    *,
    allow_outside_root: bool = False,
) -> VerifiedPackage:
    """Resolve, verify signature and hashes, validate statically. Raises PackageError subclasses.

    Order matters: nothing of the package is parsed before its signature and hashes passed (a
    malicious manifest never reaches the JSON decoder).
    """
    pkg = resolve_package_path(path, model_root, allow_outside_root=allow_outside_root)
    sig_p, sums_p = pkg / SIG_FILE, pkg / SUMS_FILE
    if not sig_p.is_file() or sig_p.is_symlink():
        raise SignatureError(f"{pkg.name}/{SIG_FILE}: missing: the package is unsigned")
    if not sums_p.is_file() or sums_p.is_symlink():
        raise IntegrityError(f"{pkg.name}/{SUMS_FILE}: missing")
    sums_raw = sums_p.read_bytes()
    signer = trust.verify(sums_raw, sig_p.read_bytes(), f"{pkg.name}/{SIG_FILE}")
    listed = parse_sums(sums_raw, f"{pkg.name}/{SUMS_FILE}")
    _check_files(pkg, listed)
    if "manifest.json" not in listed:
        raise IntegrityError(f"{pkg.name}/manifest.json: missing")
    manifest = decode_manifest((pkg / "manifest.json").read_bytes(), f"{pkg.name}/manifest.json")
    validate_manifest(manifest, f"{pkg.name}/manifest.json")
    for f in [*manifest.weights, manifest.tokenizer, manifest.golden]:
        if f not in listed:
            raise IntegrityError(f"{pkg.name}/{f}: named by manifest.json but not in the package")
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in manifest.weights:
        for name, info in tensor_index(pkg / f).items():
            if name in index:
                raise ValidationError(f"{pkg.name}/{f}: tensor {name} also in another weights file")
            index[name] = info
    validate_tensors(manifest, index, f"{pkg.name}/{manifest.weights[0]}")
    vp = VerifiedPackage(
        path=pkg, manifest=manifest, sha256=hashlib.sha256(sums_raw).hexdigest(), signer=signer
    )
    _check_tokenizer_and_golden(vp)
    return vp


def _check_tokenizer_and_golden(vp: VerifiedPackage) -> None:
    m = vp.manifest
    tok = vp.tokenizer()
    vocab = m.model.vocab_size
    if tok.vocab_size > vocab:
        raise ValidationError(
            f"{vp.path.name}/{m.tokenizer}: {tok.vocab_size} tokens > model vocab_size {vocab}"
        )
    golden = vp.golden()
    if not golden.cases:
        raise ValidationError(f"{vp.path.name}/{m.golden}: no cases")
    batches = set(m.compiled_batches)
    for i, c in enumerate(golden.cases):
        if not c.prompt or any(not 0 <= t < vocab for t in c.prompt):
            raise ValidationError(f"{vp.path.name}/{m.golden}: cases[{i}].prompt empty or out of vocab")
        if set(c.expected) != batches:
            raise ValidationError(
                f"{vp.path.name}/{m.golden}: cases[{i}].expected covers {sorted(c.expected)},"
                f" profiles are {sorted(batches)}"
            )
