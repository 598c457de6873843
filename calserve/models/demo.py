"""The built-in demo model: tiny Qwen3 architecture, seeded weights, locally trained byte-level BPE.

Served under alias ``qwen3`` by the embedded default config. Small enough that the software runtime
decodes thousands of tokens/s on one core (hidden 64, 2 layers, 4 query / 2 KV heads of 16, vocab
~512); profiles 1/4/8/16, max_seq 2048, 64 KV sequences per profile. Built in well under a second
(tokenizer training + 3 short golden generations).

The weights are random, so the text it writes is noise — it exists to exercise the whole serving path
with real computation. Everything is seeded: two builds give the same tensors and tokenizer.

The model itself (config, weights, tokenizer, special tokens) is defined in
:mod:`calserve.models.demo_model` and re-exported here; this module builds and places its package.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from calserve.config import calserve_home
from calserve.models.demo_model import (
    DEMO_MAX_SEQ,
    DEMO_MAX_SEQUENCES,
    DEMO_NAME,
    SPECIAL_TOKENS,
    demo_model_config,
    demo_special_tokens,
    demo_tokenizer_json,
    demo_weights,
    tokenizer_vocab_size,
)

__all__ = [
    "DEMO_ALIAS",
    "DEMO_NAME",
    "DEMO_MAX_SEQ",
    "DEMO_MAX_SEQUENCES",
    "SPECIAL_TOKENS",
    "demo_model_config",
    "demo_weights",
    "demo_tokenizer_json",
    "demo_special_tokens",
    "tokenizer_vocab_size",
    "demo_package_path",
    "ensure_demo_package",
]

log = logging.getLogger(__name__)

DEMO_ALIAS = "qwen3"


def demo_package_path(home: str | os.PathLike[str] | None = None) -> Path:
    """``calserve_home()/models/demo-qwen3``."""
    base = Path(home) if home is not None else calserve_home()
    return base / "models" / DEMO_NAME


def ensure_demo_package(home: str | os.PathLike[str] | None = None) -> Path:
    """Build the demo package once (atomic; safe across processes) and return its path.

    Signed with the development key of ``home`` (created on first use), which the default config
    trusts; lives inside the default model root ``home/models``. A present package is reused as is
    (its signature is checked when it is opened, not here).
    """
    from calserve.models.pack import pack_demo
    from calserve.models.signing import dev_key

    path = demo_package_path(home)
    if (path / "SHA256SUMS.sig").exists():
        return path
    base = Path(home) if home is not None else calserve_home()
    key = dev_key(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build under a private name, then rename: if another process won the race, keep theirs.
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{DEMO_NAME}.build-"))
    try:
        built = pack_demo(staging / DEMO_NAME, key)
        try:
            os.rename(built, path)
            log.info("built the demo model package at %s", path)
        except OSError:
            if not (path / "SHA256SUMS.sig").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def pack_demo_variant(
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    seed: int,
    profiles: tuple[int, ...] = (1, 4, 8, 16),
    timing: str = "none",
    chat_template: str | None = None,
) -> Path:
    """The demo architecture and tokenizer with weights drawn from ``seed``: a second, different
    model (its own outputs, golden and sha256) for replacement and multi-model tests and benches;
    ``chat_template``: a Jinja template for it (ChatML when None)."""
    from calserve.models import demo_model
    from calserve.models.pack import build_package
    from calserve.models.tokenizer import CHATML
    from calserve.runtime.reference import random_weights

    tok_json = demo_model.demo_tokenizer_json()
    cfg = demo_model.demo_model_config(demo_model.tokenizer_vocab_size(tok_json))
    return build_package(
        out, key, name=f"{DEMO_NAME}-seed{seed}", config=cfg, weights=random_weights(cfg, seed=seed),
        tokenizer_json=tok_json, special=demo_model.demo_special_tokens(tok_json),
        profiles=profiles, timing=timing, max_seq=DEMO_MAX_SEQ, max_sequences=DEMO_MAX_SEQUENCES,
        source=f"calserve demo architecture, seeded random weights (seed {seed})", replace=True,
        chat_template=chat_template or CHATML,
    )
