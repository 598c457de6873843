"""What the built-in demo model is: its architecture, seeded weights, byte-level BPE tokenizer and
special tokens (see :mod:`calserve.models.demo` for the package built from them).

A leaf module: :mod:`calserve.models.pack` packs this definition (``pack_demo``) and
:mod:`calserve.models.demo` builds the package with ``pack_demo``, so the definition lives here and
neither of them imports the other back. Everything is seeded: two builds give the same tensors and
tokenizer.
"""

from __future__ import annotations

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from calserve.models.manifest import SpecialTokens
from calserve.runtime.reference import ModelConfig, random_weights

__all__ = [
    "DEMO_NAME",
    "DEMO_MAX_SEQ",
    "DEMO_MAX_SEQUENCES",
    "DEMO_SEED",
    "SPECIAL_TOKENS",
    "demo_model_config",
    "demo_weights",
    "demo_tokenizer_json",
    "demo_special_tokens",
    "tokenizer_vocab_size",
]

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
