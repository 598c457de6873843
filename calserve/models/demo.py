"""The built-in demo model: tiny Qwen3 architecture, seeded weights, locally trained byte-level BPE.

Served under alias ``qwen3`` by the embedded default config. Small enough that the software runtime
decodes thousands of tokens/s on one core (hidden 64, 2 layers, 4 query / 2 KV heads of 16, vocab
~512); profiles 1/4/8/16, max_seq 2048, 64 KV sequences per profile. Built in well under a second
(tokenizer training + 3 short golden generations).

The weights are random, so the text it writes is noise — it exists to exercise the whole serving path
with real computation. Everything is seeded: two builds give the same tensors and tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from calserve.config import calserve_home
from calserve.models.manifest import SpecialTokens
from calserve.runtime.reference import ModelConfig, random_weights

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
DEMO_NAME = "demo-qwen3"
DEMO_MAX_SEQ = 2048
DEMO_MAX_SEQUENCES = 64
DEMO_SEED = 20260802
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TARGET_VOCAB = 512

# The training text of the demo tokenizer: plain English about serving, plus digits and punctuation,
# so ordinary prompts tokenize into multi-byte merges rather than single bytes.
_CORPUS = """
A production language model server accepts requests over HTTP, checks them, and admits them into a
queue. The scheduler picks the next work for the device: a prefill for a new prompt, or a decode step
for sequences that are already running. Every request ends with exactly one terminal event, and every
lane and buffer comes back to its pool. When the device faults, recovery resets it and the affected
requests fail cleanly while the others continue.
The Calculet NPU runs compiled batch profiles of one, four, eight or sixteen lanes. Inactive lanes carry
a valid mask and never write the key value cache. The model package is signed, every file is hashed,
and the golden outputs are checked before the model is published under its alias.
Hello world! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2048.
Questions, answers, lists; quotes "like this" and (parentheses) - dashes, colons: and so on.
user assistant system tool message content role token tokens text stream streaming completion chat
"""


def demo_model_config(vocab_size: int = _TARGET_VOCAB) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=DEMO_MAX_SEQ,
    )


def demo_weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    return random_weights(cfg, seed=DEMO_SEED)


def demo_tokenizer_json() -> str:
    """Train the byte-level BPE (deterministic) and return its ``tokenizer.json`` text."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()]
    tok.train_from_iterator(lines * 4, trainer)
    return str(tok.to_str())


def tokenizer_vocab_size(tokenizer_json: str) -> int:
    return int(tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True))


def demo_special_tokens(tokenizer_json: str) -> SpecialTokens:
    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        assert i is not None, t  # trained in as special tokens
        ids[t] = int(i)
    return SpecialTokens(
        eos_token_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )


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
