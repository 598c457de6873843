"""Fixtures for the runtime tests: one VirtualDevice per process, so every test opens and closes it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from calserve.runtime import Device
from calserve.runtime.reference import ModelConfig, random_weights

SMALL = ModelConfig(
    vocab_size=101,
    hidden_size=40,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    tie_word_embeddings=False,
)

# The Llama family at the same size (no q/k norm tensors, RoPE base 1e5 like SmolLM2).
SMALL_LLAMA = ModelConfig(
    vocab_size=101,
    hidden_size=40,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    architecture="LlamaForCausalLM",
)

# Llama 3.1+ at the same size: RoPE frequencies divided (model.rope_freqs.weight).
SMALL_LLAMA31 = ModelConfig(**{**SMALL_LLAMA.to_dict(), "rope_freqs": True})
# Qwen2 at the same size: Llama plus the q/k/v projection biases.
SMALL_QWEN2 = ModelConfig(**{**SMALL_LLAMA.to_dict(), "architecture": "Qwen2ForCausalLM",
                             "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6})
# Gemma 3 at the same size: layers 0 and 2 slide (window 8, their own RoPE base), layers 1 and 3 are
# global (linear RoPE scaling by 8, as Gemma 3 4B+); scores divided by sqrt(24), not sqrt(head_dim).
SMALL_GEMMA3 = ModelConfig(**{**SMALL.to_dict(), "architecture": "Gemma3ForCausalLM", "num_hidden_layers": 4,
                              "tie_word_embeddings": True, "sliding_window": 8, "sliding_window_pattern": 2,
                              "rope_local_theta": 10000.0, "query_pre_attn_scalar": 24.0,
                              "rope_scaling_factor": 8.0})
# Gemma 2 at the same size: Gemma 3's decoder without q/k norms, layers 0 and 2 sliding (window 8, one
# RoPE base), scores divided by sqrt(24) then soft-capped at 2 and logits at 1.5 (caps that bite: this
# model's scores and logits reach about 4; Gemma 2's own 50 and 30 would barely move them).
SMALL_GEMMA2 = ModelConfig(**{**SMALL.to_dict(), "architecture": "Gemma2ForCausalLM", "num_hidden_layers": 4,
                              "tie_word_embeddings": True, "sliding_window": 8, "sliding_window_pattern": 2,
                              "query_pre_attn_scalar": 24.0, "attn_logit_softcapping": 2.0,
                              "final_logit_softcapping": 1.5})
# Llama with every layer sliding (window 6), and with every other one (window 8, RoPE base 1e4 there)
SMALL_LLAMA_SW = ModelConfig(**{**SMALL_LLAMA.to_dict(), "sliding_window": 6})
SMALL_LLAMA_SW2 = ModelConfig(**{**SMALL_LLAMA.to_dict(), "sliding_window": 8, "sliding_window_pattern": 2,
                                 "rope_local_theta": 10000.0})


@pytest.fixture
def small_weights() -> dict:
    return random_weights(SMALL, seed=7)


@pytest.fixture
def device() -> Iterator[Device]:
    with Device.open("calrt-0.7.6", dram_bytes=1 << 30) as d:
        yield d


@pytest.fixture
def next_device() -> Iterator[Device]:
    with Device.open("sim-next", dram_bytes=1 << 30) as d:
        yield d
