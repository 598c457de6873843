"""ed25519 signing of model packages (pynacl), the development key and the trust store.

Key files are hex text: a private ``KEY`` holds the 32-byte seed, ``KEY.pub`` the 32-byte verify key
(raw 32-byte files are accepted too). A package is signed by writing ``SHA256SUMS`` over every file
except the two signature files, then ``SHA256SUMS.sig``: one line ``ed25519 <pubkey-hex> <sig-hex>``.
The public key in the signature file only says *which* key signed; trust comes from the
:class:`TrustStore` alone (an unknown key is refused, spec §11 step 2).

The development key is created on first use in ``calserve_home()/keys/dev`` (atomic: written to a temp
file then hard-linked into place, so parallel processes agree on one key) and trusted by the default
config (``trust.trust_dev_key``), so the demo package verifies with no flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import nacl.exceptions
import nacl.signing

from calserve.config import TrustConfig, calserve_home
from calserve.errors import ConfigError, IntegrityError, SignatureError

__all__ = [
    "SUMS_FILE",
    "SIG_FILE",
    "generate_keypair",
    "load_signing_key",
    "load_verify_key",
    "dev_key",
    "key_id",
    "list_package_files",
    "compute_sums",
    "format_sums",
    "parse_sums",
    "sign_package",
    "TrustStore",
]

SUMS_FILE = "SHA256SUMS"
SIG_FILE = "SHA256SUMS.sig"
_SIG_FILES = frozenset({SUMS_FILE, SIG_FILE})


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def key_id(vk: nacl.signing.VerifyKey) -> str:
    """Hex of the verify key: how signature files and messages name a key."""
    return bytes(vk).hex()


def generate_keypair(out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new private key to ``out`` (mode 0600) and its public key to ``out.pub``."""
    priv = Path(out)
    priv.parent.mkdir(parents=True, exist_ok=True)
    sk = nacl.signing.SigningKey.generate()
    pub = priv.with_name(priv.name + ".pub")
    _write_atomic(priv, bytes(sk).hex().encode() + b"\n", 0o600)
    _write_atomic(pub, key_id(sk.verify_key).encode() + b"\n")
    return priv, pub


def _read_key_bytes(path: Path, what: str) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    if len(raw) == 32:
        return raw
    try:
        b = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"{path}: {what} is neither 64 hex digits nor 32 raw bytes") from None
    if len(b) != 32:
        raise ConfigError(f"{path}: {what} must be 32 bytes, got {len(b)}")
    return b


def load_signing_key(path: str | os.PathLike[str]) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(_read_key_bytes(Path(path), "ed25519 private key"))


def load_verify_key(path: str | os.PathLike[str]) -> nacl.signing.VerifyKey:
    return nacl.signing.VerifyKey(_read_key_bytes(Path(path), "ed25519 public key"))


def dev_key(home: str | os.PathLike[str] | None = None) -> Path:
    """Path of the development private key, created on first use (``KEY`` and ``KEY.pub``).

    Safe against parallel processes: the pair is generated in a private temp dir and the directory is
    renamed into place; a loser of the race uses the winner's key.
    """
    keys = Path(home) / "keys" if home is not None else calserve_home() / "keys"
    final = keys / "dev"
    if (final / "dev.pub").exists():
        return final / "dev"
    keys.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=keys, prefix=".dev-"))
    generate_keypair(tmp / "dev")
    try:
        os.rename(tmp, final)
    except OSError:
        # Someone else won the race (rename onto a non-empty dir fails): use theirs.
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return final / "dev"


def list_package_files(pkg: Path) -> list[str]:
    """Every regular file under ``pkg`` except the signature files, as sorted posix relative paths.

    Symlinks are listed too (as their own name) so the caller can refuse them.
    """
    out: list[str] = []
    for root, dirs, files in os.walk(pkg, followlinks=False):
        r = Path(root)
        for name in files + [d for d in dirs if (r / d).is_symlink()]:
            rel = (r / name).relative_to(pkg).as_posix()
            if rel not in _SIG_FILES:
                out.append(rel)
    return sorted(out)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compute_sums(pkg: str | os.PathLike[str]) -> dict[str, str]:
    """relative path -> sha256 hex of every package file (signature files excluded)."""
    p = Path(pkg)
    return {rel: _sha256_file(p / rel) for rel in list_package_files(p)}


def format_sums(sums: dict[str, str]) -> bytes:
    return "".join(f"{h}  {rel}\n" for rel, h in sorted(sums.items())).encode()


def parse_sums(raw: bytes, source: str = SUMS_FILE) -> dict[str, str]:
    """Parse ``<64 hex>  <path>`` lines; a malformed line is an IntegrityError naming the line."""
    out: dict[str, str] = {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrityError(f"{source}: not UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        h, sep, rel = line.partition("  ")
        if not sep or len(h) != 64 or any(c not in "0123456789abcdef" for c in h) or not rel:
            raise IntegrityError(f"{source}: line {n} is not '<sha256>  <path>'")
        if rel in out:
            raise IntegrityError(f"{source}: line {n}: {rel} listed twice")
        out[rel] = h
    return out


def sign_package(pkg: str | os.PathLike[str], key: str | os.PathLike[str]) -> Path:
    """Write ``SHA256SUMS`` over every file of ``pkg`` and its detached signature; returns the sig path."""
    p = Path(pkg)
    sk = load_signing_key(key)
    sums = format_sums(compute_sums(p))
    sig = sk.sign(sums).signature
    _write_atomic(p / SUMS_FILE, sums)
    _write_atomic(p / SIG_FILE, f"ed25519 {key_id(sk.verify_key)} {sig.hex()}\n".encode())
    return p / SIG_FILE


@dataclasses.dataclass(frozen=True)
class TrustStore:
    """The set of public keys whose package signatures are accepted (spec §11 step 2)."""

    keys: tuple[nacl.signing.VerifyKey, ...]
    # Where each key came from, for messages (same order as ``keys``).
    sources: tuple[str, ...] = ()

    @classmethod
    def from_config(
        cls,
        trust: TrustConfig,
        extra_keys: Iterable[str | os.PathLike[str]] = (),
        home: str | os.PathLike[str] | None = None,
    ) -> TrustStore:
        """Keys from ``trust.trusted_keys`` + ``extra_keys`` + the dev key when ``trust_dev_key``
        (created on first use, so the demo flow works with no flags)."""
        paths = [Path(k).expanduser() for k in trust.trusted_keys] + [Path(k) for k in extra_keys]
        if trust.trust_dev_key:
            d = dev_key(home)
            paths.append(d.with_name(d.name + ".pub"))
        keys = tuple(load_verify_key(p) for p in paths)
        return cls(keys=keys, sources=tuple(str(p) for p in paths))

    def ids(self) -> frozenset[str]:
        return frozenset(key_id(k) for k in self.keys)

    def verify(self, sums: bytes, sig_text: bytes, source: str = SIG_FILE) -> str:
        """Check ``sig_text`` (the ``SHA256SUMS.sig`` content) over ``sums``; returns the key id.

        Raises :class:`SignatureError` naming ``source`` and the reason (malformed, untrusted key,
        bad signature).
        """
        try:
            algo, kid, sig_hex = sig_text.decode("ascii").split()
            sig = bytes.fromhex(sig_hex)
        except (UnicodeDecodeError, ValueError):
            raise SignatureError(f"{source}: malformed (expected 'ed25519 <pubkey> <sig>')") from None
        if algo != "ed25519":
            raise SignatureError(f"{source}: unsupported algorithm {algo!r}")
        for k in self.keys:
            if key_id(k) == kid:
                try:
                    k.verify(sums, sig)
                except nacl.exceptions.BadSignatureError:
                    raise SignatureError(
                        f"{source}: bad signature of {SUMS_FILE} by key {kid[:16]}… "
                        "(SHA256SUMS or the signature was modified)"
                    ) from None
                return kid
        raise SignatureError(
            f"{source}: signed by untrusted key {kid[:16]}… "
            f"({len(self.keys)} trusted key(s); add it with --trusted-key or trust.trusted_keys)"
        )
