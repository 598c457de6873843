"""Spec §11 steps 1–3: every refusal of open_package, each naming the file and the reason."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from calserve.config import TrustConfig
from calserve.errors import (
    IntegrityError,
    PackageError,
    PackagePathError,
    SignatureError,
    ValidationError,
)
from calserve.models.package import open_package
from calserve.models.signing import TrustStore, generate_keypair, sign_package
from calserve.runtime.reference import weight_shapes


def test_demo_package_opens(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    vp = open_package("demo", dev_trust, model_root)
    assert vp.path == pkg_copy.resolve()
    assert vp.manifest.compiled_batches == [1, 4, 8, 16]
    w = vp.weights()
    assert {k: v.shape for k, v in w.items()} == weight_shapes(vp.manifest.model_config())
    assert all(v.dtype.name == "float32" for v in w.values())
    assert len(vp.sha256) == 64
    assert vp.golden().cases


def test_tampered_weight_byte(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    f = pkg_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.safetensors: sha256 mismatch"):
        open_package(pkg_copy, dev_trust, model_root)


def test_tampered_manifest(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    f = pkg_copy / "manifest.json"
    f.write_text(f.read_text().replace('"max_seq": 2048', '"max_seq": 2049', 1))
    with pytest.raises(IntegrityError, match=r"manifest\.json: sha256 mismatch"):
        open_package(pkg_copy, dev_trust, model_root)


def test_tampered_sums_breaks_signature(
    pkg_copy: Path, model_root: Path, dev_trust: TrustStore
) -> None:
    f = pkg_copy / "SHA256SUMS"
    f.write_text(f.read_text() + "0" * 64 + "  evil.bin\n")
    with pytest.raises(SignatureError, match="bad signature"):
        open_package(pkg_copy, dev_trust, model_root)


def test_missing_file(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    (pkg_copy / "golden.json").unlink()
    with pytest.raises(IntegrityError, match=r"golden\.json: missing"):
        open_package(pkg_copy, dev_trust, model_root)


def test_extra_file(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    (pkg_copy / "sub").mkdir()
    (pkg_copy / "sub" / "extra.bin").write_bytes(b"x")
    with pytest.raises(IntegrityError, match=r"sub/extra\.bin: extra file"):
        open_package(pkg_copy, dev_trust, model_root)


def test_unsigned(pkg_copy: Path, model_root: Path, dev_trust: TrustStore) -> None:
    (pkg_copy / "SHA256SUMS.sig").unlink()
    with pytest.raises(SignatureError, match="unsigned"):
        open_package(pkg_copy, dev_trust, model_root)


def test_wrong_key(pkg_copy: Path, model_root: Path, dev_trust: TrustStore, tmp_path: Path) -> None:
    priv, pub = generate_keypair(tmp_path / "other")
    sign_package(pkg_copy, priv)
    with pytest.raises(SignatureError, match="untrusted key"):
        open_package(pkg_copy, dev_trust, model_root)
    # The same package passes once that key is trusted explicitly (e.g. --trusted-key).
    trust = TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub])
    assert open_package(pkg_copy, trust, model_root).signer == pub.read_text().strip()


def test_signature_by_trusted_key_over_other_content(
    pkg_copy: Path, model_root: Path, dev_trust: TrustStore
) -> None:
    # A signature file copied from another package does not verify these sums.
    (pkg_copy / "tokenizer.json").write_text((pkg_copy / "tokenizer.json").read_text() + " ")
    sig = (pkg_copy / "SHA256SUMS.sig").read_bytes()
    from calserve.models.signing import compute_sums, format_sums

    (pkg_copy / "SHA256SUMS").write_bytes(format_sums(compute_sums(pkg_copy)))
    (pkg_copy / "SHA256SUMS.sig").write_bytes(sig)
    with pytest.raises(SignatureError, match="bad signature"):
        open_package(pkg_copy, dev_trust, model_root)


def test_dotdot_escape(pkg_copy: Path, model_root: Path, dev_trust: TrustStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(pkg_copy, outside)
    with pytest.raises(PackagePathError, match="outside the trusted model root"):
        open_package("../outside", dev_trust, model_root)
    with pytest.raises(PackagePathError, match="outside the trusted model root"):
        open_package(outside, dev_trust, model_root)
    # Named on the command line, the location is trusted; the signature still is checked.
    assert open_package(outside, dev_trust, model_root, allow_outside_root=True).manifest


def test_symlink_escape(pkg_copy: Path, model_root: Path, dev_trust: TrustStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.move(pkg_copy, outside)
    os.symlink(outside, model_root / "link")
    with pytest.raises(PackagePathError, match="via a symlink"):
        open_package("link", dev_trust, model_root)


def test_symlinked_file_inside_package_refused(
    pkg_copy: Path, model_root: Path, dev_trust: TrustStore, tmp_path: Path, resign: Callable[[Path], None]
) -> None:
    target = tmp_path / "golden-elsewhere.json"
    shutil.move(pkg_copy / "golden.json", target)
    os.symlink(target, pkg_copy / "golden.json")
    resign(pkg_copy)
    with pytest.raises(PackagePathError, match=r"golden\.json: is a symlink"):
        open_package(pkg_copy, dev_trust, model_root)


def test_missing_package_and_root(model_root: Path, dev_trust: TrustStore, tmp_path: Path) -> None:
    with pytest.raises(PackagePathError, match="no such package"):
        open_package("nope", dev_trust, model_root)
    with pytest.raises(PackagePathError, match="model root does not exist"):
        open_package("nope", dev_trust, tmp_path / "no-root")


# -- the static validator, reached with a valid signature -------------------------------------


def _set_profile(i: int, **kv: Any) -> Callable[[dict[str, Any]], None]:
    def fn(m: dict[str, Any]) -> None:
        for k, v in kv.items():
            node = m["profiles"][i]
            *path, last = k.split("__")
            for p in path:
                node = node[p]
            node[last] = v

    return fn


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set_profile(1, inactive_policy__valid_mask=False), r"profiles\[1\].*no valid-mask contract"),
        (_set_profile(2, inactive_policy__writes_kv=True), r"profiles\[2\].*inactive lanes write KV"),
        (_set_profile(0, kv_layout__kv_heads=4), r"profiles\[0\]\.kv_layout\.kv_heads"),
        (_set_profile(0, kv_layout__bytes_per_token=1), r"profiles\[0\]\.kv_layout\.bytes_per_token"),
        (_set_profile(3, compiled_batch=32), r"profiles\[3\]\.compiled_batch: 32"),
        (_set_profile(0, max_seq=10**7), r"profiles\[0\]\.max_seq"),
        (_set_profile(3, max_sequences=8), r"profiles\[3\]\.max_sequences"),
        (lambda m: m["model"].update(hidden_size=96), r"model\.safetensors: tensor .* has shape"),
        (lambda m: m["model"].update(num_hidden_layers=3), r"kv_layout\.layers"),
        (lambda m: m["model"].update(tie_word_embeddings=False), r"lm_head\.weight missing"),
        (lambda m: m.update(unknown_key=1), r"manifest\.json: schema: .*unknown_key"),
        (lambda m: m.update(format="calculet-calbin/v2"), r"manifest\.json: schema: .*\$\.format"),
        (lambda m: m["special_tokens"].update(eos_token_ids=[9999]), r"eos_token_ids: 9999"),
        (lambda m: m["capacity"].update(parameter_bytes=1), r"capacity"),
        (lambda m: m.update(weights=["../x.safetensors"]), r"plain name"),
    ],
)
def test_validator_refusals(
    pkg_copy: Path,
    model_root: Path,
    dev_trust: TrustStore,
    edit_manifest: Callable[[Path, Callable[[dict[str, Any]], None]], None],
    edit: Callable[[dict[str, Any]], None],
    match: str,
) -> None:
    edit_manifest(pkg_copy, edit)
    with pytest.raises(ValidationError, match=match):
        open_package(pkg_copy, dev_trust, model_root)


def test_every_refusal_is_a_package_error() -> None:
    for cls in (PackagePathError, SignatureError, IntegrityError, ValidationError):
        assert issubclass(cls, PackageError)
